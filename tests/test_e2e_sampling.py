"""End to end, temperature > 0: lossless sample-and-walk, seeded and reproducible.

* Seeded: the same seeds give the same tokens on a repeat, and (the noise is keyed by seed and token
  position, siblings share it) across budgets and drafters: the tree shape never changes a sample.
* Statistical: on a 32-token vocabulary, the joint distribution of the generated tokens under DDTree
  matches vLLM's own sampling without speculation (two-sample chi-square homogeneity test), through
  tree steps and through whole-step chain fallbacks (prefills joining the batch), which DDTree also
  draws by seeded sample-and-walk. (vLLM 0.32's own flat DFlash fails this test on CPU: its C++
  random rejection kernel is not lossless for drafts without draft probabilities; p < 1e-80 here.)
Float32 engines (see test_e2e_attention.py).
"""

import math

import pytest
import torch

from ddtree_compile.integration import config, metrics, plugin
from ddtree_compile.testing import e2e, harness, models

DRAFT_LEN, TOP_K = 6, 4
PROMPTS = models.token_prompts(4, 16, models.VOCAB, seed=3)


@pytest.fixture(scope="module", autouse=True)
def _ddtree_plugin():
    plugin.register()


def _llm(target, **kw):
    """An engine for a `with` block: eager, float32."""
    return e2e.engine(**models.tiny_llm_kwargs(target, enforce_eager=True, dtype="float32", **kw))


def _sample(llm, prompts, max_tokens, seeds, temperature=1.0):
    from vllm import SamplingParams

    params = [SamplingParams(temperature=temperature, seed=s, max_tokens=max_tokens, ignore_eos=True) for s in seeds]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e_sampling")
    target = models.write_tiny_model("qwen3", root / "qwen3", seed=3)
    return {"target": target, "drafter": models.write_tiny_dflash_drafter(target, root / "dflash", seed=3)}


def test_seeded_sampling_is_reproducible_across_repeats_budgets_and_drafters(dirs):
    seeds, n = [11, 12, 13, 14], 64
    runs = {}
    for budget in (8, 22):
        with _llm(dirs["target"], **config.vllm_kwargs(dirs["drafter"], budget=budget, top_k=TOP_K,
                                                       num_speculative_tokens=DRAFT_LEN)) as llm:
            first = _sample(llm, PROMPTS, n, seeds)
            again = _sample(llm, PROMPTS, n, seeds)
            other = _sample(llm, PROMPTS, n, [s + 100 for s in seeds])
            h = harness.DraftHarness(harness.reference_from_outputs(PROMPTS, first)).install(llm)
            before = metrics.collect(llm)[0]
            with_harness = _sample(llm, PROMPTS, n, seeds)
            h.uninstall()
            c = e2e.counters_delta(metrics.collect(llm)[0], before)
        e2e.assert_same(again, first, f"budget {budget}: seeded repeat")
        e2e.assert_same(with_harness, first, f"budget {budget}: harness drafter vs random drafter")
        assert all(a != b for a, b in zip(first, other))
        assert c["tree_requests"] > 0 and c["max_accept_depth"] == DRAFT_LEN and c["fallback_total"] == 0
        runs[budget] = first
    e2e.assert_same(runs[22], runs[8], "seeded: budget 22 vs budget 8")
    assert min(len(set(o)) for o in runs[8]) > n // 4  # really sampled, not a repeated token


SMALL_VOCAB, N_SAMPLES, N_TOKENS = 32, 384, 4


def _write_small_vocab_model(out):
    """A tiny Qwen3 with a 32-token vocabulary (models.py's targets use 512)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(5)
    cfg = Qwen3Config(vocab_size=SMALL_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                      tie_word_embeddings=False, initializer_range=0.05, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    Qwen3ForCausalLM._from_config(cfg, dtype=torch.float32).to(torch.bfloat16).save_pretrained(out)
    return out


def _chi2_homogeneity(a: list[tuple], b: list[tuple]) -> tuple[float, int, float]:
    """Two-sample chi-square test on categorical samples: (statistic, dof, p-value)."""
    cats = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(c) for c in cats], dtype=torch.float64)
    cb = torch.tensor([b.count(c) for c in cats], dtype=torch.float64)
    # Pool sparse categories so every expected count is >= 5.
    tot = ca + cb
    order = tot.argsort(descending=True)
    ca, cb, tot = ca[order], cb[order], tot[order]
    keep = int((tot >= 10).sum())
    ca = torch.cat([ca[:keep], ca[keep:].sum().view(1)])
    cb = torch.cat([cb[:keep], cb[keep:].sum().view(1)])
    na, nb = ca.sum(), cb.sum()
    tot = ca + cb
    ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
    mask = tot > 0
    stat = float((((ca - ea) ** 2 / ea) + ((cb - eb) ** 2 / eb))[mask].sum())
    dof = int(mask.sum()) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                      torch.tensor(stat / 2.0, dtype=torch.float64)))
    return stat, dof, p


def test_small_vocab_distribution_matches_no_speculation(tmp_path):
    target = _write_small_vocab_model(tmp_path / "small")
    drafter = models.write_tiny_dflash_drafter(target, tmp_path / "small_dflash", seed=5)
    prompt = [{"prompt_token_ids": [3, 17, 8, 25, 1, 9, 30, 4]}]
    seeds = list(range(1000, 1000 + N_SAMPLES))
    big = dict(max_num_seqs=64, max_num_batched_tokens=2048)
    samples = {}
    for name, kw in (("plain", {}), ("ddtree", config.vllm_kwargs(drafter, budget=8, top_k=3,
                                                                    num_speculative_tokens=3))):
        with _llm(target, **big, **kw) as llm:
            samples[name] = [tuple(o) for o in _sample(llm, prompt * N_SAMPLES, N_TOKENS, seeds, temperature=1.5)]
            if name == "ddtree":
                c = metrics.collect(llm)[0]
                print("\nsmall-vocab DDTree counters:", metrics.format_line(c))
                assert c["tree_requests"] > N_SAMPLES // 2 and c["nodes_accepted"] > 0 and c["sibling_rounds"] > 0
                assert c["chain_steps"] > 0  # batches that mix prefills in: chain-shaped sample-and-walk
    # Per position and jointly (each tree round commits several tokens at once).
    for pos in range(N_TOKENS):
        a = [(s[pos],) for s in samples["plain"]]
        b = [(s[pos],) for s in samples["ddtree"]]
        stat, dof, p = _chi2_homogeneity(a, b)
        assert dof >= 3, "the distribution must not be degenerate"
        assert p > 1e-3, f"token {pos}: chi2 {stat:.1f} on {dof} dof, p = {p:.2e}"
    # Jointly: a fixed hash of tokens 1..3 into 12 buckets (each tree round commits several at once).
    joint = [[((s[1] * 7 + s[2] * 13 + s[3]) % 12,) for s in samples[k]] for k in ("plain", "ddtree")]
    stat, dof, p = _chi2_homogeneity(*joint)
    assert dof >= 8 and p > 1e-3, f"tokens 1-3 jointly: chi2 {stat:.1f} on {dof} dof, p = {p:.2e}"
    # And the sampling really is random (not a fixed sequence).
    assert len(set(samples["ddtree"])) > N_SAMPLES // 8 and math.isfinite(stat)
