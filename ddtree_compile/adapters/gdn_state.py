"""The GatedDeltaNet state slots vLLM allotted an engine, and vLLM's own sampler held to them (either
model runner; vLLM 0.26 and 0.32 alike). adapters/gdn_slots.py sizes the slots."""

from __future__ import annotations


def _is_mamba(spec) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


def gdn_state_slots(runner) -> tuple[int, int]:
    """(state slots per request of the runner's GDN KV cache groups, 1 + their spec blocks; bytes one
    slot takes over every GDN layer: the layers' pages), from the KV cache config vLLM allotted;
    (0, 0) without GDN layers."""
    groups = [g for g in runner.kv_cache_config.kv_cache_groups if _is_mamba(g.kv_cache_spec)]
    if not groups:
        return 0, 0
    slots = {1 + g.kv_cache_spec.num_speculative_blocks for g in groups}
    if len(slots) != 1:
        raise RuntimeError(f"GDN KV cache groups with different state slots per request: {sorted(slots)}")
    return slots.pop(), sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)


class LimitedSampler:
    """Stands in for a runner's rejection sampler: vLLM's output cut to `max_tokens` tokens per request
    (-1 after; Model Runner V2 reads its counts, which follow). Lossless: a verify's output is a prefix
    the target agrees with, so its first `max_tokens` tokens are too (greedy: the target's argmax at
    each; sampling: each token drawn from the target's distribution given the ones before, and where
    the cut falls depends on the position only)."""

    def __init__(self, original, max_tokens: int):
        self.original = original
        self.max_tokens = max_tokens

    def __call__(self, *args, **kwargs):
        out = self.original(*args, **kwargs)
        out.sampled_token_ids[:, self.max_tokens:] = -1
        n = getattr(out, "num_sampled", None)  # V2 (`v1/worker/gpu/sample/output.py`)
        if n is not None:
            cut = (n - n.clamp(max=self.max_tokens)).to(out.num_rejected.dtype)
            n.clamp_(max=self.max_tokens)
            out.num_rejected.add_(cut)
        return out

    def __getattr__(self, name):
        return getattr(self.original, name)


def limit_accepted(runner, max_tokens: int) -> None:
    """vLLM's own rejection sampler on this runner (both runners call `runner.rejection_sampler`)
    emits at most `max_tokens` tokens per request."""
    if not isinstance(runner.rejection_sampler, LimitedSampler):
        runner.rejection_sampler = LimitedSampler(runner.rejection_sampler, max_tokens)
