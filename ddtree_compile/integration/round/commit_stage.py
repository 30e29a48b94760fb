"""Commit: K/V of the accepted path compacted into place, GDN state + conv window of the path, and
the drafter's next inputs reordered so the accepted path comes first."""

from __future__ import annotations

import torch

from ... import adapters
from ...core.commit import block_boundary_depth, commit_plan
from ..tree_ops import kv_layout
from .stage_graphs import StageGraphs
from .step import RoundContext, Step


class CommitStage:
    def __init__(self, ctx: RoundContext):
        self.ctx = ctx
        self.commit_hooks: list = []  # tests: fn(ctx, info) after each GDN commit (per KV cache group)
        self._views: dict | None = None
        self._stacks: dict = {}  # (name, shape, dtype) -> the commit's own buffer of GDN groups' addressing
        self.graphs = StageGraphs(ctx, "commit", ctx.cfg.round_graphs)
        self.reorder_graphs = StageGraphs(ctx, "reorder", ctx.cfg.round_graphs)

    def commit(self, step: Step) -> None:
        """K/V (+ GDN state and conv) of the accepted paths, in the layout vLLM's chain leaves (its own
        update then counts the accepted tokens and, with prefix caching, caches block states). On CUDA
        one graph replay per step (stage_graphs.py); tests' commit hooks and debug mode run eagerly."""
        from ...templates.gdn_step import debug_enabled

        eager = bool(self.commit_hooks) or debug_enabled()
        copied, fixed = self._inputs(step, in_graph=not eager and self.graphs.on)
        if eager:
            read = {**copied, **fixed}
            before = self._conv_lines(read) if self.commit_hooks else None
            self._device_work(**read, parents=step.tree.parents)
            self._run_hooks(step, read, before)
        else:
            self.graphs.run(self._device_work, copied, fixed)

    def _inputs(self, step: Step, in_graph: bool = False) -> tuple[dict, dict]:
        """What the commit reads: (new every step, at fixed addresses). The roots' positions and the
        block tables are views of the runner's own buffers (vLLM's, which its CUDA graphs read: the
        same address every step); the paths are the walk graph's buffers where it replayed. `in_graph`:
        the commit runs as its graph (stage_graphs.py)."""
        path = {"accepted": step.walk.accepted, "path_len": step.walk.num_accepted}
        copied, fixed = ({}, path) if step.walk_fixed else (path, {})
        fixed |= {"start": step.start, **{f"block_table_{gid}": step.block_tables[gid] for gid in self.ctx.kv_groups}}
        if self.ctx.hybrid:
            # every GDN group's addressing, one row per group (vLLM's tensors are not written): the
            # verify's committed columns in num_accepted become the paths' lengths
            gids = list(self.ctx.gdn_groups)
            for col, name in enumerate(("state_indices", "num_accepted")):
                parts = [step.gdn_groups[g][col] for g in gids]
                if in_graph and step.verify_replayed:
                    # the target's FULL graph read them from vLLM's GDN builders' own buffers (filled
                    # for FULL graphs: 0.26 `gdn_attn.py:420-445`), the same address every step: the
                    # commit's graph stacks them itself (no launch here; an address that moved keys
                    # another graph, stage_graphs.py)
                    fixed |= {f"{name}_{i}": t for i, t in enumerate(parts)}
                else:
                    fixed[name] = self._stacked(name, parts)
            if self.ctx.cfg.gdn_state == "replay":
                fixed["rec_kv"], fixed["rec_gb"] = step.gdn_records_all
        return copied, fixed

    def close(self) -> None:
        self.graphs.close()
        self.reorder_graphs.close()
        self._stacks.clear()

    def _stacked(self, name: str, parts: list) -> torch.Tensor:
        """torch.stack(parts), written into the stage's buffer of that shape: vLLM's tensors are new every
        step, the buffer is at one address for every step of that shape, so the commit's graph reads it
        in place (one launch: the stack; a stacked copy would be copied into the graph's input again)."""
        first = parts[0]
        key = (name, len(parts), tuple(first.shape), first.dtype, first.device)
        buf = self._stacks.get(key)
        if buf is None:
            buf = self._stacks[key] = torch.empty((len(parts), *first.shape), dtype=first.dtype, device=first.device)
        return torch.stack(parts, out=buf)

    def _device_work(self, accepted, path_len, start, state_indices=None, num_accepted=None, rec_kv=None,
                     rec_gb=None, parents=None, **per_group) -> None:
        """Device work only (captured as a graph): K/V compaction per attention KV cache group, then
        every GDN group's conv window and state of the accepted path in one call (each group reads
        its own state lines); with prefix caching also the state at the step's block boundary
        (core.commit.block_boundary_depth). `per_group`: each attention group's `block_table_<gid>`
        and, where `_inputs` did not stack the GDN groups' addressing, each one's `state_indices_<g>`
        and `num_accepted_<g>`, stacked here. The int32 casts of vLLM's addressing happen here: the
        stacked copies are the commit's own."""
        from ...templates.gdn_step import commit_accepted_path

        if state_indices is None and "state_indices_0" in per_group:
            state_indices, num_accepted = (
                torch.stack([per_group[f"{name}_{i}"] for i in range(len(self.ctx.gdn_groups))])
                for name in ("state_indices", "num_accepted"))
        plan = commit_plan(accepted, start)
        views = self._cache_views()
        for gid, (layout, caches, head_size) in views["kv"].items():
            layout.compact(caches, head_size, per_group[f"block_table_{gid}"].to(torch.int32), plan.src_pos,
                           plan.dst_pos)
        if state_indices is None:
            return
        block = self.ctx.view.settings.mamba_align_block_size
        path_len = path_len.to(torch.int32)
        snap = None if block is None else block_boundary_depth(start, path_len, block)
        convs, ssms, layer_group = views["gdn"]["all"]
        commit_accepted_path(convs, ssms, state_indices.to(torch.int32), num_accepted.to(torch.int32),
                             accepted.to(torch.int32), path_len, views["gdn"]["width"], rec_kv=rec_kv, rec_gb=rec_gb,
                             parents=parents, snap_depth=snap, layer_group=layer_group)

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
            gdn["width"] = gdn[next(iter(ctx.gdn_groups))][2] if ctx.gdn_groups else None
            self._views = {"kv": kv, "gdn": gdn}
        return self._views

    def _conv_lines(self, copied: dict) -> dict:
        """Tests: per GDN KV cache group, the requests' conv lines as the verify left them."""
        if not self.ctx.hybrid:
            return {}
        views = self._cache_views()["gdn"]
        return {gid: {"conv_lines": [c[copied["state_indices"][i, :, 0].long()].clone() for c in views[gid][0]]}
                for i, gid in enumerate(self.ctx.gdn_groups)}

    def _run_hooks(self, step: Step, copied: dict, before: dict) -> None:
        """Tests: per GDN KV cache group, what the commit read and wrote."""
        if not self.ctx.hybrid:
            return
        views = self._cache_views()["gdn"]
        block = self.ctx.view.settings.mamba_align_block_size
        path_len = step.walk.num_accepted.to(torch.int32)
        snap = None if block is None else block_boundary_depth(step.start, path_len, block)
        for i, gid in enumerate(self.ctx.gdn_groups):
            group_convs, group_ssms, width = views[gid]
            info = {"step": step, "group": gid, "layers": self.ctx.gdn_groups[gid], "before": before[gid],
                    "ssm": group_ssms, "conv": group_convs, "width": width,
                    "state_indices": copied["state_indices"][i].to(torch.int32),
                    "verify_num_accepted": step.gdn_groups[gid][1],
                    "num_accepted": copied["num_accepted"][i].to(torch.int32),
                    "records": step.gdn_records.get(gid), "snap_depth": snap}
            for hook in self.commit_hooks:
                hook(self.ctx, info)

    def reorder_drafter_inputs(self, step: Step, aux_hidden_states) -> None:
        """Accepted path rows first in each request's segment (core.walk.drafter_order, which the
        walk computed): with flat positions, rows 0..a then carry the path at start..start+a, which
        is what the drafter's context K/V must see."""
        ids = self.ctx.view.input_ids()
        hidden = {f"hidden_{i}": h for i, h in enumerate(aux_hidden_states or ())}
        if not step.verify_replayed:  # (the hidden states are the eager forward's: new every step)
            _reorder(step.walk.order, ids, **hidden)
            return
        # after a FULL graph's replay they are its outputs, and the input ids the runner's buffer: at
        # fixed addresses, reordered in place by one replay (the order too where the walk's graph made it)
        order = {"order": step.walk.order}
        copied, fixed = ({}, order) if step.walk_fixed else (order, {})
        self.reorder_graphs.run(_reorder, copied, {**fixed, "ids": ids, **hidden})


def _reorder(order, ids, **hidden) -> None:
    """Device work only: rows 0..T-1 of the input ids and of each hidden state in `order` [T]."""
    T = order.shape[0]
    for x in (ids, *hidden.values()):
        x[:T] = x[:T][order]
