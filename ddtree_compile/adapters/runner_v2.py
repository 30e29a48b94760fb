"""Model Runner V2 (`vllm/v1/worker/gpu/`, vLLM 0.26 and 0.32): the RunnerView and the class patches.

V2 has none of V1's round members; v2_driver.py drives the round from V2's own objects (its
speculator, model state and rejection sampler, re-typed as DDTree subclasses), so build / verify /
walk / commit are the same stages on both runners (docs/runner_v2.md has the lines of both releases).
The target forward is V2's own in every form (eager, compiled, PIECEWISE, FULL): the tree verify is
set before it.

Served: V2's default loop (async scheduling on: the round is device work between V2's own host steps,
no host sync of its own, and the host learns the committed tokens through V2's asynchronous output one
step later, as for flat DFlash) and the synchronous one; greedy and seeded sampling, chain rows
through V2's own rejection sampler with one-hot drafts
(lossless: the drafts are the tree's, not samples of the drafter's distribution), attention-only and
GatedDeltaNet hybrids, M-RoPE, eager engines and torch.compile with PIECEWISE / FULL_AND_PIECEWISE
graphs (tree verifies replay FULL graphs captured through V2's graph manager; the drafter's graphs are
captured for L queries). Refused at attach (unsupported_features): pure FULL graphs, V2's breakable
graphs, custom logits processors, hybrid prefix caching other than "align", a user's dynamic draft schedule.
Budget "auto" under async scheduling: the tree or the chain per step through vLLM's per-batch-size draft
counts (draft_schedule.py); in the synchronous loop it verifies the tree every step."""

from __future__ import annotations

import numpy as np
import torch

from .draft_schedule import SCHEDULER_CLS, DraftSchedule, runs_draft_schedule
from .v1_runner import V1RunnerView, model_features_unsupported, patch_after, patch_before

_SHARED = "_ddtree_v2"  # on the runner instance: what every view of that runner reads (_Shared)


class _Shared:
    """Per runner, set by the round's driver (v2_driver.py) and read by every view of the runner (the round's, a test
    harness's): V2 keeps a request's SamplingParams and prompt nowhere on the host, and passes the
    step's InputBatch as an argument instead of holding it."""

    def __init__(self):
        self.requests: dict = {}  # req_id -> (SamplingParams, prompt token ids)
        self.batch = None  # the InputBatch of the step in flight
        self.attn_metadata: dict = {}  # layer name -> metadata of the step (model_state.prepare_attn)
        self.cg_mode = None  # (InputBatch, CUDA-graph mode) of the last model_state.prepare_attn
        self.next_drafts: int | None = None  # drafts per request the scheduler gave the next step (auto)
        self.capture_reqs: int | None = None  # requests of the graph V2 is capturing (prepare_dummy_inputs)
        self.schedule = None  # budget "auto": the scheduler's draft counts (draft_schedule.DraftSchedule)
        self.draft_schedule: bool | None = None  # vLLM runs a draft schedule the round serves (draft_schedule.py)


def runner_v2_class():
    """Model Runner V2's class, or None on a build without it (V2 needs Triton)."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    except Exception:
        return None
    return RunnerV2


def is_runner_v2(runner) -> bool:
    cls = runner_v2_class()
    return cls is not None and isinstance(runner, cls)


def patch_kv_caches_ready(on_kv_caches_ready) -> bool:
    """After Model Runner V2's `initialize_kv_cache` (0.26 `model_runner.py:411`; no profiling pass
    there) `on_kv_caches_ready(runner)` runs: the caches exist, the round may attach. Before its
    `execute_model`, the draft count the scheduler gave the next step is recorded for the runner's
    views (`_Shared.next_drafts`; budget "auto": draft_schedule.py). False on a build without V2 or if
    already patched."""
    cls = runner_v2_class()
    if cls is None:
        return False
    patch_before(cls, "execute_model", _record_schedule)
    return patch_after(cls, "initialize_kv_cache", lambda runner, args, kwargs: on_kv_caches_ready(runner))


def _record_schedule(runner, args, kwargs) -> None:
    shared = runner.__dict__.get(_SHARED)
    if shared is not None:
        scheduler_output = args[0] if args else kwargs.get("scheduler_output")
        shared.next_drafts = getattr(scheduler_output, "num_spec_tokens_to_schedule", None)


def patch_load_model(on_model_load) -> bool:
    """Before Model Runner V2's `load_model` (0.26 `model_runner.py:276`): a warm start loads the
    compiled graph, which calls the ddtree ops, from vLLM's compile cache (as V1's)."""
    cls = runner_v2_class()
    return cls is not None and patch_before(cls, "load_model", lambda runner, args, kwargs: on_model_load(runner))


def patch_profile_run(on_memory_profile) -> bool:
    """Before Model Runner V2's `profile_run` (0.26 `:673`, inside the worker's memory profile as V1's):
    the round's workspace is reserved there. False on a build without V2 or if already patched."""
    cls = runner_v2_class()
    return cls is not None and patch_before(cls, "profile_run", lambda runner, args, kwargs: on_memory_profile(runner))


class V2RunnerView(V1RunnerView):
    """The RunnerView of Model Runner V2. Forward-time reads (block tables, GDN addressing, layer
    kinds) are V1's: V2 builds the same attention metadata and binds the same caches."""

    def __init__(self, runner):
        super().__init__(runner)  # the same runner fields in V2 (settings, device, dtype, max_num_reqs, eager)
        self.speculator = runner.speculator
        if not hasattr(runner, _SHARED):  # the first view of this runner: before the round's driver
            setattr(runner, _SHARED, _Shared())
        self._shared = getattr(runner, _SHARED)
        self._requests = self._shared.requests

    @property
    def batch(self):
        return self._shared.batch

    # -- refusals ---------------------------------------------------------------------------------
    def unsupported_features(self) -> str | None:
        vc = self.runner.vllm_config
        mc, cc = vc.model_config, vc.cache_config
        mode = vc.compilation_config.cudagraph_mode
        if mode is not None and mode.has_full_cudagraphs() and not mode.separate_routine():
            # Pure FULL also captures mixed batches as FULL graphs; the tree context is captured into
            # the uniform-decode graphs only (install_graph_capture).
            return (f"cudagraph_mode={mode.name} (FULL graphs for mixed batches); use FULL_AND_PIECEWISE, "
                    f"FULL_DECODE_ONLY or PIECEWISE")
        if getattr(getattr(self.runner, "cudagraph_manager", None), "use_breakable_cg", False):
            return "breakable CUDA graphs of Model Runner V2 (the round hooks vLLM's compiled piecewise graphs)"
        if type(self.speculator).__name__ != "DFlashSpeculator":
            return f"a {type(self.speculator).__name__} speculator (DDTree needs V2's DFlash speculator)"
        schedule = getattr(vc.speculative_config, "num_speculative_tokens_per_batch_size", None)
        if schedule and not self.schedules_draft_counts():
            return ("a dynamic draft schedule (num_speculative_tokens_per_batch_size) with counts other than the "
                    "chain's L and the tree's budget (or budget \"auto\"'s menu), or without async scheduling")
        return model_features_unsupported(mc, cc)

    def budget_auto_unsupported(self) -> str | None:
        own = self.runner.vllm_config.scheduler_config.scheduler_cls
        if own is not None and own != SCHEDULER_CLS:
            return (f"budget 'auto' with a scheduler class of the user's (scheduler_cls={own}): the round writes "
                    f"its per-batch-size draft counts through its own ({SCHEDULER_CLS})")
        if self.schedules_draft_counts():
            return None
        return ("budget 'auto' on Model Runner V2 without async scheduling, with data parallelism or with workers "
                "of their own (vLLM's per-batch-size draft counts carry the choice, written where the scheduler "
                "runs: draft_schedule.py)")

    def schedules_draft_counts(self) -> bool:
        shared = self._shared
        if shared.draft_schedule is None:  # (read once: next_draft_count asks at every step)
            shared.draft_schedule = runs_draft_schedule(self.runner.vllm_config, self.settings)
        return shared.draft_schedule

    def next_draft_count(self) -> int | None:
        return self._shared.next_drafts if self.schedules_draft_counts() else None

    def choose_draft_count(self, R: int, count: int) -> bool:
        s = self._shared
        s.schedule = s.schedule or DraftSchedule(self.runner.vllm_config)
        return s.schedule.choose(R, count)

    def hold_seeded_with(self, counts) -> None:
        if self.schedules_draft_counts():
            s = self._shared
            s.schedule = s.schedule or DraftSchedule(self.runner.vllm_config)
            s.schedule.hold_seeded_with(counts)

    def has_drafter(self) -> bool:
        return self.speculator is not None

    # -- requests of the current step ---------------------------------------------------------------
    def num_reqs(self) -> int:
        return self.batch.num_reqs

    def req_ids(self, R: int) -> list[str]:
        return list(self.batch.req_ids[:R])

    def sampling_params(self, req_id: str):
        return self._requests.get(req_id, (None, ()))[0]

    def live_req_ids(self) -> set[str]:
        return set(self.runner.req_states.req_id_to_index)

    def temperatures_host(self, R: int):
        return self.runner.sampler.sampling_states.temperature.np[self.batch.idx_mapping_np[:R]]

    def scheduled_drafts(self, scheduled) -> dict[str, list[int]]:
        """`scheduled` is the InputBatch (V2's model state prepares the inputs from it); the drafts
        themselves live on the device, so the lists hold placeholders of the right length."""
        b = scheduled
        per_req = b.num_draft_tokens_per_req
        if not b.num_draft_tokens or per_req is None:
            return {}
        R = b.num_reqs
        return {q: [-1] * int(n) for q, n in zip(b.req_ids[:R], per_req[:R]) if n > 0}

    # -- the sampler's inputs and output ---------------------------------------------------------------
    def sampling_temperature(self, batch) -> torch.Tensor | None:
        R = self.batch.num_reqs
        host = self.temperatures_host(R)
        if not (host >= 1e-5).any():
            return None
        temp = self.runner.sampler.sampling_states.temperature.gpu[self.batch.idx_mapping[:R]]
        return torch.where(temp < 1e-5, torch.zeros_like(temp), temp)

    def spec_batch(self, batch):
        from .interface import SpecBatch

        b = batch  # the InputBatch
        ks = self.drafts_per_request(b)
        if ks is None:
            return None
        starts = b.query_start_loc_np[: b.num_reqs]
        rows = np.concatenate([np.arange(s + 1, s + 1 + k) for s, k in zip(starts, ks)] or [np.zeros(0, np.int64)])
        rows = torch.from_numpy(rows.astype(np.int64))
        if b.input_ids.is_cuda:  # pinned + non_blocking: under async scheduling the host must not wait here
            rows = rows.pin_memory()
        draft_tokens = b.input_ids[rows.to(b.input_ids.device, non_blocking=True)]
        return SpecBatch(ks, draft_tokens, b.logits_indices)

    def drafts_per_request(self, batch) -> list[int] | None:
        b = batch  # the InputBatch: V2 keeps the counts on the host (numpy)
        if not b.num_draft_tokens or b.num_draft_tokens_per_req is None:
            return None
        return [int(k) for k in b.num_draft_tokens_per_req[: b.num_reqs]]

    def sampled_tokens(self, sampler_output) -> tuple[torch.Tensor, object]:
        """V2 leaves the columns past num_sampled unspecified: -1 there, as V1 writes them."""
        ids = sampler_output.sampled_token_ids
        col = torch.arange(ids.shape[1], device=ids.device)
        keep = col.unsqueeze(0) < sampler_output.num_sampled.to(ids.device).unsqueeze(1)
        return torch.where(keep, ids, torch.full_like(ids, -1)), sampler_output.logprobs_tensors

    def sampler_output(self, sampled_token_ids: torch.Tensor, logprobs_tensors=None, counts=None):
        """V2 reads the counts (sampled, and rejected: the query's tokens not sampled), not the padding."""
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        if counts is None:
            b = self.batch
            R = sampled_token_ids.shape[0]
            num_sampled = (sampled_token_ids != -1).sum(1).to(torch.int32)
            query_len = (b.query_start_loc[1: R + 1] - b.query_start_loc[:R]).to(torch.int32)
            num_rejected = query_len - num_sampled
        else:  # (a graph's buffers: V2 copies the output to the host on its own stream, past this step)
            num_sampled, num_rejected = counts.clone()
        return SamplerOutput(sampled_token_ids=sampled_token_ids.to(torch.int64), logprobs_tensors=logprobs_tensors,
                             num_nans=None, num_sampled=num_sampled, num_rejected=num_rejected)

    def replace_sampled(self, sampler_output, tokens: torch.Tensor, rows: torch.Tensor):
        """V2 reads the counts, not the padding: they are replaced with the ids. The tokens a row
        loses become rejected ones, counted from V2's own values: a row of a chunked prefill (V2 set
        0 sampled, 0 rejected) keeps them, and so does every row not replaced. Recounting from the
        drafts (drafts + 1 - sampled) would reject a token of such a row and move V2's device
        num_computed_tokens one short of the scheduler's."""
        out = sampler_output
        ids = out.sampled_token_ids
        ids.copy_(torch.where(rows.unsqueeze(1), tokens.to(ids.dtype), ids))
        n = torch.where(rows, (tokens != -1).sum(1).to(out.num_sampled.dtype), out.num_sampled)
        out.num_rejected.add_((out.num_sampled - n).to(out.num_rejected.dtype))
        out.num_sampled.copy_(n)
        return out

    def prompt_token_ids(self, req_id: str) -> list[int]:
        return list(self._requests.get(req_id, (None, ()))[1])

    # -- positions and the verify batch ----------------------------------------------------------------
    def positions(self, T: int) -> torch.Tensor:
        return self.batch.positions[:T]

    def verify_positions(self, logits_indices: torch.Tensor) -> torch.Tensor:
        return self.batch.positions[logits_indices]

    def full_graph_batch(self) -> tuple[int, int] | None:
        """The step's batch as V2 padded it to its FULL graph's descriptor (`prepare_inputs`), when the
        mode V2 prepared this batch's attention for is FULL."""
        batch, mode = self._shared.cg_mode or (None, None)
        if batch is None or batch is not self.batch or mode.name != "FULL":
            return None
        return batch.num_tokens_after_padding, batch.num_reqs_after_padding

    def _query_len(self) -> int:
        return 1 + self.settings.num_speculative_tokens  # V2's one uniform decode length

    def input_ids(self) -> torch.Tensor:
        return self.batch.input_ids

    # -- layers and caches -------------------------------------------------------------------------------
    def layer(self, name: str):
        return self.runner.vllm_config.compilation_config.static_forward_context[name]

    def _attn_metadata(self) -> dict:
        """The step's metadata as `model_state.prepare_attn` built it: a FULL graph replays without a
        forward context (`run_fullgraph`), so it is not read from there."""
        return self._shared.attn_metadata

    def _drafter_layer_names(self) -> set[str]:
        return set(getattr(self.speculator, "draft_attn_layer_names", ()) or ())

    # -- the drafter -------------------------------------------------------------------------------------
    def drafter_draft_len(self) -> int:
        return self.speculator.num_speculative_steps  # L while the round drafts (V2Driver)

    def drafter_compute_logits(self, hidden_states) -> torch.Tensor:
        return self.speculator.model.compute_logits(hidden_states)

    def drafter_root_positions(self, R: int) -> torch.Tensor:
        """The DFlash query block of each request starts with its bonus token at its flat position
        (the speculator's input buffers; V2 drafts on flat positions, M-RoPE targets included)."""
        L = self.drafter_draft_len()
        return self.speculator.input_buffers.positions[: R * (1 + L)].view(R, 1 + L)[:, 0]

    def wrap_drafter_logits(self, fn, topk=None, flat=None) -> None:
        model = self.speculator.model
        original = model.compute_logits
        model.compute_logits = lambda hidden_states: fn(original, hidden_states)
        model.__dict__["_ddtree_hook_topk"], model.__dict__["_ddtree_hook_flat"] = topk, flat

    def unwrap_drafter_logits(self) -> None:
        for name in ("compute_logits", "_ddtree_hook_topk", "_ddtree_hook_flat"):
            self.speculator.model.__dict__.pop(name, None)

    def drafter_hook_topk(self):
        return self.speculator.model.__dict__.get("_ddtree_hook_topk")

    def drafter_hook_flat(self):
        return self.speculator.model.__dict__.get("_ddtree_hook_flat")

    def drafter_hooked(self) -> bool:
        """A drafter hook (integration/drafter_logits.py) wraps compute_logits: eager Python, which a
        replay of the drafter's CUDA graph skips (the driver then runs it after the graph)."""
        return "compute_logits" in self.speculator.model.__dict__

    def wrap_flat_drafts(self, fn) -> bool:
        """vLLM's own flat DFlash on V2 samples its drafts inside the drafter's FULL graph (0.26
        `dflash/speculator.py` `_generate_draft`), where a wrapped compute_logits is never called:
        after each proposal fn(drafts) rewrites them in place (benchmark oracles). The requests' prompts
        are tracked for the views, as the round's driver does. False where DDTree's round runs (it
        computes the drafter's logits eagerly, so the logits hook reaches it)."""
        from ..integration.engines import state_of
        from .v2_driver import FlatOracleSpeculator, TrackedModelState, retype

        r, s = self.runner, self.speculator
        if state_of(r) is not None or s is None:
            return False
        retype(s, FlatOracleSpeculator, _ddtree_shared=self._shared, _ddtree_oracle=fn)
        retype(r.model_state, TrackedModelState, _ddtree_requests=self._shared)
        return True

    def unwrap_flat_drafts(self) -> None:
        """Undo wrap_flat_drafts, and only that."""
        from .v2_driver import FlatOracleSpeculator, retyped_as, vllm_class

        s = self.speculator
        if s is not None and retyped_as(s, FlatOracleSpeculator):
            for obj in (s, self.runner.model_state):
                obj.__class__ = vllm_class(obj)
                for name in ("_ddtree_shared", "_ddtree_oracle", "_ddtree_requests"):
                    obj.__dict__.pop(name, None)

    # -- the round's driver on this runner ------------------------------------------------------------------
    def install_graph_capture(self, capture, query_lens=()) -> set[int]:
        """V2 captures its graphs in `cudagraph_manager.capture(model, ...)` (0.26 `cudagraph_utils.py:
        440-565`): each FULL descriptor's warm-up and capture call `model(**inputs)` (attention metadata
        set, runtime mode NONE; the capture inside `torch.cuda.graph`). The manager is re-typed
        (v2_driver.retype) so that its capture hands V2 the model inside `_CaptureModel`, which runs
        those forwards inside `capture(num_tokens, num_reqs, capturing)`'s tree context, with the
        request count V2 hands `model_state.prepare_dummy_inputs` (recorded by the driver's model
        state). FULL graphs of V2's own lengths only: 1 + K, and with budget "auto"'s schedule the
        chain's 1 + L (`query_lens` are not added)."""
        from .v2_driver import TreeCaptureManager, retype

        manager = getattr(self.runner, "cudagraph_manager", None)
        mode = self.runner.vllm_config.compilation_config.cudagraph_mode
        if manager is None or mode is None or not mode.has_full_cudagraphs():
            return set()
        retype(manager, TreeCaptureManager, _ddtree_capture=(capture, self._shared, self._query_len()))
        lens = {self._query_len()}
        if self.schedules_draft_counts():
            lens.add(1 + self.drafter_draft_len())
        return lens

    def install_driver(self, round_, draft_len: int) -> None:
        from .v2_driver import V2Driver

        V2Driver(self, round_, draft_len).install()

