"""`ddtree-compile precompile` on CPU: tiny float32 Qwen3, budgets 4 and 8, batches 1 and 2 (eager:
the compile-cache part is vLLM's own and is measured on the GPU, cold vs warm)."""

import json

import pytest

from ddtree_compile import cli
from ddtree_compile.cli import precompile
from ddtree_compile.integration import plugin
from ddtree_compile.testing import models


def test_batch_buckets_and_bad_input():
    assert precompile.batch_buckets(1) == [1]
    assert precompile.batch_buckets(6) == [1, 2, 4, 6]
    assert precompile.batch_buckets(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="--max-batch"):
        precompile.batch_buckets(0)
    with pytest.raises(SystemExit, match="--budgets"):
        cli.main(["precompile", "--model", "m", "--draft", "d", "--budgets", "8,x", "--max-batch", "2"])
    with pytest.raises(SystemExit, match="--llm-kwargs"):
        cli.main(["precompile", "--model", "m", "--draft", "d", "--budgets", "8", "--max-batch", "2",
                  "--llm-kwargs", "[1]"])


def test_precompile_writes_the_cost_table(tmp_path, monkeypatch):
    plugin.register()
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    target = models.write_tiny_model("qwen3", tmp_path / "qwen3")
    drafter = models.write_tiny_dflash_drafter(target, tmp_path / "dflash")
    kw = models.tiny_llm_kwargs(target, enforce_eager=True, dtype="float32")
    kw.pop("model"), kw.pop("max_num_seqs")
    rc = cli.main(["precompile", "--model", str(target), "--draft", str(drafter), "--budgets", "4,8",
                   "--max-batch", "2", "--top-k", "4", "--draft-len", "7", "--max-tokens", "8",
                   "--llm-kwargs", json.dumps(kw)])
    assert rc == 0
    path = precompile.default_path(target, drafter, 4, 7, 2)
    assert path.parent == tmp_path / "cache" / "ddtree"
    table = json.loads(path.read_text())
    assert [(b["budget"], b["batch"]) for b in table["buckets"]] == [(4, 1), (4, 2), (8, 1), (8, 2)]
    for b in table["buckets"]:
        assert b["round_ms"] > 0 and b["tree_steps"] > 0, b
        assert set(b["phase_ms"]) >= {"build", "verify", "walk", "commit"}
    assert set(table["starts"]) == {"4", "8"} and all(s > 0 for s in table["starts"].values())
