"""Resume at column 0: a request's GatedDeltaNet state moved from where a verify left it to where a
forward without drafts reads it. Argument checks and the plain torch reference (gdn_resume.py is the
Triton kernel; adapters/gdn_resume.py says when vLLM 0.26 needs it).

A verify that accepted n tokens leaves a request's state the lazy way vLLM's chain verify does (and
DDTree's commit, gdn_commit_ref.py): the SSM state in line `state_indices[r, n - 1]`, the conv window
at columns [n - 1, n + W - 2) of line `state_indices[r, 0]`, and `num_accepted[r] = n`. A forward that
reads the request at column 0 (line `state_indices[r, 0]`, conv columns [0, W - 1)) needs it there:
for each row r in `rows` with n = num_accepted[r] > 1, line `state_indices[r, n - 1]`'s SSM state is
copied to line `state_indices[r, 0]` and the conv window shifted left by n - 1 in that line (column c
<- n - 1 + c, in increasing c: nothing is overwritten before it is read). Rows with n <= 1 are
already there; a null line (0: vLLM's padding block) is neither read nor written. num_accepted is
left alone: every KV cache group's layers read it, and vLLM resets it after the forward.
Per-layer cache tensors go in as lists (vLLM gives each layer its own tensors).
"""

from __future__ import annotations

import torch


def check_resume_args(conv_states, ssm_states, state_indices, num_accepted, rows, width) -> None:
    """Shape/dtype checks (host only, no sync)."""
    if not conv_states or len(conv_states) != len(ssm_states):
        raise ValueError(f"conv_states and ssm_states must list one tensor per GDN layer, got {len(conv_states)} "
                         f"and {len(ssm_states)}")
    for name, ts, shape in (("conv_states", conv_states, "[lines, dim, state_len]"),
                            ("ssm_states", ssm_states, "[lines, HV, V, K]")):
        t0 = ts[0]
        if any(t.shape != t0.shape or t.stride() != t0.stride() or t.dtype != t0.dtype for t in ts):
            raise ValueError(f"all {name} must share shape, strides and dtype")
        if t0.dim() != shape.count(",") + 1:
            raise ValueError(f"{name} entries must be {shape}, got {tuple(t0.shape)}")
    if conv_states[0].shape[0] != ssm_states[0].shape[0]:
        raise ValueError("conv_states and ssm_states must have the same number of lines")
    if state_indices.dim() != 2 or state_indices.dtype != torch.int32:
        raise ValueError(f"state_indices must be int32 [R, NS], got {state_indices.dtype} {tuple(state_indices.shape)}")
    if num_accepted.dim() != 1 or num_accepted.shape[0] < state_indices.shape[0] or num_accepted.dtype != torch.int32:
        raise ValueError(f"num_accepted must be int32 [>= R={state_indices.shape[0]}], got {num_accepted.dtype} "
                         f"{tuple(num_accepted.shape)}")
    if rows.dim() != 1 or rows.dtype != torch.int32:
        raise ValueError(f"rows must be int32 [M], got {rows.dtype} {tuple(rows.shape)}")
    if width not in (2, 3, 4) or conv_states[0].shape[2] < state_indices.shape[1] + width - 2:
        raise ValueError(f"width (conv kernel size) must be 2, 3 or 4 with state_len >= NS + width - 2 (a window "
                         f"at column NS - 1 fits), got width {width}, state_len {conv_states[0].shape[2]}, "
                         f"NS {state_indices.shape[1]}")


def gdn_resume_ref(conv_states, ssm_states, state_indices, num_accepted, rows, width) -> None:
    """Reference (and CPU kernel): in place, module docstring. Host loops: tests and CPU only."""
    check_resume_args(conv_states, ssm_states, state_indices, num_accepted, rows, width)
    ns = state_indices.shape[1]
    for r in rows.tolist():
        n = int(num_accepted[r])
        if n <= 1 or n > ns:
            continue
        src, dst = int(state_indices[r, n - 1]), int(state_indices[r, 0])
        if dst <= 0:
            continue
        for conv, ssm in zip(conv_states, ssm_states):
            if src > 0:
                ssm[dst] = ssm[src]
            conv[dst, :, : width - 1] = conv[dst, :, n - 1: n - 2 + width].clone()
