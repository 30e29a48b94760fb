"""Commit: K/V of the accepted path compacted into place, GDN state + conv window of the path, and
the drafter's context features reordered so the accepted path comes first."""

from __future__ import annotations

import time

import torch

from .. import vllm_ops
from ..commit import commit_plan
from .step import Step


class CommitStage:
    """Commit stage of DDTreeState (state.py): wraps runner._update_states_after_model_execute and
    runner.propose_draft_token_ids."""

    def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
        step = self.step
        if step is None or step.walk is None:
            return self._orig["update"](output_token_ids, scheduler_output)
        t0 = time.perf_counter()
        self._commit_kv(step)
        committed = self._commit_gdn(step) if self.hybrid else None
        self._orig["update"](output_token_ids, scheduler_output)
        if committed is not None:  # the next step reads state/conv at the last accepted node
            r = self.runner
            r.num_accepted_tokens.gpu[: step.R] = committed.to(r.num_accepted_tokens.gpu.dtype)
            r.input_batch.num_accepted_tokens_cpu_tensor[: step.R].copy_(committed, non_blocking=True)
            if r.num_accepted_tokens_event is not None:  # the next step waits for this copy, not the original's
                r.num_accepted_tokens_event.record()
        self.metrics.add_time("commit", time.perf_counter() - t0)
        self.metrics.tree_steps += 1
        self.metrics.maybe_log()
        for hook in self.round_hooks:
            hook(self, step)

    def _cache_views(self) -> dict:
        """Per KV cache group, the layers' cache views, built once: the caches exist from attach on
        (vllm_patch attaches after initialize_kv_cache) and keep their storage."""
        if self._views is None:
            kv = {}
            for gid, names in self._kv_groups.items():
                layers = [self._layer(n) for n in names]
                layouts = {vllm_ops.kv_layout(x) for x in layers}
                if len(layouts) != 1:  # one ISA per KV cache group (vLLM picks it per group)
                    raise RuntimeError(f"KV cache group {gid}: layers in several layouts {layouts}")
                kv[gid] = (layouts.pop(), [x.kv_cache for x in layers], layers[0].impl.head_size)
            gdn = {}
            for gid, names in self._gdn_groups.items():
                views = [vllm_ops._gdn_state_views(self._layer(n)) for n in names]
                gdn[gid] = ([c for c, _, _ in views], [s for _, s, _ in views], views[0][2].shape[-1])
            self._views = {"kv": kv, "gdn": gdn}
        return self._views

    def _commit_kv(self, step: Step) -> None:
        plan = commit_plan(step.walk, step.start)
        for gid, (layout, caches, head_size) in self._cache_views()["kv"].items():
            layout.compact(caches, head_size, step.block_tables[gid].to(torch.int32), plan.src_pos, plan.dst_pos)

    def _commit_gdn(self, step: Step) -> torch.Tensor:
        """Per GDN KV cache group: conv window (+ state, replay strategy) of the accepted path."""
        from ..templates.gdn_ops import commit_accepted_path

        g = step.meta.gdn
        replay = self.cfg.gdn_state == "replay"
        accepted = step.walk.accepted.to(torch.int32)
        path_len = step.walk.num_accepted.to(torch.int32)
        committed = None
        for gid, names in self._gdn_groups.items():
            state_indices, verify_num_accepted = step.gdn_groups[gid]
            convs, ssms, width = self._cache_views()["gdn"][gid]
            before = None
            if self.commit_hooks:  # the requests' conv lines as the verify left them
                before = {"conv_lines": [c[state_indices[:, 0].long()].clone() for c in convs]}
            num_accepted = verify_num_accepted.clone()  # the verify's committed column; becomes p + 1
            rec_kv, rec_gb = g["rec_all"][gid] if replay else (None, None)
            commit_accepted_path(convs, ssms, state_indices, num_accepted, accepted, path_len, width,
                                 rec_kv=rec_kv, rec_gb=rec_gb, parents=step.tree.parents)
            for hook in self.commit_hooks:
                hook(self, {"step": step, "group": gid, "layers": names, "before": before, "ssm": ssms,
                            "conv": convs, "width": width, "state_indices": state_indices,
                            "verify_num_accepted": verify_num_accepted, "num_accepted": num_accepted,
                            "records": g["rec_all"][gid] if "rec_all" in g else None})
            committed = num_accepted
        return committed

    # -- drafter context -------------------------------------------------------------------------
    def _propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                 sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                 common_attn_metadata, slot_mappings):
        step, self.step = self.step, None
        if step is not None and step.walk is not None:
            # Accepted path rows first in each request's segment: with flat positions, rows 0..a then
            # carry the path at start..start+a, which is what the drafter's context K/V must see.
            R, N = step.R, step.N
            W = step.walk.accepted.shape[1]
            slot = torch.arange(N, device=self.device).expand(R, N)
            acc = step.walk.accepted
            key = torch.full((R, N + 1), 2 * N, dtype=torch.int64, device=self.device)  # column N: sink
            depth = torch.arange(W, device=self.device).expand(R, W)
            key.scatter_(1, torch.where(acc >= 0, acc, N), torch.where(acc >= 0, depth, 2 * N))
            key = torch.where(key[:, :N] >= 2 * N, N + slot, key[:, :N])
            order = (key.argsort(1) + torch.arange(R, device=self.device).unsqueeze(1) * N).reshape(-1)
            T = R * N
            ids = self.runner.input_ids.gpu
            ids[:T] = ids[:T][order]
            for h in aux_hidden_states or ():
                h[:T] = h[:T][order]
        return self._orig["propose_ids"](scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                         sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                         common_attn_metadata, slot_mappings)

