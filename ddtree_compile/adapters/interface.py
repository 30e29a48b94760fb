"""The runner interface: everything the round reads or writes of a vLLM model runner, declared once.

The round (integration/round/) holds a `RunnerView` and calls only what is declared here; each
adapter implements it for one runner and release line (v1_runner.V1RunnerView for the V1
`GPUModelRunner` of 0.26 and 0.32, subclassed per release; runner_v2.V2RunnerView for Model Runner
V2 of both, a subclass of the V1 view that shares its forward-time reads). tests/test_adapters.py checks that every
`view.<name>` the package uses is declared here and that each adapter implements all of it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class EngineSettings:
    """The engine settings the round checks and sizes itself by, read once from vLLM's config by the
    adapter (`engine_settings`), so no module outside the adapters reads vLLM's config objects."""

    spec_method: str | None  # speculative_config.method (None: no speculation)
    num_speculative_tokens: int = 0  # vLLM's draft slots per request (K)
    draft_block_size: int | None = None  # the DFlash drafter's block size (L + 1)
    padded_drafter_batch: bool = True
    is_hybrid: bool = False  # a target with GatedDeltaNet (Mamba-like) layers
    compiled: bool = True  # compilation mode != NONE: there is a graph for the tree pass to rewrite
    post_grad_pass: object = None  # compilation_config.inductor_passes['post_grad_custom_post_pass'] (name)
    additional_config: dict = field(default_factory=dict)
    seed: int = 0
    model: str = ""
    draft_model: str = ""
    max_num_seqs: int = 1
    served_model_name: str = ""
    async_scheduling: bool = False  # as vLLM resolved it (for the start-up line: the loop DDTree runs in)
    # hybrid prefix caching ("align"): the block size at whose boundaries vLLM caches GDN states, else None
    mamba_align_block_size: int | None = None


@dataclass(frozen=True)
class SpecBatch:
    """The drafts of a verify as vLLM's rejection sampler gets them."""

    drafts_per_request: list[int]
    draft_tokens: torch.Tensor  # [sum(drafts_per_request)], request after request
    sample_rows: torch.Tensor  # the rows of the step's hidden states whose logits are sampled


class RunnerView(abc.ABC):
    """One engine's model runner as the round sees it, under names that do not depend on vLLM's."""

    # set by the implementation's __init__
    runner: object  # the vLLM runner itself: only adapters and engine bookkeeping touch it
    settings: EngineSettings
    device: torch.device
    dtype: torch.dtype
    max_num_reqs: int
    eager: bool  # no compiled graph: the ops are redirected to the tree ops in Python

    # -- refusals --------------------------------------------------------------------------------
    @abc.abstractmethod
    def unsupported_features(self) -> str | None:
        """An engine feature the round does not serve (logged once, counted, flat DFlash), or None."""

    @abc.abstractmethod
    def budget_auto_unsupported(self) -> str | None:
        """Why budget "auto" cannot verify a chain step here (the round then verifies the tree every
        step, logged once, counted), or None."""

    def schedules_draft_counts(self) -> bool:
        """The scheduler gives each step budget "auto"'s draft count: a tree bucket's or the chain's
        (draft_schedule.py)."""
        return False

    def next_draft_count(self) -> int | None:
        """Drafts per request the scheduler already gave the next step, where it decides them (budget
        "auto" on Model Runner V2: draft_schedule.py), else None: the drafts the round proposes."""
        return None

    def choose_draft_count(self, R: int, count: int) -> bool:
        """Budget "auto"'s choice for batches of R's bucket (`count` drafts per request: the chain's L or
        a tree bucket's b), handed to a scheduler that decides the draft count (next_draft_count); False
        where there is none to hand it to."""
        return False

    def hold_seeded_with(self, counts) -> None:
        """Where the scheduler decides the draft counts (next_draft_count): `counts(buckets)` -> {bucket:
        drafts per request} of the kinds seeded steps take, written before each schedule that has a
        request with its own seed (draft_schedule.hold_seeded). Elsewhere the round proposes each step's
        kind itself: nothing to hold."""

    def gdn_takes_short_drafts(self) -> bool:
        """Whether vLLM's own GatedDeltaNet verify takes fewer drafts per request than
        num_speculative_tokens (budget "auto"'s chain steps); where not, the round verifies them as
        chain-shaped trees through its templates, and repairs the conv lines of the rows vLLM verified
        itself (`gdn_short_spec_rows`)."""
        return True

    def gdn_short_spec_rows(self, layer_name: str, num_spec: int) -> list[tuple[int, int]]:
        """(state line, query length) of the spec-decode rows of the forward just run (its GDN metadata,
        this layer's KV cache group) whose query is shorter than 1 + num_spec; host values, read only
        where `gdn_takes_short_drafts` is False (CPU: no device to sync)."""
        return []

    @abc.abstractmethod
    def has_drafter(self) -> bool:
        """The engine runs a DFlash drafter whose logits the round (and the test harnesses) can read."""

    # -- the round's driver on this runner -------------------------------------------------------
    @abc.abstractmethod
    def install_driver(self, round_, draft_len: int) -> None:
        """Make this runner instance drive `round_` (integration/round/state.py DDTreeRound): call its
        phases (propose, drafter_topk, schedule, forward or verify_begin/verify_end, sample, commit,
        drafter_inputs) in the runner's own order, the drafter drafting `draft_len` positions
        (V1: v1_driver.py; Model Runner V2: v2_driver.py)."""

    @abc.abstractmethod
    def install_graph_capture(self, capture, query_lens=()) -> set[int]:
        """Make the runner capture its FULL uniform-decode graphs with `capture(num_tokens, num_reqs,
        capturing)`'s tree context active (None: the graph keeps the original ops), for its own
        query length and, where the runner can, each of `query_lens` (tokens per request); returns
        the query lengths that get FULL graphs (empty when the engine has none)."""

    # -- the step's requests ---------------------------------------------------------------------
    @abc.abstractmethod
    def num_reqs(self) -> int: ...

    @abc.abstractmethod
    def req_ids(self, R: int) -> list[str]: ...

    @abc.abstractmethod
    def live_req_ids(self) -> set[str]: ...

    @abc.abstractmethod
    def sampling_params(self, req_id: str): ...

    @abc.abstractmethod
    def temperatures_host(self, R: int): ...

    @abc.abstractmethod
    def scheduled_drafts(self, scheduled) -> dict[str, list[int]]:
        """Request id -> the drafts the scheduler put in this step (absent: none; the round reads
        only how many). `scheduled`: what the runner prepared the step's inputs from, as its driver
        has it (V1: the SchedulerOutput; V2: the InputBatch)."""

    # -- the sampler's inputs and output -----------------------------------------------------------
    # `batch`: the step's verify inputs as the runner's driver hands them to the round's `sample`
    @abc.abstractmethod
    def sampling_temperature(self, batch) -> torch.Tensor | None:
        """Per-request temperatures [R] of the step, or None when every request is greedy."""

    @abc.abstractmethod
    def spec_batch(self, batch) -> SpecBatch | None:
        """The verify's drafts, or None on a step that verifies none."""

    @abc.abstractmethod
    def drafts_per_request(self, batch) -> list[int] | None:
        """The verify's draft count per request, read on the host (no device work), or None on a step
        that verifies none."""

    @abc.abstractmethod
    def sampled_tokens(self, sampler_output) -> tuple[torch.Tensor, object]:
        """(sampled token ids [R, 1+K] with -1 after the accepted ones, logprobs or None) of vLLM's sampler."""

    @abc.abstractmethod
    def sampler_output(self, sampled_token_ids: torch.Tensor, logprobs_tensors=None, counts=None):
        """What the rejection sampler hands the runner for a tree step: sampled ids [R, 1+K] (the
        accepted path + bonus, -1 after; int32). counts: int32 [2, R], per row the tokens sampled and
        the query's tokens rejected, where the walk's graph made them (then the ids and counts are
        that graph's buffers, rewritten by its next replay: a runner that keeps them past the step
        copies them); else the runner counts them."""

    @abc.abstractmethod
    def replace_sampled(self, sampler_output, tokens: torch.Tensor, rows: torch.Tensor):
        """vLLM's sampler output with rows `rows` (bool [R]) replaced by `tokens` [R, W] (path +
        bonus, -1 after; W = vLLM's width); returns the output the runner gets. A row may hold no
        drafts or a chunk of a prefill (no token kept): what vLLM counted for it stays its count
        of the step, less the tokens the replacement drops."""

    @abc.abstractmethod
    def prompt_token_ids(self, req_id: str) -> list[int]: ...

    # -- positions and the verify batch ------------------------------------------------------------
    @abc.abstractmethod
    def positions(self, T: int) -> torch.Tensor:
        """Flat positions of the step's T tokens (slot mapping, tree attention context)."""

    def tree_positions(self, positions: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """The target's position input for a tree verify of `depths` [R, N] (a new tensor).

        `positions` is what vLLM hands the model: flat [T_pad], or with M-RoPE [3, T_pad], where
        every draft token's three rows hold flat + the request's delta (both runners: V1's
        `_calc_mrope_positions` completion branch, V2's rope state for decode tokens). A node's
        rotary position is its root's (vLLM's value at slot 0) plus its depth in every row; the
        runner's flat positions (start + column) stay what the slot mapping reads."""
        out = positions.clone()
        self.write_tree_positions(out, depths)
        return out

    def write_tree_positions(self, positions: torch.Tensor, depths: torch.Tensor, R: int | None = None) -> None:
        """`tree_positions` written into `positions` itself, in one launch: of the first R requests' N
        columns each, columns 1..N-1 become the request's column 0 (its root, left as it is) plus
        `depths` [R, N]; no other column changes. With `depths` [1, N] and R given, every request
        gets those depths: `arange(N)` puts back vLLM's own positions of a uniform decode step (its
        query tokens at consecutive positions from the root's), so no copy of them is kept."""
        R = depths.shape[0] if R is None else R
        N = depths.shape[-1]
        if N < 2:
            return
        depths = depths[:, 1:] if depths.dtype == positions.dtype else depths[:, 1:].to(positions.dtype)
        if positions.dim() == 1:
            cols = positions[: R * N].view(R, N)
            torch.add(cols[:, :1], depths, out=cols[:, 1:])
            return
        cols = positions[:, : R * N].view(positions.shape[0], R, N)
        torch.add(cols[:, :, :1], depths.unsqueeze(0), out=cols[:, :, 1:])

    @abc.abstractmethod
    def verify_positions(self, logits_indices: torch.Tensor) -> torch.Tensor: ...

    @abc.abstractmethod
    def full_graph_batch(self) -> tuple[int, int] | None:
        """For the step's target forward: (padded tokens, padded requests) when it replays a FULL
        uniform-decode CUDA graph, else None (PIECEWISE or eager: the ops' Python runs)."""

    @abc.abstractmethod
    def input_ids(self) -> torch.Tensor:
        """The step's input-id buffer (the drafter reads it after the verify)."""

    # -- layers, KV and GDN state addressing ---------------------------------------------------------
    @abc.abstractmethod
    def layer(self, name: str): ...

    @abc.abstractmethod
    def classify_layers(self) -> tuple[list[str], list[str], list[str]]:
        """(attention, Qwen GatedDeltaNet, other sequence-state layers) of the target."""

    @abc.abstractmethod
    def kv_cache_groups(self) -> list[list[str]]: ...

    @abc.abstractmethod
    def block_table(self, layer_name: str, R: int) -> torch.Tensor: ...

    @abc.abstractmethod
    def gdn_spec_addressing(self, layer_name: str, R: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(state_indices [R, 1+K], num_accepted [R]) of a pure spec-decode GDN batch: vLLM's own
        tensors (views; read them, copy before writing)."""

    @abc.abstractmethod
    def gdn_state_slots(self) -> tuple[int, int]:
        """(GDN state slots vLLM allotted per request: 1 + its spec blocks, from the engine's KV cache
        config; bytes of one slot over every GDN layer), (0, 0) without GDN layers. Columns of
        `gdn_spec_addressing` past the slots hold vLLM's null block (adapters/gdn_slots.py)."""

    @abc.abstractmethod
    def limit_accepted(self, max_tokens: int) -> None:
        """From now on vLLM's own rejection sampler on this runner emits at most `max_tokens` tokens per
        request (a prefix of its output: lossless), for an engine the round does not serve whose GDN
        state slots are fewer than 1 + num_speculative_tokens."""

    # -- the drafter -----------------------------------------------------------------------------------
    @abc.abstractmethod
    def drafter_draft_len(self) -> int: ...

    @abc.abstractmethod
    def drafter_compute_logits(self, hidden_states) -> torch.Tensor: ...

    @abc.abstractmethod
    def drafter_root_positions(self, R: int) -> torch.Tensor:
        """Token index of each request's bonus token in the drafter's current forward ([R])."""

    @abc.abstractmethod
    def wrap_drafter_logits(self, fn, topk=None, flat=None) -> None:
        """The drafter's compute_logits -> fn(original, hidden_states); `topk`: the hook's own top-k
        lists (BuildStage.hook_topk), `flat`: its fn(drafts [R, L]) rewriting drafts in place as it
        rewrites flat DFlash's (a chain step's), for where a drafter graph replays past the wrapped method."""

    @abc.abstractmethod
    def unwrap_drafter_logits(self) -> None: ...

    def drafter_hook_topk(self):
        """The `topk` a drafter hook wrapped with, where the round takes it (Model Runner V2), else None."""
        return None

    def drafter_hook_flat(self):
        """The `flat` a drafter hook wrapped with, where the round takes it (Model Runner V2), else None."""
        return None

    def wrap_flat_drafts(self, fn) -> bool:
        """Where vLLM's flat DFlash samples its drafts inside a CUDA graph (no Python reached there):
        fn(drafts [R, L] on the device) rewrites them after each proposal. False where not needed."""
        return False

    def unwrap_flat_drafts(self) -> None:
        return None
