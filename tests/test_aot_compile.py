"""Every Triton template compiles ahead of time for sm_121a (GB10 / DGX Spark) and fits its limits.

A real compile (Triton 3.9 targets an architecture this machine does not have; ptxas -v gives the
registers) through benchmarks/aot_compile.py --quick: the sm_121a tree-attention tile of every head size
and one realistic configuration of each other template, plus a probe (the H100's D=256 tile) that must be
reported as NOT fitting, so the check can say no. Run in a subprocess: the suite sets TRITON_INTERPRET=1,
under which kernels cannot be compiled. The full table for sm_90 and sm_121a:
python benchmarks/aot_compile.py (writes build/aot_sm90_sm121a.json).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "aot_compile.py"
SM121_SMEM, REGS_PER_BLOCK, REGS_PER_THREAD = 101376, 65536, 255  # GB10: 99 KB smem/block (CUDA guide, 12.x)
TEMPLATES = {"tree_attention", "kv_compact", "draft_topk", "tree_build", "tree_walk", "gdn_meta", "tree_conv",
             "tree_gdn", "gdn_commit"}
KERNELS = {"tree_attn_fwd_kernel", "tree_attn_combine_kernel", "kv_compact_kernel", "topk_partial_kernel",
           "topk_merge_kernel", "tree_build_kernel", "tree_walk_kernel", "gdn_meta_kernel", "tree_conv_kernel",
           "tree_gdn_kernel", "qk_norms_kernel", "state_commit_kernel", "conv_commit_kernel"}


def _ptxas_path() -> str:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(121).path
    except Exception as e:  # noqa: BLE001  any failure to find it is the same failure here
        pytest.fail(f"no ptxas for sm_121a: {e!r}. The project's venv has triton 3.9, which ships "
                    "triton/backends/nvidia/bin/ptxas-blackwell; reinstall triton (this test does not skip).")
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        pytest.fail(f"ptxas for sm_121a not found or not executable at {path}; reinstall triton 3.9")
    return path


@pytest.fixture(scope="module")
def aot(tmp_path_factory):
    _ptxas_path()
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--arch", "sm_121", "--quick", "--probe", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.exists(), f"aot_compile wrote nothing (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    res = json.loads(out.read_text())
    res["rc"], res["log"] = proc.returncode, proc.stdout[-4000:] + proc.stderr[-2000:]
    return res


def test_ptxas_for_sm121a_present():
    _ptxas_path()


def test_limits_as_documented(aot):
    lim = aot["limits"]["sm_121"]
    assert (lim["smem_per_block"], lim["regs_per_block"], lim["regs_per_thread"]) == (
        SM121_SMEM, REGS_PER_BLOCK, REGS_PER_THREAD)


def test_every_template_compiles_for_sm121a_and_fits(aot):
    real = [e for e in aot["entries"] if e["template"] != "probe"]
    assert {e["template"] for e in real} == TEMPLATES
    assert {e["kernel"] for e in real} == KERNELS
    for e in real:
        assert e["arch"] == "sm_121a" and e["regs"] > 0, e
        assert e["fits"] and e["smem"] <= SM121_SMEM and e["regs"] <= REGS_PER_THREAD, (e, aot["log"])
        assert -(-e["regs"] * 32 // 256) * 256 * e["num_warps"] <= REGS_PER_BLOCK, e
    assert aot["rc"] == 0 and aot["all_fit"], aot["log"]


def test_sm121a_attention_tiles_fit(aot):
    """The compiled tree-attention entries are the tuning table's sm_121 tiles, every head size."""
    from ddtree_compile.templates import tuning

    fwd = [e for e in aot["entries"] if e["template"] == "tree_attention" and e["kernel"] == "tree_attn_fwd_kernel"]
    for D in (64, 128, 256):
        t = tuning.attention_tiles("sm_121", D)
        hits = [e for e in fwd if e["constexprs"]["HEAD_DIM"] == D]
        assert hits, f"no sm_121a tree-attention entry for D={D}"
        for e in hits:
            assert (e["constexprs"]["BLOCK_M"], e["constexprs"]["BLOCK_N"], e["num_warps"], e["num_stages"]) == (
                t.block_m, t.block_n, t.num_warps, t.num_stages), e
            assert e["fits"] and 0 < e["smem"] <= SM121_SMEM, e


def test_fp8_tree_attention_compiles_for_sm121a(aot):
    """The FP8 variant (an FP8 KV cache and query: FP8 tiles cast for the same dot) is its own compile."""
    fp8 = [e for e in aot["entries"] if e["template"] == "tree_attention" and e["kernel"] == "tree_attn_fwd_kernel"
           and e["constexprs"].get("KV_FP8") and e["constexprs"].get("Q_FP8")]
    assert len(fp8) == 1 and fp8[0]["fits"] and 0 < fp8[0]["smem"] <= SM121_SMEM, fp8


def test_oversized_config_reported_not_fitting(aot):
    """The H100's D=256 tile (128 x 32, 4 stages) needs far more than GB10's 99 KB: the check says so."""
    probe = [e for e in aot["entries"] if e["template"] == "probe" and e["kernel"] == "tree_attn_fwd_kernel"]
    assert len(probe) == 1
    e = probe[0]
    assert e["smem"] > SM121_SMEM and not e["fits"], e
    assert any(v.startswith("smem") for v in e["violations"]), e
