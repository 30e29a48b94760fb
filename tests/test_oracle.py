"""The benchmark's oracle drafter (testing/oracle.py): its profiles, its simulation through the real
tree build, its device-only logits, and what it makes a real engine accept (DDTree and vLLM's
flat DFlash), in float32 so the outputs must equal no speculation token for token."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddtree_compile.integration import config, metrics, plugin
from ddtree_compile.testing import e2e, models, oracle

L, TOP_K, BUDGET, MAX_TOKENS = 7, 4, 16, 64
PROMPTS = models.token_prompts(4, 16, models.VOCAB, seed=3)


def test_profile_validation_names_the_field():
    with pytest.raises(ValueError, match="rank_probs"):
        oracle.Profile("bad", (0.7, 0.5))
    with pytest.raises(ValueError, match=r"rank_probs\[0\]"):
        oracle.Profile("bad", (0.0, 0.5))
    p = oracle.Profile.geometric("g", 0.8, 0.5, decay=0.5, k=4)
    assert p.k == 4 and math.isclose(sum(p.rank_probs), 0.8 + 0.2 * 0.5)


def test_simulate_chain_matches_the_closed_form_and_trees_gain():
    p = oracle.Profile.geometric("g", 0.83, 0.7, k=8)
    chain = oracle.simulate(p, budget=15, top_k=1, draft_len=15, samples=20000, seed=1)
    assert abs(chain - p.chain_acceptance(15)) < 0.08, (chain, p.chain_acceptance(15))
    tree = oracle.simulate(p, budget=32, top_k=8, draft_len=15, samples=20000, seed=1)
    assert tree > chain + 0.3  # the tree holds the rank-1 siblings the chain misses
    perfect = oracle.Profile("perfect", (1.0,))
    assert oracle.simulate(perfect, budget=16, top_k=4, draft_len=7, samples=64) == 8.0
    never_in_list = oracle.Profile("top1-only", (0.5,))  # misses are absent: the tree cannot help
    assert oracle.simulate(never_in_list, 32, 8, 15, 20000) == pytest.approx(never_in_list.chain_acceptance(15), abs=0.05)


def test_the_low_acceptance_profile_is_calibrated_as_documented():
    """benchmarks/oracle_profiles.json's `thinking_2p5` (calibrate_oracle.py): its chain makes 2.5 tokens
    per round at 15 drafts, its misses sit in the list as port_plus4's do, and its gain is simulated
    (none given); `calibrate` takes exactly one of a gain and a list share."""
    import json
    import pathlib

    doc = json.loads((pathlib.Path(__file__).parents[1] / "benchmarks" / "oracle_profiles.json").read_text())
    by_name = {p["name"]: p for p in doc["profiles"]}
    low = by_name["thinking_2p5"]
    assert oracle.profile_from(low).chain_acceptance(low["draft_len"]) == pytest.approx(2.5, abs=1e-6)
    assert low["miss_in_list"] == by_name["port_plus4"]["miss_in_list"] and low["target_gain"] is None
    again = oracle.calibrate("x", 2.5, None, 32, samples=300, miss_in_list=low["miss_in_list"])
    assert again["p0"] == pytest.approx(low["p0"]) and again["rank_probs"] == pytest.approx(low["rank_probs"])
    for gain, miss in ((None, None), (1.2, 0.5)):
        with pytest.raises(ValueError, match="gain and miss_in_list"):
            oracle.calibrate("x", 2.5, gain, 32, samples=10, miss_in_list=miss)


class _SyncWatch(TorchDispatchMode):
    """Records ops that read a device value on the host (a host sync on CUDA)."""

    SYNCING = {"_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.SYNCING:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_draft_logits_place_the_truth_at_the_drawn_rank_without_host_reads():
    V, k = 64, 4
    ref = {(1, 2): [1, 2] + list(range(10, 40)), (3,): [3] + list(range(40, 50))}
    od = oracle.OracleDrafter(ref, oracle.Profile("p", (0.4, 0.3, 0.2, 0.05)), seed=5)
    state = od._device_state(torch.device("cpu"))
    table, cand = state[0], state[1]
    rows = torch.tensor([0, 1, -1])
    bonus = torch.tensor([5, 8, 0])  # row 1 runs past its reference at depth >= 3
    table_before = table.clone()
    with _SyncWatch() as w:
        out = od.draft_logits(state, rows, bonus, L, V)
    assert w.seen == [], w.seen
    assert torch.equal(table, table_before)
    top = out.topk(k, dim=-1)
    assert torch.allclose(top.values, cand.expand(3, L, k))  # the candidates carry the profile's log-probs
    assert (top.indices < V - 1).all()  # never DFlash's mask id
    assert all(len(set(row.tolist())) == k for row in top.indices.view(-1, k))  # distinct candidates
    for r, (row, b) in enumerate(zip(rows.tolist(), bonus.tolist())):
        for d in range(1, L + 1):
            seq = ref[list(ref)[row]] if row >= 0 else []
            truth = seq[b + d] if b + d < len(seq) else None
            if truth is not None:  # present once (at the drawn rank) or absent
                assert top.indices[r, d - 1].tolist().count(truth) <= 1
    # The drawn ranks follow the profile (many rows, one depth position each).
    n = 4000
    big = od.draft_logits(state, torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), 1, V)
    truth = table[0, 1]
    idx = big[:, 0].topk(k).indices
    ranks = torch.where(idx == truth, torch.arange(k), k).amin(1)
    freq = torch.bincount(ranks, minlength=k + 1).float() / n
    want = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05])
    assert (freq - want).abs().max() < 0.035, freq


class _View:
    """What the oracle reads of a runner: the step's requests, their prompts, the bonus positions."""

    def __init__(self, prompts, bonus):
        self.prompts, self.bonus = prompts, bonus

    def req_ids(self, R):
        return [str(i) for i in range(R)]

    def prompt_token_ids(self, req_id):
        return self.prompts[int(req_id)]

    def drafter_root_positions(self, R):
        return self.bonus[:R]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_oracles_top_k_lists_are_its_logits_top_k(dtype, temperature):
    """Where DDTree's drafter graph replays past the logits hook (Model Runner V2 on a GPU), the round
    takes the oracle's top-k lists as they are (BuildStage.hook_topk): the ids of `draft_topk` of the
    oracle's logits in the model's dtype, and their log-probs, without [R, L, V] logits."""
    from ddtree_compile.core.build import draft_topk
    from ddtree_compile.core.spec import TreeSpec

    V, k = 64, 4
    ref = {(1, 2): [1, 2] + list(range(10, 40)), (3,): [3] + list(range(40, 50)), (9, 9): [9, 9, 5]}
    profile = oracle.Profile("p", (0.3, 0.4, 0.1, 0.05, 0.08, 0.02))  # ranks not in log-prob order
    od = oracle.OracleDrafter(ref, profile, seed=5)
    od._view = _View([[1, 2], [3], [7], [9, 9]], torch.tensor([5, 8, 0, 1]))  # row 2: not in the reference
    R, cpu = 4, torch.device("cpu")
    got = od._draft_topk(R, L, k, temperature, V, dtype, cpu)
    od._dev = None  # (the same rank draws again)
    logits = od.draft_logits(od._device_state(cpu), od._rows_on(R, cpu), od._view.bonus, L, V).to(dtype)
    lp, ids = draft_topk(logits, TreeSpec(budget=16, top_k=k, temperature=temperature))
    assert torch.equal(got[1], ids)
    torch.testing.assert_close(got[0], lp, rtol=0, atol=1e-5)
    # lists the candidates alone cannot order: more slots than candidates, ties, an impossible rank
    assert od._draft_topk(R, L, 7, temperature, V, dtype, cpu) is None
    for probs in ((0.4, 0.2, 0.2, 0.1), (0.5, 0.3, 0.0, 0.1)):
        other = oracle.OracleDrafter(ref, oracle.Profile("p", probs), seed=5)
        other._view = od._view
        assert other._draft_topk(R, L, k, temperature, V, dtype, cpu) is None


@pytest.fixture(scope="module", autouse=True)
def _ddtree_plugin():
    plugin.register()


@pytest.fixture(scope="module")
def engines(tiny_fp32_reference):
    """No speculation (the reference), DDTree and vLLM's flat DFlash, float32, eager (conftest)."""
    return tiny_fp32_reference


def _run(llm, reference, profile):
    od = oracle.OracleDrafter(reference, profile, seed=1).install(llm)
    try:
        return e2e.generate(llm, PROMPTS, MAX_TOKENS)
    finally:
        od.uninstall()


@pytest.mark.parametrize("p0", [1.0, 0.75])
def test_ddtree_with_the_oracle_accepts_what_the_simulation_says(engines, p0):
    profile = oracle.Profile("perfect", (1.0,)) if p0 == 1.0 else oracle.Profile.geometric("g", p0, 0.8, k=TOP_K)
    with engines["llm"](**config.vllm_kwargs(engines["drafter"], budget=BUDGET, top_k=TOP_K,
                                             num_speculative_tokens=L)) as llm:
        out = _run(llm, engines["reference"], profile)
        c = metrics.collect(llm)[0]
    e2e.assert_same(out, engines["ref"], f"DDTree with the oracle (p0={p0})")  # float32: lossless token for token
    assert c["tree_steps"] > 0 and c["fallback_total"] == 0, c
    measured = 1 + c["nodes_accepted"] / c["tree_requests"]
    want = oracle.simulate(profile, BUDGET, TOP_K, L, samples=20000)
    print(f"\noracle p0={p0}: DDTree tokens/round {measured:.2f}, simulated {want:.2f}, {metrics.format_line(c)}")
    if p0 == 1.0:  # every round accepts the whole draft but the last ones of each request
        assert c["full_accepts"] >= 0.8 * c["tree_requests"], c
    assert abs(measured - want) < 0.2 * want, (measured, want)


def test_flat_dflash_with_the_oracle_accepts_the_chain(engines):
    profile = oracle.Profile.geometric("g", 0.75, 0.8, k=TOP_K)
    with engines["llm"](speculative_config={"method": "dflash", "model": str(engines["drafter"]),
                                            "num_speculative_tokens": L}) as llm:
        out = _run(llm, engines["reference"], profile)
        c = e2e.spec_counters(llm)
    e2e.assert_same(out, engines["ref"], "flat DFlash with the oracle")
    measured = 1 + c["vllm:spec_decode_num_accepted_tokens"] / c["vllm:spec_decode_num_drafts"]
    want = profile.chain_acceptance(L)
    print(f"\noracle p0=0.75: flat DFlash tokens/round {measured:.2f}, closed form {want:.2f}")
    assert abs(measured - want) < 0.2 * want, (measured, want)
