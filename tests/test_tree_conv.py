"""Tree causal conv1d: Triton (interpreter) vs torch reference, and a per-path oracle."""

import pytest
import torch
from _gdn_common import KINDS, poison, random_parents, root_path  # sets TRITON_INTERPRET first

from ddtree_compile.templates.gdn_meta import build_gdn_meta
from ddtree_compile.templates.tree_conv import tree_conv1d_triton
from ddtree_compile.templates.tree_conv_ref import tree_conv1d_ref


def make_case(W, N, D, dtype, layout, seed, kinds=KINDS):
    gen = torch.Generator().manual_seed(seed)
    R = len(kinds)
    parents = torch.tensor([random_parents(k, N, N if i % 2 == 0 else max(1, N - 3), gen)
                            for i, k in enumerate(kinds)])
    x = torch.randn(R * N, D, generator=gen).to(dtype)
    weight = torch.randn(D, W, generator=gen).to(dtype)
    bias = torch.randn(D, generator=gen).to(dtype)
    SL = W - 2 + N
    store = torch.randn(R + 2, SL, D, generator=gen).to(dtype)
    conv_state = store.transpose(1, 2) if layout == "SD" else store.transpose(1, 2).contiguous()
    lines = torch.arange(1, R + 1, dtype=torch.int32)
    lines[-1] = 0  # a padded request on vLLM's null block
    state_indices = torch.stack([lines, lines + 7], 1).to(torch.int32)
    num_accepted = torch.randint(1, N + 1, (R,), generator=gen, dtype=torch.int32)
    return parents, x, weight, bias, conv_state, state_indices, num_accepted


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("layout", ["SD", "DS"])
def test_triton_matches_reference(W, layout):
    parents, x, weight, bias, conv_state, si, na = make_case(W, 10, 40, torch.float32, layout, seed=W)
    meta = build_gdn_meta(parents, W)
    outs = []
    for fn, kw in ((tree_conv1d_ref, {}), (tree_conv1d_triton, dict(block_d=16, block_t=4))):
        cs, out = conv_state.clone(), poison(torch.empty_like(x))
        fn(x, weight, bias if W != 3 else None, cs, si, na, meta.conv_anc, out, W != 2, **kw)
        assert not out.isnan().any()
        outs.append((out, cs))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=0, atol=0)
    # The null-block request's line is untouched.
    torch.testing.assert_close(outs[1][1][0], conv_state[0], rtol=0, atol=0)


@pytest.mark.parametrize("vllm_order", [False, True])
def test_triton_bf16(vllm_order):
    """Both arithmetics: float32 products (CPU engines), and vLLM's CUDA conv's (bf16-rounded products,
    bias first, oldest first: what a CUDA engine runs). The output's own bf16 rounding differs by up to
    one ulp under the interpreter (its float32 -> bf16 cast truncates)."""
    parents, x, weight, bias, conv_state, si, na = make_case(4, 9, 24, torch.bfloat16, "SD", seed=5)
    meta = build_gdn_meta(parents, 4)
    res = []
    for fn in (tree_conv1d_ref, tree_conv1d_triton):
        cs, out = conv_state.clone(), poison(torch.empty_like(x))
        fn(x, weight, bias, cs, si, na, meta.conv_anc, out, True, vllm_order=vllm_order)
        res.append((out.float(), cs))
    torch.testing.assert_close(res[1][0], res[0][0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(res[1][1], res[0][1], rtol=0, atol=0)


def test_vllm_order_rounds_each_product_to_bf16():
    """The vLLM-order reference equals a direct evaluation of vLLM's formula on a chain: fl32(bias) +
    bf16(x_{t-3} w_0) + bf16(x_{t-2} w_1) + bf16(x_{t-1} w_2) + bf16(x_t w_3), summed in that order, and
    differs from the float32-product order (so the switch is not a no-op)."""
    W, N, D = 4, 6, 32
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(N, D, generator=gen).to(torch.bfloat16)
    weight = torch.randn(D, W, generator=gen).to(torch.bfloat16)
    bias = torch.randn(D, generator=gen).to(torch.bfloat16)
    line = torch.randn(1 + 1, W - 2 + N, D, generator=gen).to(torch.bfloat16)  # [lines, state_len, dim]
    parents = torch.arange(-1, N - 1).unsqueeze(0)
    meta = build_gdn_meta(parents, W)
    si, na = torch.tensor([[1]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    outs = {}
    for order in (True, False):
        cs, out = line.clone().transpose(1, 2), poison(torch.empty(N, D))
        tree_conv1d_ref(x, weight, bias, cs, si, na, meta.conv_anc, out, False, vllm_order=order)
        outs[order] = out
    seq = torch.cat([line[1, : W - 1].float(), x.float()])  # history (oldest first), then the chain
    want = torch.empty(N, D)
    for t in range(N):
        acc = bias.float().clone()
        for j in range(W):
            acc = acc + (seq[t + j] * weight[:, j].float()).to(torch.bfloat16).float()
        want[t] = acc
    torch.testing.assert_close(outs[True], want, rtol=0, atol=0)
    assert not torch.equal(outs[True], outs[False])


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_per_path_oracle_and_line_rewrite(impl):
    W, N, D = 4, 12, 8
    parents, x, weight, bias, conv_state, si, na = make_case(W, N, D, torch.float32, "SD", seed=11)
    R = parents.shape[0]
    meta = build_gdn_meta(parents, W)
    cs, out = conv_state.clone(), poison(torch.empty_like(x))
    fn = tree_conv1d_ref if impl == "ref" else tree_conv1d_triton
    fn(x, weight, bias, cs, si, na, meta.conv_anc, out, True)
    for r in range(R):
        line, o = int(si[r, 0]), int(na[r]) - 1
        hist = conv_state[line, :, o: o + W - 1] if line > 0 else torch.zeros(D, W - 1)
        p = parents[r].tolist()
        for s in range(N):
            live = s == 0 or p[s] >= 0
            path = root_path(p, s) if live else [s]  # padding reads like the root
            seq = torch.cat([hist, x[r * N + torch.tensor(path)].T], 1)[:, -W:]
            want = torch.nn.functional.silu((seq * weight).sum(1) + bias)
            torch.testing.assert_close(out[r * N + s], want, rtol=1e-5, atol=1e-5)
        if line > 0:  # [window[1:], x_0 .. x_{N-1}], exactly like vLLM's chain update
            want_line = torch.cat([hist[:, 1:], x[r * N: r * N + N].T], 1)
            torch.testing.assert_close(cs[line], want_line, rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_lines_longer_than_the_verify(impl):
    """vLLM sizes the conv lines for num_speculative_tokens drafts (W - 1 + K columns); a smaller tree
    bucket of budget "auto", or a chain of fewer drafts, verifies N < K + 1 slots on them: the same
    outputs and the same first W - 2 + N columns as on lines of its own size, the rest untouched."""
    W, N, D, extra = 4, 7, 24, 5
    parents, x, weight, bias, conv_state, si, na = make_case(W, N, D, torch.float32, "SD", seed=8)
    meta = build_gdn_meta(parents, W)
    fn = tree_conv1d_ref if impl == "ref" else tree_conv1d_triton
    tail = torch.randn(conv_state.shape[0], D, extra, generator=torch.Generator().manual_seed(1))
    longer = torch.cat([conv_state, tail], 2)  # the committed window sits in the first columns
    runs = []
    for cs in (conv_state.clone(), longer.clone()):
        out = poison(torch.empty_like(x))
        fn(x, weight, bias, cs, si, na, meta.conv_anc, out, True)
        runs.append((out, cs))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=0, atol=0)
    torch.testing.assert_close(runs[1][1][:, :, : W - 2 + N], runs[0][1], rtol=0, atol=0)
    torch.testing.assert_close(runs[1][1][:, :, W - 2 + N:], tail, rtol=0, atol=0)


def test_bad_arguments_rejected():
    parents, x, weight, bias, conv_state, si, na = make_case(4, 6, 8, torch.float32, "SD", seed=1)
    meta = build_gdn_meta(parents, 4)
    out = torch.empty_like(x)
    with pytest.raises(ValueError, match="state_len"):
        tree_conv1d_ref(x, weight, bias, conv_state[:, :, :-1], si, na, meta.conv_anc, out, True)
    with pytest.raises(ValueError, match="weight"):
        tree_conv1d_triton(x, weight[:, :3], bias, conv_state, si, na, meta.conv_anc, out, True)
    with pytest.raises(ValueError, match="num_accepted"):
        tree_conv1d_ref(x, weight, bias, conv_state, si, na.long(), meta.conv_anc, out, True)
    with pytest.raises(ValueError, match="width"):
        build_gdn_meta(parents, 5)
