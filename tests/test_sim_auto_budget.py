"""benchmarks/sim_auto_budget.py: budget "auto"'s real policy offline over synthetic steps. Where one
kind is clearly the better it takes that kind in most steps and keeps nearly its rate; a cost file
without a cell's concurrency is an error naming the option."""

import importlib
import json

import pytest


def _costs(tmp_path, chain_ms, tree_ms):
    runs = [{"mode": mode, "concurrency": c, "ms_per_step": ms[c]}
            for mode, ms in (("flat", chain_ms), ("ddtree32", tree_ms)) for c in ms]
    path = tmp_path / f"costs_{len(list(tmp_path.iterdir()))}.json"
    path.write_text(json.dumps({"runs": runs}))
    return str(path)


def _run(tmp_path, costs, *extra):
    sim = importlib.import_module("sim_auto_budget")
    out = tmp_path / "sim.json"
    assert sim.main(["--costs", costs, "--profile-names", "sglang_plus22", "--concurrency", "1,4", "--steps", "160",
                     "--seeds", "2", "--samples", "2000", "--probe-interval", "8", "--out", str(out), *extra]) == 0
    return {r["concurrency"]: r for r in json.loads(out.read_text())["cells"]}


def test_the_policy_takes_the_better_kind_and_keeps_its_rate(bench, tmp_path):
    # sglang_plus22: the tree commits ~6.8 tokens per round, the chain ~5.5 (oracle.simulate_rows)
    cells = _run(tmp_path, _costs(tmp_path, {1: 12.0, 4: 13.0}, {1: 12.0, 4: 26.0}), "--warmup-steps", "40")
    tree, chain = cells[1], cells[4]  # c=1: the tree at the chain's cost; c=4: the tree at twice it
    assert tree["tree_share"] > 0.8 and tree["vs_best_mean"] > 0.93 and tree["vs_flat_mean"] > 1.1, tree
    assert chain["tree_share"] < 0.15 and chain["vs_best_mean"] > 0.93, chain
    assert chain["vs_flat_mean"] == pytest.approx(chain["vs_best_mean"])  # the chain is the better kind there


def test_a_cost_file_without_the_concurrency_names_the_option(bench, tmp_path):
    with pytest.raises(SystemExit, match=r"--concurrency 4: .* has no tree step cost at c=4"):
        _run(tmp_path, _costs(tmp_path, {1: 12.0, 4: 13.0}, {1: 12.0}))


def test_a_draining_batch_costs_steps_between_the_measured_concurrencies(bench, tmp_path):
    sim = importlib.import_module("sim_auto_budget")
    costs = {("tree", 1): 0.010, ("tree", 4): 0.016, ("tree", 16): 0.040}
    assert sim.cost_at(costs, "tree", 1) == 0.010 and sim.cost_at(costs, "tree", 2) == pytest.approx(0.012)
    assert sim.cost_at(costs, "tree", 10) == pytest.approx(0.028) and sim.cost_at(costs, "tree", 28) == pytest.approx(0.064)
    # requests leave as their tokens are committed: the policy, the chain and the tree over the same runs
    drain = ["--run-tokens", "48", "--runs", "2", "--host-drift", "1.4,20"]
    cells = _run(tmp_path, _costs(tmp_path, {1: 12.0, 4: 13.0}, {1: 12.0, 4: 13.0}), *drain)
    for c, cell in cells.items():  # the tree at the chain's cost: the tree, at nearly its rate
        assert cell["tree_share"] > 0.7 and cell["vs_best_mean"] > 0.85, cell
    # the tree at 2.5x the chain's cost: mostly the chain (the tree's share is exploring each bucket a
    # draining batch passes through, and probes); --no-pairs: the policy on its kinds' own costs alone
    longer = ["--run-tokens", "96", "--runs", "4", "--host-drift", "1.4,20"]
    for extra in ([], ["--no-pairs"]):
        cells = _run(tmp_path, _costs(tmp_path, {1: 12.0, 4: 13.0}, {1: 30.0, 4: 36.0}), *longer, *extra)
        assert all(cell["tree_share"] < 0.2 and cell["vs_flat_mean"] > 0.75 for cell in cells.values()), cells


def test_an_invalid_row_is_no_cost(bench, tmp_path):
    """A row summarize_e2e marked invalid (e.g. its engine never held the cell's requests at once)
    timed other work than its cell: its ms_per_step is left out, and a cell with no valid one is refused."""
    sim = importlib.import_module("sim_auto_budget")
    runs = [{"mode": "flat", "concurrency": 4, "ms_per_step": 13.0},
            {"mode": "ddtree32", "concurrency": 4, "ms_per_step": 20.0, "profile": "a"},
            {"mode": "ddtree32", "concurrency": 4, "ms_per_step": 9.0, "profile": "b", "invalid": "at most 3 of 4"}]
    assert sim.costs_from({"runs": runs}, 32) == {("chain", 4): 0.013, ("tree", 4): 0.020}
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"runs": runs[:1] + runs[2:]}))
    with pytest.raises(SystemExit, match=r"--concurrency 4: .* has no tree step cost at c=4"):
        sim.main(["--costs", str(path), "--profile-names", "sglang_plus22", "--concurrency", "4", "--steps", "10",
                  "--out", str(tmp_path / "sim.json")])


def test_async_lag_needs_the_policys_depth(bench, tmp_path):
    """--lag 2: each step reports the cycle of the step two before it, as vLLM's async loop does; the
    tree at twice the chain's cost at c = 4. With depth 1 (a step timed after one of its kind) the
    probes read the other kind's work and the tree keeps most steps; with depth 2 the chain wins."""
    costs = _costs(tmp_path, {1: 12.0, 4: 13.0}, {1: 12.0, 4: 26.0})
    one = _run(tmp_path, costs, "--warmup-steps", "40", "--lag", "2", "--depth", "1")[4]
    two = _run(tmp_path, costs, "--warmup-steps", "40", "--lag", "2", "--depth", "2")[4]
    assert two["tree_share"] < 0.15 and two["vs_best_mean"] > 0.9, two
    assert one["tree_share"] > 0.5 and one["vs_best_mean"] < two["vs_best_mean"], one
