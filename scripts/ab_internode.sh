#!/usr/bin/env bash
# A/B of the internode path in one GPU call: another revision's library built beside this tree's, both timed by this
# tree's `bench internode`, runs alternated so both see the same machine state (runs on different hosts, or far apart
# on one, differ by more than most changes). Results: $OUT/ab-all.json (every run's JSON) and $OUT/ab-table.txt.
#
# Here:   git archive --format=tar --prefix=old/ <rev> > ab-old.tar
# Device: bash scripts/ab_internode.sh ab-old.tar      (carry ab-old.tar and .whl)
# Settings: RUNS (default 3) capped pairs at UCCL_EP_LOOPBACK_BW_GBPS=${CAP:-50}, then one uncapped pair; ITERS
# (default 20) calls per timed loop; NPROC (default 2) ranks as 2 emulated nodes (4: 2 x 2; "--share-gpu" in
# BENCH_ARGS where they outnumber the GPUs); VARIANT="NAME=VALUE ..." adds a third run per round: this tree with those
# settings (e.g. VARIANT=UCCL_EP_PUSH_HEAD=0), and one uncapped at the end; BENCH_ARGS: more bench options for
# every run (e.g. "--share-gpu" on one GPU, under MPS started by the caller); NEW_ARGS: more options for this tree's
# runs only (e.g. "--timeline 10", which an older backend may not support). VARIANTS="NAME|ENV=V ENV=V|OPTIONS;..."
# adds named runs of this tree per round (e.g. "em||--expert-major;sf|UCCL_EP_DRAIN_AFTER_WAITS=never|--sync-free"),
# capped only. BUDGET_SECS: skip the runs that would start within 150 s of that many seconds from now (so the table
# is still written inside a device call's limit). OLD_BENCH=own times the other revision with its own `bench
# internode` (for revisions whose backend this tree's bench no longer fits); by default this tree's bench is copied
# into it, and the other revision then needs `bench internode` to accept this tree's options.
set -uo pipefail
tarball=${1:?usage: scripts/ab_internode.sh OLD.tar (made with git archive --prefix=old/)}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/.gpu-out}
mkdir -p "$OUT"
work=$(mktemp -d)
bash scripts/gpu-check.sh none >/dev/null 2>&1  # builds this tree in place (and installs the carried wheels)
tar -xf "$tarball" -C "$work" &&
  { [[ ${OLD_BENCH:-} == own ]] ||
    cp uccl_ep_train/bench/internode.py "$work/old/uccl_ep_train/bench/internode.py"; } &&
  (cd "$work/old" && UCCL_EP_PYTHON=$(command -v python3) UCCL_EP_WITH_GPU=CUDA UCCL_EP_SETUP_LOG="$work/build-old.log" \
     bash scripts/setup.sh >/dev/null) || { echo "building the other revision failed" | tee -a "$OUT/summary.txt"; exit 1; }

deadline=$(( $(date +%s) + ${BUDGET_SECS:-86400} ))  # runs that would start within 150 s of it are skipped
bench() {  # bench TAG DIR CAP "BENCH OPTIONS" [NAME=VALUE ...]
  local tag=$1 dir=$2 cap=$3 opts=$4; shift 4
  (( $(date +%s) + 150 <= deadline )) || { echo "$tag skipped (BUDGET_SECS)" >>"$OUT/summary.txt"; return; }
  (cd "$dir" && env "$@" UCCL_EP_LOOPBACK_BW_GBPS=$cap PYTHONPATH="/tmp/site:$dir" timeout 150 torchrun --standalone \
     --nproc-per-node "${NPROC:-2}" -m uccl_ep_train bench internode --emulate-nodes 2 --iters "${ITERS:-20}" ${BENCH_ARGS:-} \
     $opts --json "$work/$tag.json" >"$work/$tag.log" 2>&1; local rc=$?; echo "$tag rc=$rc" >>"$OUT/summary.txt"
   [[ $rc == 0 ]] || tail -25 "$work/$tag.log" >>"$OUT/summary.txt")
}
IFS=';' read -r -a variants <<<"${VARIANTS:-}"
for i in $(seq "${RUNS:-3}"); do
  bench "old-capped-$i" "$work/old" "${CAP:-50}" ""
  bench "new-capped-$i" "$PWD" "${CAP:-50}" "${NEW_ARGS:-}"
  [[ -z ${VARIANT:-} ]] || bench "var-capped-$i" "$PWD" "${CAP:-50}" "${NEW_ARGS:-}" $VARIANT
  for v in "${variants[@]}"; do
    IFS='|' read -r name venv vargs <<<"$v"
    bench "$name-capped-$i" "$PWD" "${CAP:-50}" "${NEW_ARGS:-} $vargs" $venv
  done
done
bench old-uncapped "$work/old" 0 ""
bench new-uncapped "$PWD" 0 "${NEW_ARGS:-}"
[[ -z ${VARIANT:-} ]] || bench var-uncapped "$PWD" 0 "${NEW_ARGS:-}" $VARIANT
python3 - "$work" "$OUT" <<'PY'
import glob, json, os, sys

work, out = sys.argv[1:]
keys = ["dispatch_us", "cached_dispatch_us", "combine_us", "step_dispatch_us", "step_combine_us",
        "backward_cached_dispatch_us", "backward_combine_us", "median_us.dispatch", "median_us.cached_dispatch",
        "median_us.combine", "median_us.step_combine", "median_us.backward_cached_dispatch",
        "dispatch_network_hop_us", "combine_network_hop_us", "raw_copy_us", "dispatch_network_GBps",
        "cached_dispatch_network_GBps", "combine_network_GBps", "in_turn_network_GBps.forward_pair",
        "in_turn_network_GBps.backward_pair", "in_turn_us.forward_dispatch", "in_turn_us.forward_combine",
        "in_turn_us.backward_cached_dispatch", "in_turn_us.backward_combine", "packs_during_notify",
        "spare_send_tables_taken",
        "training_step_network_GBps.forward_pair", "training_step_network_GBps.backward_pair",
        "training_step_network_GBps.layer", "beside_compute_network_GBps.layer", "dispatch_host_held_us.alone",
        "dispatch_host_held_us.behind_compute",
        "training_step_us.forward_dispatch", "training_step_us.forward_combine",
        "training_step_us.backward_cached_dispatch", "training_step_us.backward_combine", "plans_made_ahead",
        "beside_compute_network_GBps.forward_pair", "beside_compute_network_GBps.backward_pair",
        "beside_compute_us.forward_dispatch", "beside_compute_us.forward_combine",
        "beside_compute_us.backward_cached_dispatch", "beside_compute_us.backward_combine"]


def get(run, key):  # "a.b": run["a"]["b"]; nan where a run (an older bench) lacks it
    for part in key.split("."):
        run = run.get(part, {}) if isinstance(run, dict) else {}
    return run if isinstance(run, (int, float)) else float("nan")

runs = {}
for f in sorted(glob.glob(f"{work}/*.json")):
    d = json.load(open(f))
    runs[os.path.basename(f)[:-5]] = d[0] if isinstance(d, list) else d
json.dump(runs, open(f"{out}/ab-all.json", "w"), indent=1)
with open(f"{out}/ab-table.txt", "w") as fh:
    fh.write("| metric | " + " | ".join(runs) + " |\n")
    for k in keys:
        fh.write(f"| {k} | " + " | ".join(f"{get(r, k):.1f}" for r in runs.values()) + " |\n")
    for tag, r in runs.items():
        fh.write(f"{tag} host steps (rank 0) {(r.get('host_step_us_by_rank') or [{}])[0]}\n")
        for name, steps in (r.get("in_turn_host_step_us_by_rank") or [{}])[0].items():
            fh.write(f"{tag} in-turn {name} host steps (rank 0) {steps}\n")
        fh.write(f"{tag} training-step host steps (rank 0) {(r.get('training_step_host_step_us_by_rank') or [{}])[0]}\n")
print(open(f"{out}/ab-table.txt").read())
PY
