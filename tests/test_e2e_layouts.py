"""End to end on the `vec16` KV layout, beside the layout of the other end-to-end tests (vLLM's
choice for the host: `vec` for float32, `amx` for the bf16 hybrid on CPUs with AMX tiles).

vLLM picks vec16 for head sizes that are multiples of 16 but not of 32; our tiny models have head
size 64, so both engines here are started with vLLM's choice forced to vec16 (the adapter's
testing/cpu_choices.py; vec16's kernels serve any head size). Greedy DDTree == no speculation, with
branching trees (harness drafter), and the counters prove the tree path ran on that layout.
Per-layout unit checks of every layout, AMX included, are in test_kv_layouts.py.
"""

import os

import pytest

from ddtree_compile.integration import config, metrics, plugin
from ddtree_compile.testing import cpu_choices, e2e, harness, models

DRAFT_LEN, TOP_K, BUDGET, MAX_TOKENS = 7, 4, 16, 120
PROMPTS = models.token_prompts(4, 16, models.VOCAB, seed=1)


@pytest.fixture(scope="module", autouse=True)
def _ddtree_plugin():
    plugin.register()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e_layouts")
    target = models.write_tiny_model("qwen3", root / "qwen3")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash")

    def llm(**kw):
        return e2e.engine(**models.tiny_llm_kwargs(target, enforce_eager=True, dtype="float32", **kw))

    cpu_choices.force_attn_isa("vec16")
    try:
        return _run(llm, drafter)
    finally:
        cpu_choices.force_attn_isa(os.environ.get(cpu_choices.ENV_ISA) or None)  # the suite's choice


def _run(llm, drafter):
    with llm() as ref_llm:
        ref = e2e.generate(ref_llm, PROMPTS, MAX_TOKENS)
    with llm(**config.vllm_kwargs(drafter, budget=BUDGET, top_k=TOP_K, num_speculative_tokens=DRAFT_LEN)) as tree_llm:
        h = harness.DraftHarness(harness.reference_from_outputs(PROMPTS, ref)).install(tree_llm)
        out = e2e.generate(tree_llm, PROMPTS, MAX_TOKENS)
        h.uninstall()
        counters = metrics.collect(tree_llm)
    return ref, out, counters


def test_ddtree_on_vec16_equals_no_speculation(runs):
    ref, out, counters = runs
    assert len(counters) == 1, "DDTree did not attach (flat DFlash fallback)"
    c = counters[0]
    print(f"\nlayout {c['kv_layouts']}: {metrics.format_line(c)}")
    assert c["kv_layouts"] == ["vec16"]
    assert c["tree_steps"] > 0 and c["sibling_rounds"] > 0 and c["fallback_total"] == 0
    e2e.assert_same(out, ref, "DDTree on vec16")
