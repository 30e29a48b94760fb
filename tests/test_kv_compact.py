"""K/V compaction: Triton kernel (TRITON_INTERPRET=1, in a subprocess) and the torch reference against an
independent expectation: destination positions hold the accepted nodes' K/V, every other slot is unchanged.
"""

from __future__ import annotations

import json

import pytest
import torch
from _interp import run_interpreted

# name -> case: per-request (context length, accepted slots); layers; layout; identity moves kept or -1.
BASE = dict(bs=8, heads=2, D=64, layers=3, layout="flash", keep_identity=False, dtype="bfloat16", seed=0)
CASES = {
    "branchy_paths": dict(paths=[(5, [0, 2, 3]), (12, [0, 1, 4, 6, 7]), (0, [0, 3])]),
    "main_chain_moves_nothing": dict(paths=[(9, [0, 1, 2, 3]), (3, [0])], keep_identity=True),
    "identity_mixed": dict(paths=[(6, [0, 1, 3, 4, 9]), (7, [0, 1, 2, 5])], keep_identity=True),
    "block_crossing": dict(paths=[(14, [0, 2, 5, 9, 13]), (7, [0, 1, 10])], bs=4),
    "cpu_layout": dict(paths=[(5, [0, 2, 3]), (20, [0, 4, 5, 11])], layout="cpu", D=32, heads=3),
    "one_layer_fp16": dict(paths=[(2, [0, 3, 7, 8])], layers=1, dtype="float16", D=128),
    # an FP8 KV cache: vLLM allocates it as uint8 (the bytes move as they are), backends view it as float8
    "fp8_as_vllm_stores_it": dict(paths=[(5, [0, 2, 3]), (12, [0, 1, 4, 6, 7])], dtype="uint8"),
    "fp8_e4m3_view": dict(paths=[(14, [0, 2, 5, 9, 13]), (7, [0, 1, 10])], bs=4, dtype="float8_e4m3fn"),
}
CASES = {k: {**BASE, **v} for k, v in CASES.items()}


def make_case(c: dict) -> dict:
    g = torch.Generator().manual_seed(c["seed"])
    dtype = getattr(torch, c["dtype"])
    bs, H, D = c["bs"], c["heads"], c["D"]
    R = len(c["paths"])
    M = max(len(p) for _, p in c["paths"])
    max_blocks = max(-(-(x + max(p) + 1) // bs) for x, p in c["paths"]) + 1
    num_blocks = R * max_blocks + 3
    block_table = torch.randperm(num_blocks, generator=g)[: R * max_blocks].view(R, max_blocks).int()
    keys, values = [], []

    def rand(*shape):
        if dtype == torch.uint8:
            return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
        return torch.randn(*shape, generator=g).to(dtype)

    for _ in range(c["layers"]):
        # vLLM's CUDA layout: one [2, nb, bs, H, D] tensor per layer, K and V as views of it.
        if c["layout"] == "flash":
            kv = rand(2, num_blocks, bs, H, D)
            keys.append(kv[0])
            values.append(kv[1])
        else:  # CPU-backend-like [nb, H, bs, D] storage seen through a permuted view
            keys.append(rand(num_blocks, H, bs, D).permute(0, 2, 1, 3))
            values.append(rand(num_blocks, H, bs, D).permute(0, 2, 1, 3))
    src = torch.full((R, M), -1, dtype=torch.int64)
    dst = torch.full((R, M), -1, dtype=torch.int64)
    for r, (x, path) in enumerate(c["paths"]):
        for d, slot in enumerate(path):
            if slot != d or c["keep_identity"]:
                src[r, d], dst[r, d] = x + slot, x + d
    return dict(keys=keys, values=values, block_table=block_table, src=src, dst=dst)


def expected(c: dict, t: dict) -> tuple[list, list]:
    """Independent expectation built from snapshots: position x+d of request r gets node path[d]."""
    bs = c["bs"]
    keys = [k.clone() for k in t["keys"]]
    values = [v.clone() for v in t["values"]]
    for r, (x, path) in enumerate(c["paths"]):
        bt = t["block_table"][r].long()
        src = torch.tensor([x + s for s in path])
        dst = torch.arange(x, x + len(path))
        for new, old in zip(keys + values, t["keys"] + t["values"]):
            new[bt[dst // bs], dst % bs] = old[bt[src // bs], src % bs]
    return keys, values


def check(c: dict, t: dict, keys: list, values: list) -> bool:
    """Compare caches after the op with the expectation (all slots, all layers, exact)."""
    ek, ev = expected(c, t)
    bits = (lambda x: x.view(torch.uint8)) if keys[0].element_size() == 1 else (lambda x: x)  # no float8 equal
    return all(torch.equal(bits(a), bits(b)) for a, b in zip(keys + values, ek + ev))


def _interp_main() -> None:
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    from ddtree_compile.templates import kv_compact as kc

    results = {}
    for name, c in CASES.items():
        t = make_case(c)  # the snapshot
        work = make_case(c)  # an identical (seeded) copy, same storage layout, to move in
        keys, values = work["keys"], work["values"]
        kc.launch_kv_compact(keys, values, t["block_table"], t["src"], t["dst"])
        results[name] = dict(
            interpreted=bool(triton.knobs.runtime.interpret) and isinstance(kc._kv_compact_kernel, InterpretedFunction),
            ok=check(c, t, keys, values),
        )
    print(json.dumps(results))


@pytest.fixture(scope="module")
def interp_results() -> dict:
    return run_interpreted(__file__, timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_triton_compaction(interp_results, name):
    assert interp_results[name]["interpreted"]
    assert interp_results[name]["ok"], f"{name}: caches differ from the expected compaction"


@pytest.mark.parametrize("name", list(CASES))
def test_reference_compaction(name):
    from ddtree_compile.templates.kv_compact_ref import kv_compact_reference

    c = CASES[name]
    t, work = make_case(c), make_case(c)
    kv_compact_reference(work["keys"], work["values"], t["block_table"], t["src"], t["dst"])
    assert check(c, t, work["keys"], work["values"])


def test_op_dispatch_and_compile():
    import ddtree_compile.templates.ops  # noqa: F401  registers the op

    c = CASES["branchy_paths"]
    t, work = make_case(c), make_case(c)
    torch.ops.ddtree.kv_compact(work["keys"], work["values"], t["block_table"], t["src"], t["dst"])
    assert check(c, t, work["keys"], work["values"])
    args = ([k.clone() for k in t["keys"]], [v.clone() for v in t["values"]], t["block_table"], t["src"], t["dst"])
    torch.library.opcheck(torch.ops.ddtree.kv_compact.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static"))

    def f(k0, k1, v0, v1, bt, s, d):
        torch.ops.ddtree.kv_compact([k0, k1], [v0, v1], bt, s, d)
        return k0.sum() + v1.sum()

    fresh = lambda: [x.clone() for x in (t["keys"][:2] + t["values"][:2])]  # noqa: E731
    a, b = fresh(), fresh()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*a, t["block_table"], t["src"], t["dst"]),
                               f(*b, t["block_table"], t["src"], t["dst"]))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("field,change", [
    ("key_caches", lambda t: dict(key_caches=[])),
    ("value_caches", lambda t: dict(value_caches=t["values"][:1])),
    ("key_caches[1]", lambda t: dict(key_caches=[t["keys"][0], t["keys"][1].half()] + t["keys"][2:])),
    ("value_caches[0]", lambda t: dict(value_caches=[t["values"][0][:-1]] + t["values"][1:])),
    ("block_table", lambda t: dict(block_table=t["block_table"].long())),
    ("src_pos", lambda t: dict(src_pos=t["src"].int())),
    ("dst_pos", lambda t: dict(dst_pos=t["dst"][:, :1])),
])
def test_bad_inputs_name_the_field(field, change):
    import ddtree_compile.templates.ops  # noqa: F401  registers the op
    from ddtree_compile.templates.kv_compact import launch_kv_compact
    from ddtree_compile.templates.kv_compact_ref import kv_compact_reference

    t = make_case(CASES["branchy_paths"])
    args = dict(key_caches=t["keys"], value_caches=t["values"], block_table=t["block_table"], src_pos=t["src"],
                dst_pos=t["dst"])
    args.update(change(t))
    for fn in (kv_compact_reference, launch_kv_compact, torch.ops.ddtree.kv_compact):
        with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
            fn(**args)


if __name__ == "__main__":
    _interp_main()
