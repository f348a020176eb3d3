#!/usr/bin/env bash
# Run every technique script on the same model and data, then print one markdown table of their
# RESULT lines and the time the whole run took. Gloo on CPU, NCCL when every rank has a GPU.
#
#   ./run_all.sh              # one row per script, its headline configuration (< 3 min, 2 CPU cores)
#   ./run_all.sh --all        # plus every variant and every nd_parallel layout (longer)
#   NPROC=4 ./run_all.sh      # world size (default: 2, or the number of GPUs, at most 4)
#   ONLY='zero|fsdp' ./run_all.sh   # only the rows whose name matches (a grep -E pattern)
#   DATA_DIR=path ./run_all.sh      # where MNIST is (default: data, as the scripts'); else synthetic
#   LOGS=dir ./run_all.sh           # keep each row's output there (default: a new temp directory)
#
# The quick setting, the same for every row, chosen so that the whole default run fits in
# 3 minutes on 2 CPU cores and the table still shows the model learning:
#   --patch 14         4 tokens of 14x14 pixels. With the default 7x7 patches (16 tokens) the
#                      ViT needs a few hundred steps to leave its plateau (about 37% after 64
#                      steps); with 14x14 ones it is above 75% after 64 steps, and every step is
#                      cheaper. 4 tokens still split over 2 or 4 ranks (context and sequence
#                      parallelism need W | T).
#   --depth 4          blocks: interleaved pipelining needs depth >= p·V = 2·NPROC, so
#                      depth = 2·NPROC (at least 4) for every row, not a deeper model on one row.
#   --dim 64 --heads 4 the default width (heads divisible by W = 2 or 4 for TP and Ulysses).
#   --limit 4096 --epochs 1 --batch-size 64: 64 optimizer steps, 4096 test images. Most of a
#                      row's time is process start-up and per-step communication, not
#                      arithmetic, so steps, not samples, are what the budget buys.
#   --lr 4e-3          twice the default: a 64-step run (5% warm-up, cosine decay) learns faster
#                      with it on this model; 1e-2 is too much.
# The full setting (the scripts' defaults: 6 epochs of all 60,000 images, batch 128, 7x7 patches)
# is what reaches 98%: see docs/measured.md.
#
# Exits non-zero if any row fails, naming it and its log.
set -uo pipefail
cd "$(dirname "$0")"

ALL=0
case "${1:-}" in
  "") ;;
  --all) ALL=1 ;;
  *) echo "usage: $0 [--all]   (env: NPROC, ONLY, DATA_DIR, LOGS)" >&2; exit 2 ;;
esac

gpus() {   # what torch.cuda.device_count() will say, without a second's import of torch
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .
  else
    nvidia-smi -L 2>/dev/null | grep -c '^GPU'
  fi
}
if [ -z "${NPROC:-}" ]; then
  GPUS=$(gpus)
  NPROC=$(( GPUS >= 2 ? (GPUS < 4 ? GPUS : 4) : 2 ))
fi
DEPTH=$(( 2 * NPROC > 4 ? 2 * NPROC : 4 ))
DATA_DIR=${DATA_DIR:-data}
LOGS=${LOGS:-$(mktemp -d -t run_all.XXXXXX)}
mkdir -p "$LOGS/offload"                   # zero_offload.py --offload disk: its state files
QUICK=(--patch 14 --depth "$DEPTH" --dim 64 --heads 4 --limit 6144 --epochs 1 --batch-size 128
       --lr 8e-3 --shift 0)
COMMON=(--no-progress --data-dir "$DATA_DIR" "${QUICK[@]}")

# tier (quick: the default run; all: --all only) | row name (ONLY matches it) | launcher (python:
# one process; ranks: NPROC of them, ranks:W a layout's own W; torchrun: NPROC under torchrun) |
# script and its own flags | why the row's numbers differ from ddp's, if they do
MOE="--experts 4 --top-k 2"   # E = 4: a multiple of W = 1, 2 or 4 for expert_parallel.py
RUNS=(
  "quick|dp|python|dp.py|"
  "quick|ddp|ranks|ddp.py|"
  "quick|ddp_torchrun|torchrun|ddp_torchrun.py --snapshot $LOGS/snapshot.pt|under torchrun: s includes its agent"
  "quick|amp_checkpoint bf16 + checkpoint|ranks|amp_checkpoint.py --amp bf16 --checkpoint|bf16 matmuls: not fp32's loss"
  "all|amp_checkpoint checkpoint|ranks|amp_checkpoint.py --checkpoint|"
  "quick|zero stage 3|ranks|zero.py --stage 3|"
  "all|zero stage 1|ranks|zero.py --stage 1|"
  "all|zero stage 2|ranks|zero.py --stage 2|"
  "quick|zero_offload stage 3 disk|ranks|zero_offload.py --stage 3 --offload disk --offload-dir $LOGS/offload|"
  "all|zero_offload stage 3 cpu|ranks|zero_offload.py --stage 3 --offload cpu|"
  "quick|fsdp|ranks|fsdp.py|"
  "all|fsdp mixed precision|ranks|fsdp.py --mixed-precision|bf16 compute: not fp32's loss"
  "all|fsdp_resume dcp|ranks|fsdp_resume.py --dcp $LOGS/dcp|"
  "quick|tensor_parallel|ranks|tensor_parallel.py|"
  "all|tensor_parallel sequence parallel|ranks|tensor_parallel.py --sequence-parallel|"
  "quick|tensor_parallel_zero_r partitioned|ranks|tensor_parallel_zero_r.py --partition-activations|"
  "all|tensor_parallel_zero_r checkpoint|ranks|tensor_parallel_zero_r.py --checkpoint|"
  "quick|context_parallel ring|ranks|context_parallel.py --method ring|"
  "all|context_parallel ulysses|ranks|context_parallel.py --method ulysses|"
  "quick|expert_parallel E=4 k=2|ranks|expert_parallel.py $MOE|MoE model (own Ψ, loss)"
  "all|ddp MoE E=4 k=2|ranks|ddp.py $MOE|MoE model, dense DDP: expert_parallel's numbers"
  "quick|pipeline 1f1b|ranks|pipeline.py --schedule 1f1b --microbatches 4|"
  "all|pipeline naive|ranks|pipeline.py --schedule naive|"
  "all|pipeline gpipe|ranks|pipeline.py --schedule gpipe --microbatches 4|"
  "quick|pipeline_schedules interleaved V=2|ranks|pipeline_schedules.py --schedule interleaved --virtual-stages 2 --microbatches 4|"
  "all|pipeline_schedules zb-h1|ranks|pipeline_schedules.py --schedule zb-h1 --microbatches 4|"
  "quick|pipeline_pipedream|ranks|pipeline_pipedream.py --microbatches 4|asynchronous: own loss; a step per micro-batch"
  # nd_parallel: one row per layout (R, S, T, P) = (dp_replicate, dp_shard, tp, pp), at its own W
  "quick|nd_parallel FSDP x PP (1,2,1,2)|ranks:4|nd_parallel.py --dp-shard 2 --pp 2|"
  "all|nd_parallel FSDP x TP (1,2,2,1)|ranks:4|nd_parallel.py --dp-shard 2 --tp 2|"
  "all|nd_parallel HSDP x TP (2,1,2,1)|ranks:4|nd_parallel.py --dp-replicate 2 --dp-shard 1 --tp 2|"
  "all|nd_parallel HSDP x PP (2,1,1,2)|ranks:4|nd_parallel.py --dp-replicate 2 --dp-shard 1 --pp 2 --schedule gpipe|"
  "all|nd_parallel TP x PP (1,1,2,2)|ranks:4|nd_parallel.py --dp-shard 1 --tp 2 --pp 2|"
  "all|nd_parallel FSDP x TP x PP (1,2,2,2)|ranks:8|nd_parallel.py --dp-shard 2 --tp 2 --pp 2|"
  "all|nd_parallel HSDP x TP (2,2,2,1)|ranks:8|nd_parallel.py --dp-replicate 2 --dp-shard 2 --tp 2|"
  # no training: collectives.py checks every primitive's result and prints its own line below
  "quick|collectives|ranks|collectives.py|"
)

# W processes of one script on this machine, each given the variables torchrun gives its workers
# (the scripts read them, as under srun). Why not torchrun itself: its agent starts a Python of its
# own and watches the workers, about 3 s of every row's 11 on 2 cores, for nothing the table shows.
# Unlike torchrun it does not stop the other ranks when one fails: they stop at their next
# collective, or at --timeout. ddp_torchrun.py, whose subject torchrun is, runs under it.
ranks() {
  local world=$1 port rank pids=() status=0
  shift
  port=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  for ((rank = 0; rank < world; rank++)); do
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=$world \
      LOCAL_WORLD_SIZE=$world RANK=$rank LOCAL_RANK=$rank "$@" &
    pids+=("$!")
  done
  for pid in "${pids[@]}"; do
    wait "$pid" || status=1
  done
  return "$status"
}

failed=()
: > "$LOGS/results"
start=$(date +%s)
for entry in "${RUNS[@]}"; do
  IFS='|' read -r tier name launcher cmd why <<< "$entry"
  [ "$tier" = all ] && [ "$ALL" = 0 ] && continue
  [ -n "${ONLY:-}" ] && ! grep -qE "$ONLY" <<< "$name" && continue
  log="$LOGS/$(tr -c 'A-Za-z0-9=\n' '_' <<< "$name").log"
  flags=("${COMMON[@]}")
  [ "$name" = collectives ] && flags=()   # it trains nothing: none of the training flags apply
  case $launcher in
    python) set -- python $cmd "${flags[@]}" ;;
    torchrun) set -- torchrun --standalone --nproc_per_node="$NPROC" $cmd "${flags[@]}" ;;
    ranks) set -- ranks "$NPROC" python $cmd "${flags[@]}" ;;
    ranks:*) set -- ranks "${launcher#ranks:}" python $cmd "${flags[@]}" ;;
  esac
  t0=$(date +%s)
  if "$@" > "$log" 2>&1 && grep -q '^RESULT ' "$log"; then
    seconds=$(( $(date +%s) - t0 ))
    echo "ok    ${seconds}s  $name" >&2
    echo "$name|$seconds|$why|$(grep '^RESULT ' "$log" | tail -1 | cut -c8-)" >> "$LOGS/results"
  else
    echo "FAIL  $(( $(date +%s) - t0 ))s  $name: $* (log: $log)" >&2
    failed+=("$name (log: $log)")
  fi
done

python - "$LOGS/results" <<'PY'
import json
import sys


def size(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def measured_and_formula(measured, formula):
    """The measured bytes, and the formula's next to them where the two differ as printed
    (padding, rank-dependent routing: the script's own summary says which)."""
    if formula is None or size(formula) == size(measured):
        return size(measured)
    return f"{size(measured)} (formula {size(formula)})"


def comm_cell(result):
    """Bytes this rank put into collectives per step, and for each kind the formula counts whose
    measured bytes differ from it as printed, the two (kinds with the same pair share them)."""
    pairs = {}
    for kind, formula in (result["formula"].get("comm") or {}).items():
        measured = result["comm"].get(kind, 0)
        if formula is not None and size(measured) != size(formula):
            pairs.setdefault((size(measured), size(formula)), []).append(kind.replace("_", "-"))
    notes = [f"{', '.join(kinds)} {m}, formula {f}" for (m, f), kinds in pairs.items()]
    cell = size(result["comm_bytes"])
    return f"{cell} ({'; '.join(notes)})" if notes else cell


header = (
    "technique", "W", "backend", "data", "steps", "final loss", "test acc", "samples/s",
    "params/rank", "grads/rank", "optimizer/rank", "comm/step/rank", "s", "differs from ddp by",
)
print("| " + " | ".join(header) + " |")
print("|" + "---|" * len(header))
collectives = []
for line in open(sys.argv[1]):
    name, seconds, why, js = line.rstrip("\n").split("|", 3)
    r = json.loads(js)
    if r["script"] == "collectives":
        collectives.append(r)
        continue
    f = r["formula"]
    cells = (
        name, r["world_size"], r["backend"], r["data"], r["steps"], f"{r['loss']:.4f}",
        f"{r['test_acc']:.4f}", f"{r['samples_per_s']:.0f}",
        measured_and_formula(r["param_bytes"], f.get("param_bytes")),
        measured_and_formula(r["grad_bytes"], f.get("grad_bytes")),
        measured_and_formula(r["optim_bytes"], f.get("optim_bytes")),
        comm_cell(r), seconds, why,
    )
    print("| " + " | ".join(str(c) for c in cells) + " |")
for r in collectives:
    print(
        f"\ncollectives.py, W={r['world_size']} {r['backend']}: {r['checks_passed']}/{r['checks_total']}"
        f" checks passed; ring all-reduce of {r['ring_numel']:,} floats sends "
        f"{size(r['ring_bytes_sent'][0])} per rank (formula 2(p-1)/p·N = {size(r['ring_bytes_formula'])})"
    )
PY
load=""
[ -r /proc/loadavg ] && load=" (load average $(cut -d' ' -f1-3 /proc/loadavg))"
echo
echo "$(( $(date +%s) - start )) s in all$load; logs in $LOGS"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
