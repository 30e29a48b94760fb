"""The DDTree walk (accepted path + bonus token) as one Triton program per request.

Same result as the torch reference `ddtree_compile.core.walk.walk_tree` (core/walk.py calls this
kernel instead on CUDA), computed the other way round: the reference marks every node whose
ancestors all match (one masked reduction over the ancestor mask, ~70 small ops), the kernel walks
down from the root, at each depth taking the lowest-numbered live child of the current node whose
token is the target's token at the current node (the reference's "a parent's first matching child
wins"). The tree's nodes stay in registers; one launch replaces the reference's ops, which on the
GPU are each a kernel launch plus host dispatch in every round.

The tree's tokens, parents and the target row are read once; the walk loop then runs in registers
(each depth: two masked reductions over the B + 1 slots, no memory access), and the output rows are
accumulated in registers and stored once at the end (no store-then-overwrite ordering between threads).

The same program also writes what the round reads right after the walk, which in torch took ~40 more
small ops per step: the drafter's next input order (`walk.drafter_order`: the path's slots first,
then the others in slot order, one scatter of a permutation) and, given the drafter's top-1 chain,
the accepted nodes off it (`walk.accepted_off_chain`).
"""

from __future__ import annotations

import torch

from ddtree_compile.core.tree import TreeBatch, WalkResult

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: only the reference is available
    triton = None

MAX_SLOTS = 1024  # the largest tree (B + 1 slots) a program holds in registers

if triton is not None:

    @triton.jit
    def _tree_walk_kernel(
        TOK, PAR, NN, TGT, ACC, NACC, BONUS, OUT, ORDER, TOP1, OFF,
        s_tok, s_par, s_tgt, s_acc, s_out, s_top1, L,
        N: tl.constexpr, L1: tl.constexpr, NP: tl.constexpr, LP: tl.constexpr, HAS_TOP1: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, NP)
        inb = offs < N
        tok = tl.load(TOK + r * s_tok + offs, mask=inb, other=0)
        par = tl.load(PAR + r * s_par + offs, mask=inb, other=-1)
        tgt = tl.load(TGT + r * s_tgt + offs, mask=inb, other=0)  # read once: the loop stays in registers
        nn = tl.load(NN + r)
        # a node can be accepted: live (slot <= num_nodes) and not the root (its parent is >= 0 anyway)
        cand_ok = inb & (offs > 0) & (offs.to(tl.int64) <= nn)
        cols = tl.arange(0, LP)
        acc = tl.where(cols == 0, 0, -1).to(tl.int64)  # slot per path depth, root first
        path_tok = tl.full((LP,), -1, tl.int64)  # token per path depth (column d-1 for depth d)
        cur = tl.zeros((), tl.int64)  # slot of the last accepted node
        n_acc = tl.full((), 1, tl.int64)
        alive = tl.full((), 1, tl.int1)
        on_path = offs == 0  # per slot: accepted (the root is)
        depth = tl.zeros((NP,), tl.int64)  # per accepted slot: its depth
        if HAS_TOP1:  # the drafter's argmax per depth (column d - 1 for depth d), first L columns
            top1 = tl.load(TOP1 + r * s_top1 + cols, mask=cols < L, other=-1)
        on_chain = tl.full((), 1, tl.int1)  # the path so far is the drafter's top-1 chain
        off = tl.zeros((), tl.int64)
        for d in range(1, L1):
            want = tl.sum(tl.where(offs == cur, tgt, 0), axis=0)  # the target's token at the current node
            hit = cand_ok & (par == cur) & (tok == want)
            j = tl.min(tl.where(hit, offs, NP), axis=0)
            found = alive & (j < NP)
            tok_j = tl.sum(tl.where(offs == j, tok, 0), axis=0)
            acc = tl.where(found & (cols == d), j.to(tl.int64), acc)
            path_tok = tl.where(found & (cols == d - 1), tok_j, path_tok)
            cur = tl.where(found, j.to(tl.int64), cur)
            n_acc += found.to(tl.int64)
            alive = found
            at_j = found & (offs == j)
            on_path = on_path | at_j
            depth = tl.where(at_j, d, depth)
            if HAS_TOP1:  # (paths deeper than the drafter's L positions count only their first L)
                on_chain = on_chain & (tok_j == tl.sum(tl.where(cols == d - 1, top1, 0), axis=0))
                off += (found & (d <= L) & ~on_chain).to(tl.int64)
        bonus = tl.sum(tl.where(offs == cur, tgt, 0), axis=0)
        # committed tokens: the path after the root, then the bonus, then -1
        out = tl.where(cols == n_acc - 1, bonus, path_tok)
        cmask = cols < L1
        tl.store(ACC + r * s_acc + cols, acc, mask=cmask)
        tl.store(OUT + r * s_out + cols, out, mask=cmask)
        tl.store(NACC + r, n_acc)
        tl.store(BONUS + r, bonus)
        # drafter order: an accepted slot goes to its depth, the k-th other slot to n_acc + k
        others = tl.cumsum((inb & ~on_path).to(tl.int64), axis=0) - 1
        pos = tl.where(on_path, depth, n_acc + others)
        tl.store(ORDER + r * N + pos, r * N + offs, mask=inb)
        if HAS_TOP1:
            tl.store(OFF + r, off)


def supports(num_slots: int) -> bool:
    """Whether the kernel handles trees of this many slots (the dispatch falls back to torch otherwise)."""
    return triton is not None and num_slots <= MAX_SLOTS


def walk_tree_triton(tree: TreeBatch, target_tokens: torch.Tensor, out: WalkResult | None = None,
                     top1: torch.Tensor | None = None) -> WalkResult:
    """`walk.walk_tree` on the device. target_tokens: integer [R, N] (the target's token at each slot);
    top1: the drafter's top-1 chain [R, L] (then out.off_chain is filled).

    `out`: a WalkResult of this shape to write into (every element is written, order included;
    off_chain when top1 is given). CPU tensors need TRITON_INTERPRET=1 set before triton is
    imported. The tree must be well formed (parents before children, depth = parent's depth + 1),
    as `build_tree` and the round make them.
    """
    if triton is None:
        raise RuntimeError("tree_walk: triton is not installed")
    R, N = tree.tokens.shape
    if not supports(N):
        raise ValueError(f"tree_walk: trees of {N} slots; the kernel holds at most {MAX_SLOTS}; use the torch walk")
    if tree.tokens.device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("tree_walk: CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    dev, L1 = tree.tokens.device, tree.max_depth + 1
    target = target_tokens.long()
    tok, par, nn = (t.contiguous() for t in (tree.tokens, tree.parents, tree.num_nodes))
    if target.stride(1) != 1:
        target = target.contiguous()
    i64 = dict(dtype=torch.int64, device=dev)
    if out is None:
        out = WalkResult(torch.empty(R, L1, **i64), torch.empty(R, **i64), torch.empty(R, **i64),
                         torch.empty(R, L1, **i64))
    if out.order is None:
        out.order = torch.empty(R * N, **i64)
    if top1 is not None:
        top1 = top1 if top1.dtype == torch.int64 and top1.stride(1) == 1 else top1.long().contiguous()
        if out.off_chain is None:
            out.off_chain = torch.empty(R, **i64)
    checks = [("accepted", out.accepted, (R, L1)), ("num_accepted", out.num_accepted, (R,)),
              ("bonus", out.bonus, (R,)), ("tokens", out.tokens, (R, L1)), ("order", out.order, (R * N,))]
    for name, t, shape in checks + ([("off_chain", out.off_chain, (R,))] if top1 is not None else []):
        if t.shape != shape or t.dtype != torch.int64 or t.device != dev or t.stride(-1) != 1:
            raise ValueError(f"tree_walk: out.{name} must be int64 {shape} on {dev}, last dim contiguous; "
                             f"got {t.dtype} {tuple(t.shape)}")
    if R:
        has_top1 = top1 is not None
        L = min(top1.shape[1], L1) if has_top1 else 0  # columns a path can reach (depth <= L1 - 1)
        _tree_walk_kernel[(R,)](
            tok, par, nn, target, out.accepted, out.num_accepted, out.bonus, out.tokens, out.order,
            top1 if has_top1 else out.order, out.off_chain if has_top1 else out.order,
            tok.stride(0), par.stride(0), target.stride(0), out.accepted.stride(0), out.tokens.stride(0),
            top1.stride(0) if has_top1 else 0, L,
            N=N, L1=L1, NP=triton.next_power_of_2(N), LP=triton.next_power_of_2(L1), HAS_TOP1=has_top1,
            num_warps=1 if N <= 64 else 2)
    return out
