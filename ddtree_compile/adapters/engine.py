"""Reads of an engine's config and process that do not depend on the model runner (V1 or V2) and mean
the same in vLLM 0.26 and 0.32: the settings the round checks itself against, the plugin's switches,
the tensor-parallel rank."""

from __future__ import annotations

from .interface import EngineSettings


def engine_settings(vllm_config) -> EngineSettings:
    """What the round checks and sizes itself by, read once from an engine's VllmConfig (the same
    fields in 0.26 and 0.32)."""
    sc, mc, cc = vllm_config.speculative_config, vllm_config.model_config, vllm_config.compilation_config
    cache = vllm_config.cache_config
    align = bool(mc.is_hybrid) and getattr(cache, "mamba_cache_mode", "none") == "align"
    base = dict(is_hybrid=bool(mc.is_hybrid), compiled=cc.mode != 0,
                mamba_align_block_size=int(cache.mamba_block_size) if align else None,
                post_grad_pass=(cc.inductor_passes or {}).get("post_grad_custom_post_pass"),
                additional_config=dict(vllm_config.additional_config or {}), seed=mc.seed or 0, model=str(mc.model),
                max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
                served_model_name=str(mc.served_model_name),
                async_scheduling=bool(getattr(vllm_config.scheduler_config, "async_scheduling", False)))
    if sc is None:
        return EngineSettings(spec_method=None, **base)
    draft = sc.draft_model_config
    block = getattr(getattr(draft, "hf_config", None), "block_size", None)
    return EngineSettings(spec_method=sc.method, num_speculative_tokens=sc.num_speculative_tokens,
                          draft_block_size=block, padded_drafter_batch=not sc.disable_padded_drafter_batch,
                          draft_model=str(getattr(draft, "model", "")), **base)


def settings_of(runner) -> EngineSettings:
    """The settings of the engine a runner (either model runner) belongs to."""
    return engine_settings(runner.vllm_config)


def engine_switches(runner) -> tuple[dict, object]:
    """(additional_config, the post-grad pass vLLM resolved) of a runner's engine (either model runner):
    what the plugin's hooks read before deciding whether the engine is DDTree's at all."""
    vc = runner.vllm_config
    return dict(vc.additional_config or {}), vc.compilation_config.inductor_compile_config.get("post_grad_custom_post_pass")


def tp_rank() -> int:
    """This process's tensor-parallel rank."""
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def tp_agree():
    """None at tensor-parallel size 1; else obj -> rank 0's obj on every rank (vLLM's TP group
    broadcast: its shared-memory queue where vLLM set one up, else the group's CPU collective), for a
    host decision that every rank must take alike although each rank computes it from its own timings."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return None
    return lambda obj: group.broadcast_object(obj, src=0)
