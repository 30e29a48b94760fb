"""Launch parameters for the tree templates, per GPU architecture.

Tree attention on sm_90 (H100). The tiles for head sizes 128 and 256 won the f078ad5 tile sweep
(benchmarks/bench_tree_attention.py --sweep; candidates and times in tree_attention_h100.json, in the
git history, under "tile_sweep_f078ad5"). The per-bucket rules (one row tile, whole-wave split
count, min_chunk) come from the low-request / short-context plan sweep (`--lowr-sweep`, under "lowr_sweep"
in the same file); the ratio table there ("records") was timed with exactly these entries. Head size 64 on
sm_90 was checked for correctness on the H100 but not swept. sm_121 (GB10 / DGX Spark) entries are
UNMEASURED and deliberately conservative: GB10 has ~99 KB of shared memory per block (vs 227 KB on H100)
and no wgmma, so tiles are small and pipelining shallow. Anything else uses the conservative table.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from fractions import Fraction

import torch


@dataclass(frozen=True)
class AttnTiles:
    block_m: int  # packed query rows (tree slot x GQA group) per program
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int
    waves: float = 1.0  # split-KV: programs resident per SM (slots = waves * num_SMs); see num_splits
    min_chunk: int = 128  # split-KV: never give a split fewer keys than this (short contexts)
    max_splits: int = 32
    page_group: int = 0  # >0 (a power of two): load block ids PAGE_GROUP pages at a time (see kernel)


# head_dim -> tiles (H100, Triton 3.6). 128 packed rows, 8 warps, 3-4 stages, grouped block-id loads: the
# winners of the f078ad5 long-context sweep. The low-R sweep also timed 64-row tiles (rows padded less,
# twice the programs): 1.3-1.9x slower at 8k-32k and at R >= 8, ahead only at R = 1 with a 1k context
# (Qwen, 15.4 vs 18.9 us), which the host cannot see; so one row tile. One program per SM (shared memory)
# -> waves = 1. min_chunk: the best 1k-context chunk at R = 1 (3 key tiles at D=256: 96 keys beat 64 and
# 160; 2 key tiles at D=128).
_SM90 = {
    64: AttnTiles(64, 64, 4, 3),  # correct on H100, not swept
    128: AttnTiles(128, 64, 8, 3, waves=1.0, min_chunk=128, page_group=64),
    256: AttnTiles(128, 32, 8, 4, waves=1.0, min_chunk=96, page_group=64),
}
# GB10 (sm_121a): UNMEASURED. ~99 KB smem per block and mma.sync (no wgmma), so small tiles, 2 stages.
# Compile-checked only (benchmarks/aot_compile.py, Triton 3.9 / ptxas 13.4, sm_121a; its table
# aot_sm90_sm121a.json is in the git history): shared memory 51 / 37 / 25 KB for D = 256 / 128 / 64 against
# 99 KB; spills: D=256 40 B (split-KV path) and 188 B (one-split path), D=64 68 B (one-split), D=128 none.
# Unmeasured alternative without spills at D=256: 32x32 tiles with 8 warps (same 51 KB, 228-234 regs).
_SM121 = {
    64: AttnTiles(64, 64, 4, 2),
    128: AttnTiles(64, 32, 8, 2),
    256: AttnTiles(32, 32, 4, 2),
}
_TABLES = {"sm_90": (_SM90, True), "sm_121": (_SM121, False), "default": (_SM121, False)}


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> tuple[str, int]:
    major, minor = torch.cuda.get_device_capability(index)
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    arch = f"sm_{major}{minor}"
    return arch, sms


def arch_of(device: torch.device) -> tuple[str, int]:
    """(table key, number of SMs) for a device; CPU (the interpreter) uses the default table."""
    if device.type != "cuda":
        return "default", 4
    arch, sms = _device_info(device.index if device.index is not None else torch.cuda.current_device())
    key = arch if arch in _TABLES else ("sm_121" if arch.startswith("sm_12") else "default")
    return key, sms


def is_measured(arch: str) -> bool:
    return _TABLES.get(arch, _TABLES["default"])[1]


def attention_tiles(arch: str, head_dim: int) -> AttnTiles:
    table, _ = _TABLES.get(arch, _TABLES["default"])
    return table[head_dim if head_dim in table else 64]


SPLIT_TOLERANCE = Fraction(11, 10)  # fewest splits within 10% of the best wave cost (fewer partials)


@functools.lru_cache(maxsize=4096)
def num_splits(tiles: AttnTiles, num_sms: int, num_requests: int, num_kv_heads: int, m_blocks: int,
               max_keys: int | None = None) -> int:
    """Fixed split-KV factor for a (R, N) bucket (the device shrinks it for short contexts: min_chunk).

    With P = R x Hkv x m-blocks programs per split and `slots` programs resident at once, a context of L
    keys takes about ceil(S * P / slots) waves of L / S keys each: cost(S) = ceil(S * P / slots) / S. Only
    whole-wave counts S = floor(k * slots / P) (and 1) are candidates -- one program past a wave costs a
    whole extra wave -- and the fewest splits within SPLIT_TOLERANCE of the best cost win, since every
    split adds a partial to write and merge and its own fixed cost (at R = 8 with a 1k context, 4 splits
    ran 1.5x slower than 2). On the H100 low-R sweep ("lowr_sweep" in tree_attention_h100.json, git
    history) it picks the fastest timed split count at every swept shape where its choice was timed, but
    one (2% off). Capped by max_splits and by the keys the block table can hold (`max_keys`, context +
    tree): a split that max_keys can never reach would stay empty.

    Known cost: a grid that already fills the GPU (P >= slots) gets one split. At 8k-32k contexts 2-5
    splits ran 4-13% faster there (f078ad5 table), but at 1k they ran 25-42% slower (lowr_sweep), and a
    bucket does not know its context length. Getting both needs a device-side direct write when a
    request's context makes one chunk (then extra splits would cost short contexts nothing): not measured.
    """
    per_split = num_requests * num_kv_heads * m_blocks
    slots = max(1, int(tiles.waves * num_sms))
    cap = tiles.max_splits
    if max_keys is not None:
        cap = min(cap, -(-max_keys // max(tiles.min_chunk, tiles.block_n)))
    cap = max(1, cap)
    cands = {1} | {min(cap, k * slots // per_split) for k in range(1, cap + 1)}
    cost = {s: Fraction(-(-s * per_split // slots), s) for s in cands if s >= 1}  # exact: ties stay ties
    best = min(cost.values())
    return min(s for s, c in cost.items() if c <= SPLIT_TOLERANCE * best)


@dataclass(frozen=True)
class AttnPlan:
    tiles: AttnTiles
    m_blocks: int
    splits: int


def choose_plan(arch: str, num_sms: int, num_requests: int, n_slots: int, group: int, num_kv_heads: int,
                head_dim: int, max_keys: int | None = None) -> AttnPlan:
    """Tiles, m-blocks and split count for a bucket, from shapes only (host side; the caller caches it)."""
    t = attention_tiles(arch, head_dim)
    mb = -(-n_slots * group // t.block_m)
    return AttnPlan(t, mb, num_splits(t, num_sms, num_requests, num_kv_heads, mb, max_keys))


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def plan_tree_attention(query, key_cache, ancestor_bits, block_table, tiles: AttnTiles | None = None,
                        splits: int | None = None):
    """Tiles, BLOCK_M, m-blocks and split count for a tree-attention bucket (host-side, from shapes only).

    `choose_plan` on the tensors' shapes, with the row tile shrunk to the packed rows a request has
    (N slots x G heads, at least 16); `tiles` / `splits` override the table (tests, sweeps). The keys a
    request can have are bounded by its block-table row (context + tree), so a bucket never gets more
    splits than that many keys can fill (vLLM sizes the table for max_model_len)."""
    R, N = ancestor_bits.shape[:2]
    Hq, D = query.shape[1:]
    max_keys = block_table.shape[1] * key_cache.shape[1]
    return plan_bucket(query.device, R, N, Hq, key_cache.shape[2], D, max_keys, tiles, splits)


def plan_bucket(device, R: int, N: int, Hq: int, Hkv: int, D: int, max_keys: int | None = None,
                tiles: AttnTiles | None = None, splits: int | None = None):
    """`plan_tree_attention` from the bucket's numbers alone: R requests of N slots, Hq query and Hkv KV
    heads of size D, at most `max_keys` keys a request (None: no bound)."""
    G = Hq // Hkv
    arch, sms = arch_of(device)
    if tiles is None:
        plan = choose_plan(arch, sms, R, N, G, Hkv, D, max_keys)
        tiles = plan.tiles
    block_m = min(tiles.block_m, max(16, next_pow2(N * G)))
    m_blocks = -(-N * G // block_m)
    if splits is None:
        splits = num_splits(tiles, sms, R, Hkv, m_blocks, max_keys)
    return tiles, block_m, m_blocks, splits


def with_overrides(tiles: AttnTiles, **kw) -> AttnTiles:
    return replace(tiles, **kw)


@dataclass(frozen=True)
class GdnTiles:
    block_v: int  # value rows of the [BV, K] fp32 state tile one program carries through its request's walk
    num_warps: int
    splits: int = 1  # programs per (request, head, tile) walking consecutive parts of the walk (tree_gdn.py)


# Tree gated delta rule (tree_gdn.py). Its outputs must be vLLM's `fused_sigmoid_gating_delta_rule_update`'s
# bit for bit, so a chain's GDN outputs equal flat DFlash's (tests/gpu/test_layer_diff.py; CHANGELOG: 1-2
# bf16 ulps at the first verify became gate misses on the tiny bf16 hybrids at long context). vLLM's tile is
# 32 value rows on 4 warps (the default off sm_90). On sm_90, the H100 sweep's fastest (tree_gdn_sweep_h100.json,
# bench_tree_gdn.py --sweep, 4B shape): 16 rows on one warp, one request's walk in 4 parts and two requests'
# in 2 (a part replays its first node's ancestors: the same updates in the same order), 41% off 32 / 4 at
# R = 1, B = 32 (7-50% over B = 8-64), 3-34% at R = 2, 22-45% from R = 4 on (norm pre-pass included). One
# warp would sum the q / k norms' 128 squares 4 a thread before the lanes, where vLLM's 4 warps sum one a
# thread across lanes, then warps (each lane's first step an fma of its own square, every lane storing its
# warp's partial to one word: no other warp count can redo it). So a tile off 4 warps reads the norms from a
# pre-pass on vLLM's 4 warps (tree_gdn.py; on sm_90 its PTX is vLLM's reduction instruction for instruction);
# the row sums of 16 or 8 rows on 1 or 4 warps already have 32 / 4's layouts. On an H100 every tile's outputs
# and records equal 32 / 4's bit for bit (tests/gpu/test_kernels.py) and test_layer_diff passes with this plan.
# DDTREE_GDN_TILES overrides it (e.g. "32x4": vLLM's tile; FAST_PLAN spells sm_90's plan).
# Rows (most requests, tiles): the first whose bound holds; None: any number.
_GDN_PLANS: dict[str, tuple[tuple[int | None, GdnTiles], ...]] = {
    "sm_90": ((1, GdnTiles(16, 1, 4)), (2, GdnTiles(16, 1, 2)), (None, GdnTiles(16, 1))),
}
_GDN_DEFAULT = GdnTiles(32, 4)
_GDN_ENV = "DDTREE_GDN_TILES"
FAST_PLAN = "1:16x1x4,2:16x1x2,16x1"  # sm_90's plan in DDTREE_GDN_TILES' spelling (other archs may opt in)


@functools.lru_cache(maxsize=None)
def _gdn_override(value: str) -> tuple[tuple[int | None, GdnTiles], ...] | None:
    """DDTREE_GDN_TILES: one tile for every batch, or a plan of rows "<most requests>:<tile>" ending in a
    bare tile, e.g. FAST_PLAN; a tile is "<block_v>x<num_warps>[x<splits>]"."""
    if not value:
        return None
    rows, entries = [], value.lower().split(",")
    for i, entry in enumerate(entries):
        most, _, tile = entry.rpartition(":")
        parts = tile.split("x")
        try:
            bv, nw, sp = (int(x) for x in (parts + ["1"])[:3]) if len(parts) in (2, 3) else (0, 0, 0)
            bound = None if not most else int(most)
        except ValueError:
            bv = nw = sp = 0
            bound = None
        last = i == len(entries) - 1
        if (bv not in (8, 16, 32, 64, 128) or nw not in (1, 2, 4, 8) or not 1 <= sp <= 64
                or (bound is None) != last or (rows and bound is not None and bound <= rows[-1][0])):
            raise ValueError(f"{_GDN_ENV}={value!r}: expected '<block_v>x<num_warps>[x<splits>]' with block_v in 8, "
                             f"16, 32, 64, 128, num_warps in 1, 2, 4, 8 and splits in 1..64 (e.g. '16x1', '32x4x4'), "
                             f"or rows '<most requests>:<tile>' with rising bounds ending in a bare tile (e.g. "
                             f"'{FAST_PLAN}'), or unset")
        rows.append((bound, GdnTiles(bv, nw, sp)))
    return tuple(rows)


def gdn_tiles(arch: str = "default", requests: int = 1) -> GdnTiles:
    """The tree recurrence's tile and walk split for `requests` requests on `arch` (arch_of's key): the
    first row that holds them of DDTREE_GDN_TILES if set, else of the arch's plan, else vLLM's tile."""
    return _gdn_pick(os.environ.get(_GDN_ENV, ""), arch, requests)


@functools.lru_cache(maxsize=None)
def _gdn_pick(value: str, arch: str, requests: int) -> GdnTiles:
    """(every GDN layer's launch of an eager step asks the same question: answered once)"""
    rows = _gdn_override(value) or _GDN_PLANS.get(arch, ())
    for most, tiles in rows:
        if most is None or requests <= most:
            return tiles
    return _GDN_DEFAULT


@dataclass(frozen=True)
class CompactTiles:
    num_warps: int


def compact_tiles(arch: str) -> CompactTiles:
    return CompactTiles(num_warps=4 if arch == "sm_90" else 2)
