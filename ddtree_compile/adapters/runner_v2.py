"""Model Runner V2 (vLLM 0.26 and 0.32): DDTree has no round there yet, so a V2 engine that asks for it
is refused once, logged and counted, and runs flat DFlash; the advice fits the engine (a DFlash
drafter mixing sliding and full attention cannot run on the V1 runner at all)."""

from __future__ import annotations

from .v1_runner import patch_after


def refuse_ddtree_on_runner_v2(line: str, on_runner_v2) -> None:
    """Patch Model Runner V2's `initialize_kv_cache` (if this build has V2): `on_runner_v2(runner,
    reason, advice)` runs once its caches exist. V2 has none of the round hooks: the caller refuses
    DDTree there (logged once, counted) and the engine runs flat DFlash."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    except Exception:  # Model Runner V2 needs Triton; builds without it have no V2 engines
        return

    def after(runner, args, kwargs) -> None:
        on_runner_v2(runner, f"vLLM {line} runs this engine on Model Runner V2, which has no DDTree round hooks "
                     "(they exist in the V1 GPUModelRunner only)", _v2_advice(runner.vllm_config))

    patch_after(RunnerV2, "initialize_kv_cache", after)


def _v2_advice(vllm_config) -> str:
    """What a user of a V2 engine can do: V1 is a way out unless the drafter forces V2 (0.26:
    `config/vllm.py:564-568`, `_dflash_needs_multi_kv_group` `:593-603`; V1 then raises in
    `qwen3_dflash.py:103-113`; 0.32 the same, `qwen3_dflash.py:156-166`)."""
    draft = getattr(getattr(vllm_config, "speculative_config", None), "draft_model_config", None)
    layer_types = set(getattr(getattr(draft, "hf_config", None), "layer_types", None) or ())
    if {"sliding_attention", "full_attention"} <= layer_types:
        return ("it runs as flat DFlash: its DFlash drafter mixes sliding-window and full attention layers, "
                "which vLLM serves on Model Runner V2 only")
    return "it runs as flat DFlash; set VLLM_USE_V2_MODEL_RUNNER=0 to use the V1 runner"
