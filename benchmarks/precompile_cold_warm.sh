#!/usr/bin/env bash
# Cold vs warm engine start on the GPU: `ddtree-compile precompile` twice with the same settings, in two
# processes. The first run fills vLLM's compile cache (and Triton's); the second finds it warm, as a later
# `vllm serve` with the same settings would. Both cost tables keep `starts` (seconds per budget).
#   bash benchmarks/precompile_cold_warm.sh OUTDIR [TARGET] [BUDGETS] [MAX_BATCH]
set -euo pipefail
out=${1:?OUTDIR}; target=${2:-qwen35_4b}; budgets=${3:-32}; max_batch=${4:-4}
models=/tmp/ddtree_shapes
mkdir -p "$out"
python3 -c "import pathlib, sys; sys.path.insert(0, 'benchmarks'); import _e2e_engine as b; \
b.write_shaped('$target', pathlib.Path('$models'))"
kw='{"load_format": "dummy", "dtype": "bfloat16", "gpu_memory_utilization": 0.5, "max_model_len": 1024,
     "additional_config": {"gdn_prefill_backend": "triton"}}'
export TRITON_CACHE_AUTOTUNING=1
for run in cold warm; do
  t0=$(date +%s.%N)
  ddtree-compile precompile --model "$models/$target" --draft "$models/${target}_dflash" --budgets "$budgets" \
    --max-batch "$max_batch" --llm-kwargs "$kw" --out "$out/precompile_${target}_$run.json" 2>&1 \
    | grep -E "^\[|cost table|Compil|torch.compile|Directly load|load failure|Graph capturing|Error|error" | tail -n 25
  echo "$run: whole process $(python3 -c "import time; print(round(time.time() - $t0, 1))") s"
done
python3 - "$out" "$target" <<'PY'
import json, sys
out, target = sys.argv[1:]
for run in ("cold", "warm"):
    t = json.load(open(f"{out}/precompile_{target}_{run}.json"))
    print(run, "engine start s:", {b: round(s, 1) for b, s in t["starts"].items()},
          "round ms:", [(r["budget"], r["batch"], round(r["round_ms"], 2)) for r in t["buckets"]])
PY
