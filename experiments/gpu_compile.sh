#!/usr/bin/env bash
# Why GPT-2 small's private step compiles ~4x longer than the non-private one on a GPU, in one device call.
#
# On an H200 (2026-11-30, docs/benchmarks/gpu.md) XLA's priority-fusion pass took 27.2 s of the private step's
# compile against 4.8 s for the non-private step, and `vmap` compiled as slowly as `bk`: the parts both private
# modes share were the likelier cost. Lowered for CUDA on a CPU (experiments/lowered_size.py), that step held 90k
# operations, 68k of them the noise's Threefry (JAX writes each call out in full there; two calls a gradient leaf,
# 149 leaves), against 10k for the non-private step. Since then the partitionable generator derives the keys in
# one call and draws the small leaves of one shape in one: 30k operations, 55 calls. This script measures, on the
# GPU:
#
#   1. bench_overhead.py --gpt2-small --modes auto (the library as it is), XLA's pass times logged
#      (xla_pass_times.py's table): compile, step time and memory against the reading above;
#   2. the same with JAX_THREEFRY_GPU_KERNEL_LOWERING=true: each remaining Threefry call one CUDA kernel (same bits,
#      written to memory before use).
#
# Make .gpuwheels/ and carry it as gpu_bf16.sh says; in the device tool: OUT=$OUT bash experiments/gpu_compile.sh
#
#   bash experiments/gpu_compile.sh [LIMIT1 LIMIT2]     # seconds per part (default 170 170)
#   WORKLOAD=--quick bash experiments/gpu_compile.sh    # a smoke test of the script on a CPU
set -uo pipefail
OUT=${OUT:-/tmp/gpu_compile}
source "$(dirname "$0")/gpu_env.sh"
unset JAX_COMPILATION_CACHE_DIR    # every compile is timed whole

for part in default threefry_kernel; do
  if [ "$part" = threefry_kernel ]; then export JAX_THREEFRY_GPU_KERNEL_LOWERING=true; limit=${2:-170}
  else limit=${1:-170}; fi
  TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=hlo_pass_pipeline=1 timeout "$limit" python3 experiments/bench_overhead.py \
      ${WORKLOAD:---gpt2-small} --modes auto --rounds 8 --warmup 1 --out "$OUT/bench_overhead_bf16_auto_$part.json" 2>&1 \
    | grep -v "hlo_pass_pipeline.cc:181\|Running HLO pass pipeline" > "/tmp/passes_$part.log"
  grep -v "^[IWE][0-9]\{4\} " "/tmp/passes_$part.log" | tail -30 | tee "$OUT/bench_overhead_bf16_auto_$part.log"
  python3 experiments/xla_pass_times.py "/tmp/passes_$part.log" --top 12 --out "$OUT/xla_passes_$part.json"
done
echo "done"
