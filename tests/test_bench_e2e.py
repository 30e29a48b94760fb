"""benchmarks/bench_e2e_gpu.py on CPU with the tiny float32 model: the benchmark the GPU runs use,
end to end at toy size (no speculation, vLLM's flat DFlash, DDTree; oracle drafter; two
concurrencies). Timings are not checked (CPU); what the JSON reports is: every mode ran, outputs
equal the reference (float32: lossless), DDTree's rounds were tree rounds, and the derived fields
(tokens per round, break-even gain, ratios) are there and consistent."""

import importlib
import json
import math
import os

import pytest

from ddtree_compile.testing import oracle



def test_an_unknown_profile_name_is_refused_with_the_allowed_ones(bench, tmp_path):
    with pytest.raises(SystemExit, match=r"--profile-names: \['nope'\].*allowed: .*thinking_2p5"):
        bench.main(["--target", "tiny", "--profile-names", "sglang_plus22,nope", "--out", str(tmp_path / "x.json")])


@pytest.mark.slow  # (vLLM engines on CPU; `make test-slow`: keeps `make test` near 30 min)
def test_bench_e2e_smoke(bench, tmp_path):
    prof = oracle.calibrate("sglang_plus22", 5.6, 1.22, 32, samples=500)
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps({"profiles": [prof]}))
    out = tmp_path / "e2e.json"
    rc = bench.main(["--target", "tiny", "--out", str(out), "--max-tokens", "24", "--concurrency", "1,2",
                     "--budgets", "8", "--top-k", "4", "--flat-len", "7", "--profiles", str(profiles),
                     "--profile-names", "sglang_plus22", "--auto-budget", "8", "--repeats", "2"])
    res = json.loads(out.read_text())
    assert rc == 0, [r for r in res["runs"] if "error" in r]
    runs = {(r["mode"], r["concurrency"]): r for r in res["runs"]}
    assert set(runs) == {(m, c) for m in ("nospec", "flat", "ddtree8", "auto") for c in (1, 2)}
    for (mode, c), r in runs.items():
        assert r["output_tokens"] == 24 * c and r["tok_s"] > 0 and r["reference_match"] == 1.0, r
        assert r["tpot_p50_ms"] > 0 and r["tpot_p90_ms"] >= r["tpot_p50_ms"]
        assert len(r["tok_s_runs"]) == 2 and r["tok_s"] in r["tok_s_runs"] and r["wall_s_total"] > r["wall_s"]
        assert 0 < r["ms_per_step"] < 1e3 * r["wall_s_total"] / 2, r  # at least one step per run
        if mode != "nospec":
            assert r["tokens_per_round"] > 1.5 and r["rounds"] > 0, r  # the oracle's drafts were accepted
    for c in (1, 2):
        d, f = runs[("ddtree8", c)], runs[("flat", c)]
        assert d["tree_steps"] > 0 and d["fallback_total"] == 0
        assert d["graph_steps"] == d["plain_graph_steps"] == 0, d  # (CPU: no FULL graph replays, counted)
        assert set(d["round_split_s"]) >= {"draft", "build", "verify"}
        assert d["own_host_ms_per_step"] > 0 and 0 < d["own_host_share"] < 1  # DDTree's own host work, no drafter
        assert math.isclose(d["own_host_share"], d["own_host_ms_per_step"] / d["ms_per_step"])
        assert math.isclose(d["tok_s_vs_flat"], d["tok_s"] / f["tok_s"])
        assert math.isclose(d["break_even_gain"], (f["rounds"] / f["wall_s_total"]) / (d["rounds"] / d["wall_s_total"]))
    for c in (1, 2):  # budget "auto": both kinds of steps were possible, its choices are reported
        a = runs[("auto", c)]
        assert a["budget"] == "auto" and a["tree_steps"] + a["auto_chain_steps"] > 0, a
        assert a["auto"]["tree_budget"] == 8 and sum(a["auto"]["decisions"].values()) > 0, a
        cell = a["auto_decisions_in_cell"]  # (the snapshot is cumulative over the engine's cells)
        assert 0 < sum(cell.values()) <= sum(a["auto"]["decisions"].values()), a
        if c == 2:  # one engine for both cells: the first cell's decisions are not this one's
            assert sum(cell.values()) < sum(a["auto"]["decisions"].values()), a
        assert all(k.split("@")[0] in ("tree", "chain") for k in cell), cell
        assert a["tok_s_vs_flat"] > 0 and a["simulated_tokens_per_round"] is None
    assert set(res["starts"]) == {"nospec", "flat", "ddtree8", "auto"}


@pytest.mark.slow  # (vLLM engines on CPU; `make test-slow`: keeps `make test` near 30 min)
def test_bench_e2e_split_over_commands_and_merged(bench, tmp_path):
    """A GPU run spreads the modes over several commands: the reference is computed once and
    read back, and --merge recomputes the break-even across the parts."""
    profs = [{"name": "perfect", "rank_probs": [1.0]}, {"name": "perfect2", "rank_probs": [1.0]}]
    (tmp_path / "p.json").write_text(json.dumps({"profiles": profs}))
    common = ["--target", "tiny", "--max-tokens", "16", "--concurrency", "1", "--budgets", "8", "--top-k", "4",
              "--flat-len", "7", "--profiles", str(tmp_path / "p.json"), "--profile-names", "perfect",
              "--reference", str(tmp_path / "ref.json")]
    assert bench.main(common + ["--modes", "flat", "--out", str(tmp_path / "a.json")]) == 0
    assert (tmp_path / "ref.json").exists()
    a = json.loads((tmp_path / "a.json").read_text())
    assert set(a["starts"]) == {"nospec", "flat"} and [r["mode"] for r in a["runs"]] == ["flat"]
    assert bench.main(common + ["--modes", "ddtree", "--out", str(tmp_path / "b.json")]) == 0
    b = json.loads((tmp_path / "b.json").read_text())
    assert set(b["starts"]) == {"ddtree8"}  # the reference was read back: no second no-spec engine
    assert "break_even_gain" not in b["runs"][0]  # no flat run in this part
    assert bench.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "m.json")]) == 0
    m = json.loads((tmp_path / "m.json").read_text())
    d = next(r for r in m["runs"] if r["mode"] == "ddtree8")
    assert d["reference_match"] == 1.0 and d["tokens_per_round"] == pytest.approx(8.0, abs=1.0)
    assert d["break_even_gain"] > 0 and d["tok_s_vs_flat"] > 0


def test_shaped_target_is_dense_with_one_moe_layer(bench, tmp_path):
    """The real-size targets are dense models: vLLM's Qwen3-Next needs one MoE layer, so only the last
    layer is a one-expert MoE; a MoE in every layer would time fused_moe instead of cuBLAS GEMMs."""
    target, drafter = importlib.import_module("_e2e_engine").write_shaped("qwen36_27b", tmp_path)
    cfg = json.loads((target / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    assert n == 64 and cfg["mlp_only_layers"] == list(range(n - 1))
    assert cfg["num_experts"] == 1 and cfg["moe_intermediate_size"] == cfg["intermediate_size"] == 17408
    d = json.loads((drafter / "config.json").read_text())
    assert d["architectures"] == ["DFlashDraftModel"] and d["num_target_layers"] == n
    assert all(0 < i < n for i in d["dflash_config"]["target_layer_ids"])


def test_merge_keeps_every_parts_gpu_profiles(bench, tmp_path):
    parts = []
    for i, mode in enumerate(("flat", "ddtree32")):
        parts.append(tmp_path / f"{mode}.json")
        parts[-1].write_text(json.dumps({"args": {"part": i}, "runs": [], "starts": {mode: 1.0 + i},
                                         "gpu_profiles": [{"mode": mode, "gpu_busy_ms_per_round": 26.0 + i}]}))
    m = importlib.import_module("_e2e_cells").merge(parts, tmp_path / "m.json")
    assert [g["mode"] for g in m["gpu_profiles"]] == ["flat", "ddtree32"] and m["starts"] == {"flat": 1.0,
                                                                                              "ddtree32": 2.0}


def test_summary_table_ratios_and_no_speculation_row(bench):
    """summarize_e2e: ratios over the mean of flat's valid runs (an invalid flat run, which left the
    reference, is not a baseline), break-even over all of a cell's timed runs, and the no-speculation row."""
    summ = importlib.import_module("summarize_e2e")  # bench put benchmarks/ on sys.path
    cell = dict(concurrency=1, tpot_p50_ms=1.0, reference_match=1.0)
    runs = [dict(cell, mode="flat", profile=p, tok_s=t, tokens_per_round=5.0, rounds=100, wall_s=1.0, wall_s_total=2.0)
            for p, t in (("a", 100.0), ("b", 140.0))]
    runs.append(dict(cell, mode="flat", profile="c", tok_s=10.0, tokens_per_round=1.0, rounds=100, wall_s=1.0,
                     reference_match=0.01))
    runs.append(dict(cell, mode="ddtree32", budget=32, profile="a", tok_s=150.0, tokens_per_round=6.0, rounds=80,
                     wall_s=0.5, wall_s_total=1.0, own_host_ms_per_step=0.5, own_host_share=0.05))
    runs.append({"mode": "nospec", "concurrency": 1, "tok_s": 40.0})
    res = summ.summarize({"runs": runs})
    d = runs[3]
    assert res["flat_baseline"]["1"]["runs"] == 2 and math.isclose(d["vs_flat"], 150.0 / 120.0)
    assert math.isclose(d["gain"], 6.0 / 5.0) and math.isclose(d["break_even"], (100 / 2.0) / (80 / 1.0))
    lines = summ.table(res).splitlines()
    assert lines[2].startswith("| ddtree32 | 1.25x (1.20) |") and lines[-1].startswith("| no speculation tok/s | 40 |")
    assert "| ddtree32 | 0.50 ms (5%) |" in lines  # DDTree's own host work per step, the goal line's number
    auto = dict(cell, mode="auto", budget="auto", profile="a", tok_s=90.0, tokens_per_round=5.5, rounds=90,
                wall_s=1.0, wall_s_total=2.0, auto_decisions_in_cell={"tree@1": 8, "chain@1": 2, "chain@16": 3})
    lines = summ.table(summ.summarize({"runs": [*runs, auto]})).splitlines()
    assert "| auto | 1: tree 80%, 16: chain 100% |" in lines, lines  # the kind taken most per batch bucket
    for r in runs:  # --side-by-side: each cell's own flat run is the baseline (no mean over profiles)
        r.pop("vs_flat", None)
    res = summ.summarize({"args": {"side_by_side": True}, "runs": runs})
    assert set(res["flat_baseline"]) == {"a c=1", "b c=1"} and math.isclose(d["vs_flat"], 150.0 / 100.0)
    assert math.isclose(d["break_even"], (100 / 2.0) / (80 / 1.0))
    assert "| flat DFlash tok/s | 100 |" in summ.table(res)
    # a profile of another chain (thinking_2p5's p0): flat's mean is over the profiles of its chain only
    for r in runs:
        r.pop("vs_flat", None)
    runs[2]["reference_match"] = 1.0
    runs[2].pop("invalid")
    chains = {"profiles": [{"name": n, "chain_tokens_per_round": t} for n, t in (("a", 5.6), ("b", 5.6), ("c", 2.5))]}
    res = summ.summarize({"profiles": chains, "runs": runs})
    assert set(res["flat_baseline"]) == {"chain 5.60 c=1", "chain 2.50 c=1"}, res["flat_baseline"]
    assert res["flat_baseline"]["chain 2.50 c=1"]["runs"] == 1 and math.isclose(d["vs_flat"], 150.0 / 120.0)


@pytest.mark.slow  # (vLLM engines on CPU; `make test-slow`: keeps `make test` near 30 min)
def test_bench_e2e_side_by_side(bench, tmp_path, monkeypatch):
    """--side-by-side: the speculative engines are up together, each in a process of its own (on the
    GPU --devices names for it), and their runs alternate within each cell (the order rotated per
    repeat)."""
    profs = [{"name": "perfect", "rank_probs": [1.0]}, {"name": "perfect2", "rank_probs": [1.0]}]
    (tmp_path / "p.json").write_text(json.dumps({"profiles": profs}))
    out = tmp_path / "s.json"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "9,8,7,6,5,4")  # --devices index into the parent's list
    rc = bench.main(["--target", "tiny", "--max-tokens", "16", "--concurrency", "1,2", "--budgets", "8", "--top-k", "4",
                     "--flat-len", "7", "--profiles", str(tmp_path / "p.json"), "--profile-names", "perfect,perfect2",
                     "--modes", "flat,ddtree8", "--repeats", "3", "--side-by-side", "--devices", "3,5",
                     "--gpu-profile", "2", "--phase-timers", "--out", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0, [r for r in res["runs"] if "error" in r]
    # --gpu-profile 2: one profiled run per engine at c=2 only (CPU: no kernels, the host ops are counted)
    assert [(g["mode"], g["concurrency"], g["profile"]) for g in res["gpu_profiles"]] == [("flat", 2, "perfect"),
                                                                                         ("ddtree8", 2, "perfect")]
    assert all(g["rounds"] > 0 and g["host_aten_ops_per_round"] > 0 for g in res["gpu_profiles"])
    # after every timed and warm-up run of both profiles (a profiled run slows its engine after it)
    last = max(t for r in res["runs"] for t in r["run_started_s"] + r["warmup_started_s"])
    assert min(g["started_s"] for g in res["gpu_profiles"]) > last
    assert res["worker_devices"] == {"flat": "6", "ddtree8": "4"}  # (CPU engines: the variable is all there is)
    pids = res["worker_pids"]
    assert set(pids) == {"flat", "ddtree8"} and len({*pids.values(), os.getpid()}) == 3, pids
    wall = res["worker_start_wall"]  # started together: every process spawned before any engine was up
    assert max(s for s, _ in wall.values()) < min(r for _, r in wall.values()), wall
    runs = {(r["mode"], r["concurrency"]): r for r in res["runs"] if r["profile"] == "perfect"}
    assert set(runs) == {(m, c) for m in ("flat", "ddtree8") for c in (1, 2)}
    assert len(res["runs"]) == 8  # (and the same cells of perfect2)
    for c in (1, 2):
        f, d = runs[("flat", c)], runs[("ddtree8", c)]
        starts = sorted([(t, "flat") for t in f["run_started_s"]] + [(t, "dd") for t in d["run_started_s"]])
        order = [m for _, m in starts]
        assert order == ["flat", "dd", "dd", "flat", "flat", "dd"], order  # alternating, rotated per repeat
        # one untimed run of each (the default --warmup-runs 1) before the cell's timed runs
        assert len(f["warmup_started_s"]) == len(d["warmup_started_s"]) == 1
        assert max(f["warmup_started_s"] + d["warmup_started_s"]) < starts[0][0]
        for r in (f, d):
            assert r["reference_match"] == 1.0 and len(r["tok_s_runs"]) == 3 and r["rounds"] > 0
            assert r["peak_batch"] == c  # every run had the cell's c requests in flight at once
            assert r["tokens_per_round"] > 5  # the perfect oracle: (nearly) every draft accepted
        assert d["tree_steps"] > 0 and d["fallback_total"] == 0  # the tree ran, in its own process
        assert math.isclose(d["tok_s_vs_flat"], d["tok_s"] / f["tok_s"])
        # --phase-timers in each engine's process: its phases; the step clock is Model Runner V2's (these
        # CPU engines run the V1 runner; test_phase_timers.py clocks V2's)
        assert f["runner"].endswith("CPUModelRunner") and f["phase_ms_per_step"] and "step_clock" not in f, f


def test_bench_devices_repeat_and_name_the_option(bench, monkeypatch, capsys):
    device_of_each = importlib.import_module("_e2e_side_by_side").device_of_each
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert device_of_each(None, 2) == [None, None] and device_of_each("1,2", 3) == ["1", "2", "1"]
    assert device_of_each("0+1,2+3", 2) == ["0,1", "2,3"]
    with pytest.raises(ValueError, match=r"--devices 'cuda:1': expected CUDA device indices"):
        device_of_each("cuda:1", 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    assert device_of_each("1,0", 2) == ["7", "6"]
    assert device_of_each("0+1", 2) == ["6,7", "6,7"]  # one engine's GPUs (tensor parallel)
    with pytest.raises(ValueError, match=r"--devices '2': CUDA_VISIBLE_DEVICES=6,7 holds 2 devices"):
        device_of_each("2", 1)
    main = importlib.import_module("bench_e2e_gpu").main
    for argv in (["--devices", "0+1,2"], ["--devices", "0,1"]):  # an engine with one GPU at tensor-parallel 2
        with pytest.raises(SystemExit):
            main(["--out", "x.json", "--side-by-side", "--tensor-parallel-size", "2", *argv])
        assert "each engine needs --tensor-parallel-size (2) GPUs, joined by '+'" in capsys.readouterr().err


def test_bench_kv_cache_gib_per_mode(bench):
    """--kv-cache-gib: one size, or per mode with "*" for the rest; a mode without a size is an error
    naming the option and the mode."""
    kv_cache_gib = importlib.import_module("_e2e_engine").kv_cache_gib
    assert kv_cache_gib("12", "auto") == 12.0
    assert kv_cache_gib("flat=11,*=23", "flat") == 11.0 and kv_cache_gib("flat=11,*=23", "ddtree32") == 23.0
    with pytest.raises(ValueError, match=r"--kv-cache-gib 'flat=11' names no size for mode 'auto'"):
        kv_cache_gib("flat=11", "auto")
    with pytest.raises(ValueError, match=r"--kv-cache-gib: 'flat=x' is not GIB or MODE=GIB"):
        kv_cache_gib("flat=x", "flat")


def test_merged_side_by_side_parts_keep_their_own_flat(bench, tmp_path):
    """Two --side-by-side commands (flat+ddtree32, flat+auto) merged: each mode's ratio and break-even
    are against the flat runs of its own command, not the other's nor a mean of both."""
    summ = importlib.import_module("summarize_e2e")
    cell = dict(profile="a", concurrency=1, tpot_p50_ms=1.0, reference_match=1.0, tokens_per_round=5.0, wall_s=1.0)
    parts = []
    for i, (mode, flat_tok_s, flat_rounds) in enumerate((("ddtree32", 100.0, 100), ("auto", 200.0, 50))):
        runs = [dict(cell, mode="flat", tok_s=flat_tok_s, rounds=flat_rounds),
                dict(cell, mode=mode, budget=32 if mode != "auto" else "auto", tok_s=150.0, rounds=40)]
        parts.append(tmp_path / f"{i}.json")
        parts[-1].write_text(json.dumps({"args": {"side_by_side": True}, "runs": runs}))
    m = importlib.import_module("_e2e_cells").merge(parts, tmp_path / "m.json")
    rows = {r["mode"] + "@" + r["pair"]: r for r in m["runs"]}
    assert set(rows) == {"flat@flat+ddtree32", "ddtree32@flat+ddtree32", "flat@flat+auto", "auto@flat+auto"}
    assert math.isclose(rows["ddtree32@flat+ddtree32"]["break_even_gain"], 100 / 40)
    assert math.isclose(rows["auto@flat+auto"]["break_even_gain"], 50 / 40)
    res = summ.summarize(m)
    assert math.isclose(rows["ddtree32@flat+ddtree32"]["vs_flat"], 1.5) and math.isclose(rows["auto@flat+auto"]["vs_flat"], 0.75)
    text = summ.table(res)
    assert "| flat DFlash tok/s (flat+ddtree32) | 100 |" in text and "| flat DFlash tok/s (flat+auto) | 200 |" in text


def test_bench_attention_config_reaches_every_engine_and_names_the_option(bench, capsys):
    import types

    engine_kwargs = importlib.import_module("_e2e_engine").engine_kwargs
    args = types.SimpleNamespace(target="tiny", tiny_kind="qwen3", prompt_len=8, max_tokens=8, budgets=[8], flat_len=4,
                                 auto_budget=[8], device="cpu", attention_config={"backend": "TRITON_ATTN"})
    kw = engine_kwargs("/models/t", args, 2, None, {})
    assert kw["attention_config"] == {"backend": "TRITON_ATTN"}
    args.attention_config = None
    assert "attention_config" not in engine_kwargs("/models/t", args, 2, None, {})
    main = importlib.import_module("bench_e2e_gpu").main
    for bad, why in (("{backend", "not JSON"), ('["TRITON_ATTN"]', "a JSON object expected")):
        with pytest.raises(SystemExit):
            main(["--out", "x.json", "--attention-config", bad])
        assert f"--attention-config: {why}" in capsys.readouterr().err


def test_gpu_profile_concurrencies_bare_listed_or_named_error(bench, capsys):
    import types

    at = importlib.import_module("_e2e_cells").gpu_profile_at
    args = types.SimpleNamespace(gpu_profile=None)
    assert at(args, [1, 4, 16], [1]) == []
    args.gpu_profile = "all"
    assert at(args, [1, 4, 16], [1]) == [1] and at(args, [1, 4, 16], [1, 4, 16]) == [1, 4, 16]
    args.gpu_profile = [16, 1, 64]  # the listed ones this command runs, in the listed order
    assert at(args, [1, 4, 16], [1]) == [16, 1]
    main = importlib.import_module("bench_e2e_gpu").main
    with pytest.raises(SystemExit):
        main(["--out", "x.json", "--gpu-profile", "c16"])
    assert "--gpu-profile: concurrencies joined by ',' (e.g. '1,16') or bare, got 'c16'" in capsys.readouterr().err


def test_timed_runs_report_their_peak_batch_and_a_short_one_is_invalid(bench, tmp_path):
    """A run whose engine cannot hold all of its requests at once (here max_num_seqs=2; on the GPU a
    KV cache too small for the cell) times smaller batches and a queue: timed_steps reports the most
    requests that got tokens in one step, and summarize_e2e refuses such a row as a cell of c."""
    from ddtree_compile.cli.timing import timed_steps
    from ddtree_compile.testing import e2e, models

    target = models.write_tiny_model("qwen3", tmp_path / "qwen3")  # (in-process engine: conftest)
    with e2e.engine(**models.tiny_llm_kwargs(target, enforce_eager=True, max_num_seqs=2)) as llm:
        prompts = models.token_prompts(3, 8, 200, seed=0)
        full, short = timed_steps(llm, prompts[:2], 6), timed_steps(llm, prompts, 6)
    assert full["peak_batch"] == 2 and full["output_tokens"] == 12
    assert short["peak_batch"] == 2 and short["output_tokens"] == 18  # all served, never 3 at once
    summ = importlib.import_module("summarize_e2e")
    cells = importlib.import_module("_e2e_cells")
    rows = []
    for c, r in ((2, full), (3, short)):
        for mode in ("flat", "auto"):
            s = cells.summary(cells.median([r]), r["outputs"], 6)
            rows.append(dict(s, mode=mode, profile="p", concurrency=c, tokens_per_round=5.0, rounds=10))
    res = summ.summarize({"args": {"side_by_side": True}, "runs": rows})
    assert [("invalid" in r, "vs_flat" in r) for r in res["runs"]] == [(False, False), (False, True),
                                                                      (True, False), (True, False)]
    assert res["runs"][2]["invalid"].startswith("at most 2 of its 3 requests in flight at once")


def test_ratio_interval_resamples_the_paired_repeats(bench):
    """summarize_e2e's vs_flat_ci90: a bootstrap over a cell's repeats that keeps repeat i's two runs
    together, so a ratio every repeat agrees on has no spread however much the runs' speeds vary."""
    summ = importlib.import_module("summarize_e2e")
    cell = dict(profile="p", concurrency=4, reference_match=1.0, tokens_per_round=5.0, rounds=10, wall_s=1.0,
                wall_s_total=4.0, output_tokens=100, tpot_p50_ms=1.0)
    flat = dict(cell, mode="flat", tok_s=100.0, tok_s_runs=[100.0, 130.0, 70.0, 100.0])
    auto = dict(cell, mode="auto", tok_s=80.0, tok_s_runs=[80.0, 104.0, 56.0, 80.0])  # 0.8x in every repeat
    res = {"args": {"side_by_side": True}, "runs": [flat, auto]}
    summ.summarize(res)
    assert all(math.isclose(x, 0.8) for x in auto["vs_flat_ci90"]), auto["vs_flat_ci90"]  # (unpaired: 0.6-1.1)
    assert "| auto | 0.80-0.80 below |" in summ.table(res)
    auto["tok_s_runs"] = [120.0, 104.0, 91.0, 100.0]  # 1.2, 0.8, 1.3, 1.0: either side of 1.00x
    summ.summarize(res)
    lo, hi = auto["vs_flat_ci90"]
    agg = sum(1 / t for t in flat["tok_s_runs"]) / sum(1 / t for t in auto["tok_s_runs"])
    assert 0.8 <= lo < 1.0 < hi <= 1.3 and lo < agg < hi
    assert f"| auto | {lo:.2f}-{hi:.2f} |" in summ.table(res)
    summ.summarize(res)
    assert auto["vs_flat_ci90"] == [lo, hi]  # seeded: the same file summarised twice reads the same
    auto["tok_s_runs"], flat["tok_s_runs"] = auto["tok_s_runs"][:2], flat["tok_s_runs"][:2]
    summ.summarize(res)
    assert "vs_flat_ci90" not in auto  # two repeats: no interval


def test_flatalike_is_flat_dflash_compiled_as_ddtree_engines_are(bench):
    """Mode "flatalike": flat DFlash's speculative config compiled with DDTree's pass and Inductor's graph
    partition, where "flat" keeps vLLM's own compile (--flat-compile vllm): side by side they tell the
    compile's share of budget "auto"'s chain step from the rest of its engine (CHANGELOG 2026-12-06);
    "flatpart" (the partition alone) and "flatnosplit" (one graph, no split) tell the compile's parts apart."""
    import types

    modes = ["flat", "flatalike", "flatpart", "flatnosplit", "autochain"]
    args = types.SimpleNamespace(modes=modes, budgets=[32], loop="v2async")
    assert bench.speculative_modes(args) == [(m, "auto" if m == "autochain" else None) for m in modes]
    engine = importlib.import_module("_e2e_engine")
    kw_args = types.SimpleNamespace(target="tiny", tiny_kind="qwen3", prompt_len=8, max_tokens=8, budgets=[8],
                                    flat_len=4, auto_budget=[8], device="cuda", flat_compile="vllm",
                                    cudagraph_mode="FULL_AND_PIECEWISE", gpu_memory_utilization=0.5)
    spec = {"method": "dflash", "model": "/d", "num_speculative_tokens": 4}
    flat = engine.engine_kwargs("/t", kw_args, 2, spec, {}, "v2async")
    alike = engine.engine_kwargs("/t", kw_args, 2, spec, {}, "v2async", compile_as="flatalike")
    assert flat["speculative_config"] == alike["speculative_config"] == spec
    assert "additional_config" not in flat and "additional_config" not in alike
    assert "inductor_passes" not in flat["compilation_config"], flat["compilation_config"]
    cc = alike["compilation_config"]
    assert cc["use_inductor_graph_partition"] is True and "ddtree::qwen_gdn_attention_core" in cc["splitting_ops"]
    assert cc["inductor_passes"]["post_grad_custom_post_pass"] == "ddtree_compile.tree_verify_pass"
    # "flatpart": vLLM's own config (its splitting ops, no pass) with Inductor's graph partition only
    part = engine.engine_kwargs("/t", kw_args, 2, spec, {}, "v2async", compile_as="flatpart")
    assert part["speculative_config"] == spec and "additional_config" not in part
    assert part["compilation_config"] == {**flat["compilation_config"], "use_inductor_graph_partition": True}
    # "flatnosplit": one Inductor graph, no split, FULL CUDA graphs (vLLM's piecewise graphs need a split)
    whole = engine.engine_kwargs("/t", kw_args, 2, spec, {}, "v2async", compile_as="flatnosplit")
    assert whole["compilation_config"] == {**flat["compilation_config"], "splitting_ops": [],
                                           "cudagraph_mode": "FULL"}, whole["compilation_config"]


def test_modes_take_a_loop_and_the_summary_compares_with_the_old_baseline(bench, capsys):
    """--modes NAME@LOOP: each mode's engine in its loop (v2async: vLLM's default, async scheduling left
    to vLLM; v2sync / v1sync: async off), mixed loops only side by side (one runner per process), an
    unknown loop named with the allowed ones; the summary adds every mode's ratio to flat@v1sync."""
    import types

    args = types.SimpleNamespace(modes=["nospec", "flat", "ddtree@v2sync", "flat@v1sync", "auto"], budgets=[16, 32],
                                 loop="v2async")
    assert bench.speculative_modes(args) == [("flat", None), ("ddtree16@v2sync", 16), ("ddtree32@v2sync", 32),
                                             ("flat@v1sync", None), ("auto", "auto")]
    engine = importlib.import_module("_e2e_engine")
    assert [engine.loop_of(m, args) for m in ("flat", "flat@v1sync")] == ["v2async", "v1sync"]
    kw_args = types.SimpleNamespace(target="tiny", tiny_kind="qwen3", prompt_len=8, max_tokens=8, budgets=[8],
                                    flat_len=4, auto_budget=[8], device="cpu")
    assert "async_scheduling" not in engine.engine_kwargs("/t", kw_args, 2, None, {}, "v2async")
    assert engine.engine_kwargs("/t", kw_args, 2, None, {}, "v2sync")["async_scheduling"] is False
    for argv, why in ((["--modes", "flat@v3"], "unknown loop(s) ['v3']; allowed: v2async, v2sync, v1sync"),
                      (["--modes", "flat@v2async,flat@v1sync"], "different loops: only with --side-by-side")):
        with pytest.raises(SystemExit):
            bench.main(["--out", "x.json", *argv])
        assert why in capsys.readouterr().err
    summ = importlib.import_module("summarize_e2e")
    cell = dict(profile="a", concurrency=1, tpot_p50_ms=1.0, reference_match=1.0, tokens_per_round=5.0, wall_s=1.0,
                rounds=10)
    runs = [dict(cell, mode="flat", tok_s=200.0), dict(cell, mode="flat@v1sync", tok_s=100.0),
            dict(cell, mode="ddtree32", budget=32, tok_s=150.0)]
    text = summ.table(summ.summarize({"args": {"side_by_side": True}, "runs": runs}))
    assert "| ddtree32 | 0.75x (1.00) |" in text and "| flat@v1sync | 0.50x (1.00) |" in text
    assert text.split("Over flat@v1sync")[1].count("| ddtree32 | 1.50x |") == 1, text
