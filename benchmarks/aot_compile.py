"""Ahead-of-time compile of every Triton template configuration for sm_90 (H100) and sm_121a (GB10).

No GPU is needed: Triton compiles for a target the machine does not have. Each case below calls a
template's own launcher (tree attention, KV compaction, draft top-k, tree build, tree walk, tree conv,
tree GDN, GDN commit) on meta tensors of realistic shapes (Qwen3.5-4B / Qwen3.6-27B), with the device taken to be
the target architecture (`tuning.arch_of` answers (arch, SMs)), so the launch plan comes from the
templates' own tables (tuning.py, draft_topk.CONFIGS, tree_build's warp rule, the launchers' defaults).
The kernel launches are recorded instead of run, bound exactly as Triton's JIT binds them (signature,
constexprs, 16-byte alignment / stride-1 specialization) and compiled with `triton.compile` for the
target. ptxas -v (Triton's own flags) then gives registers and spills; Triton's metadata gives the
dynamic shared memory. Each configuration is checked against the architecture's limits (LIMITS).

    .venv/bin/python benchmarks/aot_compile.py                  # all cases, both archs, writes the JSON
    .venv/bin/python benchmarks/aot_compile.py --quick --probe --json /tmp/x.json   # what the test runs

Exit status 1 if any configuration does not fit (probes, which are meant not to fit, excepted).
TRITON_INTERPRET must be unset or 0 (tests/conftest.py sets it; the test runs this in a subprocess).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, get_ptxas_version, sm_arch_from_capability
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime import jit as triton_jit

from ddtree_compile.core.tree import TreeBatch
from ddtree_compile.templates import draft_topk, tree_attention, tuning
from ddtree_compile.templates.gdn_commit import gdn_commit_triton
from ddtree_compile.templates.gdn_meta_triton import build_gdn_meta_triton
from ddtree_compile.templates.kv_compact import launch_kv_compact
from ddtree_compile.templates.tree_attention import launch_tree_attention
from ddtree_compile.templates.tree_build import build_tree_triton
from ddtree_compile.templates.tree_conv import tree_conv1d_triton
from ddtree_compile.templates.tree_gdn import tree_gdn_triton
from ddtree_compile.templates.tree_walk import walk_tree_triton

warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "aot_sm90_sm121a.json")


@dataclass(frozen=True)
class Limits:
    capability: int  # Triton's GPUTarget arch (ptxas target sm_90a / sm_121a)
    smem_per_block: int  # bytes of shared memory one block may use (dynamic, opt-in maximum)
    regs_per_block: int  # 32-bit registers one block may hold (= the SM's register file)
    regs_per_thread: int
    threads_per_block: int
    sms: int  # SM count the launch plans are made for (split counts, regimes)


# From the CUDA C++ Programming Guide, "Technical Specifications per Compute Capability" (and
# cudaDeviceProp.sharedMemPerBlockOptin, which Triton's launcher checks `metadata.shared` against):
#   9.0 (H100):  228 KB shared memory per SM, 227 KB (232448 B) per block; 64K registers per SM and per
#                block; 255 registers per thread; 1024 threads per block. H100 SXM: 132 SMs.
#   12.x (GB10): 100 KB shared memory per SM, 99 KB (101376 B) per block; 64K registers per SM and per
#                block; 255 registers per thread; 1024 threads per block. GB10 (DGX Spark): 48 SMs.
LIMITS = {
    "sm_90": Limits(90, 232448, 65536, 255, 1024, 132),
    "sm_121": Limits(121, 101376, 65536, 255, 1024, 48),
}
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256 (32 threads x 8)

# Shapes. Attention: (Hq, Hkv, D); Qwen3.5-4B 16/4/256, Qwen3.6-27B 24/4/256, plus D = 128 and 64.
ATTN_SHAPES = {"qwen3.5-4b": (16, 4, 256), "qwen3.6-27b": (24, 4, 256), "d128": (16, 4, 128), "d64": (16, 4, 64)}
GDN_SHAPES = {"qwen3.5-4b": (16, 32), "qwen3.6-27b": (16, 48)}  # (key heads H, value heads HV); K = V = 128
GDN_K, CONV_W, GDN_LAYERS, ATTN_LAYERS = 128, 4, 24, 8
BUDGETS = (16, 32, 64)  # tree budget B: N = B + 1 verify slots per request
REQUESTS = (1, 64)  # a lone request (split-KV, split vocabulary) and a full batch (one split, "large" regime)
VOCAB, DRAFT_LEN, TOP_K = 248320, 15, 8
PAGE, CONTEXT = 16, 32768  # KV page size, max_model_len (block-table width)
DT = torch.bfloat16
META = torch.device("meta")


def _t(*shape, dtype=DT):
    return torch.empty(*shape, dtype=dtype, device=META)


# ---------------------------------------------------------------- cases: the templates' own launchers


def attention_case(arch, R, B, shape, tiles=None, fp8=False):
    """fp8: an FP8 KV cache and the FP8 query vLLM hands over with it (e4m3, per-tensor scales)."""
    Hq, Hkv, D = shape
    N = B + 1
    kv = torch.float8_e4m3fn if fp8 else DT
    q, kc = _t(R * N, Hq, D, dtype=kv), _t(64, PAGE, Hkv, D, dtype=kv)
    bt, ctx = _t(R, CONTEXT // PAGE, dtype=torch.int32), _t(R, dtype=torch.int32)
    bits, dep = _t(R, N, -(-N // 32), dtype=torch.int32), _t(R, N, dtype=torch.int32)
    scales = {n: _t((), dtype=torch.float32) for n in ("q_scale", "k_scale", "v_scale")} if fp8 else {}
    launch_tree_attention(q, kc, kc, bt, ctx, bits, dep, _t(R * N, Hq, D), D ** -0.5, tiles=tiles, **scales)


def kv_compact_case(arch, D):
    caches = [_t(64, PAGE, 4, D) for _ in range(ATTN_LAYERS)]
    launch_kv_compact(caches, caches, _t(4, 64, dtype=torch.int32), _t(4, 16, dtype=torch.int64),
                      _t(4, 16, dtype=torch.int64))


def topk_case(arch, R):
    draft_topk.draft_topk_triton(_t(R, DRAFT_LEN, VOCAB), 1.0, TOP_K)


def tree_build_case(arch, B):
    build_tree_triton(_t(4, DRAFT_LEN, TOP_K, dtype=torch.float32), _t(4, DRAFT_LEN, TOP_K, dtype=torch.int64), B,
                      True)


def tree_walk_case(arch, B):
    N, i64 = B + 1, dict(dtype=torch.int64)
    tree = TreeBatch(_t(4, N, **i64), _t(4, N, **i64), _t(4, N, **i64), _t(4, N, dtype=torch.float32), _t(4, **i64),
                     _t(4, N, -(-N // 32), dtype=torch.int32), max_depth=max(DRAFT_LEN, B))  # the round's depth
    walk_tree_triton(tree, _t(4, N, **i64), top1=_t(4, DRAFT_LEN, **i64))  # the round's variant: off-chain too


def gdn_meta_case(arch, B):
    build_gdn_meta_triton(_t(4, B + 1, dtype=torch.int64), CONV_W, max(DRAFT_LEN, B))  # the round's depth bound


def _gdn_io(R, B, H, HV):
    N, K = B + 1, GDN_K
    dim = 2 * H * K + HV * K
    return N, K, dim, _t(R, dtype=torch.int32)


def tree_conv_case(arch, R, B, heads):
    N, K, dim, nacc = _gdn_io(R, B, *heads)
    conv_state = _t(R + 1, CONV_W - 2 + N, dim).transpose(1, 2)  # vLLM's layout: channels innermost
    tree_conv1d_triton(_t(R * N, dim), _t(dim, CONV_W), None, conv_state, _t(R, 1, dtype=torch.int32), nacc,
                       _t(R, N, CONV_W - 1, dtype=torch.int32), _t(R * N, dim), True)


def tree_gdn_case(arch, R, B, heads, snapshots, records, **launch):
    """`launch`: block_v / num_warps / splits (a split walk needs R x splits stack rows)."""
    N, K, dim, nacc = _gdn_io(R, B, *heads)
    H, HV = heads
    rec = (_t(R, N, H * K + HV * K), _t(R, N, 2, HV, dtype=torch.float32)) if records else (None, None)
    f32 = dict(dtype=torch.float32)
    tree_gdn_triton(_t(R * N, dim), _t(R * N, HV), _t(R * N, HV), _t(HV, **f32), _t(HV, **f32),
                    _t(R * N + 1, HV, K, K), _t(R, N if snapshots else 1, dtype=torch.int32), nacc,
                    _t(R, N, 4, dtype=torch.int32), _t(R * launch.get("splits", 1), DRAFT_LEN, HV, K, K, **f32),
                    _t(R * N, HV, K), *rec, H, K, K ** -0.5, snapshots, **launch)


def gdn_commit_case(arch, R, B, heads):
    N, K, dim, nacc = _gdn_io(R, B, *heads)
    H, HV = heads
    conv = [_t(R + 1, CONV_W - 2 + N, dim).transpose(1, 2) for _ in range(GDN_LAYERS)]
    ssm = [_t(R + 1, HV, K, K) for _ in range(GDN_LAYERS)]
    gdn_commit_triton(conv, ssm, _t(R, N, dtype=torch.int32), nacc, _t(R, DRAFT_LEN + 1, dtype=torch.int32),
                      _t(R, dtype=torch.int32), _t(GDN_LAYERS, R, N, H * K + HV * K),
                      _t(GDN_LAYERS, R, N, 2, HV, dtype=torch.float32), CONV_W,
                      snap_depth=_t(R, dtype=torch.int32))  # (align prefix caching's block-boundary state)


def cases(quick: bool, probe: bool):
    """(template, label, fn(arch)) for every case; --quick: the sm_121a-critical attention entries (every
    head size) and one realistic configuration of each other template."""
    out = []
    for name, shape in ATTN_SHAPES.items():
        if quick and name == "qwen3.6-27b":  # the 4B's tile with another GROUP: the full run has it
            continue
        for R in ((1,) if quick else REQUESTS):
            for B in ((64,) if quick else BUDGETS):
                out.append(("tree_attention", f"{name} R={R} B={B}", lambda a, R=R, B=B, s=shape: attention_case(a, R, B, s)))
    out.append(("tree_attention", "qwen3.5-4b R=1 B=64 FP8 KV + query",
                lambda a: attention_case(a, 1, 64, ATTN_SHAPES["qwen3.5-4b"], fp8=True)))
    for D in ((256,) if quick else (64, 128, 256)):
        out.append(("kv_compact", f"D={D}", lambda a, D=D: kv_compact_case(a, D)))
    for R in ((1,) if quick else REQUESTS):
        out.append(("draft_topk", f"R={R} L={DRAFT_LEN} V={VOCAB} k={TOP_K}", lambda a, R=R: topk_case(a, R)))
    for B in ((64,) if quick else BUDGETS):
        out.append(("tree_build", f"B={B} L={DRAFT_LEN} K={TOP_K}", lambda a, B=B: tree_build_case(a, B)))
        out.append(("tree_walk", f"B={B} L={DRAFT_LEN}", lambda a, B=B: tree_walk_case(a, B)))
        out.append(("gdn_meta", f"B={B} W={CONV_W}", lambda a, B=B: gdn_meta_case(a, B)))
    for model, heads in (list(GDN_SHAPES.items())[:1] if quick else GDN_SHAPES.items()):
        for B in ((64,) if quick else (16, 64)):
            lab = f"{model} R=4 B={B}"
            out.append(("tree_conv", lab, lambda a, B=B, h=heads: tree_conv_case(a, 4, B, h)))
            for snap, rec in (((False, True),) if quick else ((False, True), (True, False), (False, False))):
                out.append(("tree_gdn", f"{lab} {'snapshots' if snap else 'records' if rec else 'plain'}",
                            lambda a, B=B, h=heads, s=snap, r=rec: tree_gdn_case(a, 4, B, h, s, r)))
            out.append(("gdn_commit", lab, lambda a, B=B, h=heads: gdn_commit_case(a, 4, B, h)))
        # one request's split walk (records): vLLM's tile and sm_90's plan's (tuning.gdn_tiles; with the norm pre-pass)
        for bv, nw in ((32, 4), (16, 1)):
            out.append(("tree_gdn", f"{model} R=1 B=32 records {bv}x{nw} split 4",
                        lambda a, h=heads, bv=bv, nw=nw: tree_gdn_case(a, 1, 32, h, False, True, block_v=bv,
                                                                       num_warps=nw, splits=4)))
    if probe:  # meant NOT to fit sm_121a: the H100's D=256 tile (the check must be able to say no)
        out.append(("probe", "sm_90 D=256 tile on sm_121a",
                    lambda a: attention_case(a, 1, 64, ATTN_SHAPES["qwen3.5-4b"], tuning.attention_tiles("sm_90", 256))))
    return out


# ---------------------------------------------------------------- recording launches, binding, compiling


@contextlib.contextmanager
def as_device(arch: str, sms: int, calls: list):
    """Launches record (kernel, args, kwargs) instead of running; `tuning.arch_of` answers (arch, sms).
    Tree attention's plan cache is keyed on tensors, not on the arch: it starts empty here."""
    run, arch_of, plans = triton_jit.JITFunction.run, tuning.arch_of, tree_attention._PLANS

    def record(self, *args, grid, warmup, **kwargs):
        calls.append((self, args, kwargs))

    triton_jit.JITFunction.run, tuning.arch_of, tree_attention._PLANS = record, lambda device: (arch, sms), {}
    try:
        yield
    finally:
        triton_jit.JITFunction.run, tuning.arch_of, tree_attention._PLANS = run, arch_of, plans


def bind(fn, args, kwargs, backend):
    """(signature, constexprs, attrs, options) as JITFunction.run makes them (triton 3.9 internals)."""
    kwargs = dict(kwargs, debug=kwargs.get("debug", fn.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode,
                  fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts)
    binder = triton_jit.create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return signature, constexprs, attrs, options


def ptxas_usage(ptx: str, capability: int, fp_fusion: bool) -> dict:
    """Registers, spills, stack and static shared memory from `ptxas -v` with Triton's own flags."""
    ptxas = get_ptxas(capability).path
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-lineinfo", *([] if fp_fusion else ["--fmad=false"]), "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(capability)}", src, "-o", os.path.join(tmp, "k.o")]
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr

    def grab(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    regs = re.search(r"Used (\d+) registers", log)
    if regs is None:
        raise RuntimeError(f"no register count in the ptxas log:\n{log}")
    return {"regs": int(regs.group(1)), "spill_stores": grab(r"(\d+) bytes spill stores"),
            "spill_loads": grab(r"(\d+) bytes spill loads"), "stack": grab(r"(\d+) bytes stack frame"),
            "static_smem": grab(r"(\d+) bytes smem")}


def check(entry: dict, lim: Limits) -> list[str]:
    """The limits an entry breaks (empty: it fits)."""
    threads = entry["num_warps"] * 32
    per_warp = -(-entry["regs"] * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    bad = []
    if entry["smem"] > lim.smem_per_block:
        bad.append(f"smem {entry['smem']} > {lim.smem_per_block}")
    if entry["regs"] > lim.regs_per_thread:
        bad.append(f"regs {entry['regs']} > {lim.regs_per_thread}/thread")
    if per_warp * entry["num_warps"] > lim.regs_per_block:
        bad.append(f"regs {per_warp * entry['num_warps']} > {lim.regs_per_block}/block")
    if threads > lim.threads_per_block:
        bad.append(f"threads {threads} > {lim.threads_per_block}")
    return bad


def _config(fn, constexprs, options) -> tuple[dict, str]:
    """The declared constexprs (not stride-1 ints) and a short label: true flags by name, false ones left out."""
    names = {p.num: p.name for p in fn.params if p.is_constexpr}
    cx = {names[k[0]]: v for k, v in sorted(constexprs.items()) if k[0] in names}
    short = [k if v is True else f"{k}={v}" for k, v in cx.items() if v is not False]
    return cx, " ".join(short + [f"w{options.num_warps}", f"s{options.num_stages}"])


def _compile(job) -> dict:
    e, kernel, signature, constexprs, attrs, options, lim = job
    t0 = time.time()
    target = GPUTarget("cuda", lim.capability, 32)
    ck = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options)
    usage = ptxas_usage(ck.asm["ptx"], lim.capability, options["enable_fp_fusion"])
    e.update(smem=ck.metadata.shared + usage["static_smem"], **usage, compile_s=round(time.time() - t0, 2))
    e["violations"] = check(e, lim)
    e["fits"] = not e["violations"]
    return e


def compile_all(archs, quick=False, probe=False, log=print) -> list[dict]:
    """Record every case's launches per arch, then compile each distinct launch once, in order (parallel
    compiles were no faster on a 2-core machine: each ran about twice as long)."""
    work, seen = [], {}
    for arch in archs:
        lim = LIMITS[arch]
        backend = make_backend(GPUTarget("cuda", lim.capability, 32))
        for template, label, fn in cases(quick, probe and arch == "sm_121"):
            calls = []
            with as_device(arch, lim.sms, calls):
                fn(arch)
            for kernel, args, kwargs in calls:
                signature, constexprs, attrs, options = bind(kernel, args, kwargs, backend)
                key = (arch, kernel.__name__, repr(signature), repr(sorted(constexprs.items())), repr(attrs),
                       repr(sorted(options.__dict__.items())), template == "probe")
                if key in seen:  # the same compile from another shape: one entry, every case listed
                    seen[key]["cases"].append(label)
                    continue
                cx, config = _config(kernel, constexprs, options)
                ones = [n for n, t in signature.items() if t == "constexpr" and n not in cx]  # ints specialized to 1
                e = {"template": template, "kernel": kernel.__name__.strip("_"), "config": config,
                     "constexprs": {k: v if isinstance(v, (bool, int, float)) else str(v) for k, v in cx.items()},
                     "specialized_to_1": ones, "arch": sm_arch_from_capability(lim.capability), "cases": [label],
                     "num_warps": options.num_warps, "num_stages": options.num_stages}
                seen[key] = e
                work.append((e, kernel, signature, constexprs, attrs, options.__dict__, lim))
    entries = []
    for job in work:
        entries.append(_compile(job))
        log(row(entries[-1]))
    return entries


def row(e: dict) -> str:
    spill = f"{e['spill_stores']}/{e['spill_loads']}" if e["spill_stores"] or e["spill_loads"] else "-"
    fits = "yes" if e["fits"] else "NO: " + "; ".join(e["violations"])
    return (f"{e['kernel'][:22]:22} {e['config']:72} {e['cases'][0]:24} {e['arch']:8} {e['smem']:7} {e['regs']:4} "
            f"{spill:>9} {fits}")


HEADER = (f"{'kernel':22} {'config':72} {'first case':24} {'arch':8} {'smem B':>7} {'regs':>4} {'spills st/ld':>9} "
          "fits")


def _ptxas_release(capability: int) -> str:
    lines = get_ptxas_version(capability).strip().splitlines()
    return next((ln for ln in lines if "release" in ln), lines[-1]).strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=list(LIMITS), choices=list(LIMITS))
    ap.add_argument("--quick", action="store_true", help="the attention entries and one config per other template")
    ap.add_argument("--probe", action="store_true", help="also compile a config meant not to fit sm_121a")
    ap.add_argument("--json", default=OUT, help="where to write the results (default: %(default)s)")
    args = ap.parse_args(argv)
    if knobs.runtime.interpret:
        raise SystemExit("aot_compile: TRITON_INTERPRET is set; run with TRITON_INTERPRET=0")
    for arch in args.arch:
        try:
            path = get_ptxas(LIMITS[arch].capability).path
        except Exception as e:  # knobs raise when no ptxas is found
            raise SystemExit(f"aot_compile: no ptxas for {arch} ({e}); triton 3.9 ships it under "
                             "triton/backends/nvidia/bin") from e
        if not os.path.isfile(path):
            raise SystemExit(f"aot_compile: ptxas for {arch} not found at {path}")
    t0 = time.time()
    print(HEADER)
    entries = compile_all(args.arch, args.quick, args.probe)
    bad = [e for e in entries if not e["fits"] and e["template"] != "probe"]
    result = {
        "triton": triton.__version__, "torch": torch.__version__,
        "ptxas": {arch: _ptxas_release(LIMITS[arch].capability) for arch in args.arch},
        "limits": {arch: LIMITS[arch].__dict__ for arch in args.arch},
        "limits_source": "CUDA C++ Programming Guide, technical specifications per compute capability "
                         "(9.0: 227 KB smem/block; 12.x: 99 KB smem/block; 64K regs/block; 255 regs/thread)",
        "smem_note": "smem = Triton's dynamic shared memory (metadata.shared) + ptxas static smem",
        "quick": args.quick, "seconds": round(time.time() - t0, 1), "entries": entries,
        "all_fit": not bad,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    print(f"{len(entries)} configurations in {result['seconds']} s; "
          + ("all fit" if not bad else f"{len(bad)} do NOT fit: " + ", ".join(f"{e['kernel']} {e['arch']}" for e in bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
