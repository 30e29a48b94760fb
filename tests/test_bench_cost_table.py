"""bench_e2e_gpu.py --cost-table: budget "auto" engines given a precompile cost table (a path, or one
precompiled first on the auto mode's own engine settings), the table's rows kept in the result."""

import argparse
import json

import pytest

from ddtree_compile.integration import config
from ddtree_compile.testing import oracle


def _args(**kw) -> argparse.Namespace:
    base = dict(target="tiny", tiny_kind="qwen3", prompt_len=16, max_tokens=16, budgets=[8], flat_len=7,
                auto_budget=[4, 8], top_k=4, device="cpu", loop="v1sync", op_swap="pass", cost_table=None,
                cudagraph_mode="FULL_AND_PIECEWISE", gpu_memory_utilization=0.85)
    return argparse.Namespace(**{**base, **kw})


def test_the_cost_table_reaches_auto_engines_only_and_precompile_times_the_auto_engine(bench, tmp_path):
    import _e2e_engine as E

    table = tmp_path / "t.json"
    args = _args(cost_table=str(table))
    spec, extra = E.spec_of("auto", args, tmp_path / "d")
    assert config.parse(extra).cost_table == str(table.resolve())
    assert config.parse(E.spec_of(8, args, tmp_path / "d")[1]).cost_table is None  # a fixed budget: no table
    assert E.spec_of(None, args, tmp_path / "d")[1] == {}  # flat DFlash: vLLM's own
    cmd = E.precompile_command(_args(op_swap="trace"), tmp_path / "m", tmp_path / "d", 4, tmp_path / "o.json")
    opts = dict(zip(cmd[4::2], cmd[5::2]))
    assert cmd[1:4] == ["-m", "ddtree_compile.cli", "precompile"]
    assert {k: opts[k] for k in ("--auto-budget", "--max-batch", "--top-k", "--draft-len", "--op-swap")} == {
        "--auto-budget": "4,8", "--max-batch": "4", "--top-k": "4", "--draft-len": "7", "--op-swap": "trace"}
    kw = json.loads(opts["--llm-kwargs"])  # the auto engine's own settings, less what precompile's switch sets
    want = E.engine_kwargs(tmp_path / "m", _args(op_swap="trace"), 4, *E.spec_of("auto", _args(), tmp_path / "d"))
    assert not {"model", "max_num_seqs", "speculative_config"} & set(kw) and "ddtree" not in kw["additional_config"]
    assert kw["max_model_len"] == want["max_model_len"] and kw["enforce_eager"] == want["enforce_eager"]
    with pytest.raises(SystemExit):  # nothing to give a table to
        bench.main(["--target", "tiny", "--modes", "flat", "--cost-table", "precompile", "--out", str(tmp_path / "x")])


@pytest.mark.slow  # (two vLLM engines on CPU, one in a child process)
def test_bench_precompiles_the_auto_engines_cost_table(bench, tmp_path):
    prof = oracle.calibrate("sglang_plus22", 5.6, 1.22, 32, samples=500)
    profiles = tmp_path / "profiles.json"
    profiles.write_text(json.dumps({"profiles": [prof]}))
    out = tmp_path / "e2e.json"
    rc = bench.main(["--target", "tiny", "--out", str(out), "--max-tokens", "16", "--concurrency", "1,2",
                     "--modes", "auto", "--top-k", "4", "--flat-len", "7", "--profiles", str(profiles),
                     "--profile-names", "sglang_plus22", "--auto-budget", "4,8", "--repeats", "1",
                     "--cost-table", "precompile"])
    res = json.loads(out.read_text())
    assert rc == 0, [r for r in res["runs"] if "error" in r]
    table = tmp_path / "e2e.cost_table.json"
    assert res["args"]["cost_table"] == "precompile" and table.is_file()
    rows = res["cost_table"]["buckets"]
    assert {(r["kind"], r["batch"]) for r in rows} >= {(k, b) for k in ("tree", "chain") for b in (1, 2)}, rows
    assert res["cost_table"]["max_batch"] == 2 and all(r["round_ms"] > 0 for r in rows)
    auto = [r for r in res["runs"] if r["mode"] == "auto"]
    assert len(auto) == 2 and all(r["auto"]["table"] == str(table.resolve()) for r in auto), auto
