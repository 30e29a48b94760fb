"""Oracle drafter for benchmarks: drafts built on the device from each request's known continuation.

No trained DFlash drafter is reachable offline, so the end-to-end benchmark gets its acceptance
from an oracle. It knows each request's reference continuation (the target's own output without
speculation, computed beforehand) and, at every draft depth d, puts the true next token at rank r
of a k-long candidate list, r drawn from a `Profile` (P(rank 0), P(rank 1), ...; the rest: the
true token is absent). The logits it returns are the log of those same probabilities at ranks
0..k-1 (a calibrated drafter), so DDTree's best-first build sees the odds the oracle draws from.

Unlike testing/harness.py (tests; host-side Python per row), every per-round operation here is a
device op on [R, L] tensors (table gather, rank draw, scatter): no device-to-host copy, so the
round's timings stay real. Host work per round: the request -> table row list and one small
host-to-device copy of it. It wraps the DFlash drafter's `compute_logits` (the drafter's forward
still runs and costs what it costs), so it serves DDTree and vLLM's flat DFlash alike; where flat
DFlash samples its drafts inside the drafter's CUDA graph (Model Runner V2), its drafts are rewritten
after each proposal with the same draws' top-1 (`_flat_drafts`).

`simulate(profile, budget, top_k, draft_len)` gives the acceptance the same profile yields through
the real tree build (core.build_tree) without an engine: the benchmark calibrates its profiles
with it and reports both the simulated and the measured acceptance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ddtree_compile.core.build import build_tree
from ddtree_compile.core.spec import TreeSpec
from ddtree_compile.integration.drafter_logits import DrafterLogitsHook

LOW = -30.0  # logit of tokens outside the candidate list (softmax mass ~ e^-30 each)


@dataclass(frozen=True)
class Profile:
    """rank_probs[r]: probability that the true token is the drafter's rank-r candidate, at every
    depth, independently (1 - sum: absent). The candidate list has len(rank_probs) entries."""

    name: str
    rank_probs: tuple[float, ...]

    def __post_init__(self) -> None:
        p = self.rank_probs
        if not p or any(not (0.0 <= x <= 1.0) or not math.isfinite(x) for x in p) or sum(p) > 1.0 + 1e-9:
            raise ValueError(f"Profile.rank_probs must be probabilities in [0, 1] summing to <= 1, got {p!r}")
        if p[0] <= 0.0:
            raise ValueError("Profile.rank_probs[0] must be > 0 (the drafter's top-1 is sometimes right)")

    @classmethod
    def geometric(cls, name: str, p0: float, miss_in_list: float, decay: float = 0.5, k: int = 8) -> "Profile":
        """Rank 0 with p0; of the misses, a fraction `miss_in_list` sits at ranks 1..k-1 with
        geometric weights decay^(r-1); the rest is absent."""
        w = [decay ** (r - 1) for r in range(1, k)]
        s = sum(w)
        return cls(name, (p0,) + tuple((1.0 - p0) * miss_in_list * x / s for x in w))

    @property
    def k(self) -> int:
        return len(self.rank_probs)

    def chain_acceptance(self, draft_len: int) -> float:
        """Expected tokens per round of the plain chain (flat DFlash): 1 (bonus) + sum_d p0^d."""
        p0 = self.rank_probs[0]
        return 1.0 + sum(p0 ** d for d in range(1, draft_len + 1))

    def logits_row(self) -> torch.Tensor:
        """The candidates' logits (log-probabilities of ranks 0..k-1; zero-probability ranks LOW)."""
        return torch.tensor([math.log(p) if p > 0 else LOW for p in self.rank_probs], dtype=torch.float32)


def _cdf(profile: Profile) -> torch.Tensor:
    return torch.tensor(profile.rank_probs, dtype=torch.float64).cumsum(0).to(torch.float32)


def _draw_ranks(cdf: torch.Tensor, shape, generator) -> torch.Tensor:
    """Ranks in [0, k] (k: absent) drawn independently per element, on cdf's device."""
    u = torch.rand(shape, generator=generator, device=cdf.device)
    return torch.searchsorted(cdf, u, right=True)


def simulate(profile: Profile, budget: int, top_k: int, draft_len: int, samples: int = 4096,
             seed: int = 0) -> float:
    """Expected tokens per round (accepted depth + 1 bonus) of DDTree with this profile."""
    accepted, _ = simulate_rows(profile, budget, top_k, draft_len, samples, seed)
    return 1.0 + accepted.float().mean().item()


def simulate_rows(profile: Profile, budget: int, top_k: int, draft_len: int, samples: int = 4096,
                  seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sampled request-round: the nodes DDTree's walk accepts, and those the drafter's top-1
    chain (flat DFlash) accepts, through core.build_tree: candidates are tokens 0..k-1 by rank, the
    truth at depth d is the drawn rank (k: absent), and a node is accepted when its whole path is
    the truth. The chain is in every tree (chain seeded), so the first is never below the second."""
    g = torch.Generator().manual_seed(seed)
    truth = _draw_ranks(_cdf(profile), (samples, draft_len), g)  # [S, L]
    k = min(profile.k, top_k)
    lp = profile.logits_row()[:k].expand(samples, draft_len, k).contiguous()
    lp = lp - torch.logsumexp(profile.logits_row(), 0)  # log-probs over the whole list
    ids = torch.arange(k).expand(samples, draft_len, k).contiguous()
    tree = build_tree((lp, ids), TreeSpec(budget=budget, top_k=top_k), impl="torch")
    ok = torch.zeros_like(tree.tokens, dtype=torch.bool)
    ok[:, 0] = True
    depth_truth = torch.cat([torch.full((samples, 1), -1), truth], 1)  # index by node depth
    for i in range(1, tree.num_slots):  # parents come before children
        par = tree.parents[:, i].clamp(min=0)
        d = tree.depths[:, i]
        hit = tree.tokens[:, i] == depth_truth.gather(1, d.unsqueeze(1)).squeeze(1)
        ok[:, i] = ok.gather(1, par.unsqueeze(1)).squeeze(1) & hit & (i <= tree.num_nodes)
    chain = (truth == 0).to(torch.int64).cumprod(1).sum(1)  # the top-1 prefix that is the truth
    return torch.where(ok, tree.depths, 0).amax(1), chain


class OracleDrafter(DrafterLogitsHook):
    """Replaces a live engine's DFlash drafter logits with oracle drafts (module docstring)."""

    label = "oracle drafter"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], profile: Profile, seed: int = 0):
        """reference: prompt token ids -> prompt + reference continuation."""
        if not reference:
            raise ValueError("reference must map at least one prompt to its continuation")
        self.profile = profile
        self.seed = seed
        self._prompts = {tuple(p): i for i, p in enumerate(reference)}
        width = max(len(v) for v in reference.values())
        self._table_host = torch.full((len(reference), width), -1, dtype=torch.int64)
        for i, seq in enumerate(reference.values()):
            self._table_host[i, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
        self._row_of: dict[str, int] = {}  # req_id -> table row (-1: not in the reference)
        self._dev = None

    def _device_state(self, device):
        """(reference table, candidate logits, rank cdf, generator) on `device`, made once: a
        blocking host-to-device copy per round would be a host sync."""
        if self._dev is None or self._dev[0].device != device:
            g = torch.Generator(device=device).manual_seed(self.seed)
            self._dev = (self._table_host.to(device), self.profile.logits_row().to(device),
                         _cdf(self.profile).to(device), g)
        return self._dev

    def _rows(self, R: int) -> list[int]:
        view, out = self._view, []
        for req_id in view.req_ids(R):
            row = self._row_of.get(req_id)
            if row is None:
                row = self._row_of[req_id] = self._prompts.get(tuple(view.prompt_token_ids(req_id)), -1)
            out.append(row)
        return out

    def _compute_logits(self, original, hidden_states):
        logits = original(hidden_states)
        L = self._view.drafter_draft_len()
        R, V = logits.shape[0] // L, logits.shape[-1]
        state = self._device_state(logits.device)
        return self.draft_logits(state, self._rows_on(R, logits.device), self._view.drafter_root_positions(R), L, V
                                 ).view(R * L, V).to(logits.dtype)

    def _flat_drafts(self, drafts: torch.Tensor) -> None:
        """vLLM's flat DFlash on Model Runner V2 (drafts sampled inside its drafter's CUDA graph): the
        drafts become the oracle logits' top-1, the rank-0 candidate, drawn as for DDTree; no [R, L, V]
        logits are made, so flat DFlash pays no oracle cost beyond a few [R, L, k] ops."""
        R, L = drafts.shape
        V = self._view.runner.vllm_config.model_config.get_vocab_size()
        state = self._device_state(drafts.device)
        drafts.copy_(self.candidates(state, self._rows_on(R, drafts.device), self._view.drafter_root_positions(R),
                                     L, V)[..., 0].to(drafts.dtype))

    def _draft_topk(self, R: int, L: int, k: int, temperature: float, V: int, dtype, device):
        """DDTree on Model Runner V2 (its drafter's graph replays past `_compute_logits`): the top-k
        lists `topk_of` would take of `draft_logits` in `dtype`, made from the candidates alone, as
        `_flat_drafts` makes flat DFlash's drafts: no [R, L, V] logits after the graph, which the
        product's round does not make either. None (the logits then) where a rank outside the
        candidates or a tie between them would need the full vocabulary to order."""
        key = (k, temperature, V, dtype, device)
        if getattr(self, "_topk_key", None) != key:  # (made once: a copy to the device per round would sync)
            low = torch.tensor(LOW).to(dtype).float() / temperature
            vals = self.profile.logits_row().to(dtype).float() / temperature
            kk = vals.shape[0]
            self._topk_key, self._topk_const = key, None
            if k <= kk and len(set(vals.tolist())) == kk and bool((vals > low).all()):
                order = torch.sort(vals, descending=True, stable=True).indices[:k]
                lse = torch.logsumexp(torch.cat([vals, (low + math.log(V - kk)).view(1)]), 0)
                self._topk_const = (order.to(device), (vals[order] - lse).to(device))
        if self._topk_const is None:
            return None
        order, lp = self._topk_const
        state = self._device_state(device)
        cand = self.candidates(state, self._rows_on(R, device), self._view.drafter_root_positions(R), L, V)
        return lp.expand(R, L, k), cand[..., order]

    def _rows_on(self, R: int, device) -> torch.Tensor:
        rows = torch.tensor(self._rows(R), dtype=torch.int64)
        if device.type == "cuda":  # pinned + non_blocking: an async copy, the host does not wait for the GPU
            rows = rows.pin_memory()
        return rows.to(device, non_blocking=True)

    def draft_logits(self, state, rows, bonus_pos, L: int, V: int) -> torch.Tensor:
        """[R, L, V] oracle logits on the device of `state` (`_device_state`); no host sync (tests
        check that no op reads a device value on the host)."""
        cand = self.candidates(state, rows, bonus_pos, L, V)
        R, k = rows.shape[0], self.profile.k
        out = torch.full((R, L, V), LOW, dtype=torch.float32, device=cand.device)
        out.scatter_(2, cand, state[1].expand(R, L, k))
        return out

    def candidates(self, state, rows, bonus_pos, L: int, V: int) -> torch.Tensor:
        """[R, L, k] the candidate tokens by rank at each depth (the truth at its drawn rank)."""
        table, _, cdf, gen = state
        dev, k = table.device, self.profile.k
        R = rows.shape[0]
        depth = torch.arange(1, L + 1, device=dev)
        pos = bonus_pos.to(torch.int64).unsqueeze(1) + depth  # [R, L] index of the true next token
        truth, known = self._truth(table, rows, pos)
        rank = _draw_ranks(cdf, (R, L), gen)
        rank = torch.where(known, rank, k)  # past the reference: every candidate is a distractor
        # k distinct distractors != truth, none the DFlash mask id (V - 1): truth + 1 + h + j (mod V - 1)
        # with 0 <= h < V - k - 1, so the offsets 1 + h + j stay in [1, V - 2].
        h = (rows.unsqueeze(1) * 1000003 + pos * 7919 + self.seed) % max(V - k - 1, 1)
        base = truth.clamp(min=0) + 1 + h
        cand = (base.unsqueeze(-1) + torch.arange(k, device=dev)) % (V - 1)  # [R, L, k]
        slot = torch.arange(k, device=dev)
        return torch.where(slot == rank.unsqueeze(-1), truth.clamp(min=0).unsqueeze(-1), cand)

    def _truth(self, table, rows, pos) -> tuple[torch.Tensor, torch.Tensor]:
        """(the true token at each position [R, L], whether it is known): the request's reference row."""
        known = (rows >= 0).unsqueeze(1) & (pos < table.shape[1])
        truth = table[rows.clamp(min=0).unsqueeze(1), pos.clamp(max=table.shape[1] - 1)]
        return truth, known & (truth >= 0)


class PromptRepeatOracle(OracleDrafter):
    """The oracle of a target whose greedy continuation repeats the prompt's last token (the benchmarks'
    sharpened dummy weights, benchmarks/_e2e_engine.sharpen): the truth of every request follows from its
    prompt, so no reference is computed beforehand and any prompt works (`vllm serve` under `vllm bench
    serve`'s random prompts, benchmarks/bench_serve.py). A request's table row is its last prompt token."""

    label = "prompt-repeat oracle"

    def __init__(self, profile: Profile, seed: int = 0):
        super().__init__({(): [-1]}, profile, seed)

    def _rows(self, R: int) -> list[int]:
        view, out = self._view, []
        if len(self._row_of) > 4096:  # a server's requests come and go: keep the live ones
            live = view.live_req_ids()
            self._row_of = {q: r for q, r in self._row_of.items() if q in live}
        for req_id in view.req_ids(R):
            row = self._row_of.get(req_id)
            if row is None:
                prompt = view.prompt_token_ids(req_id)
                row = self._row_of[req_id] = int(prompt[-1]) if len(prompt) else -1
            out.append(row)
        return out

    def _truth(self, table, rows, pos) -> tuple[torch.Tensor, torch.Tensor]:
        rows = rows.unsqueeze(1).expand_as(pos)
        return rows, rows >= 0


# -- calibration to published acceptance numbers --------------------------------------------------

def p0_for_chain(tokens_per_round: float, draft_len: int) -> float:
    """The rank-0 probability whose plain chain of `draft_len` drafts yields `tokens_per_round`."""
    lo, hi = 0.0, 1.0
    if not 1.0 < tokens_per_round < draft_len + 1:
        raise ValueError(f"tokens_per_round must be in (1, {draft_len + 1}), got {tokens_per_round}")
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if Profile("p", (mid,)).chain_acceptance(draft_len) < tokens_per_round else (lo, mid)
    return (lo + hi) / 2


def calibrate(name: str, chain_tokens: float, gain: float | None, budget: int, top_k: int = 8, draft_len: int = 15,
              decay: float = 0.25, samples: int = 4000, seed: int = 0, miss_in_list: float | None = None) -> dict:
    """A geometric Profile whose chain yields `chain_tokens` per round and whose DDTree tree at
    `budget` yields `gain` times that (bisection on the share of misses held at ranks >= 1), or, with
    `gain` None, whose share of misses in the list is `miss_in_list` (its gain simulated).
    Returns its parameters and the simulated numbers; `reached` False when even every miss in the
    list cannot give the gain (the closest profile is returned)."""
    if (gain is None) == (miss_in_list is None):
        raise ValueError("calibrate: give exactly one of gain and miss_in_list")
    p0 = p0_for_chain(chain_tokens, draft_len)

    def ratio(miss):
        prof = Profile.geometric(name, p0, miss, decay, top_k)
        return simulate(prof, budget, top_k, draft_len, samples, seed) / prof.chain_acceptance(draft_len)

    lo, hi = 0.0, 1.0 if miss_in_list is None else miss_in_list
    reached = gain is None or ratio(hi) >= gain
    if reached and gain is not None:
        for _ in range(12):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ratio(mid) < gain else (lo, mid)
    miss = hi
    prof = Profile.geometric(name, p0, miss, decay, top_k)
    return {"name": name, "p0": p0, "miss_in_list": miss, "decay": decay, "top_k": top_k, "draft_len": draft_len,
            "calibration_budget": budget, "target_gain": gain, "reached": reached,
            "chain_tokens_per_round": prof.chain_acceptance(draft_len),
            "simulated_gain": ratio(miss), "rank_probs": list(prof.rank_probs)}


def profile_from(params: dict) -> Profile:
    """The Profile of a `calibrate` result (or of its JSON)."""
    return Profile(params["name"], tuple(params["rank_probs"]))
