#!/bin/bash
# The GPU issue's checks in one device command, after the bundle's install (README "On a GPU"):
#   bash .gpu-bundle/install.sh && bash benchmarks/run_gpu_checks.sh [NAME [pytest args]]
# NAME (default "all") names the result files, so that one kind per command fits the device's
# 10-minute limit:  run_gpu_checks.sh attn -k "not next";  run_gpu_checks.sh hybrid -k next
# Runs tests/test_gpu_vllm026.py when pytest is there (build the bundle with `make_bundle.sh DIR pytest`),
# else the same checks through benchmarks/gpu_e2e_026.py; the JSON goes to $OUT (the device tool's
# folder) or /tmp/ddtree-gpu. pytest runs from /tmp: from the repository root, `ddtree_compile/`
# (whose passes/ and templates/ live beside it) would shadow the installed package.
# NAME "attn_long" runs only the long-context tree attention check (serve case 9's shapes: Triton with its
# split-KV plan vs the float32 reference vs vLLM's FA3; benchmarks/_attn_checks.py) into
# $out/attn_long_context.json; extra arguments go to that script (e.g. --contexts 1536,2048).
set -u
. /tmp/vllm-env.sh
repo=$(pwd)
out=${OUT:-/tmp/ddtree-gpu}
name=${1:-all}; shift || true
mkdir -p "$out"
nvidia-smi -L
if [ "$name" = "attn_long" ]; then
  TRITON_INTERPRET=0 timeout ${GPU_CHECK_TIMEOUT:-540} python3 benchmarks/_attn_checks.py \
    --out "$out/attn_long_context.json" "$@" > "$out/log_$name.txt" 2>&1
  rc=$?
  grep -E "long_context|wrote|Error" "$out/log_$name.txt" | tail -60
  exit $rc
fi
if python3 -c "import pytest" 2>/dev/null; then
  cd /tmp && TRITON_INTERPRET=0 DDTREE_GPU_RESULTS="$out/gpu_vllm026_tests_$name.json" timeout ${GPU_CHECK_TIMEOUT:-540} \
    python3 -m pytest -q -x -s -p no:cacheprovider "$repo/tests/test_gpu_vllm026.py" "$@" > "$out/log_$name.txt" 2>&1
else
  timeout ${GPU_CHECK_TIMEOUT:-540} python3 benchmarks/gpu_e2e_026.py --out "$out/gpu_vllm026_tests_$name.json" > "$out/log_$name.txt" 2>&1
fi
rc=$?
grep -E "DDTree|Graph capturing|passed|failed|Error|kind:dtype|^qwen" "$out/log_$name.txt" | tail -60
exit $rc
