"""benchmarks/bench_e2e_gpu.py's cells and summary without engines: how many timed runs a cell takes
(--min-cell-s) and the steady steps over flat DFlash's on one clock (summarize_e2e's step_vs_flat)."""

import importlib

import pytest


def test_min_cell_s_adds_runs_until_every_modes_wall_time_is_reached(bench):
    """--min-cell-s: a cell of short runs takes more of them (side by side: every mode as many), at
    least --repeats, at most 8x; without it exactly --repeats."""
    cells = importlib.import_module("_e2e_cells")
    run = lambda s: {"wall_s": s}  # noqa: E731
    assert not cells.more_runs(5, [[run(0.1)] * 5], 5, 0.0)
    assert cells.more_runs(5, [[run(1.0)] * 5, [run(0.3)] * 5], 5, 2.0)  # (the faster mode: 1.5 s)
    assert not cells.more_runs(7, [[run(1.0)] * 7, [run(0.3)] * 7], 5, 2.0)  # (both past 2 s)
    assert not cells.more_runs(40, [[run(0.01)] * 40], 5, 2.0)  # (8 x 5 runs at most)
    assert cells.more_runs(1, [[run(9.0)]], 2, 2.0)  # (--repeats first)
    walls = iter([0.4] * 20)
    timed = lambda llm, prompts, n: {"wall_s": next(walls), "tok_s": 10.0, "outputs": [], "steps": 1,  # noqa: E731
                                     "peak_batch": 1}
    r = cells.cell(timed, None, [], 8, 3, min_cell_s=2.0)
    assert len(r["tok_s_runs"]) == 5 and r["wall_s_total"] == pytest.approx(2.0), r


def test_steady_steps_over_flats_at_the_cells_bucket(bench):
    """summarize_e2e's step_vs_flat: each kind's steady step (--phase-timers' step_clock) over flat's of
    the same cell and batch bucket; the table shows the bucket of c (4 -> 4, 16 -> 16), "-" where flat has none."""
    summ = importlib.import_module("summarize_e2e")
    cell = dict(profile="p", reference_match=1.0, tokens_per_round=5.0, rounds=10, wall_s=1.0,
                wall_s_total=4.0, output_tokens=100, tpot_p50_ms=1.0, tok_s=100.0)
    runs = []
    for c in (4, 16):
        runs.append(dict(cell, mode="flat", concurrency=c, step_clock={f"flat@{c}": {"n": 9, "ms": 8.0},
                                                                       "flat@2": {"n": 3, "ms": 6.0}}))
        runs.append(dict(cell, mode="auto", concurrency=c, step_clock={f"chain@{c}": {"n": 9, "ms": 8.8},
                                                                       f"tree:32@{c}": {"n": 2, "ms": 12.0},
                                                                       "chain@2": {"n": 3, "ms": 6.3},
                                                                       "chain@1": {"n": 3, "ms": 5.0}}))
    res = summ.summarize({"args": {"side_by_side": True}, "runs": runs})
    auto = runs[1]
    assert auto["step_vs_flat"] == pytest.approx({"chain@4": 1.1, "tree:32@4": 1.5, "chain@2": 1.05}), auto
    assert "| auto | chain 1.10x, tree:32 1.50x | chain 1.10x, tree:32 1.50x |" in summ.table(res)
    del runs[2]["step_clock"]["flat@16"]  # flat timed no steady step at that bucket
    summ.summarize(res)
    assert "| auto | chain 1.10x, tree:32 1.50x | - |" in summ.table(res)


def test_steady_steps_over_flatalike_in_merged_parts(bench):
    """Merged side-by-side parts "flat+flatalike" and "flatalike+autochain": autochain's steps over its own
    part's flatalike (step_vs_alike; no tok/s ratio: its part has no flat), flatalike's ratios against
    its part's flat, and the tables show the flatalike row that has them."""
    summ = importlib.import_module("summarize_e2e")
    cell = {"profile": "p", "concurrency": 16, "reference_match": 1.0, "tokens_per_round": 5.0, "rounds": 10,
            "wall_s": 1.0, "wall_s_total": 4.0, "output_tokens": 100, "tpot_p50_ms": 1.0}

    def run(mode, pair, tok_s, kind, ms):
        return {**cell, "mode": mode, "pair": pair, "tok_s": tok_s, "step_clock": {f"{kind}@16": {"n": 9, "ms": ms}}}

    runs = [run("flat", "flat+flatalike", 100.0, "flat", 10.0), run("flatalike", "flat+flatalike", 103.0, "flat", 10.3),
            run("flatalike", "flatalike+autochain", 104.0, "flat", 10.4),
            run("autochain", "flatalike+autochain", 104.0, "chain", 10.504)]
    res = summ.summarize({"args": {"side_by_side": True}, "runs": runs})
    assert runs[1]["step_vs_flat"] == pytest.approx({"flat@16": 1.03}) and runs[1]["vs_flat"] == pytest.approx(1.03)
    assert "vs_flat" not in runs[3] and runs[3]["step_vs_alike"] == pytest.approx({"chain@16": 1.01})
    assert "step_vs_alike" not in runs[1] and "step_vs_alike" not in runs[2]
    text = summ.table(res)
    assert "| flatalike | 1.03x (1.00) |" in text and "| flatalike | flat 1.03x |" in text, text
    assert "| autochain | chain 1.01x |" in text, text


def test_kernel_table_sets_each_modes_kernels_beside_the_first_modes(bench):
    """summarize_e2e --kernels: per profiled cell, busy time and kernels over the first mode's, and a
    Triton variant of vLLM's GDN kernels that only one mode compiled (gpu_profile's triton_specializations)."""
    summ = importlib.import_module("summarize_e2e")

    def prof(mode, gdn_ms, keys):
        return dict(mode=mode, profile="p", concurrency=16, gpu_busy_ms_per_round=0.5 + gdn_ms,
                    kernels=[dict(name="fused_sigmoid_gating_delta_rule_update_kernel", ms_per_round=gdn_ms),
                             dict(name="gemm", ms_per_round=0.5)],
                    triton_specializations={"fused_sigmoid_gating_delta_rule_update_kernel": keys})

    text = summ.kernel_table({"gpu_profiles": [prof("flat", 0.2, ["k16"]), prof("flatalike", 0.218, ["k16", "k35"])]})
    lines = text.splitlines()
    assert lines[0] == "p c = 16: ms per round (x the first mode's)" and lines[1] == "| kernel | flat | flatalike |"
    assert "| GPU busy | 0.7000 | 0.7180 (1.026x) |" in lines
    assert "| fused_sigmoid_gating_delta_rule_update_kernel | 0.2000 | 0.2180 (1.090x) |" in lines
    assert "| gemm | 0.5000 | 0.5000 (1.000x) |" in lines
    assert [x.strip() for x in lines if "variant only" in x] == [
        "fused_sigmoid_gating_delta_rule_update_kernel variant only in flatalike: k35"]
