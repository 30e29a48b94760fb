"""Tiny offline models: configs write and load, outputs vary, flat DFlash runs on them.

Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so op counters patched here see
the worker's calls) and eager (the compile path is covered by the pass tests). Each engine
fixture runs its generations, shuts the engine down and returns plain data.
"""

import json
import os

import pytest
import torch

from ddtree_compile.testing import e2e, models

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read by huggingface_hub at import time

NUM_PROMPTS, PROMPT_LEN, MAX_TOKENS, NUM_SPEC = 4, 16, 48, 4
GDN_OPS = (
    "fused_sigmoid_gating_delta_rule_update_cpu",  # plain decode
    "fused_sigmoid_gating_delta_rule_update_spec_cpu",  # speculative (multi-slot) decode
    "chunk_gated_delta_rule_cpu",  # prefill
)


# ---------------------------------------------------------------- no engine


@pytest.mark.parametrize(
    "kind,arch,layer_types",
    [
        ("qwen3", "Qwen3ForCausalLM", None),
        ("qwen3_next", "Qwen3NextForCausalLM", ["linear_attention"] * 3 + ["full_attention"]),
        ("qwen3_next_dense", "Qwen3NextForCausalLM", ["linear_attention"] * 3 + ["full_attention"]),
        ("qwen3_5", "Qwen3_5ForCausalLM", ["linear_attention"] * 3 + ["full_attention"]),
    ],
)
def test_write_tiny_model_config_and_weights(tmp_path, kind, arch, layer_types):
    from safetensors import safe_open
    from transformers import AutoConfig

    out = models.write_tiny_model(kind, tmp_path / kind, seed=3)
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.architectures == [arch]
    assert cfg.vocab_size == models.VOCAB and cfg.num_hidden_layers == 4
    if kind.startswith("qwen3_next"):  # the dense variant routes every token to its one expert
        assert (cfg.num_experts, cfg.num_experts_per_tok) == ((1, 1) if kind.endswith("dense") else (4, 2))
    if layer_types:
        assert cfg.layer_types == layer_types
        assert cfg.linear_key_head_dim in (64, 128)  # CPU GDN op limit
    with safe_open(out / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert "lm_head.weight" in tensors
    # Seeded: same seed, same bytes; other seed, other weights.
    again = models.write_tiny_model(kind, tmp_path / "again", seed=3)
    other = models.write_tiny_model(kind, tmp_path / "other", seed=4)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert (other / "model.safetensors").read_bytes() != (out / "model.safetensors").read_bytes()


def test_bad_kind_or_dtype_names_allowed_values(tmp_path):
    with pytest.raises(ValueError, match="kind.*qwen3, qwen3_next, qwen3_next_dense, qwen3_5"):
        models.write_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match="dtype.*bfloat16, float16, float32"):
        models.write_tiny_model("qwen3", tmp_path, dtype="int8")


def test_tiny_model_greedy_outputs_vary_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    out = models.write_tiny_model("qwen3", tmp_path / "q")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    prompt = models.token_prompts(1, PROMPT_LEN, models.VOCAB, 0)[0]["prompt_token_ids"]
    ids = torch.tensor([prompt])
    gen = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False
    )
    assert len(set(gen[0, PROMPT_LEN:].tolist())) >= 12


def test_dflash_drafter_layout(tmp_path):
    from safetensors import safe_open

    target = models.write_tiny_model("qwen3_next", tmp_path / "t")
    out = models.write_tiny_dflash_drafter(target, tmp_path / "d", seed=1)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["num_target_layers"] == 4 and cfg["block_size"] == 16
    dflash = cfg["dflash_config"]
    assert dflash["mask_token_id"] == models.VOCAB - 1
    assert dflash["target_layer_ids"] and all(0 <= i < 4 for i in dflash["target_layer_ids"])
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        fc = f.get_tensor("fc.weight")
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= keys
    assert not any(k.startswith(("embed_tokens", "lm_head", "model.")) for k in keys)
    n_features = len(dflash["target_layer_ids"])
    assert fc.shape == (cfg["hidden_size"], cfg["target_hidden_size"] * n_features)


def test_token_prompts_and_llm_kwargs():
    prompts = models.token_prompts(3, 7, 100, seed=5)
    assert prompts == models.token_prompts(3, 7, 100, seed=5)
    assert [len(p["prompt_token_ids"]) for p in prompts] == [7, 7, 7]
    assert all(0 <= t < 99 for p in prompts for t in p["prompt_token_ids"])
    kw = models.tiny_llm_kwargs("/x", max_model_len=256)
    assert kw["model"] == "/x" and kw["max_model_len"] == 256 and kw["skip_tokenizer_init"]
    assert kw["enable_prefix_caching"] is False and kw["kv_cache_memory_bytes"] > 0


# ---------------------------------------------------------------- engines


class _OpCounter:
    """Counts calls of vLLM's CPU GDN kernels (looked up at call time by gdn_attention.py)."""

    def __init__(self, monkeypatch):
        import vllm._custom_ops as ops

        self.counts = dict.fromkeys(GDN_OPS, 0)
        for name in GDN_OPS:
            fn = getattr(ops, name)

            def wrapped(*args, _fn=fn, _name=name, **kwargs):
                self.counts[_name] += 1
                return _fn(*args, **kwargs)

            monkeypatch.setattr(ops, name, wrapped)


def _generate(model_dir, drafter_dir=None, eager=True, logprobs=None):
    """Greedy outputs (with the top `logprobs` per position) and spec-decode counters of one engine,
    which is then shut down."""
    from vllm import SamplingParams

    kwargs = models.tiny_llm_kwargs(model_dir, enforce_eager=eager, disable_log_stats=False)
    if drafter_dir is not None:
        kwargs["speculative_config"] = {
            "method": "dflash",
            "model": str(drafter_dir),
            "num_speculative_tokens": NUM_SPEC,
        }
    with e2e.engine(**kwargs) as llm:
        prompts = models.token_prompts(NUM_PROMPTS, PROMPT_LEN, models.VOCAB, seed=0)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)
        done = llm.generate(prompts, params, use_tqdm=False)
        outs = [list(o.outputs[0].token_ids) for o in done]
        lps = ([[{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs] for o in done]
               if logprobs else None)
        metrics = {
            m.name: getattr(m, "value", None) for m in llm.get_metrics() if "spec_decode" in m.name
        }
    return {"outputs": outs, "logprobs": lps, "metrics": metrics}


@pytest.fixture(scope="module", autouse=True)
def _inprocess_engines():
    """Engine core in this process (fast start, patchable ops); undone after this module."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    qwen3 = models.write_tiny_model("qwen3", root / "qwen3")
    hybrid = models.write_tiny_model("qwen3_next", root / "qwen3_next")
    return {
        "qwen3": qwen3,
        "qwen3_dflash": models.write_tiny_dflash_drafter(qwen3, root / "qwen3_dflash"),
        "qwen3_next": hybrid,
        "qwen3_next_dflash": models.write_tiny_dflash_drafter(hybrid, root / "qwen3_next_dflash"),
    }


@pytest.fixture(scope="module")
def qwen3_plain(model_dirs):
    return _generate(model_dirs["qwen3"], logprobs=5)


@pytest.fixture(scope="module")
def qwen3_dflash(model_dirs):
    return _generate(model_dirs["qwen3"], model_dirs["qwen3_dflash"])


@pytest.fixture(scope="module")
def hybrid_dflash(model_dirs):
    mp = pytest.MonkeyPatch()
    counter = _OpCounter(mp)
    try:
        run = _generate(model_dirs["qwen3_next"], model_dirs["qwen3_next_dflash"])
    finally:
        mp.undo()
    return {**run, "gdn_calls": counter.counts}


def _assert_varied(outputs):
    assert len(outputs) == NUM_PROMPTS and all(len(o) == MAX_TOKENS for o in outputs)
    assert all(0 <= t < models.VOCAB for o in outputs for t in o)
    # Not one repeated token: each continuation uses many distinct tokens, prompts differ.
    assert min(len(set(o)) for o in outputs) >= MAX_TOKENS // 4, [len(set(o)) for o in outputs]
    assert len({tuple(o) for o in outputs}) == NUM_PROMPTS


def test_qwen3_greedy_outputs_vary(qwen3_plain):
    _assert_varied(qwen3_plain["outputs"])


def test_flat_dflash_matches_no_speculation_on_qwen3(qwen3_plain, qwen3_dflash):
    """Within the regret gate, not token for token: vLLM's verify runs other bf16 kernels than its
    decode (on a CPU with AMX, another KV layout too), and a near-tie can flip at the first token
    where they differ."""
    m = qwen3_dflash["metrics"]
    assert m["vllm:spec_decode_num_drafts"] > 0
    assert m["vllm:spec_decode_num_draft_tokens"] == NUM_SPEC * m["vllm:spec_decode_num_drafts"]
    reference = list(zip(qwen3_plain["outputs"], qwen3_plain["logprobs"]))
    e2e.check_gates(e2e.gates(reference, qwen3_dflash["outputs"]), "flat DFlash vs no speculation")


def test_flat_dflash_runs_gdn_spec_path_on_hybrid(hybrid_dflash):
    _assert_varied(hybrid_dflash["outputs"])
    assert hybrid_dflash["metrics"]["vllm:spec_decode_num_drafts"] > 0
    calls = hybrid_dflash["gdn_calls"]
    # 3 GDN layers: one prefill call each, then the multi-slot spec kernel for every verify.
    assert calls["chunk_gated_delta_rule_cpu"] >= 3
    min_verifies = MAX_TOKENS // (NUM_SPEC + 1)
    assert calls["fused_sigmoid_gating_delta_rule_update_spec_cpu"] >= 3 * min_verifies


# ---------------------------------------------------------------- slow: compiled engines


def _hybrid_dflash_compiled(tmp_path, kind):
    target = models.write_tiny_model(kind, tmp_path / kind)
    drafter = models.write_tiny_dflash_drafter(target, tmp_path / "dflash")
    mp = pytest.MonkeyPatch()
    counter = _OpCounter(mp)
    try:
        run = _generate(target, drafter, eager=False)
    finally:
        mp.undo()
    _assert_varied(run["outputs"])
    assert run["metrics"]["vllm:spec_decode_num_drafts"] > 0
    assert counter.counts["fused_sigmoid_gating_delta_rule_update_spec_cpu"] >= 3 * (
        MAX_TOKENS // (NUM_SPEC + 1)
    )


@pytest.mark.slow
def test_compiled_flat_dflash_matches_no_speculation_on_qwen3(model_dirs):
    plain = _generate(model_dirs["qwen3"], eager=False)
    spec = _generate(model_dirs["qwen3"], model_dirs["qwen3_dflash"], eager=False)
    _assert_varied(plain["outputs"])
    e2e.assert_same(spec["outputs"], plain["outputs"], "compiled flat DFlash vs no speculation")


@pytest.mark.slow
def test_compiled_flat_dflash_on_qwen3_next(tmp_path):
    _hybrid_dflash_compiled(tmp_path, "qwen3_next")


@pytest.mark.slow
def test_compiled_flat_dflash_on_qwen3_5(tmp_path):
    try:
        import torchvision  # noqa: F401  (vLLM's qwen3_5.py imports it through qwen3_vl)
    except Exception as exc:  # missing, or the CUDA wheel's fake-op registration failing
        pytest.fail(
            "vLLM serves text-only Qwen3.5 (Qwen3_5ForCausalLM) only with an importable "
            f"torchvision ({exc!r}); see docs/runner_hooks.md, 'Environment'."
        )
    _hybrid_dflash_compiled(tmp_path, "qwen3_5")
