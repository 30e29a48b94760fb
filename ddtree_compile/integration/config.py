"""DDTree settings: the one switch that turns DDTree on in vLLM, and its validation.

DDTree rides on vLLM's DFlash path. The switch is two pieces of vLLM's own configuration:

    speculative_config = {"method": "dflash", "model": <drafter>, "num_speculative_tokens": K}
    additional_config  = {"ddtree": {"budget": B, "top_k": 8, "temperature": 1.0,
                                     "chain_seed": True, "draft_len": L}}

`"budget": "auto"` lets the engine choose per step between its tree buckets (`auto_budget`: a node
count, or a menu of them, e.g. [8, 16, 32]) and the drafter's plain chain (flat DFlash's L drafts),
from the precompile cost table and the acceptance DDTree measures (round/auto_budget.py).

`additional_config` is hashed into vLLM's config and compile-cache keys and reaches every process.
L is the drafter's block (the flat DFlash chain length: the drafter proposes L positions per round);
K sizes vLLM's draft slots and buffers, so it must hold the tree (K >= B) and the drafter's query
(K >= L). `vllm_kwargs` picks K for you. On hybrid (GatedDeltaNet) targets the tree templates read
conv lines of W - 1 + K columns and K + 1 state indices per request: K == B there. With the default
"replay" GDN strategy vLLM allots only 1 + L GDN state slots per request, as for flat DFlash
(adapters/gdn_slots.py); "snapshots" keeps 1 + K (a state per tree node).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass

from ddtree_compile.core import buckets
from ddtree_compile.core.spec import MAX_BUDGET, TreeSpec
from ddtree_compile.passes.entry import compilation_config, traced_compilation_config

KEY = "ddtree"
GDN_STATES = ("snapshots", "replay")
OP_SWAPS = ("pass", "trace")
_FIELDS = ("budget", "top_k", "temperature", "chain_seed", "draft_len", "gdn_state", "log_interval", "auto_budget",
           "probe_interval", "cost_table", "round_graphs", "op_swap")
AUTO = "auto"
_AUTO_FIELDS = ("auto_budget", "probe_interval", "cost_table")


def _fail(field: str, msg: str) -> None:
    raise ValueError(f"additional_config['ddtree']['{field}'] {msg}")


def _int(field: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(field, f"must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        _fail(field, f"must be {'>= ' + str(low) if high is None else f'in [{low}, {high}]'}, got {value}")
    return value


@dataclass(frozen=True)
class DDTreeConfig:
    """Validated DDTree settings (see module docstring).

    budget        tree nodes B verified per round (the verify runs B+1 tokens per request), or "auto"
    top_k         candidates per depth
    temperature   draft temperature used to score tree nodes (not the sampling temperature)
    chain_seed    always include the drafter's top-1 chain (the tree contains flat DFlash)
    draft_len     L, positions the drafter proposes per round; None: the drafter's block_size - 1
    gdn_state     hybrid targets: "replay" (record per-node k/v/g/beta, replay the accepted path at
                  commit; state memory independent of the budget) or "snapshots" (every node's
                  state in vLLM's per-draft state slots; no replay at commit)
    log_interval  tree rounds between DDTree log lines (0: no periodic log line)
    auto_budget   budget "auto" only: the tree bucket (nodes) the engine verifies when the tree wins,
                  or a list of them (the menu; the largest sizes vLLM's draft slots)
    probe_interval budget "auto" only: while one kind wins, every other kind is verified anyway now
                  and then (the tree's acceptance and every kind's cost keep being measured): as
                  often as those probes cost at most 1% of the rate, but at most every this many
                  steps and at least every 16x this many (round/auto_budget.py)
    cost_table    budget "auto" only: the precompile cost table (JSON); None: the default path
                  beside vLLM's compile cache for this target/drafter (no table: costs measured online)
    round_graphs  CUDA: the commit's device work replayed as one CUDA graph per batch shape
                  (round/stage_graphs.py) instead of ~40 ops and launches per step; false: eager
    op_swap       how vLLM's attention / GDN ops become their `ddtree::` mirrors in a compiled engine:
                  "pass" (the tree-verify pass rewrites Inductor's graph; on GPUs with Inductor's graph
                  partition, passes/entry.compilation_config) or "trace" (the ops are pointed at the
                  mirrors before vLLM traces the model, which then keeps vLLM's own compile split:
                  passes/entry.traced_compilation_config, integration/plugin.py)
    """

    budget: int | str
    top_k: int = 8
    temperature: float = 1.0
    chain_seed: bool = True
    draft_len: int | None = None
    gdn_state: str = "replay"
    log_interval: int = 100
    auto_budget: int | tuple | None = None
    probe_interval: int | None = None
    cost_table: str | None = None
    round_graphs: bool = True
    op_swap: str = "pass"

    def __post_init__(self) -> None:
        if self.budget == AUTO:
            object.__setattr__(self, "auto_budget", _menu(32 if self.auto_budget is None else self.auto_budget))
            object.__setattr__(self, "probe_interval", _int("probe_interval", 16 if self.probe_interval is None
                                                            else self.probe_interval, 1))
            if self.cost_table is not None and not isinstance(self.cost_table, str):
                _fail("cost_table", f"must be a path (string) or null, got {self.cost_table!r}")
        else:
            if isinstance(self.budget, str):
                _fail("budget", f"must be an int in [1, {MAX_BUDGET}] or \"auto\", got {self.budget!r}")
            _int("budget", self.budget, 1, MAX_BUDGET)
            given = [f for f in _AUTO_FIELDS if getattr(self, f) is not None]
            if given:
                _fail(given[0], f"is read only with budget \"auto\" (budget is {self.budget})")
        _int("top_k", self.top_k, 1)
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            _fail("temperature", f"must be a finite float > 0, got {t!r}")
        if not isinstance(self.chain_seed, bool):
            _fail("chain_seed", f"must be true or false, got {self.chain_seed!r}")
        if self.draft_len is not None:
            _int("draft_len", self.draft_len, 1)
        if self.gdn_state not in GDN_STATES:
            _fail("gdn_state", f"must be one of {', '.join(GDN_STATES)}, got {self.gdn_state!r}")
        _int("log_interval", self.log_interval, 0)
        if not isinstance(self.round_graphs, bool):
            _fail("round_graphs", f"must be true or false, got {self.round_graphs!r}")
        if self.op_swap not in OP_SWAPS:
            _fail("op_swap", f"must be one of {', '.join(OP_SWAPS)}, got {self.op_swap!r}")

    @property
    def auto(self) -> bool:
        return self.budget == AUTO

    @property
    def tree_budget(self) -> int:
        """The tree's node count: the budget, or with "auto" the largest tree bucket of its menu."""
        if not self.auto:
            return self.budget
        return max(self.auto_budget) if isinstance(self.auto_budget, tuple) else self.auto_budget

    def budget_menu(self, draft_len: int) -> tuple[int, ...]:
        """The tree buckets one step may verify, ascending (effective budgets: a tree holds no padding)."""
        menu = self.auto_budget if self.auto and isinstance(self.auto_budget, tuple) else (self.tree_budget,)
        return tuple(sorted({effective_budget(b, self.top_k, draft_len) for b in menu}))

    def tree_spec(self, draft_len: int) -> TreeSpec:
        return TreeSpec(budget=effective_budget(self.tree_budget, self.top_k, draft_len), top_k=self.top_k,
                        chain_seed=self.chain_seed, temperature=float(self.temperature))

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def _menu(value) -> int | tuple:
    """auto_budget: one node count, or a non-empty list of distinct ones (kept as a sorted tuple)."""
    if isinstance(value, (list, tuple)):
        if not value or len(set(value)) != len(value):
            _fail("auto_budget", f"must be an int or a non-empty list of distinct ints, got {list(value)!r}")
        menu = tuple(sorted(_int("auto_budget", b, 1, MAX_BUDGET) for b in value))
        return menu[0] if len(menu) == 1 else menu
    return _int("auto_budget", value, 1, MAX_BUDGET)


def effective_budget(budget: int, top_k: int, draft_len: int) -> int:
    """min(budget, nodes a top_k x draft_len tree can hold): a tree never has padding slots
    (core/buckets.EFFECTIVE_BUDGET)."""
    return buckets.effective_budget(budget, top_k, draft_len)


def parse(additional_config) -> DDTreeConfig | None:
    """The DDTree settings in vLLM's `additional_config`, or None when DDTree is off."""
    if additional_config is None:
        return None
    if not isinstance(additional_config, dict):
        additional_config = getattr(additional_config, "__dict__", {})
    raw = additional_config.get(KEY)
    if raw is None:
        return None
    if isinstance(raw, DDTreeConfig):
        return raw
    if not isinstance(raw, dict):
        raise ValueError(f"additional_config['ddtree'] must be a dict of DDTree settings, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ValueError(f"additional_config['ddtree'] has unknown keys {unknown}; allowed keys: {', '.join(_FIELDS)}")
    if "budget" not in raw:
        raise ValueError("additional_config['ddtree'] needs 'budget' (tree nodes verified per round, >= 1)")
    return DDTreeConfig(**raw)


def vllm_kwargs(draft_model, budget: int | str, top_k: int = 8, temperature: float = 1.0, chain_seed: bool = True,
                num_speculative_tokens: int = 15, platform: str | None = None, **auto) -> dict:
    """Keyword arguments that switch DDTree on for `vllm.LLM(...)` (what `cli_args` passes to `vllm serve`).

    `num_speculative_tokens` is the draft length L (flat DFlash's chain length); vLLM's own
    num_speculative_tokens becomes max(effective budget, L) so its slots hold the tree. The
    `compilation_config` installs the tree pass for `platform` ("cpu", "cuda", "rocm"; default: "cuda"
    where torch sees a GPU): on GPUs it also keeps the graph whole for the pass
    (passes/entry.compilation_config). Async scheduling is left to vLLM (on for DFlash on GPUs: Model
    Runner V2 runs the round in that loop; on the V1 runner the plugin turns it off, adapters/engine_args.py).
    Merge it with your own with `merge_llm_kwargs`. Adding only the ddtree block to a flat DFlash
    configuration does the same (adapters/engine_args.py). `auto`: auto_budget / probe_interval / cost_table with budget="auto".
    """
    cfg = DDTreeConfig(budget=budget, top_k=top_k, temperature=temperature, chain_seed=chain_seed,
                       draft_len=_int("draft_len", num_speculative_tokens, 1), **auto)
    kwargs = {
        "speculative_config": {"method": "dflash", "model": str(draft_model),
                               "num_speculative_tokens": draft_slots(cfg, cfg.draft_len)},
        "additional_config": {KEY: cfg.to_dict()},
    }
    kwargs["compilation_config"] = switch_compilation_config(cfg, platform or _platform())
    return kwargs


def switch_compilation_config(cfg: DDTreeConfig, platform: str) -> dict:
    """The `compilation_config` entries the switch needs on `platform`: with op_swap "pass" the tree-verify
    pass (vLLM resolves it as `__import__("ddtree_compile").__dict__["tree_verify_pass"]`) and on GPUs
    the graph partition it needs; with "trace" vLLM's own compile with the mirrors among its split points."""
    return compilation_config(platform, PASS_NAME) if cfg.op_swap == "pass" else traced_compilation_config(platform)


def draft_slots(cfg: DDTreeConfig, draft_len: int) -> int:
    """vLLM's num_speculative_tokens K for these settings and draft length L: max(effective budget, L)."""
    return buckets.draft_slots(effective_budget(cfg.tree_budget, cfg.top_k, draft_len), draft_len)


def _platform() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def merge_llm_kwargs(user: dict, switch: dict) -> dict:
    """`vllm.LLM` kwargs of your own plus the DDTree switch (`vllm_kwargs`): the switch's speculative
    config; additional_config and compilation_config merged key by key (yours win, except what the
    tree pass needs: `tree_pass_entries`)."""
    out = {**user, "speculative_config": switch["speculative_config"]}
    out["additional_config"] = {**user.get("additional_config", {}), **switch["additional_config"]}
    cc_user = dict(user.get("compilation_config") or {})
    out["compilation_config"] = {**switch["compilation_config"], **cc_user,
                                 **tree_pass_entries(cc_user.get, switch["compilation_config"])}
    return out


def tree_pass_entries(get, wanted: dict) -> dict:
    """The compilation_config entries that keep the switch's over a user's config (`get(key)` reads
    theirs; `wanted`: `switch_compilation_config`): with the tree-verify pass, their other inductor
    passes kept and their post-grad pass ours or none (another one is an error); on GPUs their
    splitting ops kept and ours added, with the graph partition on where the pass needs it. Used by
    `merge_llm_kwargs` and by the plugin's switch (adapters/engine_args.py)."""
    out = {}
    if "inductor_passes" in wanted:
        theirs = dict(get("inductor_passes") or {})
        if theirs.get("post_grad_custom_post_pass") not in (None, PASS_NAME):
            raise ValueError(f"compilation_config.inductor_passes['post_grad_custom_post_pass'] is "
                             f"{theirs['post_grad_custom_post_pass']!r}; DDTree needs {PASS_NAME!r} there")
        out["inductor_passes"] = {**theirs, **wanted["inductor_passes"]}
    if "splitting_ops" in wanted:
        ops = list(get("splitting_ops") or [])
        out["splitting_ops"] = ops + [op for op in wanted["splitting_ops"] if op not in ops]
        if wanted.get("use_inductor_graph_partition"):
            out["use_inductor_graph_partition"] = True
    return out


PASS_NAME = "ddtree_compile.tree_verify_pass"


def cli_args(draft_model, budget: int | str, **kw) -> list[str]:
    """`vllm serve` arguments equivalent to `vllm_kwargs(...)` (one switch, two spellings)."""
    return cli_flags(vllm_kwargs(draft_model, budget, **kw))


def cli_flags(llm_kwargs: dict) -> list[str]:
    """`vllm serve` flags of `vllm.LLM` keyword arguments (e.g. `merge_llm_kwargs(yours, vllm_kwargs(...))`)."""
    out = []
    for key, value in llm_kwargs.items():
        flag = key.replace("_", "-")
        if isinstance(value, bool):  # vLLM's boolean flags come as --x / --no-x
            out.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            out += ["--" + flag, json.dumps(value)]
    return out
