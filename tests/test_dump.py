"""`ddtree-compile dump`: the real command on a fresh tiny model folder, in a fresh process."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from ddtree_compile.cli import dump
from ddtree_compile.testing import models


def test_bad_arguments_are_refused_clearly(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    dump.add_arguments(parser)
    assert dump.run(parser.parse_args(["--model", str(tmp_path), "--out", str(tmp_path / "o")])) == 2
    assert "not a model folder (no config.json)" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert dump.run(parser.parse_args(["--model", str(tmp_path), "--out", str(tmp_path / "o"),
                                       "--budget", "0"])) == 2
    assert "--budget must be in [1, 1024], got 0" in capsys.readouterr().err


def test_dump_writes_graphs_and_summary(tmp_path):
    model = models.write_tiny_model("qwen3", tmp_path / "qwen3")
    out = tmp_path / "dump"
    proc = subprocess.run([sys.executable, "-m", "ddtree_compile.cli", "dump", "--model", str(model),
                           "--out", str(out), "--budget", "4"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ddtree-compile dump: starting vLLM on" in proc.stderr  # the progress line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rules"]["attention"] == {"matched": 4, "rewritten": 4}
    assert "kv_cache_update" not in summary["rules"]  # vLLM's KV-cache write stays as it is (rules.TREE_SAFE)
    assert summary["unmatched"] == [] and summary["num_graphs"] == 1
    assert summary["architecture"] == "Qwen3ForCausalLM" and summary["budget"] == 4
    assert len(summary["pass_uuid"]) == 64
    before = (out / summary["graphs"][0]["before"]).read_text()
    after = (out / summary["graphs"][0]["after"]).read_text()
    assert before.count("torch.ops.vllm.unified_attention_with_output.default") == 4
    assert after.count("torch.ops.ddtree.unified_attention_with_output.default") == 4
    assert after.count("torch.ops.vllm.unified_kv_cache_update.default") == 4
    assert after.replace("torch.ops.ddtree.", "torch.ops.vllm.") == before
    report = json.loads((out / summary["graphs"][0]["report"]).read_text())
    assert report["rules"]["attention"]["rewritten"] == 4


@pytest.mark.slow
def test_dump_with_depyf_on_a_hybrid(tmp_path):
    model = models.write_tiny_model("qwen3_next", tmp_path / "qwen3_next")
    out = tmp_path / "dump"
    proc = subprocess.run([sys.executable, "-m", "ddtree_compile.cli", "dump", "--model", str(model),
                           "--out", str(out), "--depyf"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rules"]["gdn_cpu"] == {"matched": 3, "rewritten": 3}
    assert any((out / "depyf").glob("*AFTER_POST_GRAD*.py"))
