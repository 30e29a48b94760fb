"""bench_tree_gdn's shared pieces: the shapes, DDTree-shaped trees and accepted paths, the timer, and
one GDN layer's inputs and caches. Imported first: with --smoke it selects Triton's interpreter (and
the CPU) before torch and the templates load."""

from __future__ import annotations

import heapq
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from ddtree_compile.templates.gdn_meta import build_gdn_meta  # noqa: E402
from ddtree_compile.templates.tree_conv import tree_conv1d_triton  # noqa: E402
from ddtree_compile.templates.tree_gdn import tree_gdn_triton  # noqa: E402

QWEN36 = dict(H=16, HV=48, K=128, V=128, W=4, layers=48)  # Qwen3.6-27B: 48 of its 64 layers are GDN
QWEN35_4B = dict(H=16, HV=32, K=128, V=128, W=4, layers=24)  # Qwen3.5-4B: 24 of its 32 layers are GDN
SHAPES = {"qwen36_27b": QWEN36, "qwen35_4b": QWEN35_4B}
TINY = dict(H=2, HV=4, K=16, V=16, W=4, layers=3)
L_DRAFT = 15  # DFlash block 16 -> tree depth <= 15
MAX_SPLITS = 8
DEV = "cpu" if SMOKE else "cuda"


def ddtree_parents(B: int, seed: int, L: int = L_DRAFT, topk: int = 8) -> list[int]:
    """A DDTree-shaped tree: best-first over per-depth top-k draft log-probs (heap-pop slot order)."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(L + 1, topk, generator=g) * 2.5, -1).sort(-1, descending=True).values
    lp = lp.tolist()
    parents, heap = [-1], [(-lp[1][0], 1, 0, 0)]
    while len(parents) <= B and heap:
        neg, d, par, rank = heapq.heappop(heap)
        slot = len(parents)
        parents.append(par)
        if d < L:
            heapq.heappush(heap, (neg - lp[d + 1][0], d + 1, slot, 0))
        if rank + 1 < topk:
            heapq.heappush(heap, (neg + lp[d][rank] - lp[d][rank + 1], d, par, rank + 1))
    return parents


def path_to(parents, s):
    p = [s]
    while parents[p[-1]] >= 0:
        p.append(parents[p[-1]])
    return p[::-1]


def side_path(parents, depth=7):
    """An accepted path of about `depth` that leaves the main chain (the conv window must move)."""
    best = None
    for s in range(len(parents) - 1, 0, -1):
        p = path_to(parents, s)
        if p != list(range(len(p))) and (best is None or abs(len(p) - 1 - depth) < abs(len(best) - 1 - depth)):
            best = p
    return best or list(range(min(depth + 1, len(parents))))


def accepted(paths):
    """A commit's accepted paths: slots [R, L_DRAFT + 1] padded with -1, and the path lengths [R], on DEV."""
    acc = torch.full((len(paths), L_DRAFT + 1), -1, dtype=torch.int32)
    for r, p in enumerate(paths):
        acc[r, : len(p)] = torch.tensor(p, dtype=torch.int32)
    return acc.to(DEV), torch.tensor([len(p) for p in paths], dtype=torch.int32, device=DEV)


def timer(fn, graph: bool = True) -> float:
    """ms per call: CUDA-graph replay under do_bench (cold L2). CPU smoke: one wall-clock call."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton.testing
    fn()
    torch.cuda.synchronize()
    if not graph:
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=10, rep=60, return_mode="median")


class Layer:
    """One GDN layer's inputs and caches for R requests of N = B + 1 slots."""

    def __init__(self, cfg, R, B, seed, state_dtype=torch.float32, snapshot_lines=True):
        H, HV, K, V, W = cfg["H"], cfg["HV"], cfg["K"], cfg["V"], cfg["W"]
        self.cfg, self.R, self.N = cfg, R, B + 1
        N, D = self.N, 2 * H * K + HV * V
        g = torch.Generator(device=DEV).manual_seed(seed)

        def rn(*shape, dtype=torch.bfloat16, scale=1.0):
            return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)

        self.x = rn(R * N, D)
        self.w = rn(D, W, scale=0.5)
        self.a, self.b = rn(R * N, HV), rn(R * N, HV)
        self.A_log = torch.log(torch.rand(HV, generator=g, device=DEV) * 15 + 1)
        self.dt = torch.log(torch.expm1(torch.rand(HV, generator=g, device=DEV) * 0.099 + 0.001))
        lines = 1 + R * N if snapshot_lines else 1 + R
        self.conv_state = rn(lines, W - 2 + N, D).transpose(1, 2)  # vLLM SD layout, seen as [lines, D, SL]
        self.ssm = rn(lines, HV, V, K, dtype=state_dtype, scale=0.1)
        self.si = (1 + torch.arange(R * N, device=DEV, dtype=torch.int32)).view(R, N)
        self.si1 = (1 + torch.arange(R, device=DEV, dtype=torch.int32)).view(R, 1)
        self.na = torch.ones(R, device=DEV, dtype=torch.int32)
        self.y = torch.empty_like(self.x)
        self.out = torch.empty(R * N, HV, V, device=DEV, dtype=torch.bfloat16)
        # a split walk (tree_gdn.py) gives each part its own stack row; swept at R <= 8 only (memory)
        self.stack = torch.empty(R * (MAX_SPLITS if R <= 8 else 1), L_DRAFT, HV, V, K, device=DEV)
        self.rec_kv = torch.empty(R, N, H * K + HV * V, device=DEV, dtype=torch.bfloat16)
        self.rec_gb = torch.empty(R, N, 2, HV, device=DEV)

    def conv(self, meta, strategy="records", **kw):
        si = self.si if strategy == "snapshot" else self.si1  # conv line = column 0, as in vLLM
        tree_conv1d_triton(self.x, self.w, None, self.conv_state, si, self.na, meta.conv_anc, self.y, True, **kw)

    def gdn(self, meta, strategy, **kw):
        c = self.cfg
        snap = strategy == "snapshot"
        tree_gdn_triton(self.y, self.a, self.b, self.A_log, self.dt, self.ssm, self.si if snap else self.si1,
                        self.na, meta.walk, self.stack, self.out, None if snap else self.rec_kv,
                        None if snap else self.rec_gb, c["H"], c["K"], c["K"] ** -0.5, snap, **kw)


def metas(R, B, W, seed):
    N = B + 1
    tree = torch.tensor([ddtree_parents(B, seed + r) for r in range(R)], device=DEV)
    chain = torch.tensor([[-1] + list(range(N - 1))] * R, device=DEV)
    return tree, build_gdn_meta(tree, W, L_DRAFT), build_gdn_meta(chain, W, N - 1)
