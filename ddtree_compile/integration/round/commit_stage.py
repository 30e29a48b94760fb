"""Commit: K/V of the accepted path compacted into place, GDN state + conv window of the path, and
the drafter's next inputs reordered so the accepted path comes first."""

from __future__ import annotations

import torch

from ... import adapters
from ...core.commit import block_boundary_depth, commit_plan
from ..tree_ops import kv_layout
from .step import RoundContext, Step


class CommitStage:
    def __init__(self, ctx: RoundContext):
        self.ctx = ctx
        self.commit_hooks: list = []  # tests: fn(ctx, info) after each GDN commit (per KV cache group)
        self._views: dict | None = None

    def commit(self, step: Step) -> None:
        """K/V (+ GDN state and conv) of the accepted paths, in the layout vLLM's chain leaves (its own
        update then counts the accepted tokens and, with prefix caching, caches block states)."""
        self._commit_kv(step)
        if self.ctx.hybrid:
            self._commit_gdn(step)

    def _cache_views(self) -> dict:
        """Per KV cache group, the layers' caches and layout, built once: the caches exist from attach
        on (the adapter attaches after the runner's initialize_kv_cache) and keep their storage."""
        if self._views is None:
            ctx, A = self.ctx, adapters.current()
            kv = {}
            for gid, names in ctx.kv_groups.items():
                layers = [ctx.layer(n) for n in names]
                layouts = {kv_layout(x) for x in layers}
                if len(layouts) != 1:  # one ISA per KV cache group (vLLM picks it per group)
                    raise RuntimeError(f"KV cache group {gid}: layers in several layouts {layouts}")
                kv[gid] = (layouts.pop(), [x.kv_cache for x in layers], A.attention_params(layers[0]).head_size)
            gdn, every = {}, ([], [], [])  # per group; and all groups' layers in group order
            for g, (gid, names) in enumerate(ctx.gdn_groups.items()):
                views = [A.gdn_state_views(ctx.layer(n)) for n in names]
                gdn[gid] = ([c for c, _, _ in views], [s for _, s, _ in views], views[0][2].shape[-1])
                every[0].extend(gdn[gid][0])
                every[1].extend(gdn[gid][1])
                every[2].extend([g] * len(names))
            gdn["all"] = every
            self._views = {"kv": kv, "gdn": gdn}
        return self._views

    def _commit_kv(self, step: Step) -> None:
        plan = commit_plan(step.walk, step.start)
        for gid, (layout, caches, head_size) in self._cache_views()["kv"].items():
            layout.compact(caches, head_size, step.block_tables[gid].to(torch.int32), plan.src_pos, plan.dst_pos)

    def _commit_gdn(self, step: Step) -> None:
        """Every GDN KV cache group's conv window and state of the accepted path in one call (each
        group reads its own state lines); with prefix caching also the state at the step's block
        boundary (core.commit.block_boundary_depth)."""
        from ...templates.gdn_step import commit_accepted_path

        replay = self.ctx.cfg.gdn_state == "replay"
        accepted = step.walk.accepted.to(torch.int32)
        path_len = step.walk.num_accepted.to(torch.int32)
        block = self.ctx.view.settings.mamba_align_block_size
        snap = None if block is None else block_boundary_depth(step.start, path_len, block)
        views = self._cache_views()["gdn"]
        gids = list(self.ctx.gdn_groups)
        # int32 copies of vLLM's addressing, one row per group (vLLM's tensors are not written): the
        # verify's committed columns in num_accepted become the paths' lengths
        state_indices = torch.stack([step.gdn_groups[g][0] for g in gids]).to(torch.int32)
        num_accepted = torch.stack([step.gdn_groups[g][1] for g in gids]).to(torch.int32)
        before = None
        if self.commit_hooks:  # the requests' conv lines as the verify left them
            before = {g: {"conv_lines": [c[state_indices[i, :, 0].long()].clone() for c in views[g][0]]}
                      for i, g in enumerate(gids)}
        convs, ssms, layer_group = views["all"]
        rec_kv, rec_gb = step.gdn_records_all if replay else (None, None)
        commit_accepted_path(convs, ssms, state_indices, num_accepted, accepted, path_len, views[gids[0]][2],
                             rec_kv=rec_kv, rec_gb=rec_gb, parents=step.tree.parents, snap_depth=snap,
                             layer_group=layer_group)
        for i, gid in enumerate(gids if self.commit_hooks else ()):
            group_convs, group_ssms, width = views[gid]
            info = {"step": step, "group": gid, "layers": self.ctx.gdn_groups[gid], "before": before[gid],
                    "ssm": group_ssms, "conv": group_convs, "width": width, "state_indices": state_indices[i],
                    "verify_num_accepted": step.gdn_groups[gid][1], "num_accepted": num_accepted[i],
                    "records": step.gdn_records.get(gid), "snap_depth": snap}
            for hook in self.commit_hooks:
                hook(self.ctx, info)

    def reorder_drafter_inputs(self, step: Step, aux_hidden_states) -> None:
        """Accepted path rows first in each request's segment (core.walk.drafter_order, which the
        walk computed): with flat positions, rows 0..a then carry the path at start..start+a, which
        is what the drafter's context K/V must see."""
        order = step.walk.order
        T = step.R * step.N
        ids = self.ctx.view.input_ids()
        ids[:T] = ids[:T][order]
        for h in aux_hidden_states or ():
            h[:T] = h[:T][order]
