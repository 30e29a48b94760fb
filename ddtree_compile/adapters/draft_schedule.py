"""Budget "auto" on Model Runner V2: a tree bucket of its menu or the chain per step, through vLLM's own
per-batch-size draft counts (dynamic speculative decoding: `speculative_config.num_speculative_tokens_per_batch_size`).

V2 under async scheduling learns a step's draft count from the scheduler, not from the drafter: the
scheduler leaves `lookup[batch size]` placeholder drafts per request for the next step
(`async_scheduler.py` `_update_after_schedule`; 0.26 `scheduler.py:1133-1137`) and tells the worker
that count in the step's SchedulerOutput (`num_spec_tokens_to_schedule`). V2 captures FULL graphs for
every count of the schedule (0.26 `cudagraph_utils.py:196-218`). So:

- at start-up (engine_args.adjust_vllm_config) an auto engine on V2 with async scheduling gets the
  schedule `[(1, M, B), (M + 1, M + 1, L), (M + 2, M + 2, b_1), ...]`: every batch size verifies the
  largest tree's B slots at first, and the entries past max_num_seqs = M (never looked up) make V2
  capture FULL graphs for flat DFlash's 1 + L tokens and each smaller bucket's 1 + b_i too (0.26
  `cudagraph_utils.py:196-218` takes every entry's count; 0.32 reads the dense lookup, which drops
  them: a 0.32+ GPU line would put them inside 1..M);
- the round reads the count the scheduler gave the next step (`next_draft_count`) and proposes that:
  L drafts are the drafter's chain (flat DFlash's step: its graphs, vLLM's sampler), b a tree bucket.
  So the counts must differ: a bucket of exactly L nodes is not served here (round/auto_setup.serveable_menu);
- the round's policy (round/auto_budget.py) writes its choice per batch bucket into the scheduler's
  lookup (`DraftSchedule.choose`), which applies from the next schedule on: a host list, no sync;
- a request that brought its own seed takes one kind per batch bucket (its tokens repeat when the same
  requests run again). The scheduler gives a step's requests their next draft count before any proposal
  sees them (a new request's first, at the schedule of its prefill), so before every schedule with such a
  request among the scheduler's, every bucket's entry is made the kind seeded steps take
  (`hold_seeded`, the policy's `AutoBudget.hold_seeded`), not at the request's first proposal.

The lookup is reachable where the scheduler and the worker share a process (the engine core with
one GPU worker); elsewhere (workers of their own: tensor parallel) auto is refused there, logged.

The scheduler is vLLM's own extension point: the auto engine's `scheduler_config.scheduler_cls` names
`DraftScheduleScheduler` (set with the schedule, engine_args.adjust_vllm_config), vLLM's AsyncScheduler
that makes its lookup known to this process's DraftSchedule and holds seeded requests' kinds before each
schedule. vLLM logs once that a custom scheduler's interface is not public (0.26 and 0.32
`SchedulerConfig.get_scheduler_cls`). Where the user named a scheduler class of their own it is kept and
budget "auto" is refused at attach (runner_v2.budget_auto_unsupported): the largest tree every step.
"""

from __future__ import annotations

import collections
import functools
import weakref

_SCHEDULERS: list = []  # weak references to this process's schedulers with a dynamic draft schedule
_SCHEDULES: list = []  # weak references to this process's DraftSchedules that hold seeded requests' kinds


def auto_schedule(menu: tuple, draft_len: int, max_num_seqs: int) -> list[tuple[int, int, int]]:
    """The start-up schedule of an auto engine on V2 (module docstring): menu ascending, its last the
    largest bucket B; a bucket of L nodes is left out (its count is the chain's)."""
    smaller = [b for b in menu[:-1] if b != draft_len]
    M = max_num_seqs
    return [(1, M, menu[-1])] + [(M + 1 + i, M + 1 + i, k) for i, k in enumerate([draft_len, *smaller])]


def runs_draft_schedule(vllm_config, settings) -> bool:
    """vLLM runs a per-batch-size draft schedule in the async loop whose every count is one the round
    serves: the chain's L or a tree bucket (budget "auto"'s menu, else the budget). Budget "auto"'s own
    (engine_args.adjust_vllm_config), or a user's that fits: the round follows its counts (and with
    budget "auto" rewrites them as it measures)."""
    from ..integration import config as config_mod

    cfg, spec = config_mod.parse(settings.additional_config), vllm_config.speculative_config
    got = getattr(spec, "num_speculative_tokens_per_batch_size", None)
    if cfg is None or not settings.async_scheduling or not got or not cfg.draft_len:
        return False
    L, menu = cfg.draft_len, cfg.budget_menu(cfg.draft_len)
    return menu[-1] == spec.num_speculative_tokens and {int(e[2]) for e in got} <= {L, *menu}


SCHEDULER_CLS = f"{__name__}.DraftScheduleScheduler"  # what vLLM resolves (`resolve_obj_by_qualname`)


def __getattr__(name: str):
    """`DraftScheduleScheduler`, built at first use: importing this module (the plugin does, in every
    vLLM process) does not import vLLM's scheduler."""
    if name == "DraftScheduleScheduler":
        return _scheduler_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _scheduler_class():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    class DraftScheduleScheduler(AsyncScheduler):
        """vLLM's async scheduler (0.26 and 0.32), its lookup known to the round's DraftSchedule; before
        each schedule, the kinds of seeded requests held (`hold_seeded`)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if getattr(self, "dynamic_sd_lookup", None) is not None:
                _SCHEDULERS.append(weakref.ref(self))

        def schedule(self, *args, **kwargs):
            if getattr(self, "dynamic_sd_lookup", None) is not None:
                hold_seeded(self)
            return super().schedule(*args, **kwargs)

    # named as this module's attribute (what vLLM's logs and pickle see)
    DraftScheduleScheduler.__module__, DraftScheduleScheduler.__qualname__ = __name__, "DraftScheduleScheduler"
    return DraftScheduleScheduler


def hold_seeded(scheduler) -> None:
    """Before `scheduler` schedules a step: where one of its requests brought its own seed, every bucket of
    its lookup gets the count of the kind seeded steps take there (module docstring)."""
    lookup = scheduler.dynamic_sd_lookup
    mine = next((s for s in (ref() for ref in _SCHEDULES) if s is not None and s.lookup() is lookup), None)
    if mine is None or not any(getattr(r.sampling_params, "seed", None) is not None
                               for r in scheduler.requests.values()):
        return  # (a schedule that is not the round's, e.g. a user's own with flat DFlash: no per-request scan)
    buckets = [1 << i for i in range(len(lookup).bit_length()) if 1 << i < len(lookup)]
    for b, count in mine.seeded_counts(buckets).items():
        _write(lookup, b, count)


class DraftSchedule:
    """The scheduler's lookup of this process, as the round writes it (found at first use: the
    scheduler is built after the workers)."""

    def __init__(self, vllm_config=None):
        self.vllm_config = vllm_config
        self._lookup: list[int] | None = None
        self.written: collections.Counter = collections.Counter()  # choices written, by draft count (tests)
        # buckets -> {bucket: the draft count of the kind seeded steps take there}: the round's (hold_seeded)
        self.seeded_counts = None

    def hold_seeded_with(self, counts) -> None:
        """`counts(buckets)` gives this lookup's entries while a seeded request is the scheduler's."""
        self.seeded_counts = counts
        _SCHEDULES.append(weakref.ref(self))

    def lookup(self) -> list[int] | None:
        """The lookup of the scheduler built from this engine's config (the engine core hands the worker
        and the scheduler the same object), else of the newest one in this process."""
        if self._lookup is None:
            live = [s for s in (r() for r in _SCHEDULERS) if s is not None]
            mine = [s for s in live if getattr(s, "vllm_config", None) is self.vllm_config] or live
            if mine:
                self._lookup = mine[-1].dynamic_sd_lookup
        return self._lookup

    def choose(self, R: int, count: int) -> bool:
        """Batch sizes of R's bucket (R .. 2R - 1, as round/auto_budget buckets them) get `count` drafts
        per request (the chain's L or a tree bucket's b) from the next schedule on; False where no
        scheduler shares this process."""
        lookup = self.lookup()
        if lookup is None:
            return False
        self.written[count] += 1
        _write(lookup, 1 << (max(R, 1).bit_length() - 1), count)
        return True


def _write(lookup: list[int], lo: int, count: int) -> None:
    """Batch sizes lo .. 2 lo - 1 (a bucket) get `count` drafts per request."""
    if lo < len(lookup) and lookup[lo] != count:  # (the bucket is written whole: one entry tells)
        lookup[lo:min(2 * lo, len(lookup))] = [count] * (min(2 * lo, len(lookup)) - lo)
