"""Accepted-path commit of the GatedDeltaNet state after the tree walk, for ALL GDN layers at once:
argument checks and the plain torch reference (float32 replay), the CPU kernel of
`torch.ops.ddtree.gdn_commit` and the oracle of the Triton kernels (gdn_commit.py).

Walk result: `accepted` [R, L+1] slot indices (root first, -1 padded) and `path_len` [R] (0 = leave the
request untouched). With n = path_len[r] and p = accepted[r, n - 1] the last accepted slot, the commit
leaves vLLM's own chain layout, as if the n path tokens had been verified as a chain:
- conv: after the verify a request's conv line holds [h_1 .. h_{W-2}, x_0 .. x_B] (see tree_conv_ref);
  the path is compacted to [h_1 .. h_{W-2}, x_path[0] .. x_path[n-1]] (column W-2+i <- W-2+path[i];
  path[i] >= i, so in increasing i nothing is overwritten before it is read; a main-chain path is
  already there: nothing moves). vLLM reads the window at offset n - 1;
- state: the state after path[n-1] in line `state_indices[r, n - 1]` (or `[r, 0]` with a single
  column): replayed from the committed line with the recorded (k, v, g, beta) (records strategy),
  or copied from p's snapshot (snapshots strategy);
- `snap_depth[r]` = d in [0, n - 1) (optional; -1 = none): the state after path[d] also goes to line
  `state_indices[r, d]`. vLLM's "align" prefix caching copies line d into the cache block that the
  token at depth d completes (its postprocess after the step; the conv window at offset d is the
  path's already);
- `num_accepted[r] = n` (in place): what vLLM itself sets from the sampled tokens.
Per-layer cache tensors go in as lists (vLLM gives each layer its own tensors).

Layers of several KV cache groups (each group its own state lines) go in one call: `state_indices`
[G, R, NS] and `num_accepted` [G, R] per group, `layer_group[l]` the group of layer l. One call for
every group instead of one per group: on the 4B shape vLLM makes 5 GDN groups, on the 27B 10, and
each call costs host time (custom op dispatch, checks, launches) on every step.
"""

from __future__ import annotations

import torch

from ddtree_compile.templates.tree_gdn_ref import committed_lines, gdn_update_ref


def _check_same(tensors, name):
    t0 = tensors[0]
    for t in tensors[1:]:
        if t.shape != t0.shape or t.stride() != t0.stride() or t.dtype != t0.dtype or t.device != t0.device:
            raise ValueError(f"all {name} must share shape, strides, dtype and device")


def check_commit_args(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
                      width, snap_depth=None, layer_group=None):
    """Shape/dtype checks (host only, no sync)."""
    R = accepted.shape[0]
    if layer_group is not None:
        G = state_indices.shape[0] if state_indices.dim() == 3 else 0
        if state_indices.dim() != 3 or num_accepted.dim() != 2 or num_accepted.shape[0] != G:
            raise ValueError(f"with layer_group, state_indices must be [G, R, NS] and num_accepted [G, R], got "
                             f"{tuple(state_indices.shape)}, {tuple(num_accepted.shape)}")
        if len(layer_group) != len(conv_states) or any(not 0 <= int(g) < G for g in layer_group):
            raise ValueError(f"layer_group must give each of the {len(conv_states)} layers a group in 0..{G - 1}, "
                             f"got {list(layer_group)}")
        state_indices, num_accepted = state_indices[0], num_accepted[0]
    elif state_indices.dim() != 2:
        raise ValueError(f"state_indices must be int32 [R={R}, NS] (or [G, R, NS] with layer_group), got "
                         f"{tuple(state_indices.shape)}")
    if snap_depth is not None and (snap_depth.shape != (R,) or snap_depth.dtype != torch.int32):
        raise ValueError(f"snap_depth must be int32 [R={R}] or None, got {snap_depth.dtype} {tuple(snap_depth.shape)}")
    if width not in (2, 3, 4):
        raise ValueError(f"width (conv kernel size) must be 2, 3 or 4, got {width}")
    if accepted.dim() != 2 or accepted.dtype != torch.int32 or path_len.shape != (R,) or path_len.dtype != torch.int32:
        raise ValueError(f"accepted must be int32 [R, L+1] and path_len int32 [R], got {accepted.dtype} "
                         f"{tuple(accepted.shape)}, {path_len.dtype} {tuple(path_len.shape)}")
    if state_indices.dim() != 2 or state_indices.shape[0] != R or state_indices.dtype != torch.int32:
        raise ValueError(f"state_indices must be int32 [R={R}, NS], got {state_indices.dtype} {tuple(state_indices.shape)}")
    if num_accepted.shape != (R,) or num_accepted.dtype != torch.int32:
        raise ValueError(f"num_accepted must be int32 [R={R}], got {num_accepted.dtype} {tuple(num_accepted.shape)}")
    if len(conv_states) == 0:
        raise ValueError("conv_states must list one [lines, dim, state_len] tensor per GDN layer")
    _check_same(conv_states, "conv_states")
    if conv_states[0].dim() != 3:
        raise ValueError(f"conv_states entries must be [lines, dim, state_len], got {tuple(conv_states[0].shape)}")
    if (rec_kv is None) != (rec_gb is None):
        raise ValueError("rec_kv and rec_gb must be given together (records strategy) or both None (snapshots)")
    nl = len(conv_states)
    if len(ssm_states) != nl:
        raise ValueError(f"the commit needs one ssm_state per layer: {len(ssm_states)} ssm_states, {nl} conv_states")
    _check_same(ssm_states, "ssm_states")
    if rec_kv is not None:
        _, HV, V, K = ssm_states[0].shape
        # Records may hold more rows than the batch (a CUDA-graph bucket's padded rows, or a slice of
        # one buffer sized for the largest batch): rows >= R are ignored, each layer's rows contiguous.
        if (rec_gb.dim() != 5 or rec_gb.shape[0] != nl or rec_gb.shape[1] < R or rec_gb.shape[3:] != (2, HV)
                or not rec_gb[0].is_contiguous() or rec_gb.shape[1] != rec_kv.shape[1]):
            raise ValueError(f"rec_gb must be [layers={nl}, rows>={R}, N, 2, HV={HV}] (rows as rec_kv, each layer "
                             f"contiguous), got {tuple(rec_gb.shape)}")
        N = rec_gb.shape[2]
        if rec_kv.dim() != 4 or rec_kv.shape[0] != nl or rec_kv.shape[2] != N or not rec_kv[0].is_contiguous():
            raise ValueError(f"rec_kv must be [layers={nl}, rows>={R}, N={N}, H*K + HV*V] (each layer contiguous), "
                             f"got {tuple(rec_kv.shape)}")
        if (rec_kv.shape[3] - HV * V) % K or rec_kv.shape[3] <= HV * V:
            raise ValueError(f"rec_kv last dim {rec_kv.shape[3]} is not H*K + HV*V for K={K}, HV*V={HV * V}")


def gdn_commit_ref(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
                   width, snap_depth=None, layer_group=None):
    """Torch reference (float32 replay). Mutates the listed caches and num_accepted."""
    check_commit_args(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
                      width, snap_depth, layer_group)
    if layer_group is None:
        layer_group, state_indices, num_accepted = [0] * len(conv_states), state_indices[None], num_accepted[None]
    groups = sorted(set(int(g) for g in layer_group))
    for g in groups:  # group by group: each group's layers read and set its own lines and num_accepted
        mine = [i for i, x in enumerate(layer_group) if int(x) == g]
        recs = (None, None) if rec_kv is None else (rec_kv[mine], rec_gb[mine])
        _commit_group([conv_states[i] for i in mine], [ssm_states[i] for i in mine], state_indices[g],
                      num_accepted[g], accepted, path_len, *recs, width, snap_depth)


def _commit_group(conv_states, ssm_states, state_indices, num_accepted, accepted, path_len, rec_kv, rec_gb,
                  width, snap_depth):
    src_lines = committed_lines(state_indices, num_accepted)
    single = state_indices.shape[1] == 1
    for r in range(accepted.shape[0]):
        n = int(path_len[r])
        if n <= 0:
            continue
        path = accepted[r, :n].long().tolist()
        d = -1 if snap_depth is None or single else int(snap_depth[r])
        d = d if 0 <= d < n - 1 else -1
        dst = int(state_indices[r, 0 if single else n - 1])
        snap = int(state_indices[r, d]) if d >= 0 else 0
        for layer, ssm in enumerate(ssm_states):
            if rec_kv is not None:
                _, HV, V, K = ssm.shape
                H = (rec_kv.shape[3] - HV * V) // K
                src = int(src_lines[r])
                h = ssm[src].float() if src > 0 else torch.zeros(HV, V, K, device=ssm.device)
                for m, s in enumerate(path):
                    kv = rec_kv[layer, r, s]
                    k = kv[: H * K].view(H, K).repeat_interleave(HV // H, 0)
                    h = gdn_update_ref(h, k, kv[H * K:].view(HV, V), rec_gb[layer, r, s, 0], rec_gb[layer, r, s, 1])
                    if m == d and snap > 0:
                        ssm[snap] = h.to(ssm.dtype)
                if dst > 0:
                    ssm[dst] = h.to(ssm.dtype)
            elif not single:  # snapshots: node s's state is in line s; path[d] may be line n - 1: d first
                if snap > 0:
                    ssm[snap] = ssm[int(state_indices[r, path[d]])].clone()
                if dst > 0 and path[-1] != n - 1:
                    ssm[dst] = ssm[int(state_indices[r, path[-1]])].clone()
        line = int(state_indices[r, 0])
        if line > 0:
            cols = torch.tensor([width - 2 + s for s in path], device=conv_states[0].device)
            for conv in conv_states:
                conv[line, :, width - 2: width - 2 + n] = conv[line][:, cols].clone()
        num_accepted[r] = n
