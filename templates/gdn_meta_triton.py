"""`gdn_meta.build_gdn_meta` as one Triton program per request: the torch reference costs ~350 tiny
kernels per step inside every FULL graph replay (mostly `ancestor_closure`'s loop); this writes the same
`conv_anc` and `walk` tensors, bit for bit, in one launch (gdn_step.make_gdn_meta calls it on CUDA).

The program holds the ancestor matrix of slots 1..N-1 in registers (the root's row and column are
known: it is everyone's ancestor and has no siblings), so a tree of 2^k + 1 slots (budget 2^k) needs a
2^k x 2^k matrix, not 2^(k+1) x 2^(k+1). Preorder positions follow the reference's formula: depth +
the sizes of the earlier siblings of every ancestor-or-self; each slot's walk row is stored straight
at its position (a scatter, no gather of the order).
"""

from __future__ import annotations

import torch

from ddtree_compile.templates.gdn_meta import (
    F_FROM_COMMITTED, F_PAD, F_RELOAD, F_SAVE, WALK_FIELDS, GdnTreeMeta, _check_width,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: only the reference is available
    triton = None

# Slots 1..N-1 as a 128 x 128 matrix at most: 8 warps hold it and its fp16 square without spilling
# (~225 registers a thread on an H100); 256 x 256 does not compile (ptxas runs out of registers).
MAX_SLOTS = 129

if triton is not None:

    @triton.jit
    def _gdn_meta_kernel(
        PAR, CONV, WALK, s_par, max_depth,
        N: tl.constexpr, W1: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr,
        FC: tl.constexpr, FR: tl.constexpr, FS: tl.constexpr, FP: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        row = PAR + r * s_par
        # Rows t and columns u both stand for slot t + 1 / u + 1 (the root, slot 0, is handled apart).
        t = tl.arange(0, BT)
        u = tl.arange(0, BT)
        s_r = t + 1
        s_c = u + 1
        in_r = s_r < N
        par_r = tl.load(row + s_r, mask=in_r, other=-1).to(tl.int32)  # loaded in both orientations so
        par_c = tl.load(row + s_c, mask=s_c < N, other=-1).to(tl.int32)  # neither needs a transpose
        p0 = tl.load(row).to(tl.int32)  # the root's parent (-1 in a well-formed tree)
        live_r = par_r >= 0  # a slot >= 1 is live iff it has a parent; padding has -1

        # anc[t, u]: slot u+1 is slot t+1 or one of its ancestors, the root left out (the reference's
        # ancestor_closure without the root column). Start from self-or-parent and square the matrix
        # on the tensor cores (0/1 in fp16, exact fp32 sums) until nothing changes: log2(depth) + 1
        # products instead of a depth-long chain of dependent gathers (on an H100 a 128-deep chain
        # takes ~25 us squared, ~140 us walked step by step). A slot at depth d has d - 1 non-root
        # ancestors, the farthest d - 1 steps up: once the reach covers max_depth - 1 the closure is complete.
        a = (live_r[:, None] & ((s_c[None, :] == s_r[:, None]) | (s_c[None, :] == par_r[:, None]))).to(tl.float16)
        n = tl.sum(tl.sum((a > 0).to(tl.int32), axis=1), axis=0)
        reach = tl.full((), 1, tl.int32)
        go = reach < max_depth - 1
        while go:
            a = (tl.dot(a, a) > 0).to(tl.float16)
            m = tl.sum(tl.sum((a > 0).to(tl.int32), axis=1), axis=0)
            reach = reach * 2
            go = (m != n) & (reach < max_depth - 1)
            n = m
        anc = a > 0
        depth_r = tl.sum(anc.to(tl.int32), axis=1)  # non-root ancestors-or-self; 0 for padding
        size_c = tl.sum(anc.to(tl.int32), axis=0)  # subtree sizes of slots u + 1
        # Earlier live siblings (same parent >= 0, lower slot); the root has none, so its size is unused.
        sib = (par_r[:, None] == par_c[None, :]) & (s_c[None, :] < s_r[:, None]) & (par_r[:, None] >= 0)
        offs_r = tl.sum(tl.where(sib, size_c[None, :], 0), axis=1)
        # The root's own offset is 0, so leaving its column out of anc changes no sum.
        pos_r = depth_r + tl.sum(tl.where(anc, offs_r[None, :], 0), axis=1)
        nchild_r = tl.sum((par_c[None, :] == s_r[:, None]).to(tl.int32), axis=1) + (p0 == s_r).to(tl.int32)
        n_live = 1 + tl.sum(live_r.to(tl.int32), axis=0)
        pad_r = in_r & ~live_r
        pad_rank = tl.cumsum(pad_r.to(tl.int32), axis=0) - 1
        pos_r = tl.where(live_r, pos_r, n_live + pad_rank)
        # In preorder with children in slot order the previous position is the parent exactly for
        # the first child (no earlier sibling, offs 0); every later child reloads the parent's state.
        flags_r = tl.where(live_r, tl.where(offs_r > 0, FR, 0) | tl.where(nchild_r >= 2, FS, 0), FP)

        f = tl.arange(0, 4)[None, :]
        walk_row = WALK + r * (N * 4)
        vals = tl.where(f == 0, s_r[:, None], tl.where(f == 1, par_r[:, None],
                                                       tl.where(f == 2, depth_r[:, None], flags_r[:, None])))
        tl.store(walk_row + pos_r[:, None] * 4 + f, vals, mask=in_r[:, None])
        # The root: position 0, depth 0.
        nchild0 = tl.sum((par_c == 0).to(tl.int32), axis=0) + (p0 == 0).to(tl.int32)
        f0 = tl.where(p0 < 0, FC, FR) | tl.where(nchild0 >= 2, FS, 0)
        f1 = tl.arange(0, 4)
        tl.store(walk_row + f1, tl.where(f1 == 0, 0, tl.where(f1 == 1, p0, tl.where(f1 == 2, 0, f0))))

        # conv_anc over every slot: W-1 steps up, past the root into the history (-1, -2, ...).
        s = tl.arange(0, BN)
        in_n = s < N
        c = s
        conv_row = CONV + r * (N * W1) + s * W1
        for w in tl.static_range(W1):
            up = tl.load(row + tl.maximum(c, 0), mask=in_n & (c >= 0), other=0).to(tl.int32)
            c = tl.where(c >= 0, up, c - 1)
            tl.store(conv_row + w, c, mask=in_n)


def supports(num_slots: int) -> bool:
    """Whether the kernel handles trees of this many slots (make_gdn_meta falls back to torch otherwise)."""
    return triton is not None and 1 <= num_slots <= MAX_SLOTS


def _num_warps(bt: int) -> int:
    # 1 warp up to 32 x 32, 4 for 64 x 64, 8 for 128 x 128 (fewer spill: N = 129 took 40x longer on 2)
    return max(1, min(8, bt * bt // 1024))


def build_gdn_meta_triton(parents: torch.Tensor, width: int, max_depth: int | None = None,
                          conv_anc: torch.Tensor | None = None, walk: torch.Tensor | None = None) -> GdnTreeMeta:
    """`build_gdn_meta` in one launch (same arguments, same result). `conv_anc` [R, N, W-1] / `walk`
    [R, N, 4]: contiguous int32 buffers to write into (every element is written). CPU tensors need
    TRITON_INTERPRET=1 set before triton is imported. The tree must be well formed and no deeper than
    `max_depth` (validate_tree): the reference truncates deeper trees, this kernel does not.
    """
    if triton is None:
        raise RuntimeError("gdn_meta: triton is not installed; use build_gdn_meta")
    if parents.dim() != 2:
        raise ValueError(f"parents must be [R, N], got shape {tuple(parents.shape)}")
    _check_width(width)
    if parents.dtype.is_floating_point or parents.dtype == torch.bool or parents.is_complex():
        raise ValueError(f"parents must be an integer tensor, got {parents.dtype}")
    R, N = parents.shape
    if not supports(N):
        raise ValueError(f"gdn_meta: trees of {N} slots; the kernel holds 1..{MAX_SLOTS}; use build_gdn_meta")
    if max_depth is None:
        max_depth = N - 1
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    dev = parents.device
    if dev.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("gdn_meta: CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    if conv_anc is None:
        conv_anc = torch.empty(R, N, width - 1, dtype=torch.int32, device=dev)
    if walk is None:
        walk = torch.empty(R, N, WALK_FIELDS, dtype=torch.int32, device=dev)
    for name, buf, shape in (("conv_anc", conv_anc, (R, N, width - 1)), ("walk", walk, (R, N, WALK_FIELDS))):
        if buf.shape != shape or buf.dtype != torch.int32 or buf.device != dev or not buf.is_contiguous():
            raise ValueError(f"gdn_meta: {name} must be a contiguous int32 {shape} tensor on {dev}; "
                             f"got {buf.dtype} {tuple(buf.shape)} on {buf.device}")
    if parents.stride(1) != 1:
        parents = parents.contiguous()
    if R:
        bt = max(16, triton.next_power_of_2(max(N - 1, 1)))
        _gdn_meta_kernel[(R,)](
            parents, conv_anc, walk, parents.stride(0), max_depth,
            N=N, W1=width - 1, BT=bt, BN=max(16, triton.next_power_of_2(N)),
            FC=F_FROM_COMMITTED, FR=F_RELOAD, FS=F_SAVE, FP=F_PAD, num_warps=_num_warps(bt))
    return GdnTreeMeta(conv_anc, walk, width, max_depth)
