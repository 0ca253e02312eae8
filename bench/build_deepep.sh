#!/usr/bin/env bash
# Build DeepEP's public source, intranode kernels only (no NVSHMEM, no -rdc), for the
# DeepEP rows of dispatch-bench (dispatch/bench/deepep_baseline.py), on the GPU machine.
# The source is never committed: it lives in the git-ignored .deepep/ of the checkout.
#   here:    echo /.deepep/ >> .git/info/exclude
#            mkdir -p .deepep && git -C DEEPEP_CLONE archive da6ca24 | tar -x -C .deepep
#            (then carry .deepep with the device call)
#   device:  bash bench/build_deepep.sh   (gpu_suite.sh's deepep part runs it)
# Builds in place; PYTHONPATH=$PWD/.deepep then imports deep_ep.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f .deepep/setup.py ]; then
  echo "build_deepep: no DeepEP source in .deepep/ (see the head of this script)" >&2
  exit 2
fi
cd .deepep
# intranode only: setup.py disables NVSHMEM when it finds none, but it also finds the
# nvidia-nvshmem wheel that torch installs; make it look no further than NVSHMEM_DIR
unset NVSHMEM_DIR
sed -i 's/nvshmem_dir = importlib.util.find_spec("nvidia.nvshmem").submodule_search_locations\[0\]/raise ModuleNotFoundError("intranode only")/' setup.py
if grep -q 'find_spec("nvidia.nvshmem")' setup.py; then
  echo "build_deepep: could not keep setup.py from finding the NVSHMEM wheel" >&2
  exit 1
fi
# no relocatable device code: without NVSHMEM nothing links device code across files
sed -i "s/nvcc_flags.extend(\['-rdc=true', /nvcc_flags.extend([/" setup.py
if grep -q -- "-rdc=true" setup.py; then
  echo "build_deepep: could not take -rdc=true out of setup.py" >&2
  exit 1
fi
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-$(nproc)}
python3 setup.py build_ext --inplace > build.log 2>&1 || { grep -E -m 40 -B 2 -A 6 "error" build.log; exit 1; }
PYTHONPATH=$PWD python3 -c "import deep_ep; print('deep_ep built:', deep_ep.__file__)"
