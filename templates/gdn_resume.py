"""Resume at column 0 (semantics and the plain torch reference: gdn_resume_ref.py): the Triton kernel,
one launch for every layer of a KV cache group. Each program moves one block of one row's SSM state
and one block of its conv channels in one layer; the layers' caches are read through gdn_commit's
cached table of base pointers. No host sync, no allocation after the first call of a layer set.
"""

from __future__ import annotations

import torch

from ddtree_compile.templates.gdn_commit import pointer_table
from ddtree_compile.templates.gdn_resume_ref import check_resume_args, gdn_resume_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs without triton: only the reference is available
    triton = None


if triton is not None:
    @triton.jit
    def _resume_kernel(ctab, clike, s_cl, s_cd, s_cc, stab, slike, s_sl, s_sh, s_sv, s_sk, idx, s_ir, s_ic, nacc,
                       rows, NS, D, E, V: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BD: tl.constexpr,
                       BE: tl.constexpr):
        r = tl.load(rows + tl.program_id(0)).to(tl.int64)
        blk = tl.program_id(1)
        layer = tl.program_id(2)
        n = tl.load(nacc + r)
        if (n > 1) & (n <= NS):
            dst = tl.load(idx + r * s_ir).to(tl.int64)
            src = tl.load(idx + r * s_ir + (n - 1) * s_ic).to(tl.int64)
            if dst > 0:
                if src > 0:  # the SSM state: line n - 1 -> line 0, any strides
                    e = blk * BE + tl.arange(0, BE)
                    em = e < E
                    off = (e // (V * K)).to(tl.int64) * s_sh + ((e // K) % V).to(tl.int64) * s_sv \
                        + (e % K).to(tl.int64) * s_sk
                    base = tl.load(stab + layer).to(tl.pointer_type(slike.dtype.element_ty))
                    tl.store(base + dst * s_sl + off, tl.load(base + src * s_sl + off, mask=em), mask=em)
                c = blk * BD + tl.arange(0, BD)
                cm = c < D
                cbase = tl.load(ctab + layer).to(tl.pointer_type(clike.dtype.element_ty))
                lp = cbase + dst * s_cl + c.to(tl.int64) * s_cd
                # the conv window: column j <- n - 1 + j, in increasing j (a channel is one thread's)
                for j in range(W - 1):
                    v = tl.load(lp + (n - 1 + j) * s_cc, mask=cm)
                    tl.store(lp + j * s_cc, v, mask=cm)


def gdn_resume_triton(conv_states, ssm_states, state_indices, num_accepted, rows, width, block_d: int = 256,
                      block_e: int = 1024, num_warps: int = 4) -> None:
    """Triton launcher, same contract as `gdn_resume_ref`."""
    if triton is None:
        raise RuntimeError("gdn_resume: triton is not installed")
    check_resume_args(conv_states, ssm_states, state_indices, num_accepted, rows, width)
    if rows.numel() == 0:
        return
    conv, ssm = conv_states[0], ssm_states[0]
    D = conv.shape[1]
    V, K = ssm.shape[-2], ssm.shape[-1]
    E = ssm[0].numel()
    blocks = max(triton.cdiv(D, block_d), triton.cdiv(E, block_e))
    _resume_kernel[(rows.numel(), blocks, len(conv_states))](
        pointer_table(conv_states), conv, *conv.stride(), pointer_table(ssm_states), ssm, *ssm.stride(),
        state_indices, *state_indices.stride(), num_accepted, rows, state_indices.shape[1], D, E, V=V, K=K, W=width,
        BD=block_d, BE=block_e, num_warps=num_warps)


def gdn_resume(conv_states, ssm_states, state_indices, num_accepted, rows, width) -> None:
    """The Triton kernel on CUDA, the reference elsewhere."""
    fn = gdn_resume_triton if conv_states[0].is_cuda else gdn_resume_ref
    fn(conv_states, ssm_states, state_indices, num_accepted, rows, width)
