"""GatedDeltaNet state slots per request sized by the drafter's chain (1 + L), not by vLLM's draft slots
(1 + K, K = the budget): issue 27 item 2, adapters/gdn_slots.py.

* Unit checks (no engine): which strategy asks for L spec blocks, the per-request GDN memory
  expressions against the measured Qwen3.5-4B numbers, and the two acceptance caps (vLLM's sampler
  held to the slots when DDTree is refused; the round's walk and tokens cut for chain rows).
* One tiny hybrid (Qwen3.5, bf16, float32 GDN state cache) DDTree engine with budget 16 > L = 8,
  "replay": the GDN groups of the engine's KV cache config, the scheduler's KV cache managers and the
  worker's block tables hold 1 + L slots per request, so the same memory serves more requests;
  "snapshots" keeps 1 + K (vLLM's own spec collection, re-run with the switch flipped); staggered
  requests (prefills joining trees: steps verified by vLLM's own GDN kernel on the padded state
  indices) and a logprobs request (chain rows) stay within the regret gate of no speculation, the
  tree path ran, and every commit passes the float32 state check.
* The same hybrid with DDTree refused at attach: vLLM's flat DFlash of K drafts runs on the 1 + L
  slots with its sampler held to L + 1 tokens per step, within the regret gate.
"""

import dataclasses
import logging

import pytest
import torch

from ddtree_compile import adapters
from ddtree_compile.adapters import gdn_state
from ddtree_compile.adapters.interface import EngineSettings
from ddtree_compile.core import buckets
from ddtree_compile.core.tree import WalkResult
from ddtree_compile.integration import config, engines, kv_layouts, metrics, plugin
from ddtree_compile.integration.round import checks
from ddtree_compile.integration.round.state import DDTreeRound
from ddtree_compile.testing import e2e, harness, models

BUDGET, DRAFT_LEN, TOP_K, MAX_TOKENS, TOL = 16, 8, 4, 64, 0.2
PROMPTS = models.token_prompts(4, 16, models.VOCAB, seed=2)


# ---------------------------------------------------------------- no engine


def _settings(K=16, block=9, hybrid=True):
    return EngineSettings(spec_method="dflash", num_speculative_tokens=K, draft_block_size=block, is_hybrid=hybrid)


def test_replay_asks_for_the_chains_slots_only():
    replay = config.DDTreeConfig(budget=16, top_k=4, draft_len=8)
    assert checks.gdn_spec_blocks(_settings(), replay) == 8
    assert checks.gdn_spec_blocks(_settings(), dataclasses.replace(replay, gdn_state="snapshots")) is None
    assert checks.gdn_spec_blocks(_settings(hybrid=False), replay) is None  # no GDN state at all
    flat = config.DDTreeConfig(budget=8, top_k=4, draft_len=8)
    assert checks.gdn_spec_blocks(_settings(K=8), flat) is None  # L == K: vLLM's slots already
    assert checks.gdn_spec_blocks(_settings(K=15), replay) is None  # refused by validate (K != budget)


def test_gdn_memory_per_request_expressions():
    """Qwen3.5-4B (24 GDN layers, conv 8192 channels of width 4, 32 value heads of 128 x 128, bf16):
    perf_h100_analysis.md 4.2 measured 0.48 / 1.20 / 3.12 GiB per request at K = 15 / 32 / 64. Replay
    keeps 1 + L slots, each still with a W - 1 + K column conv state."""
    GiB = 2**30
    per_request = {}
    for K in (15, 32, 64):
        slot = buckets.gdn_slot_bytes(24, 8192, 4, 32, 128, 128, K, 15)
        per_request[K] = [round(buckets.gdn_request_bytes(buckets.gdn_state_slots(s, K, 15), slot) / GiB, 2)
                          for s in ("snapshots", "replay")]
    assert per_request == {15: [0.48, 0.48], 32: [1.2, 0.58], 64: [3.12, 0.77]}
    assert buckets.draft_slots(22, 15) == 22 and buckets.draft_slots(4, 15) == 15
    with pytest.raises(ValueError, match="strategy"):
        buckets.gdn_state_slots("copy", 16, 8)


@dataclasses.dataclass
class _V2Output:  # Model Runner V2's sampler output: the counts are what it reads
    sampled_token_ids: torch.Tensor
    num_sampled: torch.Tensor
    num_rejected: torch.Tensor


def test_state_indices_padded_to_the_builders_columns_with_fresh_tensors():
    from ddtree_compile.adapters import gdn_slots

    idx = torch.arange(12, dtype=torch.int32).view(3, 4) + 1
    out = gdn_slots._pad(idx, 9, 0)
    assert out.shape == (3, 9) and out.dtype == torch.int32
    assert torch.equal(out, torch.nn.functional.pad(idx, (0, 5), value=0))
    again = gdn_slots._pad(idx[:2] + 100, 9, 0)  # a later build: the first result must not change
    assert torch.equal(out, torch.nn.functional.pad(idx, (0, 5), value=0))
    assert torch.equal(again[:, 4:], torch.zeros(2, 5, dtype=torch.int32)) and again.data_ptr() != out.data_ptr()
    big = gdn_slots._pad(torch.ones(300, 2, dtype=torch.int32), 4, 7)  # more rows than the cached block
    assert torch.equal(big[:, 2:], torch.full((300, 2), 7, dtype=torch.int32))


def test_limited_sampler_cuts_vllms_output_to_the_slots():
    ids = torch.tensor([[5, 6, 7, 8, 9, -1], [1, 2, -1, -1, -1, -1]])
    v1 = gdn_state.LimitedSampler(lambda *a: type("O", (), {"sampled_token_ids": ids.clone()})(), 3)
    assert v1().sampled_token_ids.tolist() == [[5, 6, 7, -1, -1, -1], [1, 2, -1, -1, -1, -1]]
    v2 = gdn_state.LimitedSampler(lambda *a: _V2Output(ids.clone(), torch.tensor([5, 2], dtype=torch.int32),
                                                       torch.tensor([0, 3], dtype=torch.int32)), 3)
    out = v2()
    assert out.num_sampled.tolist() == [3, 2] and out.num_rejected.tolist() == [2, 3]


def test_the_round_cuts_chain_paths_to_the_slots():
    """A chain row (slots 0..N-1 along a chain) that accepted 6 of 7 drafts, with 5 state slots: the
    commit and the drafter see a path of 5 (the 5th token becomes the bonus), a tree row is untouched."""
    N, P = 8, 5
    accepted = torch.tensor([[0, 1, 2, 3, 4, 5, 6, -1, -1], [0, 2, 5, -1, -1, -1, -1, -1, -1]])
    tokens = torch.tensor([[11, 12, 13, 14, 15, 16, 17, -1], [21, 22, 23, -1, -1, -1, -1, -1]])
    walk = WalkResult(accepted, torch.tensor([7, 3]), torch.tensor([17, 23]), tokens, None, torch.zeros(2))
    step = type("S", (), {"walk": walk, "N": N})()
    DDTreeRound._cap_walk(step, P)
    w = step.walk
    assert w.num_accepted.tolist() == [5, 3] and w.bonus.tolist() == [15, 23]
    assert w.accepted[0].tolist() == [0, 1, 2, 3, 4, -1, -1, -1, -1] and w.accepted[1].tolist() == accepted[1].tolist()
    assert w.tokens[0].tolist() == [11, 12, 13, 14, 15, -1, -1, -1]
    assert w.order.view(2, N)[0, :5].tolist() == [0, 1, 2, 3, 4]  # the drafter reads the cut path first


# ---------------------------------------------------------------- engines


@pytest.fixture(scope="module", autouse=True)
def _ddtree_plugin():
    plugin.register()


@pytest.fixture(autouse=True)
def _capture_ddtree_log(monkeypatch):
    monkeypatch.setattr(metrics.logger, "propagate", True)  # caplog listens on the root logger


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gdn_slots")
    target = models.write_tiny_model("qwen3_5", root / "target")
    return {"target": target, "drafter": models.write_tiny_dflash_drafter(target, root / "dflash")}


def _llm(dirs, ddtree=True, **kw):
    """An engine for a `with` block (DDTree's switch on unless `ddtree` is False)."""
    if ddtree:
        kw.update(config.vllm_kwargs(dirs["drafter"], budget=BUDGET, top_k=TOP_K, num_speculative_tokens=DRAFT_LEN))
    return e2e.engine(**models.tiny_llm_kwargs(dirs["target"], enforce_eager=True, max_model_len=1024,
                                               mamba_ssm_cache_dtype="float32", **kw))


@pytest.fixture(scope="module")
def reference(dirs):
    with _llm(dirs, ddtree=False) as llm:
        return e2e.generate_with_logprobs(llm, PROMPTS, MAX_TOKENS)


def _staggered(llm, logprobs_request=2):
    """Requests 0 and 1 start; 2 (with logprobs: a chain row) and 3 join while they decode, so their
    prefills share steps with trees. Token ids per request."""
    from vllm import SamplingParams

    eng, done = llm.llm_engine, {}

    def add(i):
        eng.add_request(f"r{i}", PROMPTS[i], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                            logprobs=1 if i == logprobs_request else None))

    add(0)
    add(1)
    steps = 0
    while len(done) < len(PROMPTS):
        if steps in (3, 6):
            add(2 if steps == 3 else 3)
        for o in eng.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
        steps += 1
    return [done[f"r{i}"] for i in range(len(PROMPTS))]


def _mamba_groups(kv_cache_config):
    from vllm.v1.kv_cache_interface import MambaSpec

    return [g for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]


def _concurrency(vllm_config, kv_cache_config, spec_blocks=None):
    """vLLM's own maximum concurrency of a KV cache config, optionally with the GDN groups given
    `spec_blocks` speculative slots (the same pool, the same pages)."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    if spec_blocks is not None:
        groups = [dataclasses.replace(g, kv_cache_spec=dataclasses.replace(g.kv_cache_spec,
                                                                           num_speculative_blocks=spec_blocks))
                  if g in _mamba_groups(kv_cache_config) else g for g in kv_cache_config.kv_cache_groups]
        kv_cache_config = dataclasses.replace(kv_cache_config, kv_cache_groups=groups)
    return get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config)


@pytest.fixture(scope="module")
def replay(dirs, reference):
    out = {}
    with _llm(dirs) as llm:
        runner = engines.find_runner(llm)
        K = runner.vllm_config.speculative_config.num_speculative_tokens
        kcc = runner.kv_cache_config
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        mamba_ids = [i for i, g in enumerate(kcc.kv_cache_groups) if g in _mamba_groups(kcc)]
        out["K"] = K
        out["worker_spec_blocks"] = {g.kv_cache_spec.num_speculative_blocks for g in _mamba_groups(kcc)}
        out["scheduler_spec_blocks"] = {managers[i].num_speculative_blocks for i in mamba_ids}
        out["block_table_width"] = {runner.input_batch.block_table[i].block_table.np.shape[1] for i in mamba_ids}
        out["concurrency"] = (_concurrency(runner.vllm_config, kcc), _concurrency(runner.vllm_config, kcc, K))
        layers = runner.compilation_config.static_forward_context
        out["conv_columns"] = {adapters.current().gdn_state_views(layers[n])[0].shape[-1]  # [lines, dim, columns]
                               for g in _mamba_groups(kcc) for n in g.layer_names}
        # vLLM's own spec collection (the worker's, which the engine core sizes by), switch flipped
        ddtree = runner.vllm_config.additional_config["ddtree"]
        for strategy in ("snapshots", "replay"):
            ddtree["gdn_state"] = strategy
            out[strategy] = {s.num_speculative_blocks for s in runner.get_kv_cache_spec().values()
                             if hasattr(s, "num_speculative_blocks")}
        # the blocks a running request holds, per GDN group, read after each tree step
        held = set()
        state = engines.find_state(llm)
        state.round_hooks.append(lambda rnd, step: held.update(
            int(runner.input_batch.block_table[i].num_blocks_per_row[r]) for i in mamba_ids for r in range(step.R)))
        state.debug_gdn_records = True
        check = harness.GdnStateCheck()
        state.commit_hooks.append(check)
        before = metrics.collect(llm)[0]
        out["staggered"] = _staggered(llm)
        out["counters"] = metrics.counters_delta(metrics.collect(llm)[0], before)
        out["fallbacks"] = metrics.collect(llm)[0]
        out["held"], out["check"] = held, check
    return out


def test_replay_engine_allots_the_chains_gdn_slots(replay):
    K = replay["K"]
    assert K == BUDGET > DRAFT_LEN
    assert replay["worker_spec_blocks"] == replay["scheduler_spec_blocks"] == {DRAFT_LEN}
    assert replay["block_table_width"] == replay["held"] == {1 + DRAFT_LEN}
    assert replay["conv_columns"] == {4 - 1 + K}  # the conv line still holds every tree node's input
    ours, vllms = replay["concurrency"]
    assert ours > vllms * 1.2, replay["concurrency"]  # the same pool holds more requests' GDN state
    assert replay["replay"] == {DRAFT_LEN} and replay["snapshots"] == {K}  # snapshots keep a slot per node


def test_replay_engine_output_within_the_gate_of_no_speculation(replay, reference):
    e2e.check_gates(e2e.gates(reference, replay["staggered"], TOL), "replay engine (staggered) vs no speculation")
    c, snap = replay["counters"], replay["fallbacks"]
    assert c["tree_steps"] > 20 and c["chain_steps"] > 0  # trees, and prefills joining them (vLLM's GDN kernel)
    assert any(k.startswith("mixed batch") for k in snap["fallback_steps"])
    assert snap["fallback_requests"].get("logprobs", 0) > 0  # the logprobs request ran as chain rows
    assert replay["check"].paths > 100


def test_refused_engine_keeps_flat_dflash_within_the_slots(dirs, reference, monkeypatch, caplog):
    monkeypatch.setattr(kv_layouts, "CPU_ISA_LAYOUTS", {})  # as on a CPU whose KV layout DDTree cannot read
    # (The logger's own level is INFO: its warnings after the start are captured either way.)
    with caplog.at_level(logging.WARNING, logger="ddtree_compile"), _llm(dirs) as llm:
        runner = engines.find_runner(llm)
        assert engines.find_state(llm) is None  # vLLM's flat DFlash
        assert {g.kv_cache_spec.num_speculative_blocks for g in _mamba_groups(runner.kv_cache_config)} == {DRAFT_LEN}
        assert isinstance(runner.rejection_sampler, gdn_state.LimitedSampler)
        outs = e2e.generate(llm, PROMPTS, MAX_TOKENS // 2)
    half = [(t[: MAX_TOKENS // 2], lp[: MAX_TOKENS // 2]) for t, lp in reference]
    e2e.check_gates(e2e.gates(half, outs, TOL), "refused engine (flat DFlash) vs no speculation")
    msgs = [r.getMessage() for r in caplog.records if "cannot run here" in r.getMessage()]
    assert len(msgs) == 1 and f"at most {DRAFT_LEN} drafts accepted per step" in msgs[0], msgs
