"""The switch as one addition to a flat DFlash configuration.

A user who runs flat DFlash (`--speculative-config '{"method": "dflash", "model": ..., 
"num_speculative_tokens": 15}'`, vLLM's own compilation and loop) adds only
`--additional-config '{"ddtree": {"budget": 32}}'` (or `additional_config=` for `vllm.LLM`). The plugin
(integration/plugin.py) wraps `EngineArgs.create_engine_config`, in the process that builds vLLM's config, and
adjusts what the round needs (`install`), logging each change once:

- `num_speculative_tokens`: the user's is the drafter's chain length L; vLLM's draft slots must hold
  the tree, so it becomes `draft_slots(budget, L)` and the ddtree block records L as `draft_len`.
- `compilation_config`: the tree-verify pass is installed (passes/entry.compilation_config), the
  user's other settings kept; another post-grad pass in its place is an error. With op_swap "trace"
  the `ddtree::` mirrors join vLLM's split points instead (passes/entry.traced_compilation_config).
- async scheduling: left as vLLM resolves it (on for DFlash on GPUs). Model Runner V2 serves the
  round in that loop; the V1 runner does not, so where vLLM picked V1 and the user did not ask for
  async scheduling, it is turned off (an explicit `--async-scheduling` on V1 starts flat DFlash,
  refused at attach and counted).
- budget "auto" on Model Runner V2 with async scheduling: vLLM's per-batch-size draft counts
  (`num_speculative_tokens_per_batch_size`, the schedule of draft_schedule.py), which the round
  then rewrites per batch bucket, in the scheduler's process: one worker, no data parallelism; the
  scheduler that lets it is vLLM's AsyncScheduler named in `scheduler_cls` (draft_schedule.py).

What `config.vllm_kwargs` produces already has these values: adjusting it again changes nothing.
"""

from __future__ import annotations

from ..integration import config as config_mod


def adjust_engine_args(args) -> list[str]:
    """Before vLLM builds its config from `args` (vLLM's EngineArgs): the changes made, as log lines."""
    cfg = config_mod.parse(getattr(args, "additional_config", None))
    spec = getattr(args, "speculative_config", None)
    if cfg is None or not isinstance(spec, dict) or spec.get("method") != "dflash":
        return []  # (no DFlash drafter: attach says so)
    notes = []
    K = spec.get("num_speculative_tokens")
    L = cfg.draft_len if cfg.draft_len is not None else K
    if L is None:
        return []  # vLLM takes the drafter's block; the round reads L from the drafter at attach
    if cfg.draft_len is None:
        args.additional_config = {**args.additional_config,
                                  config_mod.KEY: {**args.additional_config[config_mod.KEY], "draft_len": L}}
        cfg = config_mod.parse(args.additional_config)
    slots = config_mod.draft_slots(cfg, L)
    if K != slots:
        args.speculative_config = {**spec, "num_speculative_tokens": slots}
        notes.append(f"speculative_config.num_speculative_tokens {K} -> {slots} (vLLM's draft slots hold the tree of "
                     f"{slots} nodes; the drafter keeps drafting {L} positions)")
    note = _install_pass(args, cfg)
    if note:
        notes.append(note)
    return notes


def _install_pass(args, cfg) -> str | None:
    """The switch's compile entries in `args.compilation_config` (vLLM's CompilationConfig or a dict): the
    tree-verify pass, or with op_swap "trace" the mirrors among vLLM's split points."""
    from vllm.platforms import current_platform

    wanted = config_mod.switch_compilation_config(cfg, "cpu" if current_platform.device_type == "cpu" else "cuda")
    cc = args.compilation_config
    get = cc.get if isinstance(cc, dict) else lambda k, d=None: getattr(cc, k, d)
    changes = config_mod.tree_pass_entries(get, wanted)
    if all(get(k) == v for k, v in changes.items()):
        return None
    for key, value in changes.items():
        if isinstance(cc, dict):
            cc[key] = value
        else:
            setattr(cc, key, value)
    if not isinstance(cc, dict) and "inductor_passes" in changes:
        # A built CompilationConfig resolved its inductor_passes into inductor_compile_config in its
        # __post_init__ (0.26 and 0.32 `config/compilation.py`), which is what Inductor is handed:
        # ours goes there too (the object reports vLLM's InductorPass flavour: passes/entry.py), or
        # the compiled graph keeps vLLM's ops.
        from ..passes.entry import tree_verify_pass

        cc.inductor_compile_config["post_grad_custom_post_pass"] = tree_verify_pass
    what = "the tree-verify pass installed" if "inductor_passes" in changes else "the ddtree mirrors split points"
    return f"compilation_config: {what} (" + ", ".join(sorted(changes)) + ")"


def adjust_vllm_config(vllm_config, user_async) -> list[str]:
    """After vLLM built its config: async scheduling off on the V1 runner unless the user asked for it;
    budget "auto" on V2 with async scheduling gets its draft schedule."""
    cfg = config_mod.parse(vllm_config.additional_config)
    spec = vllm_config.speculative_config
    if cfg is None or spec is None:
        return []
    sc = vllm_config.scheduler_config
    if sc.async_scheduling and user_async is None and not vllm_config.use_v2_model_runner:
        sc.async_scheduling = False
        return ["async scheduling off: vLLM picked the V1 model runner, whose round runs in the synchronous "
                "loop (Model Runner V2 serves it with async scheduling: VLLM_USE_V2_MODEL_RUNNER=1)"]
    K, L = spec.num_speculative_tokens, cfg.draft_len
    menu = cfg.budget_menu(L) if cfg.auto and L else ()
    if not (menu and vllm_config.use_v2_model_runner and sc.async_scheduling and K > L and menu[-1] == K
            and vllm_config.parallel_config.data_parallel_size == 1 and vllm_config.parallel_config.world_size == 1
            and sc.scheduler_cls is None):  # (a user's own scheduler class: auto is refused at attach)
        return []
    from .draft_schedule import SCHEDULER_CLS, auto_schedule

    sc.scheduler_cls = SCHEDULER_CLS
    notes = [(f"scheduler_config.scheduler_cls = {SCHEDULER_CLS} (vLLM's async scheduler; budget \"auto\" writes "
              f"its per-batch-size draft counts)")]
    if getattr(spec, "num_speculative_tokens_per_batch_size", False) is None:  # (a user's own is kept)
        spec.num_speculative_tokens_per_batch_size = schedule = auto_schedule(menu, L, sc.max_num_seqs)
        trees = "/".join(str(b) for b in menu if b != L)
        notes.append(f"speculative_config.num_speculative_tokens_per_batch_size = {schedule} (budget \"auto\" on "
                     f"Model Runner V2: a tree of {trees} drafts or the chain's {L} per batch size, chosen as the "
                     f"engine runs)")
    return notes


def install() -> None:
    """Wrap vLLM's `EngineArgs.create_engine_config` (the front end of `vllm serve` and `vllm.LLM`
    build vLLM's config there, 0.26 and 0.32 alike) with the adjustments above; once per process."""
    from vllm.engine.arg_utils import EngineArgs

    from ..integration.metrics import logger

    original = EngineArgs.create_engine_config
    if getattr(original, "_ddtree_switch", False):
        return
    logged = set()

    def create_engine_config(self, *args, **kwargs):
        notes = adjust_engine_args(self)
        vllm_config = original(self, *args, **kwargs)
        for note in notes + adjust_vllm_config(vllm_config, self.async_scheduling):
            if note not in logged:
                logged.add(note)
                logger.info("DDTree: %s", note)
        return vllm_config

    create_engine_config._ddtree_switch = True
    EngineArgs.create_engine_config = create_engine_config
