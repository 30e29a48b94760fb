"""One DDTree round inside vLLM's V1 model runner (GPUModelRunner / CPUModelRunner).

The round's stages are the modules beside this one: draft.py (build the tree) -> verify.py ->
walk.py -> commit.py; `DDTreeState` composes them and holds the per-runner state.

`attach(runner, cfg)` (called by vllm_patch once the runner's KV caches exist) validates the
settings against the engine and installs instance-level wrappers on that runner (docs/runner_hooks.md):

  drafter.propose / _sample_draft_tokens   draft L positions, keep the logits, build the tree;
                                           the scheduler receives the B node tokens as drafts
  runner._prepare_inputs                   map this step's requests to their trees; positions
                                           start + depth; the tree metadata for the templates
  runner._model_forward                    the target verify runs with the tree context active
  runner.rejection_sampler                 walk the tree on the target logits; hand back
                                           [path tokens, bonus, -1 ...] (an accepted prefix)
  runner._update_states_after_model_execute  commit: K/V compaction, GDN state + conv window
  runner.propose_draft_token_ids           the drafter's context features: accepted path first

Request kinds in a step: a TREE row is walked by us; a CHAIN row (a request that needs sampling
features the walk does not implement: penalties, logprobs, top-k/p, structured output, ...) gets a
chain-shaped tree (its drafts verified causally, flat DFlash) and vLLM's own rejection sampler.
A step that is not uniform (a prefill or truncated drafts next to the trees) runs as a plain vLLM
chain verify of the scheduled node lists: lossless (a causal verify of any draft list is), counted.

Host syncs: none of our own inside a round (request-to-row maps and feature checks read host
state vLLM already has); vLLM's bookkeeping syncs on the sampled tokens every step anyway. The
CPU templates (torch references) sync internally (`.tolist()` loops); the CUDA ones do not.
"""

from __future__ import annotations

import random

import torch

from .. import config as config_mod, vllm_ops
from ..metrics import DDTreeMetrics, logger
from ..tree import ancestor_closure, pack_bits
from .checks import UnsupportedEngine, check_engine, classify_layers, validate
from .commit import CommitStage
from .draft import DraftStage
from .step import Pending, Step
from .verify import VerifyStage
from .walk import WalkStage, TreeSampler


def attach(runner, cfg: config_mod.DDTreeConfig) -> "DDTreeState | None":
    """Validate `cfg` against the engine; install the round on `runner`, or start as flat DFlash.

    Bad settings raise ValueError. An engine DDTree cannot serve (attention backend, model
    family, drafter kind) logs the reason once, counts it, and is left as flat DFlash.
    """
    if getattr(runner, "_ddtree", None) is not None:
        return runner._ddtree
    draft_len, num_spec = validate(runner.vllm_config, cfg)
    try:
        layers = classify_layers(runner)
        check_engine(runner)
    except UnsupportedEngine as e:
        from ..metrics import PROCESS_STARTUP_FALLBACKS

        PROCESS_STARTUP_FALLBACKS[str(e)] += 1
        logger.warning("DDTree is switched on but cannot run here: %s. Starting as flat DFlash "
                       "(num_speculative_tokens=%d).", e, num_spec)
        return None
    state = DDTreeState(runner, cfg, draft_len, layers)
    runner._ddtree = state
    return state


class DDTreeState(DraftStage, VerifyStage, WalkStage, CommitStage):
    """DDTree's per-runner state and the wrappers it installs (module docstring)."""

    def __init__(self, runner, cfg: config_mod.DDTreeConfig, draft_len: int, layers: dict):
        self.runner = runner
        self.cfg = cfg
        self.L = draft_len
        self.spec = cfg.tree_spec(draft_len)
        self.B = self.spec.budget
        self.N = self.B + 1
        self.max_depth = max(self.L, self.B)
        self.device = runner.device
        self.attn_layers = layers["attention"]
        self.gdn_layers = layers["gdn"]
        self.hybrid = bool(self.gdn_layers)
        self.metrics = DDTreeMetrics(min(self.L, self.B), self.device, cfg.log_interval)
        self.pending: Pending | None = None
        self.step: Step | None = None
        self._captured: torch.Tensor | None = None
        self._views: dict | None = None  # commit: per-group cache views (CommitStage._cache_views)
        self._reasons: dict[str, str | None] = {}
        self._seeds: dict[str, int] = {}
        self._rng = random.Random(runner.vllm_config.model_config.seed or 0)
        self._logged: set[str] = set()
        self.debug_gdn_records = False  # tests: record per-node GDN inputs in snapshots mode too
        self.commit_hooks: list = []  # tests: fn(state, info) after each GDN commit (per KV cache group)
        self.round_hooks: list = []  # demo/tests: fn(state, step) after each tree step's commit (host reads)
        self._chain = self._chain_template()
        self._kv_groups = self._groups(self.attn_layers)
        self._gdn_groups = self._groups(self.gdn_layers)
        self.metrics.kv_layouts = sorted({vllm_ops.kv_layout(self._layer(n)).name for n in self.attn_layers})
        self._install()
        logger.info("DDTree on: budget %d (requested %d), top_k %d, draft length %d, %s target, KV layout %s%s",
                    self.B, cfg.budget, cfg.top_k, self.L, "hybrid" if self.hybrid else "attention-only",
                    "/".join(self.metrics.kv_layouts), f", GDN state: {cfg.gdn_state}" if self.hybrid else "")

    # -- setup -----------------------------------------------------------------------------------
    def _install(self) -> None:
        r, d = self.runner, self.runner.drafter
        self._orig = {
            "propose": d.propose, "sample_draft": d._sample_draft_tokens,
            "prepare": r._prepare_inputs, "forward": r._model_forward, "sampler": r.rejection_sampler,
            "update": r._update_states_after_model_execute, "propose_ids": r.propose_draft_token_ids,
        }
        d.propose = self._propose
        d._sample_draft_tokens = self._sample_draft_tokens
        r._prepare_inputs = self._prepare_inputs
        r._model_forward = self._model_forward
        r.rejection_sampler = TreeSampler(self, r.rejection_sampler)
        r._update_states_after_model_execute = self._update_states_after_model_execute
        r.propose_draft_token_ids = self._propose_draft_token_ids
        self._redirected = r.vllm_config.compilation_config.mode == 0  # NONE: eager, no graph to rewrite
        if self._redirected:
            from ..vllm_patch import redirect_ops_for_eager

            redirect_ops_for_eager()

    def close(self) -> None:
        """The engine shuts down: drop the metrics and this engine's claim on the eager op redirect."""
        self.metrics.close()
        if self._redirected:
            from ..vllm_patch import release_eager_redirects

            self._redirected = False
            release_eager_redirects()

    def _chain_template(self):
        N, dev = self.N, self.device
        parents = torch.arange(-1, N - 1, device=dev)
        depths = torch.arange(N, device=dev)
        bits = pack_bits(ancestor_closure(parents.unsqueeze(0), N))[0]
        return parents, depths, bits

    def _groups(self, layer_names) -> dict[int, list[str]]:
        """KV cache group id -> the given layers in it (each group has its own block table / state lines)."""
        out = {}
        names = set(layer_names)
        for gid, group in enumerate(self.runner.kv_cache_config.kv_cache_groups):
            mine = [n for n in group.layer_names if n in names]
            if mine:
                out[gid] = mine
        return out

    def _layer(self, name):
        return self.runner.compilation_config.static_forward_context[name]

    def _h2d(self, values, dtype) -> torch.Tensor:
        """Host list -> device tensor without a stream sync (pinned staging on CUDA)."""
        host = torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)

    def _log_once(self, key: str, msg: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(msg, *args)

