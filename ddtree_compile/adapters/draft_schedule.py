"""Budget "auto" on Model Runner V2: the tree or the chain per step, through vLLM's own per-batch-size
draft counts (dynamic speculative decoding: `speculative_config.num_speculative_tokens_per_batch_size`).

V2 under async scheduling learns a step's draft count from the scheduler, not from the drafter: the
scheduler leaves `lookup[batch size]` placeholder drafts per request for the next step
(`async_scheduler.py` `_update_after_schedule`; 0.26 `scheduler.py:1133-1137`) and tells the worker
that count in the step's SchedulerOutput (`num_spec_tokens_to_schedule`). V2 captures FULL graphs for
every count of the schedule (0.26 `cudagraph_utils.py:196-218`). So:

- at start-up (engine_args.adjust_vllm_config) an auto engine on V2 with async scheduling gets the
  schedule `[(1, M, B), (M + 1, M + 1, L)]`: every batch size verifies the tree's B slots at first,
  and the entry past max_num_seqs = M makes V2 capture flat DFlash's 1 + L graphs too (it is never
  looked up);
- the round reads the count the scheduler gave the next step (`next_draft_count`) and proposes that:
  L drafts are the drafter's chain (flat DFlash's step: its graphs, vLLM's sampler), B the tree;
- the round's policy (round/auto_budget.py) writes its choice per batch bucket into the scheduler's
  lookup (`DraftSchedule.choose`), which applies from the next schedule on: a host list, no sync.

The lookup is reachable where the scheduler and the worker share a process (the engine core with
one GPU worker); elsewhere (workers of their own: tensor parallel) auto is refused there, logged.
"""

from __future__ import annotations

import weakref

_SCHEDULERS: list = []  # weak references to this process's schedulers with a dynamic draft schedule


def auto_schedule(budget: int, draft_len: int, max_num_seqs: int) -> list[tuple[int, int, int]]:
    """The start-up schedule of an auto engine on V2 (module docstring)."""
    return [(1, max_num_seqs, budget), (max_num_seqs + 1, max_num_seqs + 1, draft_len)]


def is_auto_schedule(speculative_config, budget: int, draft_len: int, max_num_seqs: int) -> bool:
    got = getattr(speculative_config, "num_speculative_tokens_per_batch_size", None)
    return got is not None and [tuple(map(int, e)) for e in got] == auto_schedule(budget, draft_len, max_num_seqs)


def runs_auto_schedule(vllm_config, settings, max_num_seqs: int) -> bool:
    """vLLM runs DDTree's auto schedule (engine_args.adjust_vllm_config) in the async loop."""
    from ..integration import config as config_mod

    cfg, spec = config_mod.parse(settings.additional_config), vllm_config.speculative_config
    return (cfg is not None and settings.async_scheduling and spec is not None
            and is_auto_schedule(spec, spec.num_speculative_tokens, cfg.draft_len or 0, max_num_seqs))


def install() -> None:
    """Record every scheduler built with a dynamic draft schedule (once per process, 0.26 and 0.32)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.__init__
    if getattr(original, "_ddtree_schedule", False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "dynamic_sd_lookup", None) is not None:
            _SCHEDULERS.append(weakref.ref(self))

    __init__._ddtree_schedule = True
    Scheduler.__init__ = __init__


class DraftSchedule:
    """The scheduler's lookup of this process, as the round writes it (found at first use: the
    scheduler is built after the workers)."""

    def __init__(self, budget: int, draft_len: int, vllm_config=None):
        self.B, self.L, self.vllm_config = budget, draft_len, vllm_config
        self._lookup: list[int] | None = None
        self.written = {budget: 0, draft_len: 0}  # choices written, by draft count (tests, the snapshot)

    def lookup(self) -> list[int] | None:
        """The lookup of the scheduler built from this engine's config (the engine core hands the worker
        and the scheduler the same object), else of the newest one in this process."""
        if self._lookup is None:
            live = [s for s in (r() for r in _SCHEDULERS) if s is not None]
            mine = [s for s in live if getattr(s, "vllm_config", None) is self.vllm_config] or live
            if mine:
                self._lookup = mine[-1].dynamic_sd_lookup
        return self._lookup

    def choose(self, R: int, chain: bool) -> bool:
        """Batch sizes of R's bucket (R .. 2R - 1, as round/auto_budget buckets them) verify the chain
        or the tree from the next schedule on; False where no scheduler shares this process."""
        lookup = self.lookup()
        if lookup is None:
            return False
        lo = 1 << (max(R, 1).bit_length() - 1)
        k = self.L if chain else self.B
        self.written[k] += 1
        if lo < len(lookup) and lookup[lo] != k:  # (the bucket is written whole: one entry tells)
            lookup[lo:min(2 * lo, len(lookup))] = [k] * (min(2 * lo, len(lookup)) - lo)
        return True
