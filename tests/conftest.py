"""Suite-wide environment, set before any test module imports triton, vLLM or huggingface_hub."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub, ever
os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run in the interpreter on CPU
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in-process: faster, patchable
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test`'s two workers share 2 cores: torch's default (one OpenMP thread per core) in each makes
    # every op a barrier across both cores, and a worker's ops wait on the other's busy core (the suite
    # took longer than in one process). One thread each, the processes they start too (an engine's
    # steps on these tiny models are serial Python anyway; vLLM's serving default is 1 as well, which
    # its CPU worker cannot apply in-process).
    os.environ.setdefault("OMP_NUM_THREADS", "1")


import gc  # noqa: E402

import pytest  # noqa: E402

# `make test` runs the suite on two pytest-xdist workers, a whole module at a time (--dist loadfile,
# module-scoped engines stay shared) in collection order (--no-loadscope-reorder). The modules that
# take longest come first, so the two workers end together instead of one starting a long module last;
# the rest keep their order. The seconds are each module's tests in the two-worker run on 2 cores (28:21
# in all; the multi-process modules there share the cores with the other worker). One process: the
# order as written.
LONGEST_FIRST = (
    "test_runner_v2_cpu.py",  # 395
    "test_serve_hybrid.py",  # 347
    "test_passes_vllm.py",  # 334
    "test_runner_v2_compiled_cpu.py",  # 279
    "test_e2e_tp.py",  # 257
    "test_e2e_attention.py",  # 219
    "test_e2e_hybrid.py",  # 179
    "test_bench_serve.py",  # 118
    "test_tree_gdn.py",  # 103
    "test_partial_drafts.py",  # 77
    "test_auto_budget_engine.py",  # 62
    "test_e2e_compiled.py",  # 61
    "test_e2e_mrope.py",  # 57
    "test_oracle.py",  # 53
    "test_dump.py",  # 53
    "test_e2e_config.py",  # 49
    "test_v2_cpu_kernels.py",  # 46
)


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's tests keep their order


# Once per test process (pytest_configure / pytest_unconfigure, in each xdist worker too):
#
# Cyclic garbage is collected at safe points only: after each test module and in engines.shutdown.
# vLLM's CPU GEMM handles have a `__del__` that fails inside a fake-tensor trace, and an automatic
# collection can fall inside the next engine's compile (ddtree_compile/engines.py); vLLM itself turns
# the collector off around CUDA graph capture for the same kind of reason.
#
# DDTREE_TEST_CPU_ATTN_ISA=vec16 (or vec) and DDTREE_TEST_CPU_KIND=avx512_bf16 (or plain) start every
# engine of the suite with that KV layout and that CPU kind's start-up choices, those another CPU would
# get (`make test-layouts`; ddtree_compile/testing/cpu_choices.py). Subprocess engines apply the same
# variables themselves.
_CPU_CHOICE_VARS = ("DDTREE_TEST_CPU_ATTN_ISA", "DDTREE_TEST_CPU_KIND")
_GC_WAS_ENABLED = gc.isenabled()


def pytest_configure(config):
    gc.disable()
    if any(os.environ.get(k) for k in _CPU_CHOICE_VARS):
        from ddtree_compile.testing import cpu_choices

        cpu_choices.apply_from_env()


def pytest_unconfigure(config):
    if any(os.environ.get(k) for k in _CPU_CHOICE_VARS):
        from ddtree_compile.testing import cpu_choices

        cpu_choices.reset()
    if _GC_WAS_ENABLED:
        gc.enable()


@pytest.fixture(autouse=True, scope="module")
def _collect_after_each_module():
    yield
    gc.collect()


@pytest.fixture(scope="module")
def compile_caches_off(tmp_path_factory):
    """Every engine of the module compiles afresh, so the tree-verify pass really runs (a cached
    artifact would skip it)."""
    import torch._inductor.config as inductor_config

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    mp.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    mp.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm_cache")))
    # Inductor read that variable when it was imported: set its config too, through its own patch()
    # (monkeypatch's undo deletes a torch config entry instead of restoring it).
    with inductor_config.patch(force_disable_caches=True):
        yield
    mp.undo()


@pytest.fixture(scope="module")
def tiny_fp32_reference(tmp_path_factory, request):
    """Tiny float32 Qwen3 + its DFlash drafter, an `llm(**kw)` factory (an `e2e.engine` context: eager,
    float32, stats on) and the no-speculation outputs of the module's PROMPTS x MAX_TOKENS: the reference
    the oracle drafts from and that lossless runs must equal token for token."""
    from ddtree_compile.testing import e2e, harness, models

    prompts, max_tokens = request.module.PROMPTS, request.module.MAX_TOKENS
    root = tmp_path_factory.mktemp("tiny_fp32")
    target = models.write_tiny_model("qwen3", root / "qwen3")
    drafter = models.write_tiny_dflash_drafter(target, root / "dflash")

    def llm(**kw):
        return e2e.engine(**models.tiny_llm_kwargs(target, enforce_eager=True, dtype="float32", disable_log_stats=False,
                                                   **kw))

    with llm() as ref_llm:
        outs = e2e.generate(ref_llm, prompts, max_tokens)
    return {"root": root, "target": target, "drafter": drafter, "llm": llm, "ref": outs,
            "reference": harness.reference_from_outputs(prompts, outs)}


@pytest.fixture(scope="module")
def bench():
    """benchmarks/bench_e2e_gpu.py as a module (loading it puts benchmarks/ on sys.path: its helper
    modules import by name)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_e2e_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_e2e_gpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
