"""End to end, the users' model class: a tiny multimodal Qwen3.5 (`Qwen3_5ForConditionalGeneration`:
vision tower, GatedDeltaNet + full attention, M-RoPE) with an all-full-attention DFlash drafter, on
vLLM's V1 runner, text prompts and image prompts, bfloat16.

Every Qwen3.5/3.6 checkpoint runs M-RoPE: positions [3, T], each draft token's three rows = flat
position + the request's delta, which is 0 for text and negative after an image (the image's tokens
span fewer position steps than tokens). A tree node's rotary position is its root's plus its depth in
every row (adapters: `tree_positions`). A wrong rotary position (flat without the delta, or the
chain's slot index instead of the depth) changes the logits of every deep node, so:

* the rotary positions the target's M-RoPE layers receive in every tree verify are, exactly, root +
  depth + the request's delta in all three rows (a hook on vLLM's MRotaryEmbedding), image requests
  (delta < 0) included;
* greedy DDTree vs no speculation is gated (regret gate at the first divergence; vLLM's own flat DFlash
  is the control where its verify already decides a bf16 near-tie otherwise) on text and on image
  prompts, with tree steps counted for each kind (the tree path ran, no silent flat fallback). Every
  engine keeps the GDN state cache in float32 (`mamba_ssm_cache_dtype`): with the bf16 default, no
  speculation rounds the state after every token and a verify after k tokens, which alone moves tie-
  heavy tiny-model outputs past the gate (vLLM's own flat DFlash included);
* with the drafter harness (deep accepts, rounds that end on sibling branches) the same gate holds and
  the committed GDN state equals a float32 replay of the committed path after every commit;
* seeded sampling is reproducible and independent of the batch a request shares.
"""

import numpy as np
import pytest
import torch

from ddtree_compile.integration import config, engines, metrics, plugin
from ddtree_compile.testing import e2e, harness, models

BUDGET, DRAFT_LEN, TOP_K, MAX_TOKENS, TOL = 16, 8, 4, 64, 0.2
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module", autouse=True)
def _ddtree_plugin():
    plugin.register()


def _image(seed, size=128):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype("uint8"))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mrope")
    target = models.write_tiny_vl_model(root / "target", seed=4)
    return {"target": target, "drafter": models.write_tiny_dflash_drafter(target, root / "dflash", seed=4)}


PROMPTS = {
    "text": models.token_prompts(2, 16, models.VOCAB - 8, seed=5),  # below the vision ids
    # 128x128 px: 8x8 patches, 2x2 merge -> 16 image tokens spanning 4 position steps: delta -12
    "image": [{"prompt": IMAGE + "what is this", "multi_modal_data": {"image": _image(0)}},
              {"prompt": "look " + IMAGE + "and say", "multi_modal_data": {"image": _image(1)}}],
}


def _llm(dirs, **kw):
    """An engine for a `with` block."""
    return e2e.engine(**models.tiny_llm_kwargs(dirs["target"], enforce_eager=True, skip_tokenizer_init=False,
                                               max_model_len=1024, limit_mm_per_prompt={"image": 1},
                                               mamba_ssm_cache_dtype="float32", **kw))


class RotaryCheck:
    """Captures the positions vLLM's M-RoPE module gets in each target forward; after each tree step's
    commit (a round hook) compares the last capture with root + depth + delta per node, all rows."""

    def __init__(self, runner):
        from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

        self.runner, self.last, self.checked, self.min_delta = runner, None, 0, 0
        mods = {id(m): m for m in runner.model.modules() if isinstance(m, MRotaryEmbedding)}
        assert mods, "the target has no M-RoPE module"
        self.handles = [m.register_forward_pre_hook(self._capture) for m in mods.values()]

    def _capture(self, module, args):
        self.last = args[0].detach().clone()

    def __call__(self, rnd, step):
        view, pos = rnd.ctx.view, self.last
        assert pos is not None and pos.dim() == 2 and pos.shape[0] == 3, pos
        deltas = torch.tensor([self.runner.requests[q].mrope_position_delta or 0 for q in view.req_ids(step.R)])
        want = (step.start.cpu() + deltas).unsqueeze(1) + step.tree.depths.cpu()
        got = pos[:, : step.R * step.N].view(3, step.R, step.N).cpu()
        assert torch.equal(got, want.expand(3, -1, -1).to(got.dtype)), (got, want)
        self.checked += 1
        self.min_delta = min(self.min_delta, int(deltas.min()))
        self.last = None


def _generate(llm, prompts, max_tokens, logprobs=None):
    """(prompt token ids as the runner saw them, generated ids, per-position {token: logprob} or None)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.prompt_token_ids), list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs] if logprobs else None)
            for o in outs]


@pytest.fixture(scope="module")
def reference(dirs):
    with _llm(dirs) as llm:
        return {kind: _generate(llm, p, MAX_TOKENS, logprobs=5) for kind, p in PROMPTS.items()}


@pytest.fixture(scope="module")
def control(dirs):
    """vLLM's own flat DFlash (the user's configuration, L = DRAFT_LEN) with its log-probs: the control
    where its verify kernels already leave no speculation at a bf16 near-tie."""
    with _llm(dirs, speculative_config={"method": "dflash", "model": str(dirs["drafter"]),
                                        "num_speculative_tokens": DRAFT_LEN}) as llm:
        return {kind: _generate(llm, p, MAX_TOKENS, logprobs=5) for kind, p in PROMPTS.items()}


@pytest.fixture(scope="module")
def runs(dirs, reference):
    """DDTree, per prompt kind: the random drafter, then the harness drafter with the GDN state check;
    the DDTree counters of each run."""
    kw = config.vllm_kwargs(dirs["drafter"], budget=BUDGET, top_k=TOP_K, num_speculative_tokens=DRAFT_LEN)
    out = {}
    with _llm(dirs, **kw) as llm:
        state = engines.find_state(llm)
        assert state is not None, dict(metrics.PROCESS_STARTUP_FALLBACKS)
        state.debug_gdn_records = True
        check = harness.GdnStateCheck()
        state.commit_hooks.append(check)
        rotary = RotaryCheck(engines.find_runner(llm))
        state.round_hooks.append(rotary)
        ref_ids = {tuple(p): p + t for kind in reference for p, t, _ in reference[kind]}
        for kind, prompts in PROMPTS.items():
            before = metrics.collect(llm)[0]
            random = _generate(llm, prompts, MAX_TOKENS)
            mid = metrics.collect(llm)[0]
            h = harness.DraftHarness(ref_ids).install(llm)
            try:
                guided = _generate(llm, prompts, MAX_TOKENS)
            finally:
                h.uninstall()
            out[kind] = {"random": random, "harness": guided, "random_counters": metrics.counters_delta(mid, before),
                         "harness_counters": metrics.counters_delta(metrics.collect(llm)[0], mid)}
        out["check"], out["rotary"] = check, rotary
        out["mrope"] = engines.find_runner(llm).uses_mrope
        # seeded sampling: reproducible, and a request's samples do not depend on its batch
        from vllm import SamplingParams

        prompts = PROMPTS["image"] + PROMPTS["text"]
        params = [SamplingParams(temperature=1.0, seed=20 + i, max_tokens=48, ignore_eos=True) for i in range(4)]
        before = metrics.collect(llm)[0]
        out["seeded"] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        out["seeded_alone"] = [list(llm.generate([p], [sp], use_tqdm=False)[0].outputs[0].token_ids)
                               for p, sp in zip(prompts, params)]
        out["seeded_counters"] = metrics.counters_delta(metrics.collect(llm)[0], before)
    return out


def test_engine_uses_mrope_and_ddtree_attached(runs):
    assert runs["mrope"] is True  # the multimodal class: positions [3, T] for every request


@pytest.mark.parametrize("kind", ["text", "image"])
@pytest.mark.parametrize("drafter", ["random", "harness"])
def test_greedy_matches_no_speculation(runs, reference, control, kind, drafter):
    """The regret gate against no speculation, with vLLM's flat DFlash as the control (a bf16 near-tie
    its own verify already decides otherwise, e.g. the AMX KV layout's kernels)."""
    gates = []
    for (p_ref, ref, lps), (_, ctl, ctl_lps), (p_got, got, _) in zip(reference[kind], control[kind],
                                                                     runs[kind][drafter]):
        e2e.assert_same([p_got], [p_ref], f"{kind} prompt ids")
        gates.append(e2e.controlled_gate((ref, lps), (ctl, ctl_lps), got, TOL))
    print(f"\n{kind}, {drafter} drafter vs no speculation / flat DFlash: " + "; ".join(
        f"{_said(g['reference'])} / {_said(g['control'])}" for g in gates))
    assert all(g["ok"] for g in gates), gates
    c = runs[kind][f"{drafter}_counters"]
    assert c["tree_steps"] > 10, c  # the tree path ran for this kind of prompt
    if drafter == "harness":  # deep paths and rounds that end on a sibling branch, under M-RoPE
        assert c["sibling_rounds"] > 0 and c["full_accepts"] > 0, c


def _said(gate) -> str:
    return "identical" if gate["divergence"] is None else f"diverges at {gate['divergence']} ({gate['regret']:.3f})"


def test_image_prompts_have_negative_mrope_delta(reference):
    # the image requests really exercise delta != 0: 16 image tokens in the prompt
    for p, _, _ in reference["image"]:
        assert sum(1 for t in p if t == models.VOCAB - 3) == 16


def test_committed_gdn_state_matches_float32_replay(runs):
    check = runs["check"]
    assert check.paths > 50 and check.sibling_paths > 5, (check.paths, check.sibling_paths)


def test_rotary_positions_of_every_tree_node(runs):
    rotary = runs["rotary"]
    assert rotary.checked > 100 and rotary.min_delta < 0  # every tree step checked, image requests among them


def test_seeded_sampling_reproducible_and_batch_independent(runs):
    e2e.assert_same(runs["seeded"], runs["seeded_alone"], "seeded: batch vs alone")
    assert len(set(map(tuple, runs["seeded"]))) == 4 and runs["seeded_counters"]["tree_steps"] > 10
