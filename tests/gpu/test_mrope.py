"""The users' model class on vLLM 0.26: M-RoPE and images, V1 runner, FULL CUDA graphs.

A tiny multimodal Qwen3.5 (`Qwen3_5ForConditionalGeneration`: a one-block vision tower, M-RoPE,
GatedDeltaNet + full attention) with an all-full-attention DFlash drafter, which vLLM serves on its V1
runner (its default for hybrids). Text and image prompts, per kind: within the regret gate of no
speculation (random drafter and drafter harness), every tree verify a FULL-graph replay, trees that
branch; the committed GDN state equal to a float32 replay; seeded sampling reproducible and
independent of the batch.
"""

from __future__ import annotations

import _engines as E
import pytest

KINDS = ("text", "image")


@pytest.fixture(scope="module")
def mrope(gpu_env, tmp_path_factory):
    gpu_env.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)  # vLLM's own choice: V1 for this pair
    from ddtree_compile.testing import models

    root = tmp_path_factory.mktemp("mrope")
    target = models.write_tiny_vl_model(root / "target", seed=4)
    drafter = models.write_tiny_dflash_drafter(target, root / "full", seed=4)
    prompts = E.text_and_image_prompts()
    ref_info, ref = E.reference(target, prompts, **E.MM)
    with E.running(target, drafter, **E.MM) as (llm, info):
        out = E.ddtree_runs(llm, ref, prompts, state_check=True)
    return {"reference_engine": ref_info, "engine": info, **out}


def test_mrope_target_served_with_m_rope(mrope, record):
    record(**{k: mrope["engine"].get(k) for k in ("start_s", "runner", "cudagraph_mode", "uses_mrope")})
    assert mrope["engine"]["uses_mrope"], mrope["engine"]
    assert ".gpu_model_runner." in mrope["engine"]["runner"], mrope["engine"]  # V1 (V2: gpu.model_runner)


@pytest.mark.parametrize("kind", KINDS)
def test_lossless_text_and_images(mrope, kind, record):
    E.check_lossless(mrope, [kind], record=record)
