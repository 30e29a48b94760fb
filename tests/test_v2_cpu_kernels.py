"""The torch forms of Model Runner V2's bookkeeping kernels that V2 test engines on CPU use
(ddtree_compile/testing/v2_cpu_kernels.py) equal vLLM's Triton kernels (interpreted) on every call of
real V2 engines: the multimodal Qwen3.5 hybrid with the mixed sliding/full drafter (two drafter KV
groups, GatedDeltaNet and attention groups in the target), DDTree's tree rounds and vLLM's flat DFlash
(rejected drafts), a prompt longer than the step's token budget (prefill chunks next to decodes),
several requests per step; and with prefix caching (vLLM's "align" GDN cache), prompts that cross a
block boundary inside deep tree rounds (the drafter harness), for the align state copies. Each call runs
both, vLLM's on copies of the outputs (the copies: vLLM's first, then ours from the same start), and
compares every output buffer whole (padding included; the copies: every state tensor and count)."""

import pytest

from ddtree_compile.testing import runner_v2_cpu, v2_cpu_kernels

SCRIPT = r"""
import json, os, pathlib, tempfile
os.environ["DDTREE_TEST_V2_KERNELS"] = "check"
from ddtree_compile.testing import runner_v2_cpu
runner_v2_cpu.enable()
from ddtree_compile.integration import config, engines, plugin
from ddtree_compile.testing import cpu_choices, e2e, harness, models, v2_cpu_kernels

plugin.register()
out = {}
with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    target = models.write_tiny_vl_model(root / "vl", seed=4)
    drafter = models.write_tiny_dflash_drafter(target, root / "vl_dflash", seed=4,
                                               layer_types=["sliding_attention", "full_attention"])
    kw = dict(enforce_eager=True, skip_tokenizer_init=False, max_model_len=1024, limit_mm_per_prompt={"image": 1},
              mamba_ssm_cache_dtype="float32", max_num_batched_tokens=96)
    prompts = [models.token_prompts(1, n, models.VOCAB - 8, seed=5 + n)[0] for n in (16, 40, 200)]
    flat = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 4}
    for name, extra in (("ddtree", config.vllm_kwargs(drafter, budget=8, top_k=3, num_speculative_tokens=4)),
                        ("flat", {"speculative_config": flat})):
        with e2e.engine(**models.tiny_llm_kwargs(target, **kw, **extra)) as llm:
            before = dict(v2_cpu_kernels.CHECKED)
            got = e2e.generate(llm, prompts, 16)
            out[name] = {"attached": engines.find_state(llm) is not None, "lengths": [len(g) for g in got],
                         "checked": {k: v - before.get(k, 0) for k, v in v2_cpu_kernels.CHECKED.items()}}
    # prefix caching on the hybrid (the GDN state in float32, as test_runner_v2_cpu's align part has it on
    # every CPU): a prompt 6 tokens short of the align block B, 24 tokens drafted by the harness from the
    # engine's own first pass, so rounds accept several tokens across the boundary; and a prompt of B
    # tokens, whose last prefill chunk ends on the boundary inside its running block
    cpu_choices.force_kind(os.environ.get(cpu_choices.ENV_KIND) or "avx512_bf16")
    spec = config.vllm_kwargs(drafter, budget=8, top_k=3, num_speculative_tokens=4)
    # (a 32 MiB cache: the check clones every state tensor, views of the whole cache, around each call)
    pc = dict(kw, mamba_ssm_cache_dtype="auto", enable_prefix_caching=True, kv_cache_memory_bytes=32 << 20)
    with e2e.engine(**models.tiny_llm_kwargs(target, **pc, **spec)) as llm:
        B = engines.find_runner(llm).vllm_config.cache_config.mamba_block_size
        prompts = [models.token_prompts(1, n, models.VOCAB - 8, seed=9 + n)[0] for n in (B - 6, B)]
        before = dict(v2_cpu_kernels.CHECKED)
        own = e2e.complete(llm, prompts, 24)
        h = harness.DraftHarness({tuple(c["prompt"]): c["prompt"] + c["tokens"] for c in own}).install(llm)
        try:
            e2e.generate(llm, prompts, 24)
        finally:
            h.uninstall()
        out["align"] = {"attached": engines.find_state(llm) is not None, "block": B,
                        "mode": engines.find_runner(llm).vllm_config.cache_config.mamba_cache_mode,
                        "checked": {k: v - before.get(k, 0) for k, v in v2_cpu_kernels.CHECKED.items()}}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return runner_v2_cpu.run_script(SCRIPT, tmp_path_factory.mktemp("v2k"))


@pytest.mark.parametrize("name", ["ddtree", "flat"])
def test_torch_forms_equal_vllms_kernels_on_every_call(run, name):
    r = run[name]
    assert r["attached"] is (name == "ddtree") and r["lengths"] == [16, 16, 16]
    checked = r["checked"]
    for kernel in ("gather_block_tables", "compute_slot_mappings", "prepare_dflash_inputs"):
        assert checked.get(kernel, 0) >= 10, checked  # every call of a 16-token run was compared
    # (the random drafter's drafts are mostly rejected: by vLLM's chain verify, and by DDTree's walk, whose
    # commit is in the chain layout)
    for path in ("with a prefill chunk", "with several requests", "with rejected drafts"):
        assert checked.get(f"prepare_dflash_inputs {path}", 0) > 0, checked


def test_torch_forms_equal_vllms_align_copies_on_every_call(run):
    r = run["align"]
    assert r["attached"] and r["mode"] == "align", r
    checked = r["checked"]
    assert checked.get("run_fused_precopy", 0) >= 24 and checked.get("run_fused_postprocess_align", 0) >= 12, checked
    # the paths that copy: a running block moved (pre-copy), the boundary state saved after a round, shifted by
    # the tokens the round accepted past it, and the count reset where the running block is the boundary's
    # (the B-token prompt's last chunk)
    for path in ("run_fused_precopy with a copy", "run_fused_postprocess_align with a copy",
                 "run_fused_postprocess_align with a shifted copy", "run_fused_postprocess_align with a reset"):
        assert checked.get(path, 0) > 0, (path, checked)


def test_the_mode_is_checked(monkeypatch):
    monkeypatch.setenv(v2_cpu_kernels.ENV, "fast")
    with pytest.raises(ValueError, match="DDTREE_TEST_V2_KERNELS='fast': allowed values: torch, triton, check"):
        v2_cpu_kernels.mode()
    monkeypatch.delenv(v2_cpu_kernels.ENV)
    assert v2_cpu_kernels.mode() == "torch"
