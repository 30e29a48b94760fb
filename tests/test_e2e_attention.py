"""End to end, attention-only tiny Qwen3: vLLM with the DDTree switch == vLLM without speculation.

Greedy, token for token, several prompts, batch 4 and batch 1, 200 generated tokens, budgets
{1, 8, 22, 40}, with the random drafter (accepts ~nothing: every round still verifies a full tree)
and with the harness drafter (deep accepts, sibling branches, full blocks, zero accepts, asserted
from the DDTree counters). Float32 engines: this test is about the tree algorithm, and bf16 logits
of the tiny model hold exact ties that any change in accumulation order flips (tests/test_e2e_hybrid.py
covers bf16 with the regret gate). Also: budget == draft length with top_k = 1 reproduces flat
DFlash's accepted counts exactly.
"""

import pytest
import torch

from ddtree_compile.integration import config, engines, metrics, plugin
from ddtree_compile.testing import e2e, harness, models

DRAFT_LEN, TOP_K, MAX_TOKENS = 7, 4, 200
BUDGETS = (1, 8, 22, 40)
PROMPTS = models.token_prompts(4, 16, models.VOCAB, seed=0)


@pytest.fixture(scope="module", autouse=True)
def _ddtree_plugin():
    plugin.register()  # what vLLM's entry point does once the package is installed


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e_attn")
    target = models.write_tiny_model("qwen3", root / "qwen3")
    return {"target": target, "drafter": models.write_tiny_dflash_drafter(target, root / "dflash")}


def _llm(dirs, **kw):
    """An engine for a `with` block: eager, float32."""
    return e2e.engine(**models.tiny_llm_kwargs(dirs["target"], enforce_eager=True, dtype="float32", **kw))


@pytest.fixture(scope="module")
def reference(dirs):
    with _llm(dirs) as llm:
        return {"b4": e2e.generate(llm, PROMPTS, MAX_TOKENS), "b1": e2e.generate(llm, PROMPTS[:1], MAX_TOKENS)}


def test_reference_outputs_vary(reference):
    outs = reference["b4"]
    assert all(len(o) == MAX_TOKENS for o in outs)
    assert min(len(set(o)) for o in outs) >= MAX_TOKENS // 4  # not one repeated token
    assert len({tuple(o) for o in outs}) == len(outs)


@pytest.fixture(scope="module", params=BUDGETS, ids=lambda b: f"budget{b}")
def budget_run(request, dirs, reference):
    """One DDTree engine per budget: random drafter, then the harness drafter, batch 4 and batch 1."""
    budget = request.param
    with _llm(dirs, **config.vllm_kwargs(dirs["drafter"], budget=budget, top_k=TOP_K,
                                         num_speculative_tokens=DRAFT_LEN)) as llm:
        out = {"budget": budget}
        out["random"] = {"b4": e2e.generate(llm, PROMPTS, MAX_TOKENS),
                         "b1": e2e.generate(llm, PROMPTS[:1], MAX_TOKENS)}
        out["staggered"] = _staggered(llm)
        out["random_counters"] = metrics.collect(llm)[0]
        ref = harness.reference_from_outputs(PROMPTS, reference["b4"])
        h = harness.DraftHarness(ref).install(llm)
        out["harness"] = {"b4": e2e.generate(llm, PROMPTS, MAX_TOKENS),
                          "b1": e2e.generate(llm, PROMPTS[:1], MAX_TOKENS)}
        h.uninstall()
        out["harness_counters"] = e2e.counters_delta(metrics.collect(llm)[0], out["random_counters"])
        for name in ("random_counters", "harness_counters"):
            c = out[name]
            print(f"\nbudget {budget}, {name.split('_')[0]} drafter: {metrics.format_line(c)}; "
                  f"accept depth histogram {c['accept_depth_histogram']}")
        return out


def _staggered(llm):
    """The requests finish one after another (max_tokens MAX_TOKENS - 45 i): the rows of a step's
    trees then differ from the rows they were proposed in, which the verify must gather by request.
    Returns the outputs and how many tree steps took their trees as proposed / gathered."""
    from vllm import SamplingParams

    verify = engines.find_state(llm).verify_stage
    make_step, seen = verify._make_step, {"as_proposed": 0, "gathered": 0}

    def counting(pending):
        R = verify.ctx.view.num_reqs()
        same = [pending.index[q] for q in verify.ctx.view.req_ids(R)] == list(range(len(pending.req_ids)))
        seen["as_proposed" if same else "gathered"] += 1
        return make_step(pending)

    verify._make_step = counting
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS - 45 * i, ignore_eos=True)
                  for i in range(len(PROMPTS))]
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        verify._make_step = make_step
    return outs, seen


def test_random_drafter_equals_no_speculation(budget_run, reference):
    for batch in ("b4", "b1"):
        e2e.assert_same(budget_run["random"][batch], reference[batch], f"budget {budget_run['budget']} random {batch}")
    c = budget_run["random_counters"]
    assert c["tree_steps"] > 0 and c["chain_steps"] == 0 and c["fallback_total"] == 0
    # Every round verified the whole budget (a tree never has padding slots).
    assert c["nodes_verified"] == c["tree_requests"] * budget_run["budget"]


def test_requests_finishing_at_different_steps_equal_no_speculation(budget_run, reference):
    outs, seen = budget_run["staggered"]
    e2e.assert_same(outs, [o[: MAX_TOKENS - 45 * i] for i, o in enumerate(reference["b4"])],  # greedy: prefixes
                    f"budget {budget_run['budget']}, staggered")
    assert seen["as_proposed"] > 0 and seen["gathered"] > 0, seen


def test_harness_drafter_equals_no_speculation(budget_run, reference):
    for batch in ("b4", "b1"):
        got = budget_run["harness"][batch]
        e2e.assert_same(got, reference[batch], f"budget {budget_run['budget']} harness {batch}")


def test_harness_drives_deep_sibling_full_and_zero_accepts(budget_run):
    c, budget = budget_run["harness_counters"], budget_run["budget"]
    depth_cap = min(budget, DRAFT_LEN)
    hist = c["accept_depth_histogram"]
    assert hist[0] > 0 and c["zero_accepts"] > 0  # zero accepts
    assert c["full_accepts"] > 0 and hist[depth_cap] > 0  # whole blocks
    if budget > DRAFT_LEN - 2:
        assert max(d for d, n in enumerate(hist) if n) > 5  # deep accepts
    if budget > DRAFT_LEN:  # spare budget beyond the top-1 chain holds siblings
        assert c["sibling_rounds"] > 0 and c["sibling_nodes"] > 0
    else:
        assert c["sibling_rounds"] == 0  # chain-seeded tree == the chain


def _checking_reorder(commit, seen):
    """Wraps the round's drafter-input reorder: after it, each request's rows must hold the accepted
    path's verify rows first (in depth order), then its other rows in slot order (ids and aux)."""
    original = commit.reorder_drafter_inputs

    def checking(step, aux_hidden_states):
        T = step.R * step.N
        before = [commit.ctx.view.input_ids()[:T].clone()] + [h[:T].clone() for h in aux_hidden_states or ()]
        original(step, aux_hidden_states)
        after = [commit.ctx.view.input_ids()[:T]] + list(aux_hidden_states or ())
        for r in range(step.R):
            path = step.walk.accepted[r, : int(step.walk.num_accepted[r])].tolist()
            order = [r * step.N + j for j in path + [j for j in range(step.N) if j not in path]]
            for b, a in zip(before, after):
                assert torch.equal(a[r * step.N:(r + 1) * step.N], b[order]), (r, path)
            seen["rows"] += 1
            seen["moved"] += path != list(range(len(path)))  # a sibling path: the rows really moved
        seen["aux"] = len(after) - 1

    commit.reorder_drafter_inputs = checking


def test_round_with_the_triton_walk_equals_no_speculation(dirs, reference, monkeypatch):
    """The walk as CUDA runs it (templates/tree_walk.py, interpreted here) inside the real round:
    every tree step's walk is the kernel's, and the outputs equal no speculation. The same run checks
    the drafter-input reorder that follows each walk, whose order the kernel computed (the drafter's
    context must be the path), and the kernel's off-chain counts are what the metrics' sibling
    rounds come from."""
    from ddtree_compile.core import walk
    from ddtree_compile.integration.round import walk_stage

    calls = []

    def triton_walk(tree, target, top1=None):
        assert top1 is not None  # the round asks for the off-chain count
        calls.append(tree.num_requests)
        return walk.walk_tree(tree, target, impl="triton", top1=top1)

    monkeypatch.setattr(walk_stage, "walk_tree", triton_walk)
    seen = {"rows": 0, "moved": 0}
    with _llm(dirs, **config.vllm_kwargs(dirs["drafter"], budget=22, top_k=TOP_K,
                                         num_speculative_tokens=DRAFT_LEN)) as llm:
        _checking_reorder(engines.find_state(llm).commit_stage, seen)
        h = harness.DraftHarness(harness.reference_from_outputs(PROMPTS, reference["b4"])).install(llm)
        e2e.assert_same(e2e.generate(llm, PROMPTS, MAX_TOKENS), reference["b4"], "triton walk")
        h.uninstall()
        c = metrics.collect(llm)[0]
    assert c["tree_steps"] > 0 and len(calls) == c["tree_steps"] and c["sibling_rounds"] > 0, (len(calls), c)
    assert seen["rows"] == c["tree_requests"] and seen["moved"] > 0 and seen["aux"] > 0, seen


def test_flat_dflash_parity_with_budget_equal_draft_len_top_k_1(dirs, reference):
    """budget == num_speculative_tokens, top_k = 1: vLLM's own accepted counts, round for round."""
    counters = {}
    for name, kw in (("flat", {"speculative_config": {"method": "dflash", "model": str(dirs["drafter"]),
                                                       "num_speculative_tokens": DRAFT_LEN}}),
                     ("ddtree", config.vllm_kwargs(dirs["drafter"], budget=DRAFT_LEN, top_k=1,
                                                   num_speculative_tokens=DRAFT_LEN))):
        with _llm(dirs, disable_log_stats=False, **kw) as llm:
            random_out = e2e.generate(llm, PROMPTS, MAX_TOKENS)
            random_counts = e2e.spec_counters(llm)
            h = harness.DraftHarness(harness.reference_from_outputs(PROMPTS, reference["b4"])).install(llm)
            harness_out = e2e.generate(llm, PROMPTS, MAX_TOKENS)
            h.uninstall()
            counters[name] = (random_counts, e2e.spec_counters(llm))
            e2e.assert_same(random_out, reference["b4"], f"{name}, random drafter")
            e2e.assert_same(harness_out, reference["b4"], f"{name}, harness drafter")
            if name == "ddtree":
                assert metrics.collect(llm)[0]["tree_steps"] > 0
    print(f"\nflat DFlash vs DDTree(budget={DRAFT_LEN}, top_k=1), random then +harness: {counters}")
    assert counters["ddtree"] == counters["flat"]
    harness_counts = counters["flat"][1]
    assert harness_counts["vllm:spec_decode_num_accepted_tokens"] > counters["flat"][0][
        "vllm:spec_decode_num_accepted_tokens"] + 100  # the harness rounds really accepted drafts
