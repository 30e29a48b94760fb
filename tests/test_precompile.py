"""`ddtree-compile precompile` on CPU: tiny float32 Qwen3, a fixed budget of 4 and budget "auto" over
the menu 4 / 8 (its buckets and the chain), batches 1 and 2, the last engine started twice (eager: the
compile-cache part is vLLM's own and is measured on the GPU, cold vs warm)."""

import hashlib
import json

import pytest

from ddtree_compile import cli
from ddtree_compile.cli import precompile
from ddtree_compile.integration import plugin
from ddtree_compile.integration.round import auto_budget as ab
from ddtree_compile.integration.round import auto_setup
from ddtree_compile.testing import models


def test_batch_buckets_and_bad_input():
    assert precompile.batch_buckets(1) == [1]
    assert precompile.batch_buckets(6) == [1, 2, 4, 6]
    assert precompile.batch_buckets(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="--max-batch"):
        precompile.batch_buckets(0)
    with pytest.raises(SystemExit, match="--budgets"):
        cli.main(["precompile", "--model", "m", "--draft", "d", "--budgets", "8,x", "--max-batch", "2"])
    with pytest.raises(SystemExit, match="--auto-budget"):
        cli.main(["precompile", "--model", "m", "--draft", "d", "--auto-budget", "8,16;", "--max-batch", "2"])
    with pytest.raises(SystemExit, match="--budgets or --auto-budget"):
        cli.main(["precompile", "--model", "m", "--draft", "d", "--max-batch", "2"])
    with pytest.raises(SystemExit, match="--llm-kwargs"):
        cli.main(["precompile", "--model", "m", "--draft", "d", "--budgets", "8", "--max-batch", "2",
                  "--llm-kwargs", "[1]"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_timing_drafters_top_k_lists_are_its_logits_top_k(dtype):
    """Where the round's drafter graph replays past the logits hook (Model Runner V2 on a GPU), the round
    takes the timing drafter's top-k lists as they are: the ids of `draft_topk` of its logits in the
    model's dtype (the candidate, then equal logits by id) and their log-probs, without [R, L, V] logits."""
    import torch

    from ddtree_compile.core.build import draft_topk
    from ddtree_compile.core.spec import TreeSpec

    class View:
        def drafter_draft_len(self):
            return 5

        def drafter_root_positions(self, R):
            return torch.tensor([0, 3, 17, 43])[:R]  # 43: candidates 2 and 1 at its last depths

    R, L, V, k, dt = 4, 5, 50, 4, getattr(torch, dtype)
    drafter = precompile.NeverRightDrafter()
    drafter._view = View()
    logits = drafter._compute_logits(lambda h: torch.zeros(R * L, V, dtype=dt), None).view(R, L, V)
    for temperature in (1.0, 0.5):
        lp, ids = draft_topk(logits, TreeSpec(budget=16, top_k=k, temperature=temperature))
        got = drafter._draft_topk(R, L, k, temperature, V, dt, torch.device("cpu"))
        assert torch.equal(got[1], ids)
        torch.testing.assert_close(got[0], lp, rtol=0, atol=1e-5)
    assert (ids[..., 0] <= 2).any()  # (candidates among the lowest ids: the skip is exercised)


def test_the_cost_table_path_is_keyed_by_the_op_swap(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    args = (tmp_path / "m", tmp_path / "d", 8, 15, 16)
    default = auto_setup.cost_table_path(*args)
    key = json.dumps([str((tmp_path / "m").resolve()), str((tmp_path / "d").resolve()), 8, 15, 16])
    # tables precompiled before the op swap was part of the key keep their path (op_swap "pass")
    assert default == tmp_path / "ddtree" / f"cost_{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    trace = auto_setup.cost_table_path(*args, "trace")
    assert auto_setup.cost_table_path(*args, "pass") == default != trace == precompile.default_path(*args, "trace")
    with pytest.raises(SystemExit):
        cli.main(["precompile", "--model", "m", "--draft", "d", "--budgets", "8", "--max-batch", "2",
                  "--op-swap", "graph"])
    err = capsys.readouterr().err
    assert "--op-swap" in err and "'pass'" in err and "'trace'" in err, err


def test_precompile_writes_the_cost_table(tmp_path, monkeypatch):
    plugin.register()
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    target = models.write_tiny_model("qwen3", tmp_path / "qwen3")
    drafter = models.write_tiny_dflash_drafter(target, tmp_path / "dflash")
    kw = models.tiny_llm_kwargs(target, enforce_eager=True, dtype="float32")
    kw.pop("model"), kw.pop("max_num_seqs")
    rc = cli.main(["precompile", "--model", str(target), "--draft", str(drafter), "--budgets", "4",
                   "--auto-budget", "4,8", "--max-batch", "2", "--top-k", "4", "--draft-len", "7", "--max-tokens", "8",
                   "--warm-start", "--llm-kwargs", json.dumps(kw)])
    assert rc == 0
    path = precompile.default_path(target, drafter, 4, 7, 2)
    assert path.parent == tmp_path / "cache" / "ddtree"
    table = json.loads(path.read_text())
    assert table["op_swap"] == "pass"
    t4 = ab.tree_kind(4, 8)
    assert [(b["budget"], b.get("kind"), b["batch"]) for b in table["buckets"]] == [
        (4, None, 1), (4, None, 2),  # the fixed budget's engine
        (8, ab.TREE, 1), (8, ab.TREE, 2), (4, t4, 1), (4, t4, 2), (7, ab.CHAIN, 1), (7, ab.CHAIN, 2)]  # the menu's
    for b in table["buckets"]:
        chain = b.get("kind") == ab.CHAIN
        # every step of a row took the kind it times: trees of that bucket, or the chain
        took_its_kind = b["chain_steps"] > 0 and b["tree_steps"] == 0 if chain else b["tree_steps"] > 0
        if "kind" in b:  # a menu's row: its tree steps all verified its own bucket
            assert b["budget_steps"] == ({} if chain else {str(b["budget"]): b["tree_steps"]}), b
        assert b["round_ms"] > 0 and took_its_kind and b["peak_batch"] == b["batch"], b
        assert set(b["phase_ms"]) >= ({"build"} if chain else {"build", "verify", "walk", "commit"}), b
    assert set(table["starts"]) == {"4", "auto:4/8"} and all(s > 0 for s in table["starts"].values())
    warm = table["warm_start"]
    assert warm["engine"] == "auto:4/8" and warm["cold_s"] == table["starts"]["auto:4/8"] and warm["warm_s"] > 0
    # budget "auto" reads the menu's rows as its priors: every bucket's tree and the chain, per batch bucket
    priors = auto_setup.table_priors(table, 8, 7, (4, 8))
    want = {(kind, R): next(b["round_ms"] / 1e3 for b in table["buckets"] if b.get("kind") == kind and b["batch"] == R)
            for kind in (ab.TREE, t4, ab.CHAIN) for R in (1, 2)}
    assert priors == want
