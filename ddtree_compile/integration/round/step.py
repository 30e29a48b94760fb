"""The values the round's stages hand each other, and the per-engine context they share.

    build  --Pending-->  verify  --Step-->  walk  --Step (+ walk)-->  commit

`Pending` is what one step's drafter proposes for the next; `Step` is one tree verify, filled in
by verify (tree rows, positions, metadata) and walk (the accepted paths) and consumed by commit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from ...core.tree import TreeBatch, WalkResult
from ..metrics import logger
from ..tree_context import TreeVerifyMetadata
from .checks import unsupported_reason
from .workspace import max_slots


@dataclass(frozen=True)
class Proposal:
    """What the build hands the runner's driver for the next step."""

    drafts: torch.Tensor | None  # [R, b] the tree bucket's node tokens; None on a chain step
    chain: bool  # the drafts are the drafter's top-1 chain, as vLLM's drafter sampled them itself
    # the drafts are the trees the drafter's forward built (`drafter_tree`), no row rewritten since: a
    # drafter that wrote those trees' tokens where it writes its drafts needs no copy of them
    built_by_drafter: bool = False


@dataclass
class Pending:
    """Trees proposed at the end of a step, verified by the next one."""

    req_ids: list[str]
    tree: TreeBatch | None  # [R, n + 1] for this step's bucket of n nodes, slot 0 = the bonus token the
    # drafter started from; None: auto_chain
    top1: torch.Tensor | None  # [R, L] the drafter's argmax per depth (flat DFlash's chain; a view of the
    # build's top-k); None: auto_chain
    chain: list[str | None]  # per row: fallback reason (verify as a chain) or None (tree)
    auto_chain: bool = False  # budget "auto" or the draft schedule took the chain: the drafts are top1
    fixed: bool = False  # tree and top1 are views of the build's buffers at fixed addresses (drafter_tree)

    def __post_init__(self):
        self.index = {r: i for i, r in enumerate(self.req_ids)}


@dataclass
class Step:
    R: int
    N: int
    tree: TreeBatch  # [R, N]; chain rows are chain-shaped
    tree_rows: torch.Tensor  # bool [R] on device: walked by us
    chain_rows: list[bool]
    top1: torch.Tensor  # [R, L]
    start: torch.Tensor  # [R] cache position of the root (a view of the runner's positions: column 0 of
    # each request, which the tree's positions leave as it is)
    meta: TreeVerifyMetadata
    block_tables: dict = field(default_factory=dict)  # kv group id -> block table of the verify
    gdn_groups: dict = field(default_factory=dict)  # kv group id -> (state_indices, num_accepted) of the verify
    gdn_records: dict = field(default_factory=dict)  # kv group id -> (rec_kv, rec_gb) of all its layers
    gdn_records_all: tuple | None = None  # (rec_kv, rec_gb) of every GDN layer, in KV cache group order
    debug_pre: dict | None = None  # tests: GDN layer -> fp32 committed state [R, HV, V, K] before the verify
    walk: WalkResult | None = None  # combined (tree + chain rows) accepted paths
    fixed: bool = False  # tree, top1 and tree_rows are at addresses every such step shares (the build's
    # buffers: Pending.fixed, no row gathered or rewritten here)
    walk_fixed: bool = False  # walk's tensors are the walk graph's buffers (it replayed): fixed addresses
    verify_replayed: bool = False  # the verify replayed a FULL graph: the target's outputs are its buffers
    committed: bool = False  # commit_stage ran (once per step)
    t0: float = 0.0  # when the step was prepared (budget "auto" times its steps from here)

    def positions(self) -> torch.Tensor:
        """[R, N] start + depth: each node's position (the runner's buffer holds them only during the
        verify's forward, and no step pays for them where nothing else reads them: seeded sampling)."""
        return self.tree.positions(self.start).to(self.start.dtype)

    @property
    def has_tree(self) -> bool:
        """False for a whole-step fallback verified as chain-shaped trees (FULL CUDA graph engines)."""
        return not all(self.chain_rows)


class RoundContext:
    """What every stage reads: the settings, the runner (through the adapter's RunnerView), the
    layers by KV cache group, the metrics, and the per-request policy (chain reason, seed)."""

    def __init__(self, view, cfg, spec, draft_len: int, layers: dict, metrics):
        self.view = view
        self.cfg = cfg
        self.spec = spec
        self.L = draft_len
        self.B = spec.budget  # the largest tree bucket: vLLM's draft slots, the round's buffers
        self.N = spec.num_slots
        self.max_slots = max_slots(cfg, draft_len)  # the widest verify through the templates (workspace.py)
        self.menu = cfg.budget_menu(draft_len)  # the tree buckets a step may verify (budget "auto")
        self.max_depth = max(self.L, self.B)
        self.device = view.device
        self.attn_layers = layers["attention"]
        self.gdn_layers = layers["gdn"]
        self.hybrid = bool(self.gdn_layers)
        self.metrics = metrics
        self.auto = None  # budget "auto": the per-step tree-or-chain policy (auto_budget.py), set by the round
        # steps may verify the drafter's chain by choice (budget "auto", the scheduler's draft counts): set by the round
        self.chain_steps = False
        self.kv_groups = self._groups(self.attn_layers)
        self.gdn_groups = self._groups(self.gdn_layers)
        self._reasons: dict[str, str | None] = {}
        self._seeds: dict[str, int] = {}
        self._own: dict[str, bool] = {}  # whether a request's seed is its own (sampling params)
        self._rng = random.Random(view.settings.seed)
        self._logged: set[str] = set()

    def _groups(self, layer_names) -> dict[int, list[str]]:
        """KV cache group id -> the given layers in it (each group has its own block table / state lines)."""
        names = set(layer_names)
        out = {}
        for gid, group in enumerate(self.view.kv_cache_groups()):
            mine = [n for n in group if n in names]
            if mine:
                out[gid] = mine
        return out

    def layer(self, name):
        return self.view.layer(name)

    def h2d(self, values, dtype) -> torch.Tensor:
        """Host list -> device tensor without a stream sync (pinned staging on CUDA)."""
        host = torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)

    def log_once(self, key: str, msg: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(msg, *args)

    def _per_request(self, cache: dict, req_id: str, value):
        """cache[req_id], set to value(sampling params) at the request's first step; past a few batches'
        worth of requests the finished ones are forgotten (from every per-request cache)."""
        if req_id in cache:
            return cache[req_id]
        got = cache[req_id] = value(self.view.sampling_params(req_id))
        if len(cache) > 4 * self.view.max_num_reqs + 64:
            live = self.view.live_req_ids()
            for c in (self._reasons, self._seeds, self._own):
                for k in [k for k in c if k not in live]:
                    del c[k]
        return got

    def chain_reason(self, req_id: str) -> str | None:
        """Why this request is verified as a chain by vLLM's sampler, or None (cached per request)."""
        return self._per_request(self._reasons, req_id, unsupported_reason)

    def own_seed(self, req_id: str) -> bool:
        """Whether the request brought its own sampling seed (budget "auto" keeps its steps' kinds)."""
        return self._per_request(self._own, req_id, lambda sp: sp is not None and sp.seed is not None)

    def seed(self, req_id: str) -> int:
        """The request's sampling seed (its own, else a draw from the engine's seeded generator)."""
        return self._per_request(self._seeds, req_id,
                                 lambda sp: sp.seed if sp.seed is not None else self._rng.getrandbits(62))
