#!/usr/bin/env bash
# The GPU run, in parts that each fit one device call (< 10 minutes):
#   tests      the whole pytest suite (NCCL worlds on the local GPUs)
#   dispatch   dispatch-bench dispatch (all shapes x variants x wires x routings,
#              Megatron-Core alongside) and the a2a sweep
#   overlap    the overlap study in five settings (NCCL defaults; a CTA budget,
#              high-priority NCCL stream and SM carveout; the same with fp8
#              dispatch; a slow exchange of 2 CTAs with carveouts of 2 and 16),
#              then own rows first (local_first) beside C = 2, carveout 8 and slow
#   local      the local_first tests and its two overlap settings (a quick check)
#   peer-tests the peer-copy transport's tests (and local_first's, the overlap bench's)
#   peer       overlap with both transports side by side (local_first and C = 2):
#              NCCL defaults, carveout 8, the tuned NCCL group, fp8 dispatch
#   peer-more  the a2a sweep (peer copy beside NCCL), and on 2 of the GPUs the
#              overlap with both transports (carveout 8; NCCL slowed to 2 CTAs)
#   local-chunks  local_first with C chunks: its tests (not with SKIP_TESTS=1); overlap
#              with the exchange slowed to 2 CTAs (carveouts 16 and 8), C = 2, 4 beside
#              local, local2, local4
#   local-chunks-nvlink  the same over NVLink (carveout 8), both transports
#   early      after the first chunk's all-to-all moved into the plan (any C): NCCL
#              defaults, the slow exchange again (carveout 16), with fp8 dispatch,
#              and on 2 of the GPUs; C = 2, 4 beside local, local2, local4
#   peak       the overlap study's forward+backward peak memory by candidate: NCCL
#              defaults and the slow exchange (carveout 16), C = 2, 4, local, local2, local4
#   ahead      how many chunks are dispatched ahead (MoEExchange's ahead): the pipeline,
#              local_first, overlap-bench and peer-copy tests (not with SKIP_TESTS=1), then the
#              overlap with the exchange slowed to 2 CTAs (carveout 16) and over NVLink, C = 2, 4
#              and local_first, every chunk ahead beside 1 and 2
#   ahead-more every chunk ahead beside two, with the exchange slowed to 2 CTAs: carveout 8, fp8
#              dispatch (carveout 16), and on 2 of the GPUs (carveout 16; a C = 2 timeline)
#   sizes      chunks of unequal sizes (MoEExchange(chunks=(1, 3, 3, 1)): a small first
#              dispatch and last combine): the pipeline, local_first and overlap-bench tests
#              (not with SKIP_TESTS=1), then the overlap with the exchange slowed to 2 CTAs
#              (carveout 16): C = 2, 4 beside sizes 1:2:1, 1:3:1, 1:3:3:1, 1:2:2:2:1 (and
#              two ahead), then own rows first; every rank's timeline of C = 4 and of
#              own rows first with 1:3:3:1
#   host       where the host's time goes in a chunked step (cProfile of rank 0, C = 4,
#              mixtral-8x7b, the exchange slowed to 2 CTAs), with the SM carveout and without
#   carveouts  the SM carveout the GEMMs leave to a slow exchange (2 CTAs): 2, 4 and 8
#              SMs, C = 2, 4 and sizes 1:2:1 (a carveout of 16 is part sizes)
#   chunk-cost one GPU: the experts' tests, then what C chunks cost the experts (dispatch-bench
#              chunk-cost) on the DeepSeek-V3, Qwen3 and Mixtral shapes at EP4 (and DeepSeek-V3 at
#              EP2), every backend, SM carveouts 0 and 16
#   overlap-padded  the overlap with the padded experts beside the default ones, exchange slowed
#              to 2 CTAs (carveout 16), C = 2, 4 and local2 (needs the GPUs of an EP group)
#   studies    hierarchical 2x2 with a slow inter-node tier, wire formats /
#              kernels, Megatron MoELayer
# Usage: before sending the tree, record what it is (the device's copy has no
# reliable git history): git describe --always --dirty > .dispatch-commit
# (git-ignored; carry it), then on the device machine, from the repository root:
#   bash bench/gpu_suite.sh PART [PART ...]
# Writes $OUT/suite.txt (machine, versions, logs) and $OUT/results.tar.gz
# (every JSON / markdown / PNG result; unpack under bench/results/<machine>/).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/gpu-out}
RES=$OUT/results
mkdir -p "$RES"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=$PWD:/tmp/site
else
  export PYTHONPATH=$PWD
fi
DISPATCH_COMMIT=${DISPATCH_COMMIT:-$(cat .dispatch-commit 2>/dev/null)}
if [ -z "$DISPATCH_COMMIT" ]; then
  echo "gpu_suite: no .dispatch-commit (git describe --always --dirty > .dispatch-commit) and no DISPATCH_COMMIT" >&2
  exit 2
fi
export DISPATCH_COMMIT
LOG=$OUT/suite.txt
{
  echo "commit $DISPATCH_COMMIT parts: $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
  python3 -c "import megatron.core as m; print('megatron-core', m.__version__)" 2>&1 | tail -1
  python3 -c "import matplotlib; print('matplotlib', matplotlib.__version__)" 2>&1 | tail -1
} > "$LOG" 2>&1
cat "$LOG"
status=0

step() {  # step SECONDS NAME COMMAND...: run, log, keep the worst exit status
  local limit=$1 name=$2
  shift 2
  echo "== $name: $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG" | grep -v '^\[' | tail -40
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  [ "$rc" -ne 0 ] && status=$rc
}

bench() { step "$1" "$2" python3 -m dispatch.bench "${@:3}"; }

for part in "$@"; do
  case $part in
    tests)
      step 560 pytest python3 -m pytest -q -p no:cacheprovider --durations=15 tests ;;
    dispatch)
      bench 330 dispatch dispatch --iters 20 --warmup 5 --out "$RES"
      bench 150 a2a a2a --iters 20 --warmup 5 --out "$RES" ;;
    overlap)
      bench 120 overlap overlap --trace --out "$RES"
      bench 120 overlap-tuned overlap --comm-high-priority --comm-max-ctas 16 --sm-carveout 16 --trace --out "$RES"
      bench 120 overlap-fp8 overlap --comm-high-priority --comm-max-ctas 16 --sm-carveout 16 --dispatch-wire fp8 --out "$RES"
      bench 120 overlap-slow overlap --comm-high-priority --comm-max-ctas 2 --sm-carveout 2 --out "$RES"
      bench 120 overlap-slow-carve16 overlap --comm-high-priority --comm-max-ctas 2 --sm-carveout 16 --trace --out "$RES"
      bench 120 overlap-local-first overlap --local-first --chunks 2 --sm-carveout 8 --trace --out "$RES"
      bench 120 overlap-local-first-slow overlap --local-first --chunks 2 --comm-high-priority --comm-max-ctas 2 \
        --sm-carveout 16 --trace --out "$RES" ;;
    local)
      step 300 pytest-local python3 -m pytest -q -p no:cacheprovider tests/test_pipeline_local.py \
        tests/test_experts.py "tests/test_properties.py::test_plan_graphs_match_eager_plan"
      bench 150 overlap-local-first overlap --local-first --chunks 2 --sm-carveout 8 --trace --out "$RES"
      bench 150 overlap-local-first-slow overlap --local-first --chunks 2 --comm-high-priority --comm-max-ctas 2 \
        --sm-carveout 16 --trace --out "$RES" ;;
    peer-tests)
      step 300 pytest-peer python3 -m pytest -q -p no:cacheprovider tests/test_peer_copy.py \
        tests/test_pipeline_local.py tests/test_overlap_bench.py ;;
    peer)
      bench 150 overlap-peer overlap --transport both --local-first --chunks 2 --trace --out "$RES"
      bench 150 overlap-peer-carve8 overlap --transport both --local-first --chunks 2 --sm-carveout 8 --trace \
        --out "$RES"
      bench 150 overlap-peer-tuned overlap --transport both --local-first --chunks 2 4 --comm-high-priority \
        --comm-max-ctas 16 --sm-carveout 16 --out "$RES"
      bench 150 overlap-peer-fp8 overlap --transport both --local-first --chunks 2 --dispatch-wire fp8 --out "$RES" ;;
    peer-more)
      bench 240 a2a a2a --iters 20 --warmup 5 --out "$RES"
      bench 150 overlap-peer-w2-carve8 overlap --world-size 2 --transport both --local-first --chunks 2 \
        --sm-carveout 8 --trace --out "$RES"
      bench 150 overlap-peer-w2-slow overlap --world-size 2 --transport both --local-first --chunks 2 \
        --comm-high-priority --comm-max-ctas 2 --sm-carveout 16 --out "$RES" ;;
    local-chunks)
      [ -n "${SKIP_TESTS:-}" ] || step 240 pytest-local-chunks python3 -m pytest -q -p no:cacheprovider tests/test_pipeline_local.py \
        tests/test_experts.py tests/test_overlap_bench.py
      bench 170 overlap-local-chunks-slow overlap --local-first --chunks 2 4 --comm-high-priority --comm-max-ctas 2 \
        --sm-carveout 16 --trace --trace-candidate local4 --out "$RES"
      bench 170 overlap-local-chunks-slow-carve8 overlap --local-first --chunks 2 4 --comm-high-priority \
        --comm-max-ctas 2 --sm-carveout 8 --out "$RES" ;;
    local-chunks-nvlink)
      bench 240 overlap-local-chunks-nvlink overlap --transport both --local-first --chunks 2 4 --sm-carveout 8 \
        --trace --trace-candidate local --out "$RES" ;;
    early)
      bench 150 overlap-early overlap --local-first --chunks 2 4 --trace --trace-candidate 2 --out "$RES"
      bench 150 overlap-early-slow overlap --local-first --chunks 2 4 --comm-high-priority --comm-max-ctas 2 \
        --sm-carveout 16 --out "$RES"
      bench 150 overlap-early-slow-fp8 overlap --local-first --chunks 2 4 --comm-high-priority --comm-max-ctas 2 \
        --sm-carveout 16 --dispatch-wire fp8 --out "$RES"
      bench 150 overlap-early-slow-w2 overlap --world-size 2 --local-first --chunks 2 4 --comm-high-priority \
        --comm-max-ctas 2 --sm-carveout 16 --out "$RES" ;;
    peak)
      bench 150 overlap-peak overlap --local-first --chunks 2 4 --out "$RES"
      bench 150 overlap-peak-slow overlap --local-first --chunks 2 4 --comm-high-priority --comm-max-ctas 2 \
        --sm-carveout 16 --out "$RES" ;;
    ahead)
      [ -n "${SKIP_TESTS:-}" ] || step 300 pytest-pipelines python3 -m pytest -q -p no:cacheprovider \
        tests/test_pipeline.py tests/test_pipeline_local.py tests/test_overlap_bench.py tests/test_peer_copy.py
      bench 240 overlap-ahead-slow overlap --local-first --chunks 2 4 --ahead 1 2 --comm-high-priority \
        --comm-max-ctas 2 --sm-carveout 16 --trace --trace-candidate 4 --out "$RES"
      bench 240 overlap-ahead-nvlink overlap --local-first --chunks 2 4 --ahead 1 2 --out "$RES" ;;
    ahead-more)
      bench 150 overlap-ahead-slow-carve8 overlap --local-first --chunks 2 4 --ahead 2 --comm-high-priority \
        --comm-max-ctas 2 --sm-carveout 8 --out "$RES"
      bench 150 overlap-ahead-slow-fp8 overlap --local-first --chunks 2 4 --ahead 2 --comm-high-priority \
        --comm-max-ctas 2 --sm-carveout 16 --dispatch-wire fp8 --out "$RES"
      bench 150 overlap-ahead-slow-w2 overlap --world-size 2 --local-first --chunks 2 4 --ahead 2 \
        --comm-high-priority --comm-max-ctas 2 --sm-carveout 16 --trace --trace-candidate 2 --out "$RES" ;;
    sizes)
      [ -n "${SKIP_TESTS:-}" ] || step 300 pytest-pipelines python3 -m pytest -q -p no:cacheprovider \
        tests/test_pipeline.py tests/test_pipeline_local.py tests/test_overlap_bench.py
      bench 300 overlap-sizes-slow overlap --chunks 2 4 1:2:1 1:3:1 1:3:3:1 1:2:2:2:1 --ahead 2 \
        --comm-high-priority --comm-max-ctas 2 --sm-carveout 16 --trace --trace-candidate 4 --out "$RES"
      bench 240 overlap-sizes-slow-local overlap --local-first --chunks 2 1:2:1 1:3:3:1 --comm-high-priority \
        --comm-max-ctas 2 --sm-carveout 16 --trace --trace-candidate local1:3:3:1 --out "$RES" ;;
    host)
      bench 150 overlap-host-slow overlap --shapes mixtral-8x7b --chunks 2 4 --comm-high-priority --comm-max-ctas 2 \
        --sm-carveout 16 --host-profile 4 --out "$RES"
      bench 150 overlap-host-slow-nocarve overlap --shapes mixtral-8x7b --chunks 2 4 --comm-high-priority \
        --comm-max-ctas 2 --host-profile 4 --out "$RES" ;;
    carveouts)
      for carve in 2 4 8; do
        bench 150 "overlap-carve$carve-slow" overlap --chunks 2 4 1:2:1 --comm-high-priority --comm-max-ctas 2 \
          --sm-carveout "$carve" --out "$RES"
      done ;;
    chunk-cost)
      [ "${SKIP_TESTS:-0}" = 1 ] || step 300 pytest-experts python3 -m pytest -q -p no:cacheprovider \
        tests/test_experts.py tests/test_chunk_cost.py
      bench 300 chunk-cost chunk-cost --shapes deepseek-v3,qwen3-235b,mixtral-8x7b --ep 4 --sm-carveout 0 16 \
        --out "$RES"
      bench 120 chunk-cost-ep2 chunk-cost --shapes deepseek-v3 --ep 2 --backends grouped_mm padded \
        --sm-carveout 0 16 --out "$RES" ;;
    overlap-padded)
      for backend in auto padded; do
        bench 240 "overlap-slow-$backend" overlap --chunks 2 4 --local-first --comm-high-priority --comm-max-ctas 2 \
          --sm-carveout 16 --experts-backend "$backend" --out "$RES"
      done ;;
    studies)
      bench 150 hierarchical dispatch --nodes 2 --inter-node-ctas 2 --shapes deepseek-v3,qwen3-235b,mixtral-8x7b \
        --routings uniform --wires native --baselines none --iters 20 --warmup 5 --out "$RES"
      bench 120 wire wire --out "$RES"
      bench 120 megatron-layer megatron-layer --out "$RES" ;;
    *)
      echo "unknown part $part" | tee -a "$LOG"; status=2 ;;
  esac
done
tar -czf "$OUT/results.tar.gz" -C "$RES" . && rm -rf "$RES"
exit $status
