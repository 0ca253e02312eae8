#!/usr/bin/env bash
# The GPU run, in parts that each fit one device call (< 10 minutes):
#   tests1, tests2  the pytest suite (NCCL worlds on the local GPUs) in two halves, by file name
#             (test_a* to test_m*, then test_n* to test_z*): the whole suite outgrew one call
#   tests     the tests named in $TESTS (files, and pytest options such as -k NAME: split at spaces)
#   groups    the tests of dispatches by groups of experts and of MoEExchange (a part of tests)
#   dispatch  dispatch-bench dispatch (all shapes x variants x wires x routings,
#             Megatron-Core alongside) and the a2a sweep
#   a2a       the a2a sweep alone (NCCL, ours, the NVLink engine's raw all-to-all)
#   overlap   dispatch-bench overlap on the model shapes (MoEExchange by groups of experts):
#             NCCL defaults (with two micro-batches overlapped by the async verbs), then the
#             exchange slowed to 2 NCCL CTAs (--comm-max-ctas 2, high-priority stream)
#   overlap-engine  the NVLink engine's layer in one piece, eager and captured in a CUDA
#             graph (max_rows), and two micro-batches overlapped by the async verbs; then the
#             layer by groups of experts on the engine (G = 2, 4, 8), eager and captured
#   overlap-engine-mb  the NVLink engine's kernels in $ENGINE_BUDGETS blocks (default "all 8 24"; all: every
#             SM, no carveout): M micro-batches ($MICRO_BATCHES, default 4) through MoEMicroBatches with
#             max_rows on $MB_SHAPES (default deepseek-v3), the GEMMs leaving the budget's SMs, then the
#             exchange on an SM partition of them
#   overlap-slow-nvshmem  over NVSHMEM with max_rows (the counts on the device, nothing read on the
#             host before the rows move), its kernels throttled to $NVSHMEM_BLOCKS blocks each
#             (default "8 32": a slow link), the GEMMs beside leaving $SM_CARVEOUT SMs (default 16; none):
#             MoEExchange by groups ($NVSHMEM_GROUPS, default 2,4,8; "none": skipped), then M
#             micro-batches through MoEMicroBatches (M of $MICRO_BATCHES, default "2 3"); then one
#             forward+backward of the first M's micro-batches profiled beside its two baselines, and
#             its host (bench/overlap_trace.py --host-profile, the first of those blocks);
#             $NVSHMEM_NO_MB set: the layer by groups alone; $SM_PARTITION: the micro-batches'
#             exchange on an SM partition of that many SMs, their GEMMs on the rest; $MB_GRAPH set:
#             the micro-batches' step also captured in a CUDA graph (--graph; not with $SM_PARTITION)
#   partition bench/partition_probe.py: a GEMM beside a few-block stand-in exchange, on shared SMs
#             and on disjoint partitions (green contexts), on one GPU
#   carveout  bench/carveout_probe.py: each of the experts' GEMMs (DeepSeek-V3 at EP2) under each SM
#             carveout, on one GPU
#   ceiling   bench/concurrency_probe.py (the experts' GEMMs and an exchange queued at once on
#             two streams against each alone: the most any overlap schedule hides; also DeepSeek-V3
#             with 16 experts, the Megatron timing layer's shape), then two
#             micro-batches by the async verbs with the exchange slowed to 2 NCCL CTAs
#   nvlink    the NVLink engine: its tests (bitwise against NCCL), then the probe
#   shared    the engine's tests of 2 and 4 ranks where one GPU is lent: the ranks share it
#             (tests/shared_gpu.py: gloo, the buffers opened by CUDA IPC, kernels by time slices;
#             correctness only), $SHARED_TESTS (default: tests/test_nvlink.py, the engine's
#             agreement tests, its captured micro-batches)
#   nvshmem   the NVSHMEM transport: its tests (bitwise against NCCL, a bounded round trip captured; its
#             plan's Triton kernels against their references),
#             then bench/nvshmem_probe.py: NVSHMEM (also with every peer reached by its get and put, as
#             across hosts), NCCL and the NVLink engine (on NVSHMEM's buffers)
#             in one process, each with kernel tables of its DeepSeek-V3 and Mixtral round trips (eager and
#             captured) and a host profile of its round trips with max_rows; then the engine
#             alone in another (on CUDA's symmetric memory); then
#             bench/nvshmem_device_probe.py (a kernel of ours on NVSHMEM's device API, in torch's instance)
#   nvshmem-hier  the hierarchical variant over NVSHMEM: its tests, then bench/nvshmem_probe.py with it
#             (every rank a node: as across hosts, mapped and not) beside itself over NCCL and the alltoall
#             variant over both
#   probe     bench/engine_probe.py (the engine beside NCCL per shape, with its kernels' times)
#   ab        the engine probe (decode, DeepSeek-V3) of a base tree in .wt/base and of this one, twice in turn;
#             then bench/agreement_probe.py (what a call's agreement costs on the host); the eager round
#             trip's host time on every rank is host-bound's
#   layer-cost  bench/layer_cost.py: the exchange's cost inside a layer (MoEExchange with one group against
#             the plain verbs and the experts alone, forward and forward+backward) on $WORLD GPUs (default 2),
#             $LAYER_SHAPES (default deepseek-v3,mixtral-8x7b)
#   one-gpu   on one GPU (no second one lent): bench/engine_one_gpu.py, the engine at W = 1 held
#             bitwise against NCCL, the host cost of a round trip's pieces and the NCCL plan's
#             graphs, a host profile, the captured round trip's GPU time (every SM, 24 blocks; alone
#             and beside the experts' GEMMs), then the eager round trip's host time (the engine, and the
#             NCCL transport) of this tree against a base tree in .wt/base (where there is one),
#             both in one process, blocks in turn; then bench/host_layers.py (that host time layer
#             by layer, decode and DeepSeek-V3) (all in results/engine-one-gpu.txt)
#   host-plan bench/host_plan_probe.py: the all-gather and hierarchical variants' expansion on one GPU in torch
#             operations against the compiled CPU plan with its copies (counts.HOST_PLAN_ITEMS), held equal bit for bit
#   host      where the engine's eager round trip spends host time (cProfile, per call), then
#             bench/eager_trace.py (one decode round trip's host calls and kernels, rank by rank)
#   tuning    bench/engine_tuning.py: blocks per SM and steps in flight of the engine's kernels
#   budget    bench/engine_tuning.py at 24 blocks (DeepEP's SM budget) and at the default 4 per SM
#   deepep    build DeepEP (bench/build_deepep.sh; its source carried in .deepep/), then
#             dispatch-bench dispatch with its rows beside ours and Megatron's (its eager round trip,
#             beside our eager one; its kernels along a cached layout, beside our CUDA graph),
#             every routing (uniform, Zipf, all to one rank), then DeepEP's own
#             tests/test_intranode.py (its tuned kernels at 24 SMs, DeepSeek-V3's shape)
#   eager-deepep  issue 46's eager comparison in one call: DeepEP built (bench/build_deepep.sh, in the
#             background) while the engine's tests run (tests/test_nvlink.py, tests/test_autograd.py, or
#             those $ENGINE_TESTS names), then
#             dispatch-bench dispatch on decode and DeepSeek-V3 (uniform routing, native wire): our eager round
#             trip beside DeepEP's eager one (layout, dispatch with its host read, combine) and NCCL's
#             ($EAGER_ITERS timed runs each, default 30; $EAGER_SHAPES, and $EAGER_FLAGS such as --no-grad)
#   host-bound  the eager round trip's host time on every rank, layer by layer (bench/host_layers.py
#             --world, decode and DeepSeek-V3), each rank pinned to cores of its own near its GPU (--bind),
#             then the same unpinned
#   host-contention  why host time grows with the ranks (one file, results/host-contention.txt):
#             bench/contention_probe.py (a busy second process beside fixed host work), then
#             bench/host_layers.py on decode and DeepSeek-V3 at W = 1 each round trip after a sync, back to
#             back (--steady) and after a sync and a 1 ms sleep (--pause-us), then W = 2 on GPU 0
#             (--shared-gpu) after a sync and a barrier, and back to back
#   soak      bench/soak.py: 10,000 round trips per transport (nccl, nvlink, nvlink with
#             max_rows), shapes, routings and wires
#             changing every call, every row checked, memory and the slowest call
#   megatron-scenarios  bench/megatron_scenarios.py: Megatron-Core's own dispatcher test
#             scenarios, its dispatcher and ours (Megatron-LM's test sources carried in .megatron-lm/)
#   megatron  bench/megatron_layer.py: a real Megatron-Core MoELayer and GPTModel with its
#             dispatcher and ours (agreement, 50-step trainings, Megatron's local CUDA
#             graphs, its EP-communication overlap, timing)
#   megatron-timing  its timing part alone on 2 ranks (the layer with each dispatcher, ours
#             with its experts by groups beside the exchange, the experts alone, the router
#             alone): 256
#             experts (SequentialMLP, host-bound), then 16 (GEMM-bound, ours by 2, 4 and 8
#             groups; in experts16/), each row also traced once (GPU busy time against wall
#             time, longest kernels and host ops, the host's time to issue a pass; rank 0's
#             timelines in traces/)
#   studies   the bench/ scripts: wire formats, the overlap layer's timelines (G = 4,
#             slowed exchange), and the ranks as 2 nodes (hierarchical tiers, bytes per tier); then
#             the CPU studies: bench/convergence.py (the wires trained, classify and regress, on two
#             GPUs where there are two; regress within 5%, its loss driven towards zero),
#             bench/group_dedup.py, bench/host_calls.py (this tree alone; then --cuda, on GPU 0)
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
  timeout -s INT -k 20 "$limit" "$@" 2>&1 | tee -a "$LOG" | grep -v '^\[' | tail -40
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  [ "$rc" -ne 0 ] && status=$rc
}

bench() { step "$1" "$2" python3 -m dispatch.bench "${@:3}"; }

for part in "$@"; do
  case $part in
    tests1|tests2)
      # SIGINT: a test that hangs is named in pytest's traceback
      files=(tests/test_[a-m]*.py)
      [ "$part" = tests2 ] && files=(tests/test_[n-z]*.py)
      step 560 "pytest-$part" python3 -m pytest -q -p no:cacheprovider --durations=15 "${files[@]}" ;;
    tests)
      if [ -z "${TESTS:-}" ]; then
        echo "part tests: name the tests in TESTS" | tee -a "$LOG"; status=2; continue
      fi
      # shellcheck disable=SC2086
      step 560 pytest-named python3 -m pytest -q -p no:cacheprovider --durations=15 $TESTS ;;
    shared)
      # shellcheck disable=SC2086
      step 560 shared-gpu-tests env DISPATCH_TEST_SHARED_GPU=1 python3 -m pytest -q -p no:cacheprovider --durations=10 \
        ${SHARED_TESTS:-tests/test_nvlink.py tests/test_agreement.py::test_the_engine_agrees_on_refusals \
        tests/test_micro_batches.py::test_on_the_engine_the_layer_with_max_rows_is_captured} ;;
    groups)
      step 240 groups-tests python3 -m pytest -q -p no:cacheprovider tests/test_groups.py tests/test_kernels.py \
        tests/test_pipeline.py tests/test_async.py ;;
    dispatch)
      bench 330 dispatch dispatch --transports nccl,nvlink,nvlink-graph --iters 20 --warmup 5 --out "$RES"
      bench 240 a2a a2a --iters 20 --warmup 5 --out "$RES" ;;
    a2a)
      bench 240 a2a a2a --iters 20 --warmup 5 --out "$RES" ;;
    overlap)
      bench 240 overlap overlap --groups 2,4,8 --sm-carveout 16 --micro-batches --out "$RES"
      bench 200 overlap-slow overlap --groups 2,4,8 --sm-carveout 16 --comm-max-ctas 2 --comm-high-priority \
        --out "$RES" ;;
    overlap-engine)
      bench 300 overlap-engine overlap --transport auto --groups 1 --graph --micro-batches --out "$RES"
      bench 240 overlap-engine-groups overlap --transport auto --groups 2,4,8 --graph --iters 10 --warmup 3 \
        --out "$RES" ;;
    overlap-engine-mb)
      for budget in ${ENGINE_BUDGETS:-all 8 24}; do
        if [ "$budget" = all ]; then  # the engine on every SM: shared SMs, no carveout (its serial schedule too)
          bench 200 overlap-engine-mb-all overlap --shapes "${MB_SHAPES:-deepseek-v3}" --transport nvlink --groups 1 \
            --micro-batches "${MICRO_BATCHES:-4}" --max-rows --iters 10 --warmup 3 --out "$RES"
          continue
        fi
        for split in "" "$budget"; do
          bench 200 "overlap-engine-mb-$budget${split:+-split}" overlap --shapes "${MB_SHAPES:-deepseek-v3}" \
            --transport nvlink --groups 1 --sm-budget "$budget" --micro-batches "${MICRO_BATCHES:-4}" --max-rows \
            --sm-carveout "$budget" ${split:+--sm-partition "$split"} --iters 10 --warmup 3 --out "$RES"
        done
      done ;;
    overlap-slow-nvshmem)
      carve=(--sm-carveout "${SM_CARVEOUT:-16}") mbs=${MICRO_BATCHES:-2 3}
      [ "${SM_CARVEOUT:-}" = none ] && carve=()
      split=()
      [ -n "${SM_PARTITION:-}" ] && split=(--sm-partition "$SM_PARTITION")
      graph=()
      [ -n "${MB_GRAPH:-}" ] && graph=(--graph)
      for blocks in ${NVSHMEM_BLOCKS:-8 32}; do
        [ "${NVSHMEM_GROUPS:-}" = none ] ||
          bench 200 "overlap-nvshmem-$blocks-groups" overlap --shapes deepseek-v3 --transport nvshmem \
            --groups "${NVSHMEM_GROUPS:-2,4,8}" --max-rows --nvshmem-blocks "$blocks" "${carve[@]}" \
            --iters 10 --warmup 3 --out "$RES/groups"
        [ -n "${NVSHMEM_NO_MB:-}" ] && continue
        for m in $mbs; do
          bench 240 "overlap-nvshmem-$blocks-mb$m" overlap --shapes deepseek-v3 --transport nvshmem --groups 1 \
            --micro-batches "$m" --max-rows --nvshmem-blocks "$blocks" "${carve[@]}" "${split[@]}" "${graph[@]}" \
            --iters 10 --warmup 3 --out "$RES"
        done
      done
      if [ -z "${NVSHMEM_NO_MB:-}" ]; then  # ($NVSHMEM_NO_MB set: the layer by groups alone)
        blocks=${NVSHMEM_BLOCKS:-8}
        step 200 overlap-trace-nvshmem python3 bench/overlap_trace.py --shapes deepseek-v3 --transport nvshmem \
          --groups 1 --micro-batches "${mbs%% *}" --max-rows --nvshmem-blocks "${blocks%% *}" "${carve[@]}" \
          "${split[@]}" --host-profile --out "$RES"
        find "$RES" -name 'overlap-trace-*-nvshmem-*.json' -delete  # (its chrome traces: too large to keep)
      fi ;;
    carveout)
      step 200 carveout-probe python3 bench/carveout_probe.py --out "$RES" ;;
    partition)
      step 120 partition-probe python3 bench/partition_probe.py --out "$RES" ;;
    ceiling)
      step 300 concurrency-probe python3 bench/concurrency_probe.py --out "$RES"
      step 200 concurrency-probe-e16 python3 bench/concurrency_probe.py --shapes deepseek-v3 --experts 16 --out "$RES"
      bench 240 overlap-slow-mb overlap --shapes deepseek-v3,mixtral-8x7b --groups 1 --micro-batches \
        --comm-max-ctas 2 --comm-high-priority --iters 10 --warmup 3 --out "$RES" ;;
    nvlink)
      step 200 nvlink-tests python3 -m pytest -q -p no:cacheprovider tests/test_nvlink.py
      step 200 engine-probe python3 bench/engine_probe.py --profile --out "$RES" ;;
    nvshmem)
      step 240 nvshmem-tests python3 -m pytest -q -p no:cacheprovider tests/test_nvshmem.py tests/test_kernels.py \
        tests/test_nvshmem_hierarchical.py -k "nvshmem or settle or pad_kernel"
      gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
      step 240 nvshmem-probe torchrun --nproc-per-node "$gpus" bench/nvshmem_probe.py "$RES" nvshmem nvshmem-unmapped nccl nvlink \
        --profile --host-profile
      step 200 nvshmem-probe-engine torchrun --nproc-per-node "$gpus" bench/nvshmem_probe.py "$RES" nvlink
      step 120 nvshmem-device-probe torchrun --nproc-per-node "$gpus" bench/nvshmem_device_probe.py ;;
    nvshmem-hier)
      step 200 nvshmem-hier-tests python3 -m pytest -q -p no:cacheprovider tests/test_nvshmem_hierarchical.py
      gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
      step 240 nvshmem-hier-probe torchrun --nproc-per-node "$gpus" bench/nvshmem_probe.py "$RES" hier-nvshmem \
        hier-nvshmem-unmapped hier-nccl nvshmem nccl ;;
    probe)
      step 200 engine-probe python3 bench/engine_probe.py --profile --out "$RES" ;;
    ab)
      # the engine probe of a base tree (git archive BASE | tar -x -C .wt/base; carry .wt/base) and of
      # this tree, twice in turn, in one call: what a change costs on the eager, bounded and captured paths
      for i in 1 2; do
        for tree in .wt/base .; do
          step 150 "engine-probe-ab-$tree-$i" env PYTHONPATH="$PWD/$tree" python3 "$tree/bench/engine_probe.py" \
            --shapes decode,deepseek-v3 --iters 30 --warmup 5
        done
      done
      step 120 agreement-probe python3 bench/agreement_probe.py ;;
    layer-cost)
      step 240 layer-cost bash -c 'set -o pipefail; torchrun --nproc-per-node "${WORLD:-2}" bench/layer_cost.py \
        --shapes "${LAYER_SHAPES:-deepseek-v3,mixtral-8x7b}" 2>&1 | grep -v "^\[\|^W1\|\*\*\*" | tee "$1"' _ \
        "$RES/layer-cost-w${WORLD:-2}.txt" ;;
    one-gpu)
      against=()
      [ -d .wt/base ] && against=(--against .wt/base)
      step 400 engine-one-gpu bash -c 'set -o pipefail; python3 bench/engine_one_gpu.py . --check --pieces --profile --gpu-time \
        "${@:2}" | tee "$1"' _ "$RES/engine-one-gpu.txt" "${against[@]}"
      for shape in decode deepseek-v3; do
        step 60 "host-layers-$shape" bash -c 'set -o pipefail; python3 bench/host_layers.py --shape "$2" | tee -a "$1"' _ \
          "$RES/engine-one-gpu.txt" "$shape"
      done ;;
    host-plan)
      step 200 host-plan python3 bench/host_plan_probe.py --out "$RES/host-plan-probe.md" ;;
    host)
      step 200 engine-host python3 bench/engine_probe.py --shapes decode,deepseek-v3 --host-profile --host-sections \
        --iters 10 --warmup 3
      step 120 eager-trace python3 bench/eager_trace.py --shape decode --out "$OUT/eager-trace"
      step 120 eager-trace-bounded python3 bench/eager_trace.py --shape decode --max-rows --out "$OUT/eager-trace-bounded" ;;
    tuning)
      step 300 engine-tuning python3 bench/engine_tuning.py --out "$RES" ;;
    budget)
      step 300 engine-budget python3 bench/engine_tuning.py --sm-budget 24,528 --unroll 4 --out "$RES" ;;
    deepep)
      step 420 build-deepep bash bench/build_deepep.sh
      outer=$PYTHONPATH
      export PYTHONPATH=$PWD/.deepep:$PYTHONPATH
      bench 400 dispatch-deepep dispatch --shapes deepseek-v3,mixtral-8x7b,decode --routings all \
        --variants alltoall --transports nccl,nvlink,nvlink-graph --wires native,fp8 --iters 20 --warmup 5 --out "$RES"
      step 300 deepep-intranode python3 .deepep/tests/test_intranode.py --num-processes "$(nvidia-smi -L | wc -l)"
      export PYTHONPATH=$outer ;;
    eager-deepep)
      (bash bench/build_deepep.sh > "$OUT/build-deepep.txt" 2>&1; echo "build-deepep: exit $?" >> "$OUT/build-deepep.txt") &
      builder=$!
      # shellcheck disable=SC2086
      step 330 engine-tests python3 -m pytest -q -p no:cacheprovider ${ENGINE_TESTS:-tests/test_nvlink.py tests/test_autograd.py}
      wait "$builder"
      tail -3 "$OUT/build-deepep.txt" | tee -a "$LOG"
      outer=$PYTHONPATH
      export PYTHONPATH=$PWD/.deepep:$PYTHONPATH
      # shellcheck disable=SC2086
      bench 200 eager-deepep dispatch --shapes "${EAGER_SHAPES:-decode,deepseek-v3}" --routings uniform \
        --variants alltoall --transports nccl,nvlink,nvlink-graph --wires native --iters "${EAGER_ITERS:-30}" \
        --warmup 10 ${EAGER_FLAGS:-} --out "$RES/eager-deepep"
      export PYTHONPATH=$outer ;;
    host-bound)
      gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
      for bind in --bind ""; do
        for shape in decode deepseek-v3; do
          step 100 "host-world-$shape$bind" bash -c 'set -o pipefail; python3 bench/host_layers.py --shape "$2" \
            --calls 300 --world "$3" $4 | tee -a "$1"' _ "$RES/host-w$gpus.txt" "$shape" "$gpus" "$bind"
        done
      done ;;
    host-contention)
      file=$RES/host-contention.txt
      : > "$file"
      step 120 contention-probe bash -c 'set -o pipefail; python3 bench/contention_probe.py | tee -a "$1"' _ "$file"
      for shape in decode deepseek-v3; do
        for how in "" --steady "--pause-us 1000" "--world 2 --shared-gpu" "--world 2 --shared-gpu --steady"; do
          step 100 "host-$shape${how// /}" bash -c 'set -o pipefail; python3 bench/host_layers.py --shape "$2" \
            --calls 300 $3 | tee -a "$1"' _ "$file" "$shape" "$how"
        done
      done ;;
    soak)
      step 280 soak-nccl python3 bench/soak.py --calls 10000 --transports nccl --out "$RES/soak-nccl"
      step 280 soak-nvlink python3 bench/soak.py --calls 10000 --transports nvlink --out "$RES/soak-nvlink"
      step 280 soak-bounded python3 bench/soak.py --calls 10000 --transports nvlink-bounded \
        --out "$RES/soak-bounded" ;;
    megatron-scenarios)
      step 400 megatron-scenarios python3 -m torch.distributed.run --nproc-per-node "$(nvidia-smi -L | wc -l)" \
        bench/megatron_scenarios.py --megatron-lm .megatron-lm --out "$RES" ;;
    megatron)
      step 540 megatron-layer python3 bench/megatron_layer.py --out "$RES" ;;
    megatron-timing)
      step 300 megatron-timing python3 bench/megatron_layer.py --parts timing --world-size 2 --trace --out "$RES"
      step 300 megatron-timing-16 python3 bench/megatron_layer.py --parts timing --world-size 2 --experts 16 \
        --overlap-groups 2 4 8 \
        --trace --out "$RES/experts16" ;;
    studies)
      step 120 wire python3 bench/wire.py --out "$RES"
      step 120 overlap-trace python3 bench/overlap_trace.py --groups 1,4 --sm-carveout 16 --comm-max-ctas 2 \
        --comm-high-priority --out "$RES"
      bench 150 hierarchical dispatch --nodes 2 --shapes deepseek-v3,qwen3-235b,mixtral-8x7b --routings uniform \
        --wires native --baselines none --iters 20 --warmup 5 --out "$RES"
      step 90 convergence python3 bench/convergence.py --wires bf16,fp8,native --steps 400 --out "$RES"
      step 90 convergence-regress python3 bench/convergence.py --wires bf16,fp8,native --steps 400 --task regress \
        --tolerance 0.05 --out "$RES"
      step 30 group-dedup python3 bench/group_dedup.py --out "$RES"
      step 150 host-calls python3 bench/host_calls.py --out "$RES/host-calls.txt"
      # the same on the GPU (a one-rank NCCL world), with the functions that take the time
      step 400 host-calls-cuda python3 bench/host_calls.py --cuda --top 14 --trips 50 --out "$RES/host-calls-cuda.txt" ;;
    *)
      echo "unknown part $part" | tee -a "$LOG"; status=2 ;;
  esac
done
tar -czf "$OUT/results.tar.gz" -C "$RES" . && rm -rf "$RES"
exit $status
