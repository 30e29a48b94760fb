"""Helpers (no tests here): drive a running vLLM model's forward directly (in-process engine), for the pass tests.

The pass tests check the rewritten graph independently of the DDTree runner: they build the
attention / GDN metadata themselves with the model runner's own metadata builders,
write K/V and recurrent state into block ids they choose (block 0 is vLLM's null block), set
vLLM's forward context and call the compiled model: the same graph the tree-verify pass
rewrote. Only valid while no request is running in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree_compile.core.tree import ancestor_closure, pack_bits


@dataclass
class Seq:
    """One request in a forward: `tokens` at `positions`, K/V written at cache positions `cache_pos`."""

    tokens: list[int]
    positions: list[int]
    cache_pos: list[int]
    context_len: int  # tokens already in the cache (and, for GDN, in the state)
    blocks: dict  # KV cache group id -> block ids of this sequence (a GDN group: [state line])


class ModelDriver:
    def __init__(self, runner):
        self.runner = runner
        self.vllm_config = runner.vllm_config
        self.groups = [g for gl in runner.attn_groups for g in gl]
        # The KV cache groups share one block pool (vLLM gives each group its own ids): split the
        # ids 1.. (block 0 is the null block) into one range per group.
        gids = sorted({g.kv_cache_group_id for g in self.groups})
        per = (runner.kv_cache_config.num_blocks - 1) // len(gids)
        self._range = {gid: [1 + i * per, 1 + (i + 1) * per] for i, gid in enumerate(gids)}

    @staticmethod
    def _kernel_table(g, bt: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(block table in the ids the group's caches are addressed by, its block size).

        Hybrid models pack several layers' pages per manager block: an attention group then
        addresses "kernel blocks" (vLLM's AttentionGroup.map_to_kernel_block_table)."""
        if g.kernel_block_size is None:
            return bt, g.kv_cache_spec.block_size
        return g.map_to_kernel_block_table(bt).clone(), g.kernel_block_size

    def alloc(self, num_tokens: int) -> dict:
        """Fresh, zeroed blocks for a sequence of up to `num_tokens` tokens: {group id: ids}."""
        out = {}
        sfc = self.runner.compilation_config.static_forward_context
        for g in self.groups:
            gid = g.kv_cache_group_id
            if gid in out:
                continue
            gdn = g.backend.get_name() == "GDN_ATTN"
            n = 1 if gdn else max(1, -(-num_tokens // g.kv_cache_spec.block_size))
            lo, hi = self._range[gid]
            if lo + n > hi:
                raise RuntimeError(f"driver: out of KV blocks in group {gid}")
            out[gid] = list(range(lo, lo + n))
            self._range[gid][0] = lo + n
        # vLLM zeroes new blocks (unwritten cache rows must not hold NaN garbage): do the same for
        # every layer, attention K/V and GDN conv/SSM state alike.
        for g in self.groups:
            ids = torch.tensor([out[g.kv_cache_group_id]], dtype=torch.int32)
            kid = self._kernel_table(g, ids)[0].flatten().long()
            for name in g.layer_names:
                kv = sfc[name].kv_cache
                for t in (kv if isinstance(kv, (list, tuple)) else [kv]):
                    t[kid] = 0
        return out

    def _common(self, seqs: list[Seq], group):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        qlens = [len(s.tokens) for s in seqs]
        qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
        seq_lens = torch.tensor([s.context_len + q for s, q in zip(seqs, qlens)], dtype=torch.int32)
        gid = group.kv_cache_group_id
        width = max(len(s.blocks[gid]) for s in seqs)
        bt = torch.zeros(len(seqs), width, dtype=torch.int32)
        for i, s in enumerate(seqs):
            bt[i, :len(s.blocks[gid])] = torch.tensor(s.blocks[gid], dtype=torch.int32)
        kbt, kbs = self._kernel_table(group, bt)
        slots = [int(kbt[i, p // kbs]) * kbs + p % kbs for i, s in enumerate(seqs) for p in s.cache_pos]
        return CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=len(seqs),
            num_actual_tokens=int(qsl[-1]), max_query_len=max(qlens), max_seq_len=int(seq_lens.max()),
            block_table_tensor=bt, slot_mapping=torch.tensor(slots, dtype=torch.int64),
            positions=torch.tensor([p for s in seqs for p in s.positions], dtype=torch.int64),
            seq_lens_cpu_upper_bound=seq_lens.clone(),
            is_prefilling=torch.tensor([s.context_len == 0 for s in seqs]))

    def forward(self, seqs: list[Seq]) -> torch.Tensor:
        """Logits for every token of `seqs`, [T, V] float32."""
        from vllm.forward_context import set_forward_context

        attn_metadata, slot_mapping = {}, {}
        for g in self.groups:
            cm = self._common(seqs, g)
            md = g.build_metadata(cm)
            for name in g.layer_names:
                attn_metadata[name] = md
                slot_mapping[name] = cm.slot_mapping
        # The compiled graph runs without guards: inputs must have the dtypes it was traced with
        # (vLLM's persistent buffers: int32 ids, int64 positions), or it silently misreads them.
        ids = torch.tensor([t for s in seqs for t in s.tokens], dtype=_dtype(self.runner.input_ids))
        pos = torch.tensor([p for s in seqs for p in s.positions], dtype=_dtype(self.runner.positions))
        model = self.runner.model
        with torch.inference_mode(), set_forward_context(attn_metadata, self.vllm_config,
                                                         num_tokens=len(ids), slot_mapping=slot_mapping):
            hidden = model(input_ids=ids, positions=pos, intermediate_tensors=None, inputs_embeds=None)
            if isinstance(hidden, tuple):  # (hidden, aux hidden states) when a DFlash drafter is on
                hidden = hidden[0]
            return model.compute_logits(hidden).float()

    def state_lines(self, seqs: list[Seq], group_id: int) -> torch.Tensor:
        """int32 [R, 1]: each sequence's GDN state line in one GDN group."""
        return torch.tensor([[s.blocks[group_id][0]] for s in seqs], dtype=torch.int32)

    def gdn_groups(self) -> dict:
        """{GDN layer name: its KV cache group id}."""
        return {n: g.kv_cache_group_id for g in self.groups if g.backend.get_name() == "GDN_ATTN"
                for n in g.layer_names}

    def prefill(self, tokens: list[int], blocks: dict | None = None) -> tuple[Seq, torch.Tensor]:
        """Ordinary prefill of a fresh sequence; returns (its Seq, logits of every token)."""
        blocks = blocks or self.alloc(len(tokens) + 64)
        s = Seq(tokens, list(range(len(tokens))), list(range(len(tokens))), 0, blocks)
        return s, self.forward([s])


def make_tree(parents: list[list[int]], tokens: list[list[int]]):
    """(parents, depths, ancestor_bits) tensors for R trees in the ddtree_compile.core.tree layout."""
    p = torch.tensor(parents, dtype=torch.int64)
    R, N = p.shape
    anc = ancestor_closure(p, N - 1)
    depths = (anc.sum(-1) - 1).clamp(min=0)
    return p, depths, pack_bits(anc), torch.tensor(tokens, dtype=torch.int64)


def root_path(parents: list[int], i: int) -> list[int]:
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]



def _dtype(buf) -> torch.dtype:
    """dtype of a runner buffer (a CpuGpuBuffer on GPU; a plain tensor on the CPU runner)."""
    return getattr(buf, "gpu", buf).dtype


def replay_paths(drv: ModelDriver, contexts: list[list[int]], paths: list[list[int]]) -> torch.Tensor:
    """Oracle: each context prefilled, then its path decoded one token at a time as an ordinary
    sequence (vLLM's own ops, no tree). Returns the logits after each path's last token, [P, V]."""
    seqs = [drv.prefill(c)[0] for c in contexts]
    out = [None] * len(paths)
    for t in range(max(len(p) for p in paths)):
        live = [i for i, p in enumerate(paths) if t < len(p)]
        step = []
        for i in live:
            s, pos = seqs[i], len(contexts[i]) + t
            step.append(Seq([paths[i][t]], [pos], [pos], pos, s.blocks))
        logits = drv.forward(step)
        for row, i in enumerate(live):
            if t == len(paths[i]) - 1:
                out[i] = logits[row]
    return torch.stack(out)
