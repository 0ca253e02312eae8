#!/usr/bin/env bash
# The GPU run: property tests on NCCL, then the round-trip benchmark next to
# Megatron-Core. Writes everything under $OUT (default ./gpu-out).
# Usage on the device machine, from the repository root:
#   DISPATCH_COMMIT=<sha> bash bench/gpu_suite.sh [tests|bench|all]
# Files: $OUT/suite.txt (machine, test and benchmark log), $OUT/results/*.json|md.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
what=${1:-all}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
export DISPATCH_COMMIT=${DISPATCH_COMMIT:-$(git rev-parse --verify -q HEAD || echo unknown)}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
  python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" 2>&1 | tail -1
} > "$OUT/suite.txt" 2>&1
cat "$OUT/suite.txt"
status=0
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 420 python3 -m pytest -q -p no:cacheprovider tests 2>&1 | tee -a "$OUT/suite.txt" | tail -25
  status=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for args in "--world-size 4" "--world-size 4 --no-check --baselines none" "--world-size 2"; do
    echo "== dispatch-bench --shape deepseek-v3 $args"
    timeout 240 python3 -m dispatch.bench --shape deepseek-v3 --iters 40 --warmup 5 $args --out "$OUT/results" 2>&1 \
      | tee -a "$OUT/suite.txt" | grep -v "^\[" | tail -12
  done
fi
exit $status
