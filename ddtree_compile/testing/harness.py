"""Test drafter harness: drafts derived from the target's own continuation, with controlled corruption.

A random drafter accepts almost nothing, so it cannot show that deep paths, sibling branches and
full blocks are verified and committed correctly. The harness replaces the drafter's logits (the
DFlash forward still runs, so its context bookkeeping is exercised) with per-position
distributions built from a reference continuation (the target's no-speculation output): at each
depth the true next token sits at a chosen rank, or is absent. Patterns, cycled per round:

  ("full",)            true token at rank 0 at every depth: the whole block is accepted
  ("zero",)            true token absent at depth 1: nothing accepted
  ("cut", d)           rank 0 before depth d, absent at d: accept d - 1
  ("sibling", d, k)    rank 0 except rank k at depth d, where ranks 0..k are near-ties, so the tree
                       holds those siblings and the path must leave the drafter's top-1 chain

Depths with rank 0 are sharp (the rank-0 token has almost all the mass), so the tree's spare
budget goes to the branch depth's siblings and their continuations.

It wraps `drafter.model.compute_logits` on a live in-process engine, so it serves DDTree and
vLLM's flat DFlash alike (e.g. to compare accepted counts with the same drafts).
"""

from __future__ import annotations

import collections
import zlib

import torch

from ddtree_compile.integration.drafter_logits import DrafterLogitsHook

DEFAULT_PATTERNS = (("full",), ("sibling", 2, 1), ("cut", 4), ("sibling", 1, 2), ("zero",), ("sibling", 3, 1))
SHARP, NEAR_TIE_STEP, LOW = 12.0, 0.05, -8.0


class DraftHarness(DrafterLogitsHook):
    label = "DraftHarness"
    install_hint = "; use harness.install_on_workers for tensor-parallel engines"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], patterns=DEFAULT_PATTERNS, seed: int = 0):
        """reference: prompt token ids -> prompt + reference continuation (the no-speculation output)."""
        if not reference:
            raise ValueError("reference must map at least one prompt to its continuation")
        for p in patterns:
            if not p or p[0] not in ("full", "zero", "cut", "sibling"):
                raise ValueError(f"pattern {p!r}: kind must be one of full, zero, cut, sibling")
        self.reference = {tuple(k): list(v) for k, v in reference.items()}
        self.patterns = tuple(patterns)
        self.seed = seed
        self.rounds: dict[str, int] = {}
        self.used: list[tuple] = []  # (req_id, round, pattern) per drafted row, for tests

    # -- logits ---------------------------------------------------------------------------------
    def _compute_logits(self, original, hidden_states):
        logits = original(hidden_states)
        view = self._view
        L = view.drafter_draft_len()
        R = logits.shape[0] // L
        req_ids = view.req_ids(R)
        out = self.draft_logits(req_ids, [tuple(view.prompt_token_ids(q)) for q in req_ids],
                                view.drafter_root_positions(R).tolist(), L, logits.shape[-1])  # test-only host sync
        return out.to(logits.dtype).to(logits.device)

    def draft_logits(self, req_ids, prompts, bonus_pos, L: int, V: int) -> torch.Tensor:
        """Drafter logits [R*L, V] (float32, CPU) of a batch: request ids, prompts (tuples) and each bonus
        token's position, read from the runner's view (either model runner)."""
        R = len(req_ids)
        out = torch.full((R, L, V), LOW, dtype=torch.float32)
        for r, (req_id, prompt) in enumerate(zip(req_ids, prompts)):
            ref = self.reference.get(prompt)
            n = self.rounds.get(req_id, 0)
            self.rounds[req_id] = n + 1
            pattern = self.patterns[(n + r) % len(self.patterns)]
            self.used.append((req_id, n, pattern))
            for d in range(1, L + 1):
                idx = bonus_pos[r] + d
                truth = ref[idx] if ref is not None and idx < len(ref) else None
                out[r, d - 1] = self._row(V, truth, _rank(pattern, d), pattern, d, prompt, self.rounds[req_id])
        return out.view(R * L, V)

    def _row(self, V, truth, rank, pattern, d, prompt, round_no) -> torch.Tensor:
        # Seeded by the prompt, never the request id: vLLM appends a random suffix to every request
        # id, and distractors drawn from it made two engines draft different tokens past the end of
        # the reference, where the target's own token can match one by chance (a flaky count).
        key = f"{self.seed}/{zlib.crc32(repr(prompt).encode())}/{d}/{round_no}".encode()
        g = torch.Generator().manual_seed(zlib.crc32(key))
        order = torch.randperm(V - 1, generator=g)  # distractors, never DFlash's mask id (V - 1)
        if truth is not None:
            order = order[order != truth]
        row = torch.full((V,), LOW)
        branch = pattern[0] == "sibling" and d == pattern[1]
        ranked = list(order[:8].tolist())
        if truth is not None and rank is not None:
            ranked.insert(rank, truth)
        for i, tok in enumerate(ranked):
            if branch and i <= pattern[2]:
                row[tok] = SHARP - NEAR_TIE_STEP * i  # near-ties: the tree keeps these siblings
            else:
                row[tok] = (SHARP if i == 0 and not branch else 0.0) - 0.5 * i
        return row


class GdnStateCheck:
    """Commit hook (round.commit_hooks, with round.debug_gdn_records on): the committed GDN state ==
    a float32 replay of the committed path from the pre-verify state, and the conv window == the
    last W-1 inputs along [history, path], where vLLM's chain leaves them (column n - 1 for a path of
    n tokens); with prefix caching also the state and window at the step's block boundary (column d).
    Raises AssertionError at the first mismatch."""

    def __init__(self):
        self.paths = self.sibling_paths = self.boundaries = 0
        self.max_err = 0.0

    def __call__(self, ctx, info):
        from ddtree_compile import adapters
        from ddtree_compile.templates import tree_gdn_ref

        step = info["step"]
        acc, n = step.walk.accepted.tolist(), step.walk.num_accepted.tolist()
        rec_kv, rec_gb = info["records"]
        lines = info["state_indices"]
        W = info["width"]
        snap = None if info.get("snap_depth") is None else info["snap_depth"].tolist()
        for li, name in enumerate(info["layers"]):
            gp = adapters.current().gdn_params(ctx.layer(name))
            H, K, HV, V = gp.num_k_heads, gp.head_k_dim, gp.num_v_heads, gp.head_v_dim
            for r in range(step.R):
                path = acc[r][: n[r]]
                last = len(path) - 1
                d = -1 if snap is None else int(snap[r])
                d = d if 0 <= d < last else -1
                h = step.debug_pre[name][r]
                states = []
                for s in path:
                    kv = rec_kv[li, r, s].float()
                    k = kv[: H * K].view(H, K).repeat_interleave(HV // H, 0)
                    h = tree_gdn_ref.gdn_update_ref(h, k, kv[H * K:].view(HV, V), rec_gb[li, r, s, 0], rec_gb[li, r, s, 1])
                    states.append(h)
                seq = list(range(W - 2)) + [W - 2 + s for s in path]
                line = info["conv"][li][int(lines[r, 0])]
                for depth in [last] + ([d] if d >= 0 else []):
                    self._check_state(info["ssm"][li][int(lines[r, depth])], states[depth], name, r, path, depth)
                    # Conv window: the last W-1 inputs along [history, path[:depth + 1]], at column depth.
                    want = info["before"]["conv_lines"][li][r][:, seq[: W - 1 + depth][-(W - 1):]]
                    assert torch.equal(line[:, depth:depth + W - 1], want), \
                        f"{name}: conv window of request {r} (path {path}) at depth {depth}"
                if li == 0:
                    self.paths += 1
                    self.sibling_paths += any(s != i for i, s in enumerate(path))
                    self.boundaries += d >= 0

    def _check_state(self, got, want, name, r, path, depth) -> None:
        # The cache stores the state in its dtype (bf16 on vLLM 0.26's CUDA default): compare with the
        # fp32 replay rounded the same way; allow 1 ulp of that dtype for the fp32 summation order of
        # another kernel (a wrong node or path is off by O(1)).
        tol = 1e-4 if got.dtype == torch.float32 else torch.finfo(got.dtype).eps
        err = (got.float() - want.to(got.dtype).float()).abs().max().item() / max(want.abs().max().item(), 1e-6)
        self.max_err = max(self.max_err, err)
        assert err <= tol, f"{name}: state of request {r} (path {path}) at depth {depth} is off by {err:.2e}"


class RotaryCheck:
    """Round hook (round.round_hooks): after each tree step the positions the target's M-RoPE modules
    got are the root's plus the node's depth, in all three rows (text prompts: M-RoPE delta 0)."""

    def __init__(self, runner):
        from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

        mods = [m for m in runner.model.modules() if isinstance(m, MRotaryEmbedding)]
        assert mods, "no M-RoPE module in the target"
        self.last, self.checked = None, 0
        for m in mods:
            m.register_forward_pre_hook(self.capture)

    def capture(self, module, args):
        self.last = args[0].detach().clone()

    def __call__(self, rnd, step):
        pos = self.last
        assert pos is not None and pos.dim() == 2 and pos.shape[0] == 3, pos
        got = pos[:, : step.R * step.N].view(3, step.R, step.N)
        want = step.start.unsqueeze(1) + step.tree.depths
        assert torch.equal(got, want.expand(3, -1, -1).to(got.dtype)), (got, want)
        self.checked += 1


def walk_inputs(state) -> collections.Counter:
    """Counts, from now on, the round's greedy walks by where their tree inputs were: "copied" (into
    the walk's graph), a bucket's fixed buffers of the build ("tree:8" ...: read in place), or
    "elsewhere"."""
    walks, build, graphs = collections.Counter(), state.build_stage, state.walk_stage.graphs
    bufs = {t.tokens.data_ptr(): f"tree:{t.tokens.shape[1] - 1}" for t in (build._trees, *build._buckets.values())}
    run = graphs.run

    def counted(fn, copied, fixed):
        walks["copied" if copied else bufs.get(fixed["tokens"].data_ptr(), "elsewhere")] += 1
        return run(fn, copied, fixed)

    graphs.run = counted
    return walks


# -- every worker of an engine (tensor parallel: one runner per rank, in its own process) ------------
# Each rank drafts the same rows from the same prompts and rounds, so every rank builds the same trees.

def install_on_workers(llm, reference, patterns=DEFAULT_PATTERNS, seed: int = 0) -> None:
    """A DraftHarness on the runner of every worker of `llm` (engines.on_runners)."""
    from ddtree_compile.integration.engines import on_runners

    on_runners(llm, _attach_harness, reference, tuple(patterns), seed)


def uninstall_on_workers(llm) -> None:
    from ddtree_compile.integration.engines import on_runners

    on_runners(llm, _detach_harness)


def install_state_check_on_workers(llm) -> None:
    """A GdnStateCheck on every worker's round (debug records on): each rank checks its own heads."""
    from ddtree_compile.integration.engines import on_runners

    on_runners(llm, _attach_state_check)


def state_checks(llm) -> list[dict]:
    """Per rank: {"paths", "sibling_paths", "max_err"} of its GdnStateCheck."""
    from ddtree_compile.integration.engines import on_runners

    return on_runners(llm, _state_check_result)


def force_auto_on_workers(llm, kinds: list) -> None:
    """Budget "auto": rank i's policy proposes kinds[i] every step (AutoBudget.forced; None: its own
    choice), so that a test can make the ranks' own choices differ."""
    from ddtree_compile.integration.engines import on_runners

    on_runners(llm, _force_auto, list(kinds))


def _force_auto(runner, kinds) -> None:
    from ddtree_compile import adapters
    from ddtree_compile.integration.engines import state_of

    state_of(runner).ctx.auto.forced = kinds[adapters.current().tp_rank()]


def _attach_harness(runner, reference, patterns, seed) -> None:
    runner._ddtree_harness = DraftHarness(reference, patterns, seed).attach(runner)


def _detach_harness(runner) -> None:
    h = runner.__dict__.pop("_ddtree_harness", None)
    if h is not None:
        h.uninstall()


def _attach_state_check(runner) -> None:
    from ddtree_compile.integration.engines import state_of

    state = state_of(runner)
    state.debug_gdn_records = True
    runner._ddtree_state_check = GdnStateCheck()
    state.commit_hooks.append(runner._ddtree_state_check)


def _state_check_result(runner) -> dict:
    c = runner._ddtree_state_check
    return {"paths": c.paths, "sibling_paths": c.sibling_paths, "boundaries": c.boundaries, "max_err": c.max_err}


def _rank(pattern, d: int) -> int | None:
    """Rank of the true token at depth d (None: absent from the drafter's top candidates)."""
    kind = pattern[0]
    if kind == "full":
        return 0
    if kind == "zero":
        return None if d == 1 else 0
    if kind == "cut":
        return 0 if d < pattern[1] else None
    return pattern[2] if d == pattern[1] else 0  # sibling


def reference_from_outputs(prompts: list[dict], outputs: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """Harness reference from TokensPrompt dicts and their no-speculation outputs."""
    return {tuple(p["prompt_token_ids"]): list(p["prompt_token_ids"]) + list(o) for p, o in zip(prompts, outputs)}
