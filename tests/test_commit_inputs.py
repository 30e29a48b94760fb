"""What the commit reads of the GDN groups' addressing (CommitStage._inputs, _device_work): after a FULL
verify's replay, where the commit runs as its graph, each group's state indices and accepted counts as
vLLM's GDN builders left them (their own buffers, at one address every step), stacked inside the
commit's device work; otherwise stacked first into the commit's own buffers. Either way the GDN commit
gets the same [groups, R, columns] addressing, in int32. (On CPU the commit runs eagerly: the same
function a CUDA graph captures.)"""

from types import SimpleNamespace

import pytest
import torch

from ddtree_compile.integration.round.commit_stage import CommitStage
from ddtree_compile.templates import gdn_step


@pytest.mark.parametrize("in_graph,verify_replayed", [(True, True), (True, False), (False, True)])
def test_the_commit_gets_every_groups_addressing_stacked(monkeypatch, in_graph, verify_replayed):
    g = torch.Generator().manual_seed(0)
    R, cols = 3, 6
    groups = {2: ["gdn.a"], 5: ["gdn.b", "gdn.c"]}  # two GDN KV cache groups
    vllms = {gid: (torch.randint(1, 50, (R, cols), generator=g), torch.randint(1, cols, (R,), generator=g))
             for gid in groups}  # (vLLM's int64 tensors: state indices [R, 1+K], accepted counts [R])
    ctx = SimpleNamespace(device=torch.device("cpu"), cfg=SimpleNamespace(round_graphs=True, gdn_state="snapshots"),
                          hybrid=True, gdn_groups=groups, kv_groups={},
                          view=SimpleNamespace(settings=SimpleNamespace(mamba_align_block_size=None)))
    stage = CommitStage(ctx)
    accepted = torch.tensor([[0, 2, -1], [0, -1, -1], [0, 1, 3]])
    step = SimpleNamespace(walk=SimpleNamespace(accepted=accepted, num_accepted=torch.tensor([2, 1, 3])),
                           walk_fixed=False, start=torch.tensor([7, 9, 11]), block_tables={}, gdn_groups=vllms,
                           verify_replayed=verify_replayed, tree=SimpleNamespace(parents=None))
    copied, fixed = stage._inputs(step, in_graph=in_graph)
    per_group = in_graph and verify_replayed
    if per_group:  # vLLM's own tensors, read where they are
        assert "state_indices" not in fixed and "num_accepted" not in fixed
        for i, gid in enumerate(groups):
            assert fixed[f"state_indices_{i}"] is vllms[gid][0] and fixed[f"num_accepted_{i}"] is vllms[gid][1]
    else:
        assert not any(k.startswith(("state_indices_", "num_accepted_")) for k in fixed), sorted(fixed)
    calls = []
    monkeypatch.setattr(gdn_step, "commit_accepted_path", lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setattr(stage, "_cache_views", lambda: {"kv": {}, "gdn": {"all": ([], [], []), "width": 4}})
    stage._device_work(**copied, **fixed, parents=None)
    (args, _), = calls
    state_indices, num_accepted = args[2], args[3]
    want_si = torch.stack([vllms[gid][0] for gid in groups]).to(torch.int32)
    want_na = torch.stack([vllms[gid][1] for gid in groups]).to(torch.int32)
    assert torch.equal(state_indices, want_si) and torch.equal(num_accepted, want_na)
    assert state_indices.dtype == num_accepted.dtype == torch.int32
