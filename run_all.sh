#!/usr/bin/env bash
# Run every technique script (and its main variants) and print one markdown table of their
# RESULT lines. Uses whatever the machine has: Gloo on CPU, NCCL when every rank has a GPU.
#
#   ./run_all.sh            # quick: 2048 samples, 1 epoch each (about 3 minutes on 2 CPU cores)
#   ./run_all.sh --full     # the default epochs on the whole data set
#   NPROC=4 ./run_all.sh    # world size (default: 2, or the number of GPUs, at most 4)
#   ONLY=nd ./run_all.sh    # only the rows whose name matches (a grep -E pattern), no collectives.py
#
# Each torchrun launch is --standalone, which rendezvouses on a free port of its own.
# Exits non-zero if any script fails, naming it; its output is kept in $LOGS.
set -uo pipefail
cd "$(dirname "$0")"

QUICK=(--limit 2048 --epochs 1 --batch-size 64)
[ "${1:-}" = "--full" ] && QUICK=()
GPUS=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
NPROC=${NPROC:-$(( GPUS >= 2 ? (GPUS < 4 ? GPUS : 4) : 2 ))}
COMMON=(--no-progress "${QUICK[@]}")
LOGS=${LOGS:-$(mktemp -d -t run_all.XXXXXX)}
mkdir -p "$LOGS/offload"                     # zero.py --offload disk: each rank's optimizer state files

# name | launcher (python, torchrun, or torchrun:W for a fixed world size) | script and its own flags
EXPERTS=$(( NPROC == 3 ? 6 : 4 ))       # the MoE rows: E experts, a multiple of W for expert_parallel.py
RUNS=(
  "dp|python|dp.py"
  "ddp|torchrun|ddp.py"
  "ddp_torchrun|torchrun|ddp_torchrun.py"
  "amp bf16 + checkpoint|torchrun|amp_checkpoint.py --amp bf16 --checkpoint"
  "zero-1|torchrun|zero.py --stage 1"
  "zero-2|torchrun|zero.py --stage 2"
  "zero-3|torchrun|zero.py --stage 3"
  "zero-3 + offload disk|torchrun|zero.py --stage 3 --offload disk --offload-dir $LOGS/offload"
  "fsdp|torchrun|fsdp.py"
  "tensor parallel|torchrun|tensor_parallel.py"
  "tensor + sequence parallel|torchrun|tensor_parallel.py --sequence-parallel"
  "tensor parallel + partitioned checkpoints|torchrun|tensor_parallel.py --partition-activations"
  "pipeline naive|torchrun|pipeline.py --schedule naive"
  "pipeline gpipe|torchrun|pipeline.py --schedule gpipe --microbatches 4"
  "pipeline 1f1b|torchrun|pipeline.py --schedule 1f1b --microbatches 4"
  "context parallel ring|torchrun|context_parallel.py --method ring"
  "context parallel ulysses|torchrun|context_parallel.py --method ulysses"
  # nd_parallel: one row per layout (R, S, T, P), at its own world size (torchrun:W)
  "nd HSDP x TP (2,1,2,1)|torchrun:4|nd_parallel.py --dp-replicate 2 --dp-shard 1 --tp 2"
  "nd FSDP x TP (1,2,2,1)|torchrun:4|nd_parallel.py --dp-shard 2 --tp 2"
  "nd HSDP x PP (2,1,1,2)|torchrun:4|nd_parallel.py --dp-replicate 2 --dp-shard 1 --pp 2 --schedule gpipe"
  "nd FSDP x PP (1,2,1,2)|torchrun:4|nd_parallel.py --dp-shard 2 --pp 2"
  "nd TP x PP (1,1,2,2)|torchrun:4|nd_parallel.py --dp-shard 1 --tp 2 --pp 2"
  "nd 3-D FSDP x TP x PP (1,2,2,2)|torchrun:8|nd_parallel.py --dp-shard 2 --tp 2 --pp 2"
  "nd HSDP x TP (2,2,2,1)|torchrun:8|nd_parallel.py --dp-replicate 2 --dp-shard 2 --tp 2"
  "ddp, MoE E=$EXPERTS k=2|torchrun|ddp.py --experts $EXPERTS --top-k 2"
  "expert parallel E=$EXPERTS k=2|torchrun|expert_parallel.py --experts $EXPERTS --top-k 2"
  "pipeline interleaved V=2|torchrun|pipeline_schedules.py --schedule interleaved --virtual-stages 2 --microbatches 4 --depth 8"
  "pipeline zb-h1|torchrun|pipeline_schedules.py --schedule zb-h1 --microbatches 4"
  "pipeline pipedream (async)|torchrun|pipeline_pipedream.py --microbatches 4"
)

failed=()
: > "$LOGS/results"
start=$(date +%s)
for entry in "${RUNS[@]}"; do
  IFS='|' read -r name launcher cmd <<< "$entry"
  [ -n "${ONLY:-}" ] && ! grep -qE "$ONLY" <<< "$name" && continue
  log="$LOGS/$(echo "$name" | tr ' +' '__').log"
  if [ "$launcher" = python ]; then
    set -- python $cmd "${COMMON[@]}"
  else   # torchrun:W: a layout that needs W ranks, whatever NPROC is
    n=$NPROC; [ "$launcher" != torchrun ] && n=${launcher#torchrun:}
    set -- torchrun --standalone --nproc_per_node="$n" $cmd "${COMMON[@]}"
  fi
  t0=$(date +%s)
  if "$@" > "$log" 2>&1 && grep -q '^RESULT ' "$log"; then
    echo "ok    $(( $(date +%s) - t0 ))s  $name" >&2
    echo "$name|$(grep '^RESULT ' "$log" | tail -1 | cut -c8-)" >> "$LOGS/results"
  else
    echo "FAIL  $(( $(date +%s) - t0 ))s  $name: $* (log: $log)" >&2
    failed+=("$name")
  fi
done
# collectives.py has no training; it must pass its own checks
if [ -n "${ONLY:-}" ]; then
  :
elif torchrun --standalone --nproc_per_node="$NPROC" collectives.py > "$LOGS/collectives.log" 2>&1 \
   && grep -q '^RESULT ' "$LOGS/collectives.log"; then
  echo "ok    collectives" >&2
else
  echo "FAIL  collectives (log: $LOGS/collectives.log)" >&2
  failed+=("collectives")
fi

python - "$LOGS/results" <<'PY'
import json, sys
def b(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
print("| technique | W | backend | steps | final loss | test acc | samples/s | params/rank | grads/rank | optimizer/rank | comm/step/rank |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for line in open(sys.argv[1]) if len(sys.argv) > 1 else []:
    name, _, js = line.partition("|")
    r = json.loads(js)
    print(f"| {name} | {r['world_size']} | {r['backend']} | {r['steps']} | {r['loss']:.4f} | {r['test_acc']:.4f} "
          f"| {r['samples_per_s']:.0f} | {b(r['param_bytes'])} | {b(r['grad_bytes'])} | {b(r['optim_bytes'])} "
          f"| {b(r['comm_bytes'])} |")
PY
echo "$(( $(date +%s) - start ))s in all; logs in $LOGS" >&2
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}" >&2
  exit 1
fi
