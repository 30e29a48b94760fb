"""Verify: this step's requests mapped to their trees, positions start + depth, the tree metadata the
attention and GDN templates read, and the target forward with the tree context active."""

from __future__ import annotations

import time

import torch

from .. import vllm_ops
from ..tree import TreeBatch
from .step import Pending, Step


class VerifyStage:
    """Verify stage of DDTreeState (state.py): wraps runner._prepare_inputs and runner._model_forward."""

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = self._orig["prepare"](scheduler_output, num_scheduled_tokens)
        self.step = None
        pending, self.pending = self.pending, None
        drafts = scheduler_output.scheduled_spec_decode_tokens
        if not drafts:
            return out
        reason = self._step_fallback(pending, drafts, num_scheduled_tokens)
        if reason is not None:
            self.metrics.chain_steps += 1
            self.metrics.fallback(reason)
            self._log_once("step:" + reason, "DDTree: steps verified as a plain chain (lossless) because of: "
                           "%s (logged once, counted in metrics)", reason)
            return out
        self.step = self._make_step(pending)
        return out

    def _step_fallback(self, pending, drafts, num_scheduled_tokens) -> str | None:
        R = self.runner.input_batch.num_reqs
        req_ids = self.runner.input_batch.req_ids[:R]
        if len(drafts) != R or any(int(n) != self.N for n in num_scheduled_tokens[:R]):
            return "mixed batch (prefill or partial drafts next to trees)"
        if any(len(drafts.get(r, ())) != self.B for r in req_ids):
            return "drafts truncated by the scheduler"
        if pending is None:
            return "drafts not from a tree (drafter skipped)"
        if any(r not in pending.index for r in req_ids):
            return "request without a tree (resumed)"
        return None

    def _make_step(self, pending: Pending) -> Step:
        r = self.runner
        R, N = r.input_batch.num_reqs, self.N
        req_ids = r.input_batch.req_ids[:R]
        rows_host = [pending.index[q] for q in req_ids]
        rows = self._h2d(rows_host, torch.int64)
        t = pending.tree
        tree = TreeBatch(t.tokens[rows], t.parents[rows], t.depths[rows], t.scores[rows], t.num_nodes[rows],
                         t.ancestor_bits[rows], max_depth=self.max_depth)
        chain_rows = [pending.chain[i] is not None for i in rows_host]
        reasons = [pending.chain[i] for i in rows_host if pending.chain[i] is not None]
        for reason in set(reasons):
            self.metrics.fallback(reason, requests=reasons.count(reason))
            self._log_once("req:" + reason, "DDTree: requests using %s are verified as a flat DFlash chain "
                           "by vLLM's sampler (logged once, counted in metrics)", reason)
        tree_rows = self._h2d([not c for c in chain_rows], torch.bool)
        if any(chain_rows):
            cr = ~tree_rows
            parents, depths, bits = self._chain
            tree.parents = torch.where(cr.unsqueeze(1), parents, tree.parents)
            tree.depths = torch.where(cr.unsqueeze(1), depths, tree.depths)
            tree.ancestor_bits = torch.where(cr.view(R, 1, 1), bits, tree.ancestor_bits)
            tree.num_nodes = torch.where(cr, self.B, tree.num_nodes)
        flat = r.positions[: R * N].view(R, N)
        start = flat[:, 0]
        positions = (start.unsqueeze(1) + tree.depths).to(flat.dtype).reshape(-1)
        meta = vllm_ops.TreeVerifyMetadata(ancestor_bits=tree.ancestor_bits.contiguous(), depths=tree.depths,
                                           parents=tree.parents, context_lens=start.to(torch.int32))
        return Step(R, N, tree, tree_rows, chain_rows, pending.top1[rows], start, positions, meta,
                     t0=time.perf_counter())

    # -- verify ----------------------------------------------------------------------------------
    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **kw):
        step = self.step
        if step is None:
            return self._orig["forward"](input_ids=input_ids, positions=positions,
                                         intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds, **kw)
        T = step.R * step.N
        pos = positions.clone()
        pos[..., :T] = step.positions
        self._capture_forward_metadata(step)
        with vllm_ops.tree_verify(step.meta):
            out = self._orig["forward"](input_ids=input_ids, positions=pos, intermediate_tensors=intermediate_tensors,
                                        inputs_embeds=inputs_embeds, **kw)
        self._check_reached(step.meta.calls)
        self.metrics.add_time("verify", time.perf_counter() - step.t0)
        return out

    def _check_reached(self, calls: dict) -> None:
        """Every attention and GDN layer must have run its tree template (never a silent causal verify)."""
        attn = sum(v for k, v in calls.items() if k.endswith("attention_with_output"))
        gdn = sum(v for k, v in calls.items() if "gdn_attention_core" in k)
        if attn != len(self.attn_layers) or gdn != len(self.gdn_layers):
            raise RuntimeError(
                f"DDTree: the tree verify reached {attn}/{len(self.attn_layers)} attention and {gdn}/"
                f"{len(self.gdn_layers)} GatedDeltaNet layers through the ddtree ops ({calls}); the graph was "
                f"not rewritten (is the tree-verify pass in compilation_config.inductor_passes?)")

    def _capture_forward_metadata(self, step: Step) -> None:
        """Block tables of the attention groups, GDN state addressing: what the templates read."""
        from vllm.forward_context import get_forward_context

        md = get_forward_context().attn_metadata
        for gid, names in self._kv_groups.items():
            step.block_tables[gid] = md[names[0]].block_table[: step.R]
        if not self.hybrid:
            return
        # GDN layers sit in several KV cache groups, each with its own state lines: the templates
        # read each layer's addressing from its own metadata; the commit needs it per group.
        step.gdn_groups = {}
        for gid, names in self._gdn_groups.items():
            g = md[self._layer(names[0]).prefix]
            if g.num_spec_decodes != step.R or g.num_prefills or g.num_decodes:
                raise RuntimeError(f"DDTree: the GDN metadata of a tree step is not a pure spec batch (spec "
                                   f"{g.num_spec_decodes}, prefills {g.num_prefills}, decodes {g.num_decodes})")
            step.gdn_groups[gid] = (g.spec_state_indices_tensor[: step.R].to(torch.int32).contiguous(),
                                    g.num_accepted_tokens[: step.R].to(torch.int32).clone())
        gdn = {"write_snapshots": self.cfg.gdn_state == "snapshots"}
        if self.debug_gdn_records:  # tests: the committed states the verify starts from
            from ..templates.tree_gdn import committed_lines

            step.debug_pre = {}
            for gid, names in self._gdn_groups.items():
                lines = committed_lines(*step.gdn_groups[gid])
                for n in names:
                    step.debug_pre[n] = vllm_ops._gdn_state_views(self._layer(n))[1][lines].float().clone()
        if self.cfg.gdn_state == "replay" or self.debug_gdn_records:
            gdn["records"], gdn["rec_all"] = self._gdn_records(step.R, step.N)
        step.meta.gdn = gdn

    def _gdn_records(self, R, N):
        layer = self._layer(self.gdn_layers[0])
        tp = getattr(layer, "tp_size", 1)
        H, K = layer.num_k_heads // tp, layer.head_k_dim
        HV, V = layer.num_v_heads // tp, layer.head_v_dim
        per_layer, per_group = {}, {}
        for gid, names in self._gdn_groups.items():
            nl = len(names)
            rec_kv = torch.empty(nl, R, N, H * K + HV * V, dtype=self.runner.model_config.dtype, device=self.device)
            rec_gb = torch.empty(nl, R, N, 2, HV, dtype=torch.float32, device=self.device)
            per_group[gid] = (rec_kv, rec_gb)
            for i, n in enumerate(names):
                per_layer[self._layer(n).prefix] = (rec_kv[i], rec_gb[i])
        return per_layer, per_group

