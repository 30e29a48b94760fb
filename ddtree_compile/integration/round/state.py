"""One DDTree round inside vLLM's model runner, as four stages that hand each other values:

    build_stage   drafter logits -> trees                              -> Pending
    verify_stage  Pending + vLLM's scheduled batch -> tree metadata, target forward -> Step
    walk_stage    Step + target logits -> accepted paths (Step.walk), the tokens vLLM sees
    commit_stage  Step -> K/V compaction, GDN state + conv window, drafter inputs reordered

`attach(runner, cfg)` (the adapter calls it once the runner's KV caches exist) validates the
settings against the engine and builds `DDTreeRound`, whose phase methods (propose, drafter_topk,
schedule, forward or verify_begin / verify_end, sample, commit, drafter_inputs) the runner's driver
calls in the runner's own order (adapters/v1_driver.py: V1's members; adapters/v2_driver.py: Model
Runner V2's objects). The round holds only the value in flight between phases: the Pending of the
last proposal and the Step being verified.

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

import dataclasses
import time

import torch

from ... import adapters
from ...core.buckets import gdn_request_bytes
from ...core.walk import drafter_order
from .. import config as config_mod
from ..engines import set_state, state_of
from ..metrics import PROCESS_STARTUP_FALLBACKS, DDTreeMetrics, logger
from ..tree_ops import kv_layout, redirect_ops, release_redirects, release_trace, traced
from .auto_setup import from_config as auto_policy
from .auto_setup import serveable_menu
from .build_stage import BuildStage
from .checks import UnsupportedEngine, check_engine, classify_layers, gdn_spec_blocks, validate
from .commit_stage import CommitStage
from .step import Pending, Proposal, RoundContext, Step
from .verify_stage import Armed, VerifyStage
from .walk_stage import WalkStage
from .workspace import release as release_workspace


def attach(runner, cfg: config_mod.DDTreeConfig) -> "DDTreeRound | None":
    """Validate `cfg` against the engine; install the round on `runner`, or start as flat DFlash.

    Bad settings raise ValueError. An engine DDTree cannot serve (attention backend, model
    family, drafter kind) logs the reason once, counts it, and is left as flat DFlash.
    """
    if state_of(runner) is not None:
        return state_of(runner)
    view = adapters.current().view_of(runner)
    draft_len, num_spec = validate(view.settings, cfg)
    slots = view.gdn_state_slots()[0]
    try:
        layers = classify_layers(view)
        check_engine(view, layers["attention"])
    except UnsupportedEngine as e:
        release_workspace(runner)  # what vLLM's memory profile reserved for the round goes back
        # (op_swap "trace": this engine's graphs keep the mirrors, which run vLLM's ops outside a tree
        # verify; the process's torch.ops.vllm is vLLM's again for the engines that come next)
        release_trace(runner)
        PROCESS_STARTUP_FALLBACKS[str(e)] += 1
        limited = ""
        if 0 < slots < 1 + num_spec:  # the GDN state slots were sized for the round's chain (gdn_slots.py)
            view.limit_accepted(slots)
            limited = f", at most {slots - 1} drafts accepted per step: its GDN state slots"
        logger.warning("DDTree is switched on but cannot run here: %s. Starting as flat DFlash "
                       "(num_speculative_tokens=%d%s).", e, num_spec, limited)
        return None
    state = DDTreeRound(runner, view, cfg, draft_len, layers)
    set_state(runner, state)
    return state


class DDTreeRound:
    """The stages of one engine's round and the hooks that feed them (module docstring)."""

    def __init__(self, runner, view, cfg: config_mod.DDTreeConfig, draft_len: int, layers: dict):
        spec = cfg.tree_spec(draft_len)
        self.metrics = DDTreeMetrics(min(draft_len, spec.budget), view.device, cfg.log_interval)
        self.ctx = ctx = RoundContext(view, cfg, spec, draft_len, layers, self.metrics)
        reason = view.budget_auto_unsupported() if cfg.auto else None
        if reason is not None:
            PROCESS_STARTUP_FALLBACKS[reason] += 1
            logger.warning("DDTree: %s; verifying the tree of auto_budget=%d nodes every step.", reason, spec.budget)
            ctx.menu = ctx.menu[-1:]  # every step the largest bucket: no smaller bucket to estimate
        elif cfg.auto:
            ctx.menu, reason = serveable_menu(ctx.menu, draft_len, view.schedules_draft_counts())
            if reason is not None:
                PROCESS_STARTUP_FALLBACKS[reason] += 1
                logger.warning("DDTree: %s; budget \"auto\" chooses among trees of %s nodes and the chain.",
                               reason, "/".join(map(str, ctx.menu)))
            ctx.auto = auto = self.metrics.auto = auto_policy(cfg, self.metrics, view.settings, spec.budget,
                                                              draft_len, ctx.menu, adapters.current().tp_agree())
            view.hold_seeded_with(lambda buckets: {b: auto.drafts[k] for b, k in auto.hold_seeded(buckets).items()})
        ctx.chain_steps = ctx.auto is not None or view.schedules_draft_counts()
        self.max_tokens = self._gdn_state_slots(view, cfg, draft_len) if ctx.hybrid else None
        self.build_stage = BuildStage(ctx)
        self.verify_stage = VerifyStage(ctx, self.build_stage.fixed_trees)
        self.walk_stage, self.commit_stage = WalkStage(ctx), CommitStage(ctx)
        self.pending: Pending | None = None
        self.step: Step | None = None
        self.armed: Armed | None = None  # the Step whose target forward the runner is running (verify_begin)
        self._plain = False  # a forward without a Step is running (verify_begin .. verify_end)
        self.round_hooks: list = []  # demo/tests: fn(round, step) after each tree step's commit (host reads)
        self.metrics.kv_layouts = sorted({kv_layout(ctx.layer(n)).name for n in ctx.attn_layers})
        view.install_driver(self, draft_len)  # the runner's driver calls the phases below
        wanted = self.verify_stage.graphs.query_lens()
        full = view.install_graph_capture(self.verify_stage.graphs.capture, wanted)
        if full and wanted - full:
            logger.info("DDTree: no FULL CUDA graphs for %s tokens per request on this runner (vLLM's own: %s): "
                        "those steps run PIECEWISE", sorted(wanted - full), sorted(full))
        ws = self.verify_stage.workspace
        if ws.nbytes:
            # sized for max_num_seqs requests (round/workspace.py): a server's default of 1024 costs KV cache
            logger.info("DDTree: workspace %.2f GiB for max_num_seqs %d (GDN records and depth stack, tree-attention "
                        "scratch; %s during vLLM's memory profile)", ws.nbytes / 2**30, view.max_num_reqs,
                        "reserved" if ws.reserved == ws.nbytes else f"{ws.reserved / 2**30:.2f} GiB reserved")
        # vLLM's ops point at the mirrors: an eager engine's from here, a traced one's since its model
        # loaded (integration/plugin.py); either way this engine's shutdown releases them
        was_traced = traced(runner)
        self._redirected = view.eager or was_traced
        if view.eager and not was_traced:
            from ...passes.rules import load_rules

            redirect_ops(load_rules())
        loop = "Model Runner V2" if adapters.current().is_runner_v2(runner) else "the V1 runner"
        loop += ", async scheduling" if view.settings.async_scheduling else ", synchronous"
        if view.settings.compiled:
            loop += "; ops swapped " + ("before the trace (op_swap trace)" if was_traced else "by the tree-verify pass")
        logger.info("DDTree on: budget %d (requested %s), top_k %d, draft length %d, %s target, KV layout %s%s; %s",
                    ctx.B, f"auto: {'/'.join(map(str, ctx.menu))} or the chain" if cfg.auto else cfg.budget,
                    cfg.top_k, ctx.L, "hybrid" if ctx.hybrid else "attention-only",
                    "/".join(self.metrics.kv_layouts), f", GDN state: {cfg.gdn_state}" if ctx.hybrid else "", loop)

    @staticmethod
    def _gdn_state_slots(view, cfg, draft_len: int) -> int | None:
        """The most tokens a step may commit per request, when vLLM allotted the GDN state slots of
        the drafter's chain (1 + L, adapters/gdn_slots.py) rather than of its draft slots (1 + K);
        else None. Logs the slots and what they cost per request."""
        slots, slot_bytes = view.gdn_state_slots()
        K = view.settings.num_speculative_tokens
        wanted = gdn_spec_blocks(view.settings, cfg)
        if wanted is not None and slots != 1 + wanted:
            reason = (f"GatedDeltaNet state slots: vLLM allotted {slots} per request where the replay strategy "
                      f"needs {1 + wanted} (the engine's KV cache spec was not sized by DDTree's plugin)")
            PROCESS_STARTUP_FALLBACKS[reason] += 1
            logger.warning("DDTree: %s; requests keep %d slots.", reason, slots)
        if slots not in (1 + K, 1 + draft_len) or (slots < 1 + K and cfg.gdn_state != "replay"):
            raise RuntimeError(f"DDTree: {slots} GatedDeltaNet state slots per request, expected {1 + K} "
                               f"(num_speculative_tokens + 1) or, replaying the state, {1 + draft_len} (L + 1)")
        GiB, vllms = 2**30, gdn_request_bytes(1 + K, slot_bytes) / 2**30
        logger.info("DDTree: GatedDeltaNet state: %d slots per request, %.3f GiB per request%s", slots,
                    gdn_request_bytes(slots, slot_bytes) / GiB,
                    "" if slots == 1 + K else f" (vLLM's {1 + K} for num_speculative_tokens {K}: {vllms:.3f} GiB)")
        return slots if slots < 1 + K else None

    # tests and tools reach the stages' switches through the round
    @property
    def commit_hooks(self) -> list:
        return self.commit_stage.commit_hooks

    @property
    def debug_gdn_records(self) -> bool:
        return self.verify_stage.debug_gdn_records

    @debug_gdn_records.setter
    def debug_gdn_records(self, on: bool) -> None:
        self.verify_stage.debug_gdn_records = on

    def close(self) -> None:
        """The engine shuts down: drop the metrics, the device buffers (whoever still holds this round
        or the runner, e.g. vLLM's graph wrappers through the runner's driver, keeps no GPU memory
        alive through them) and this engine's claim on the eager op redirect."""
        self.metrics.close()
        self.verify_stage.close()
        self.walk_stage.graphs.close()
        self.commit_stage.close()
        self.pending = self.step = self.armed = None
        if self._redirected:
            self._redirected = False
            release_redirects()

    # -- the round's phases, called by each runner's driver in that runner's order ------------------
    # (V1: adapters/v1_driver.py, from V1's members; Model Runner V2: adapters/v2_driver.py, from
    # V2's speculator, model state and rejection sampler). One step: propose (build) -> schedule ->
    # forward or verify_begin/verify_end (verify) -> sample (walk) -> commit -> drafter_inputs.
    def propose(self, run_drafter, num_reqs: int, roots) -> Proposal:
        """`run_drafter(chain)` runs vLLM's drafter for the L positions of num_reqs requests, whose logits
        reach `drafter_topk` on the way where the next step verifies a tree (chain False; True: a chain
        step, flat DFlash's drafting where the runner has it); `roots()` -> [R] each request's bonus
        token (read for trees).
        -> the next step's drafts (Proposal)."""
        proposal, self.pending = self.build_stage.propose(run_drafter, num_reqs, roots)
        return proposal

    def drafter_topk(self, logits: torch.Tensor) -> torch.Tensor:
        """Where vLLM samples the drafts: logits [R * L, V] of the drafter's L positions (its LM head's)
        -> their top-1 tokens [R * L], the top-k kept for the build. Device work only (a drafter CUDA
        graph may hold it)."""
        return self.build_stage.drafter_topk(logits)

    def drafter_tree(self, R: int, roots: torch.Tensor) -> torch.Tensor | None:
        """After `drafter_topk`, where the runner's drafter runs (a drafter CUDA graph may hold it): the
        trees of the R requests rooted at `roots` [R], into fixed buffers (BuildStage.drafter_tree).
        -> [R, B] the largest tree's node tokens (each bucket's drafts are their first columns), or
        None where the trees are built after the drafter."""
        return self.build_stage.drafter_tree(R, roots)

    def hook_topk(self, fn, R: int) -> torch.Tensor | None:
        """A test or benchmark drafter hook's own top-k lists after a drafter graph that skipped it
        (BuildStage.hook_topk): their top-1 [R * L], or None (then `drafter_topk` of its logits)."""
        return self.build_stage.hook_topk(fn, R)

    def schedule(self, scheduled_drafts: dict[str, list[int]], num_scheduled_tokens) -> None:
        """vLLM prepared the step's inputs: the proposal meets the batch it scheduled -> the Step."""
        pending, self.pending = self.pending, None
        self.step = self.verify_stage.prepare(pending, scheduled_drafts, num_scheduled_tokens)

    def forward(self, run_forward, **inputs):
        """The target forward, for a runner whose forward the round wraps (V1's `_model_forward`)."""
        if self.step is None:
            if self.verify_stage.graphs.check_plain_forward(self.ctx.view.full_graph_batch()):
                self.metrics.plain_graph_steps += 1
            out = run_forward(**inputs)
            self.verify_stage.repair_plain_forward()  # (inside the forward's context: its metadata)
            return out
        return self.verify_stage.forward(self.step, run_forward, **inputs)

    def verify_begin(self, positions: torch.Tensor) -> None:
        """A runner that runs the target forward itself, in whichever form (Model Runner V2: eager,
        compiled, PIECEWISE graphs or a FULL replay; no Python hook reaches all of them), calls this once
        the step's inputs are ready, with the positions tensor it hands the target; `verify_end` once
        the forward's output is read (before sampling)."""
        self._plain = False
        self.verify_end()  # (a forward whose output was never sampled)
        if self.step is None:
            if self.verify_stage.graphs.check_plain_forward(self.ctx.view.full_graph_batch()):
                self.metrics.plain_graph_steps += 1
            self._plain = True
            return
        self.armed = self.verify_stage.arm(self.step, positions)

    def verify_end(self) -> None:
        armed, self.armed = self.armed, None
        if armed is not None:
            self.verify_stage.disarm(armed)
        plain, self._plain = self._plain, False
        if plain:  # (the runner's metadata is still this forward's: verify_begin clears it first)
            self.verify_stage.repair_plain_forward()

    def sample(self, logits: torch.Tensor, batch, vllm_sample):
        """The verify's logits -> vLLM's sampler output: tree rows walked, chain rows through
        `vllm_sample(logits)` (vLLM's own rejection sampler on the step's drafts, one-hot). `batch`: the
        step's verify inputs as the driver has them (V1: `V1Verify`; V2: the InputBatch), for the view."""
        out = self.walk_stage.sample(self.step, vllm_sample, batch, logits)
        step, P = self.step, self.max_tokens
        if P is None:
            return out
        # Tree paths are at most L deep; chain rows and chain-verified steps may accept more drafts
        # than the GDN state slots hold: cut them (host reads only: the step's shape and vLLM's counts).
        # A chain-verified step may mix rows of every kind (full or cut drafts, none, prefill chunks):
        # only tokens past P are dropped, so a row that kept fewer keeps vLLM's counts.
        if step is not None and step.N > P and any(step.chain_rows):
            self._cap_walk(step, P)
            return self._cap_tokens(out, P)
        ks = self.ctx.view.drafts_per_request(batch) if step is None else None  # (host values)
        if ks is not None and max(ks) >= P:
            return self._cap_tokens(out, P)
        return out

    def _cap_tokens(self, out, P: int):
        """vLLM's sampled tokens cut to `P` per request: a prefix of what the target agreed with is
        committed losslessly (greedy: its argmax at each; sampling: each token is drawn from its
        distribution given the ones before, and where the cut falls depends on the position only)."""
        view = self.ctx.view
        tokens = view.sampled_tokens(out)[0]
        if tokens.shape[1] <= P:
            return out
        tokens = tokens.clone()
        tokens[:, P:] = -1
        return view.replace_sampled(out, tokens, torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device))

    @staticmethod
    def _cap_walk(step, P: int) -> None:
        """The step's accepted paths cut to `P` nodes (root included), as the commit and the drafter read them."""
        w = step.walk
        accepted, tokens = w.accepted.clone(), w.tokens.clone()
        accepted[:, P:] = -1
        tokens[:, P:] = -1
        num = w.num_accepted.clamp(max=P)
        bonus = torch.where(w.num_accepted > P, w.tokens[:, P - 1], w.bonus)
        step.walk = dataclasses.replace(w, accepted=accepted, num_accepted=num, tokens=tokens, bonus=bonus,
                                        order=drafter_order(accepted, step.N))

    def commit(self, vllm_update):
        """The step's accepted paths into vLLM's caches (K/V, GDN state in vLLM's chain layout), then
        `vllm_update()`, vLLM's own update after sampling (accepted counts from the sampled tokens;
        with prefix caching, the block-boundary copies, which read the state the commit left).
        Once per step: a second call only runs `vllm_update`."""
        step = self.step
        if step is None or step.walk is None or step.committed:
            return vllm_update()
        t0 = time.perf_counter()
        self.commit_stage.commit(step)
        step.committed = True
        self.metrics.add_time("commit", time.perf_counter() - t0)  # (DDTree's own: not vLLM's update)
        out = vllm_update()
        if step.has_tree:  # (an all-chain Step is a counted whole-step fallback, see verify_stage)
            self.metrics.tree_steps += 1
            self.metrics.budget_steps[step.N - 1] += 1
            self.metrics.maybe_log()
            for hook in self.round_hooks:
                hook(self, step)
        return out

    def drafter_inputs(self, aux_hidden_states) -> None:
        """Before the drafter's next proposal: its inputs (the target's hidden states of the step)
        reordered, accepted path first. The step ends here."""
        step, self.step = self.step, None
        if step is not None and step.walk is not None:
            self.commit_stage.reorder_drafter_inputs(step, aux_hidden_states)
