"""Launch parameters for the tree templates, per GPU architecture.

sm_90 (H100) head sizes 128 and 256 are the winners of a measured sweep (benchmarks/bench_tree_attention.py
--sweep; every candidate and time is in benchmarks/results/tree_attention_h100.json under "sweep", the
winners under "chosen"; the ratio table there was timed with exactly these entries). Head size 64 on
sm_90 was checked for correctness on the H100 but not swept. sm_121 (GB10 / DGX Spark) entries are
UNMEASURED and deliberately conservative: GB10 has ~99 KB of shared memory per block (vs 227 KB on
H100) and no wgmma, so tiles are small and pipelining shallow. Anything else uses the conservative table.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class AttnTiles:
    block_m: int  # packed query rows (tree slot x GQA group) per program
    block_n: int  # keys per inner step
    num_warps: int
    num_stages: int
    waves: float = 2.0  # split-KV: aim for waves * num_SMs programs
    min_chunk: int = 128  # split-KV: never give a split fewer keys than this (short contexts)
    max_splits: int = 32
    page_group: int = 0  # >0 (a power of two): load block ids PAGE_GROUP pages at a time (see kernel)


# head_dim -> tiles (H100, Triton 3.6). The winners use 8 warps, 128 packed rows, 3-4 pipeline stages
# and grouped block-id loads; the run-1 winners (2-3 stages, per-tile block ids) ran 1.2-1.6x slower on
# the long-context sweep shapes. At 2 stages grouping alone changed little.
_SM90 = {
    64: AttnTiles(64, 64, 4, 3),  # correct on H100, not swept
    128: AttnTiles(128, 64, 8, 3, waves=2.0, page_group=64),
    256: AttnTiles(128, 32, 8, 4, waves=4.0, page_group=64),
}
# GB10 (sm_121a): UNMEASURED. ~99 KB smem per block and mma.sync (no wgmma), so small tiles, 2 stages.
# Compile-checked only (Triton 3.9, target sm_121): shared memory 51 / 37 / 25 KB for D = 256 / 128 / 64,
# no register spills except 40 B of stack at D=256.
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


def num_splits(tiles: AttnTiles, num_sms: int, num_requests: int, num_kv_heads: int, m_blocks: int) -> int:
    """Fixed split-KV factor for a (R, N) bucket: enough programs to fill the GPU."""
    base = num_requests * num_kv_heads * m_blocks
    want = -(-int(tiles.waves * num_sms) // base)
    return max(1, min(want, tiles.max_splits))


def with_overrides(tiles: AttnTiles, **kw) -> AttnTiles:
    return replace(tiles, **kw)


@dataclass(frozen=True)
class CompactTiles:
    num_warps: int


def compact_tiles(arch: str) -> CompactTiles:
    return CompactTiles(num_warps=4 if arch == "sm_90" else 2)
