# Sourced by the GPU scripts (gpu_bf16.sh, gpu_compile.sh): the environment of a bare device machine.
#
# Installs dp-accounting and dm-tree from .gpuwheels/ when that folder is there (the GPU image lacks them and
# reaches no registry; see gpu_bf16.sh for how to make it), puts the checkout on PYTHONPATH with the top-level
# kernels/ folder under its import name dpzero_jax_kernels (what `pip install` would map; the image has no install
# of this library), turns on a persistent compilation cache, and records the GPU and the library's commit in
# $OUT/gpu.txt.
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
if [ -d .gpuwheels ]; then
  python3 -m pip install -q --no-deps --no-index .gpuwheels/*.whl 2>&1 | tail -2
fi
mkdir -p /tmp/dpzero_path
ln -sfn "$PWD/kernels" /tmp/dpzero_path/dpzero_jax_kernels
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/dpzero_path
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
git log --oneline -1 2>/dev/null | tee -a "$OUT/gpu.txt"
python3 -c "import jax, flax, optax, dpzero_jax, dpzero_jax_kernels; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())" \
  2>&1 | tee -a "$OUT/gpu.txt" || exit 1
