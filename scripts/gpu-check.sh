#!/usr/bin/env bash
# One call on a GPU machine: build with CUDA, run the GPU test suites and the benchmarks, keep logs under $OUT.
# Usage (on the lent 2xH200 machine, from the repository root): bash scripts/gpu-check.sh [step ...]
# Steps: kernels moelayer copy_agent internode bench_dispatch bench_dispatcher bench_sync_free bench_proxy bench_internode
# bench_dispatch_emulated train
# (default: all but train, bench_sync_free, bench_internode and bench_dispatch_emulated);
# diagnostics: profile (torch.profiler tables of dispatch/combine and of the dispatcher round trip), pyspy_internode
# (py-spy samples of the ranks' main threads in the emulated calls, summarized by scripts/pyspy_summary.py),
# profile_internode (torch.profiler and cProfile tables of the emulated 2-node calls), internode_shared (the internode
# GPU tests with every rank on one GPU, time-sliced: stalls seen in session 50), internode_mps (the same under MPS:
# ranks' kernels at the same time; how ranks share a GPU, on 1 or 2 GPUs), internode_mps_agent (the same with the
# copy agent forced on and up to 4 ranks per GPU: 2 x 2 on one GPU), fifo (GPU producers into the FIFO,
# tests/host_core/test_gpu_fifo.py), internode_2x2 (the 2 nodes x 2 ranks case alone, with CUDA_LAUNCH_BLOCKING=1 so
# an illegal access names its kernel), latency (bench proxy's latency with staggered watchers and the echo floor, per
# push variant), internode_loop (the intermittent 2 x 2 reordered case, LOOPS times).
# INTERNODE_K selects internode tests by pytest -k expression.
# TRAIN_DISPATCHERS (default "uccl alltoall") picks the dispatchers the train step compares; EMULATE_NODES (default
# "2") the node counts bench_internode plays with the host's GPUs (e.g. "2 4" on 4 GPUs: 2 x 2 and 4 x 1).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/.gpu-out}
mkdir -p "$OUT"
log=$OUT/log.txt
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv; nvidia-smi topo -m; python3 -c 'import torch; print("torch", torch.__version__)'; } >>"$log" 2>&1
t0=$(date +%s)
UCCL_EP_PYTHON=$(command -v python3) UCCL_EP_WITH_GPU=CUDA UCCL_EP_SETUP_LOG=$OUT/build.log bash scripts/setup.sh >/dev/null \
  || { echo "build failed" >>"$log"; tail -40 "$OUT/build.log" >>"$log"; exit 1; }
echo "build: $(( $(date +%s) - t0 ))s" >>"$log"

# The internode steps run pytest with -v: a step cut at its time limit loses pytest's summary, and each case's line
# still names what passed and failed (session 50 had to name its failures from their places in a progress line).
run() {  # run NAME SECONDS CMD...: one step, its output appended to the log, its status to the summary
  local name=$1 secs=$2; shift 2
  local s; s=$(date +%s)
  echo "===== $name: $*" >>"$log"
  timeout -k 10 "$secs" "$@" >>"$log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s ))s" | tee -a "$OUT/summary.txt" >>"$log"
}
under_mps() {  # under_mps NAME [VAR=VALUE...]: the internode GPU tests, every rank on the GPU(s) there are, inside
  # an MPS daemon of their own, stopped whatever the tests do (a stalled run leaves MPS faulting later clients)
  local name=$1; shift
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/uccl-ep-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/uccl-ep-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d >>"$log" 2>&1; then
    trap 'echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
    run "$name" "${INTERNODE_SECS:-420}" env UCCL_EP_TEST_SHARE_GPU=1 CUDA_DEVICE_MAX_CONNECTIONS=8 "$@" python3 -m \
      pytest -v --tb=short -rf --durations=8 tests/internode ${INTERNODE_K:+-k "$INTERNODE_K"}
    echo quit | nvidia-cuda-mps-control >>"$log" 2>&1
    trap - EXIT
  else
    echo "$name rc=127 (nvidia-cuda-mps-control did not start)" | tee -a "$OUT/summary.txt" >>"$log"
  fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
ngpu=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")}
tr2=(torchrun --standalone --nproc-per-node "${ngpu:-2}")  # every GPU of the host (NGPU overrides)

steps=("$@")
[[ ${#steps[@]} -gt 0 ]] || steps=(kernels moelayer internode bench_dispatch bench_dispatcher bench_proxy)
for step in "${steps[@]}"; do
  case $step in
    # (faulthandler: a rank whose peer failed hangs in the next collective; its stack then shows where)
    kernels) run kernels 150 "${tr2[@]}" -m pytest -x -q -rf -o faulthandler_timeout=60 tests/kernels/test_intranode_gpu.py ;;
    internode_shared)  # one GPU hosting every rank (a 1-GPU machine), time-sliced (no MPS); at most 2 ranks per
      # GPU, so 2 x 2 only with UCCL_EP_TEST_MAX_RANKS_PER_GPU=4 (it stalls there: docs/internode.md, "Hardware work
      # queues"). Time-sliced ranks stalled in session 50 (every_output[2-1] here; 8 of the 2 x 2 cases on 2x H200),
      # so the tests skip them unless UCCL_EP_TEST_TIME_SLICED=1, which this step sets: it checks whether they still do
      UCCL_EP_TEST_SHARE_GPU=1 UCCL_EP_TEST_TIME_SLICED=1 run internode_shared "${INTERNODE_SECS:-420}" python3 -m \
        pytest -v --tb=short -rf --durations=8 tests/internode ${INTERNODE_K:+-k "$INTERNODE_K"} ;;
    internode_mps)  # the same tests with the GPU shared through MPS: the ranks' kernels run at the same time, as on
      # separate GPUs. The loopback needs CUDA_DEVICE_MAX_CONNECTIONS set under MPS (docs/internode.md, "Hardware work
      # queues"); 8 leaves MPS room for the 2 x 2 cases' four clients.
      under_mps internode_mps ;;
    internode_mps_agent)  # as internode_mps, with the copy agent forced on and up to four ranks on one GPU: 2 x 2
      # on a 1-GPU machine. The agent's copies run in MPS clients of their own, so none waits in a hardware queue
      # behind a spinning kernel, and the drains are off as with a GPU per rank (session 49: 4-2 and 2x2 cases pass
      # where, with the proxy threads' copies, every_output[4-2] stalled 5 runs of 5). The copy agent's own cases
      # still skip on a shared GPU (they check the default, auto).
      under_mps internode_mps_agent UCCL_EP_TEST_MAX_RANKS_PER_GPU=4 UCCL_EP_LOOPBACK_COPY_AGENT=on ;;
    moelayer) run moelayer 180 python3 -m pytest -x -q -rf tests/megatron/test_moelayer_gpu.py ;;
    copy_agent)  # the defaults with a GPU per rank: the loopback's copy agent moves the bytes, no drains, the legacy
      # default stream (docs/internode.md, "The copy agent"); then Megatron's MoELayer and hooks the same way
      run copy_agent_internode "${INTERNODE_SECS:-420}" python3 -m pytest -v --tb=short -rf --durations=8 \
        tests/internode/test_internode_gpu.py -k "copy_agent or legacy_default_stream"
      run copy_agent_megatron 300 python3 -m pytest -q -rf tests/megatron/test_moelayer_gpu.py \
        tests/megatron/test_dispatcher_on_internode_gpu.py ;;
    internode)  # a GPU per rank; cases of more ranks than GPUs skip without MPS (time-sliced: internode_mps runs them)
      run internode "${INTERNODE_SECS:-420}" python3 -m pytest -v --tb=short -rf --durations=8 tests/internode \
                 ${INTERNODE_K:+-k "$INTERNODE_K"} ;;
    bench_dispatch) run bench_dispatch 120 "${tr2[@]}" -m uccl_ep_train bench dispatch --json "$OUT/dispatch.json" ;;
    bench_dispatch_24)  # every kernel of a call on 24 SMs, local ones included (DeepEP's rule), headline shape only
      run bench_dispatch_24 120 "${tr2[@]}" -m uccl_ep_train bench dispatch --local-sms 24 --sweep "" \
        --json "$OUT/dispatch-local24.json" ;;
    bench_dispatcher) run bench_dispatcher 150 "${tr2[@]}" -m uccl_ep_train bench dispatcher \
                        --dispatchers alltoall,allgather,flex,uccl,uccl-sync-free --json "$OUT/dispatcher.json" ;;
    bench_sync_free)  # sync-free at a capacity near the real rows (~32768 per rank at this shape, 2 ranks) instead
      # of the worst case (65536): what the padding costs
      run bench_sync_free 150 "${tr2[@]}" -m uccl_ep_train bench dispatcher --dispatchers uccl,uccl-sync-free \
        --sync-free-rows "${SYNC_FREE_ROWS:-36000}" --json "$OUT/dispatcher-sync-free.json" ;;
    bench_proxy)  # the default push variant (single-owner warp writer), then the per-command atomic push
      UCCL_EP_CPU_TIMEOUT_SECS=20 run bench_proxy 90 python3 -m uccl_ep_train bench proxy --producer gpu \
        --fifos 1,2,4,8 --json "$OUT/proxy.json"
      UCCL_EP_CPU_TIMEOUT_SECS=20 run bench_proxy_push 90 python3 -m uccl_ep_train bench proxy --producer gpu \
        --fifos 1,4 --push push --json "$OUT/proxy-push.json" ;;
    bench_internode)  # EMULATE_NODES (default 2) emulated nodes: NIC uncapped, then capped at 50 GB/s per GPU, each
      # with the kernel timeline of 20 rounds (docs/internode.md, "Kernel timeline"), capped also the wire timeline
      # ("Wire timeline": each call's time after its last byte split into landing, reader and host return); both
      # report the raw transport hop beside the raw copy
      for n in ${EMULATE_NODES:-2}; do
        run "bench_internode_${n}n" "${BENCH_INTERNODE_SECS:-150}" "${tr2[@]}" -m uccl_ep_train bench internode \
          --emulate-nodes "$n" --timeline 20 --json "$OUT/internode-${n}n-uncapped.json"
        UCCL_EP_LOOPBACK_BW_GBPS=50 run "bench_internode_${n}n_capped" "${BENCH_INTERNODE_SECS:-150}" "${tr2[@]}" \
          -m uccl_ep_train bench internode --emulate-nodes "$n" --timeline 20 \
          --json "$OUT/internode-${n}n-capped50.json"
        # sync-free, on the defaults (with a GPU per rank: the copy agent and no drains), where every rank-major call
        # met 45 GB/s in session 38; compare `*_network_GBps.layer` and the beside-compute figures, not the pairs
        # (calls return before their GPU work ends), and UCCL_EP_DRAIN_AFTER_WAITS=always for the drains' cost
        UCCL_EP_LOOPBACK_BW_GBPS=50 run "bench_internode_${n}n_capped_sync_free" \
          "${BENCH_INTERNODE_SECS:-150}" "${tr2[@]}" -m uccl_ep_train bench internode --emulate-nodes "$n" \
          --sync-free --json "$OUT/internode-${n}n-capped50-sync-free.json"
      done ;;
    bench_dispatch_emulated)  # the command issue 5 names: bench dispatch --emulate-nodes 2, uncapped then capped at
      # 50 GB/s per GPU; on a 1-GPU machine both ranks share it (--share-gpu: a check that it runs, no timings)
      share=(); [[ "${ngpu:-1}" -ge 2 ]] || share=(--share-gpu)
      run bench_dispatch_emulated "${BENCH_INTERNODE_SECS:-150}" torchrun --standalone --nproc-per-node 2 \
        -m uccl_ep_train bench dispatch --emulate-nodes 2 "${share[@]}" --json "$OUT/dispatch-emulated-uncapped.json"
      UCCL_EP_LOOPBACK_BW_GBPS=50 run bench_dispatch_emulated_capped "${BENCH_INTERNODE_SECS:-150}" torchrun \
        --standalone --nproc-per-node 2 -m uccl_ep_train bench dispatch --emulate-nodes 2 "${share[@]}" \
        --json "$OUT/dispatch-emulated-capped50.json" ;;
    profile)
      run profile_dispatch 120 "${tr2[@]}" -m uccl_ep_train bench dispatch --sweep "" --iters 10 \
        --profile "$OUT/profile-dispatch.txt"
      run profile_dispatcher 180 "${tr2[@]}" -m uccl_ep_train bench dispatcher --dispatchers alltoall,uccl \
        --iters 10 --profile "$OUT/profile-dispatcher" ;;
    profile_internode)  # host and kernel tables of the 2 x 1 internode calls (NIC capped at 50 GB/s per GPU); on a
      # 1-GPU machine both ranks share it (--share-gpu: the host side only)
      share=(); [[ "${ngpu:-1}" -ge 2 ]] || share=(--share-gpu)
      UCCL_EP_LOOPBACK_BW_GBPS=50 run profile_internode 150 torchrun --standalone --nproc-per-node 2 -m uccl_ep_train \
        bench internode --emulate-nodes 2 --iters 3 "${share[@]}" --profile "$OUT/profile-internode.txt" ;;
    pyspy_internode)  # where each rank's main thread spends the calls' host steps, idle samples included (py-spy
      # from a carried wheel in .whl/, whose binary lands in /tmp/site/bin): sync-free, uncapped, EMULATE_NODES nodes;
      # scripts/pyspy_summary.py splits the samples of each call kind into waits and work by frame
      spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
      if [[ -x $spy ]]; then
        for n in ${EMULATE_NODES:-2}; do
          UCCL_EP_LOOPBACK_BW_GBPS=0 run "pyspy_internode_${n}n" "${BENCH_INTERNODE_SECS:-150}" "$spy" record \
            --subprocesses --idle --rate 500 --format raw -o "$OUT/pyspy-internode-${n}n.raw" -- "${tr2[@]}" \
            -m uccl_ep_train bench internode --emulate-nodes "$n" --iters 10 --sync-free \
            --json "$OUT/pyspy-internode-${n}n.json"
          python3 scripts/pyspy_summary.py "$OUT/pyspy-internode-${n}n.raw" >"$OUT/pyspy-internode-${n}n.txt" 2>&1
        done
      else
        echo "pyspy_internode rc=127 (no py-spy: carry its wheel in .whl/)" | tee -a "$OUT/summary.txt" >>"$log"
      fi ;;
    profile_dispatcher)  # the uccl round trip alone, torch.profiler tables per kernel
      run profile_dispatcher 180 "${tr2[@]}" -m uccl_ep_train bench dispatcher --dispatchers uccl --iters 10 \
        --profile "$OUT/profile-dispatcher" ;;
    fifo) run fifo 120 python3 -m pytest -q -s -rf tests/host_core/test_gpu_fifo.py ;;
    latency)  # push-to-signal latency with 1..16 staggered watching warps, beside the GPU->host->GPU echo floor
      for push in writer-warp writer push; do
        UCCL_EP_CPU_TIMEOUT_SECS=20 run "latency_$push" 60 python3 -m uccl_ep_train bench proxy --producer gpu \
          --fifos 1 --commands 20000 --latency-samples 5000 --poll-warps 1,4,8,16 --push "$push" \
          --json "$OUT/latency-$push.json"
      done ;;
    internode_loop)  # the intermittent case (reorder + cap 1 + 4 KiB chunks, 2 x 2), LOOPS times, stop at a failure
      for i in $(seq "${LOOPS:-6}"); do
        run "internode_loop_$i" 240 python3 -m pytest -x -q -s -rf tests/internode \
          -k "reordered_transport and 4-2"
        tail -1 "$OUT/summary.txt" | grep -q "rc=0" || break
      done ;;
    internode_2x2) CUDA_LAUNCH_BLOCKING=1 run internode_2x2 150 python3 -m pytest -x -q -rf tests/internode \
                     -k "every_output and 4-2" ;;
    train)  # 1-GPU runs side by side (one per GPU), then the EP=2 runs; same seed, mock data, 50 steps
      read -r -a dispatchers <<<"${TRAIN_DISPATCHERS:-uccl alltoall}"
      gpu=0
      for d in "${dispatchers[@]}"; do
        CUDA_VISIBLE_DEVICES=$gpu run "train1_$d" 150 python3 -m uccl_ep_train train "dispatcher=$d" "run.name=gpu1-$d" &
        gpu=$(( (gpu + 1) % 2 ))
      done
      wait
      for d in "${dispatchers[@]}"; do
        run "train2_$d" 150 python3 -m uccl_ep_train train parallelism=ep2 "dispatcher=$d" "run.name=gpu2-$d"
      done
      for r in runs/gpu*; do
        { echo "== $r"; cat "$r/throughput.json" 2>/dev/null; grep -h "lm loss" "$r/train.log"; } >>"$OUT/train-summary.txt"
      done ;;
    none) ;;  # build only (scripts/ab_internode.sh)
    *) echo "unknown step $step" >>"$log" ;;
  esac
done
