#!/usr/bin/env bash
# GPT-2 small computing in bfloat16 on one GPU: the private step against the non-private one, in one call.
#
#   1. bench_overhead.py --gpt2-small --modes auto: paired step times, temporaries + arguments, compile times
#      (CUDA graphs on, as a user runs it);
#   2. profile_step.py --gpt2-small --modes auto --norm-kernel pallas: the same step with the Mosaic GPU norm
#      kernels, timed beside the non-private step and profiled per source line (CUDA graphs off so that every
#      kernel carries its HLO instruction);
#   3. the same profile with XLA's norms (--norm-kernel xla).
#
# Each part has its own time limit so that one slow compile leaves the others' output. Logs and JSON go to $OUT
# (the device tool's output folder; /tmp/gpu_bf16 otherwise). gpu_env.sh sets up the bare machine; its persistent
# compilation cache lets parts 2 and 3 share the non-private step's compile. dp-accounting and dm-tree are installed
# from .gpuwheels/ when that folder is there (the GPU image lacks them and reaches no registry). Make it here,
# ignored by git, and name it in the device tool's `carry`:
#
#   pip download dp-accounting==0.6.0 dm-tree --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .gpuwheels
#   echo "/.gpuwheels/" >> .git/info/exclude
#
#   bash experiments/gpu_bf16.sh [LIMIT1 LIMIT2 LIMIT3]     # seconds per part (default 200 160 140)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_bf16}
source "$(dirname "$0")/gpu_env.sh"

timeout "${1:-200}" python3 experiments/bench_overhead.py --gpt2-small --modes auto --rounds 10 --warmup 2 \
  --out "$OUT/bench_overhead_bf16_auto.json" 2>&1 | tee "$OUT/bench_overhead_bf16_auto.log"
export XLA_FLAGS=--xla_gpu_enable_command_buffer=
timeout "${2:-160}" python3 experiments/profile_step.py --gpt2-small --modes auto --norm-kernel pallas \
  --out "$OUT/profile_bf16_auto_pallas.json" 2>&1 | tee "$OUT/profile_bf16_auto_pallas.log"
timeout "${3:-140}" python3 experiments/profile_step.py --gpt2-small --modes auto --norm-kernel xla \
  --out "$OUT/profile_bf16_auto_xla.json" 2>&1 | tee "$OUT/profile_bf16_auto_xla.log"
echo "done"
