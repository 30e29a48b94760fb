"""The drafter's next inputs, reordered accepted path first (CommitStage.reorder_drafter_inputs): eagerly
after an eager verify, and after a FULL graph's replay through a stage graph that reads the input ids
and the hidden states in place (on CUDA one replay; on CPU the same function runs eagerly), the walk's
order read in place too where the walk's graph made it. Both give the reference gather."""

from types import SimpleNamespace

import pytest
import torch

from ddtree_compile.integration.round.commit_stage import CommitStage


@pytest.mark.parametrize("verify_replayed,walk_fixed", [(False, False), (True, False), (True, True)])
def test_reorder_of_the_drafter_inputs(verify_replayed, walk_fixed):
    g = torch.Generator().manual_seed(0)
    R, N, pad = 3, 5, 4  # (the runner's buffers are longer than the step's R x N rows)
    ids = torch.randint(0, 1000, (R * N + pad,), generator=g)
    hidden = [torch.randn(R * N + pad, 8, generator=g) for _ in range(3)]
    order = torch.cat([torch.randperm(N, generator=g) + r * N for r in range(R)])
    want = [x.clone() for x in (ids, *hidden)]
    for x in want:
        x[: R * N] = x[: R * N][order]
    ctx = SimpleNamespace(device=torch.device("cpu"), cfg=SimpleNamespace(round_graphs=True),
                          view=SimpleNamespace(input_ids=lambda: ids))
    stage = CommitStage(ctx)
    seen = []
    run = stage.reorder_graphs.run
    stage.reorder_graphs.run = lambda fn, copied, fixed: (seen.append((set(copied), set(fixed))),
                                                           run(fn, copied, fixed))
    step = SimpleNamespace(walk=SimpleNamespace(order=order), R=R, N=N, verify_replayed=verify_replayed,
                           walk_fixed=walk_fixed)
    stage.reorder_drafter_inputs(step, hidden)
    assert all(torch.equal(got, w) for got, w in zip((ids, *hidden), want))
    if not verify_replayed:
        assert not seen  # (eager: the hidden states are new every step)
    else:
        in_place = {"ids", "hidden_0", "hidden_1", "hidden_2"} | ({"order"} if walk_fixed else set())
        assert seen == [(set() if walk_fixed else {"order"}, in_place)], seen
