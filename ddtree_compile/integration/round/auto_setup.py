"""Budget "auto" as an engine configures it: the menu its runner serves, the precompile cost table it
finds (the prior of every kind's cost), its clock, and the policy (auto_budget.AutoBudget) built from them."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import pathlib

import torch

from ..metrics import logger
from .auto_budget import CHAIN, AutoBudget, bucket, tree_kind


def cost_table_path(model, draft, top_k: int, draft_len: int, max_batch: int, op_swap: str = "pass") -> pathlib.Path:
    """Where `ddtree-compile precompile` writes (and budget "auto" looks for) the cost table. The op swap is
    part of the key (the default's key is the one before it was): the swaps compile the target differently
    and their chain steps differ (op_swap "pass" compiles vLLM's GDN op inside one Inductor graph)."""
    parts = [str(pathlib.Path(model).resolve()), str(pathlib.Path(draft).resolve()), top_k, draft_len, max_batch]
    key = json.dumps(parts if op_swap == "pass" else [*parts, op_swap])
    root = pathlib.Path(os.environ.get("VLLM_CACHE_ROOT", pathlib.Path.home() / ".cache" / "vllm"))
    return root / "ddtree" / f"cost_{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def table_priors(table: dict, tree_budget: int, draft_len: int, menu: tuple = ()) -> dict:
    """{(kind, bucket): seconds per step} from a precompile cost table: the rows of each tree
    bucket's budget, and of the chain (rows of kind "chain", which a menu engine's precompile writes,
    or a fixed-budget engine's rows at the chain's length L); a row's batch goes to its bucket, the
    larger batch wins a bucket."""
    priors = {}
    kinds = [(tree_kind(b, tree_budget), b) for b in (menu or (tree_budget,))] + [(CHAIN, draft_len)]
    for kind, budget in kinds:
        chain = kind == CHAIN
        rows = (r for r in table.get("buckets", [])
                if r.get("budget") == budget and ("kind" not in r or (r["kind"] == CHAIN) == chain))
        for row in sorted(rows, key=lambda r: r["batch"]):
            priors[(kind, bucket(int(row["batch"])))] = float(row["round_ms"]) / 1e3
    return priors


def serveable_menu(menu: tuple, draft_len: int, scheduled: bool = False) -> tuple[tuple, str | None]:
    """The buckets this engine's round serves, and why the others are refused (None: all served).
    Every bucket on every target (on hybrids the tree conv and GDN templates read vLLM's state lines,
    sized for the largest bucket, for any smaller one). Where the scheduler gives each step its draft
    count (`scheduled`: Model Runner V2, adapters/draft_schedule.py) the count is all the round learns
    of the step's kind: a bucket of exactly L nodes would read as the chain, so it is not served."""
    if scheduled and draft_len in menu[:-1]:
        return tuple(b for b in menu if b != draft_len), (
            f"budget menu {'/'.join(map(str, menu))}: the bucket of {draft_len} nodes on Model Runner V2 (the "
            f"scheduler's draft count is all the round learns of a step, and {draft_len} is the chain's)")
    return menu, None


def from_config(cfg, metrics, settings, tree_budget: int, draft_len: int, menu: tuple = (), agree=None) -> AutoBudget:
    """The policy of a budget "auto" engine (settings: adapters.EngineSettings) over `menu` (default:
    the configured one), with the cost table's priors when one is found; agree: AutoBudget's."""
    menu = menu or cfg.budget_menu(draft_len)
    path = cfg.cost_table or cost_table_path(settings.model, settings.draft_model, cfg.top_k, draft_len,
                                             settings.max_num_seqs, cfg.op_swap)
    path = pathlib.Path(path)
    priors, found = {}, None
    if path.is_file():
        try:
            priors, found = table_priors(json.loads(path.read_text()), tree_budget, draft_len, menu), str(path)
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("DDTree auto budget: cost table %s unreadable (%s); measuring costs online", path, e)
    elif cfg.cost_table:
        raise ValueError(f"additional_config['ddtree']['cost_table'] = {cfg.cost_table!r}: no such file")
    logger.info("DDTree auto budget: a tree of %s nodes or the chain of %d per step; cost table: %s",
                "/".join(map(str, menu)), draft_len, found or f"none at {path} (costs measured online)")
    # on CUDA the device's own timeline (depth 1: a cycle holds its own step's work only), else the host's
    clock = DeviceClock() if metrics.device.type == "cuda" else None
    return AutoBudget(metrics, tree_budget, draft_len, cfg.probe_interval, priors, found, menu, agree,
                      depth=2 if settings.async_scheduling and clock is None else 1, clock=clock)


class DeviceClock:
    """Steps on the device's timeline (CUDA; auto_budget's module docstring): `mark` at each proposal's
    start records an event on the current stream, the end of the step before and the start of the
    next; `ready` hands back the steps whose both events have completed (no sync)."""

    def __init__(self):
        self._marks: collections.deque = collections.deque()  # (event, the step it ends, its key or None)
        self._free: list = []  # events read and done with, recorded again (none made per step once warm)

    def mark(self, step: int, key: tuple | None) -> None:
        """Now (on the stream) step `step` ends; key: its (kind, bucket) where it is timed, else None."""
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()
        self._marks.append((event, step, key))

    def ready(self) -> list[tuple[int, tuple, float]]:
        """(step, key, seconds on the device) of the timed steps whose end has completed, in order."""
        out = []
        while len(self._marks) >= 2 and self._marks[1][0].query():
            start = self._marks.popleft()[0]
            end, step, key = self._marks[0]
            if key is not None:
                out.append((step, key, start.elapsed_time(end) / 1e3))
            self._free.append(start)
        return out
