#!/usr/bin/env bash
# Run every technique script on the same model and data, then print one markdown table of their
# RESULT lines and the time the whole run took. Gloo on CPU, NCCL when every rank has a GPU.
#
#   ./run_all.sh              # one row per script, its headline configuration (< 3 min, 2 cores)
#   ./run_all.sh --all        # plus every variant and every nd_parallel layout (longer)
#   NPROC=4 ./run_all.sh      # world size (default: 2, or the number of GPUs, at most 4)
#   ONLY='zero|fsdp' ./run_all.sh   # only the rows whose name matches (a grep -E pattern)
#   DATA_DIR=path ./run_all.sh      # where MNIST is (default: data, the scripts'), else synthetic
#   LOGS=dir ./run_all.sh           # keep each row's output there (default: a new temp directory)
#
# One setting for every row (same model, same data), chosen so that the default run takes well
# under 3 minutes on 2 CPU cores and the table still shows the model learning: with MNIST, test
# accuracy from 10% to about 84% in 48 steps (67% on the synthetic digits, which start harder).
#   --patch 14        4 tokens of 14x14 pixels. With the default 7x7 patches (16 tokens) the ViT
#                     sits on a plateau for its first few hundred steps: 35% after these 48 steps,
#                     and a higher lr diverges. 4 tokens still split over W = 2 or 4 ranks
#                     (context and sequence parallelism need W | T).
#   --depth 4         = 2·NPROC, at least 4: interleaved pipelining needs depth >= p·V (V = 2),
#                     and every row gets the same depth rather than one row a deeper model.
#   --dim 64 --heads 4   the default width (heads divisible by W for tensor parallelism, Ulysses).
#   --limit 6144 --epochs 1 --batch-size 128   48 steps of the default global batch; the first
#                     6,144 test images. A row of 2 ranks takes 4-12 s on 2 idle cores: 1-6 s
#                     training, the rest loading data, measuring its first steps and shutting
#                     down (torch is imported once, below); 48 steps instead of 32 buy 6 points.
#   --clip 1.0        the global gradient norm clipped to 1.0 before every step (nanoGPT's
#                     default), each script its technique's way: torch's clip_grad_norm_ where
#                     every rank holds whole gradients, the section's own over shards, stages or
#                     experts. pipeline_pipedream.py refuses it: its stages step at different times.
#   --lr 8e-3         4x the default: best of 2e-3 to 1e-2 for a run this short (5% warm-up,
#                     then cosine decay). --shift 0: no +-1-pixel augmentation, which slows a
#                     run that sees each image once (79% against 76% at 64 steps of 64).
# The scripts' defaults (6 epochs of all 60,000 images, 7x7 patches) are what reach 98%.
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
GPUS=$(gpus)
if [ -z "${NPROC:-}" ]; then
  NPROC=$(( GPUS >= 2 ? (GPUS < 4 ? GPUS : 4) : 2 ))
fi
DEPTH=$(( 2 * NPROC > 4 ? 2 * NPROC : 4 ))
DATA_DIR=${DATA_DIR:-data}
LOGS=${LOGS:-$(mktemp -d -t run_all.XXXXXX)}
mkdir -p "$LOGS/offload"                   # zero_offload.py --offload disk: its state files
QUICK=(--patch 14 --depth "$DEPTH" --dim 64 --heads 4 --limit 6144 --epochs 1 --batch-size 128
       --lr 8e-3 --shift 0)
CLIP=(--clip 1.0)
# --log-every 8: each log shows the loss falling, and the final loss is the last 8 steps' mean
COMMON=(--no-progress --log-every 8 --data-dir "$DATA_DIR" "${QUICK[@]}")

# tier (quick: the default run; all: --all only) | row name (ONLY matches it) | launcher (python:
# one process; ranks: NPROC of them, ranks:W a layout's own W; torchrun: NPROC under torchrun) |
# script and its own flags | why the row's numbers differ from ddp's, if they do
MOE="--experts 4 --top-k 2"   # E = 4: a multiple of W = 1, 2 or 4 for expert_parallel.py
BF16="bf16 matmuls: not fp32's loss"
ASYNC="asynchronous: own loss; a step per micro-batch"
DISK="--offload disk --offload-dir $LOGS/offload"
INTERLEAVED="--schedule interleaved --virtual-stages 2 --microbatches 4"
HSDP="--dp-replicate 2 --dp-shard 1"
SNAPSHOT="--snapshot $LOGS/snapshot.pt"
PARTITION="--partition-activations"
HYBRID_SP="--dp 2 --tp 2 --sequence-parallel"
HYBRID_3D="--dp 2 --pp 2 --tp 2 --zero-stage 3"
HYBRID_PP="--dp 2 --pp 2 --zero-stage 3"
RUNS=(
  "quick|dp|python|dp.py|"
  "quick|ddp|ranks|ddp.py|"
  "quick|ddp_torchrun|torchrun|ddp_torchrun.py $SNAPSHOT|under torchrun: s includes its agent"
  "quick|amp_checkpoint bf16 + checkpoint|ranks|amp_checkpoint.py --amp bf16 --checkpoint|$BF16"
  "all|amp_checkpoint fp32 + checkpoint|ranks|amp_checkpoint.py --amp off --checkpoint|"
  "all|amp_checkpoint bf16 + grad-accum 2|ranks|amp_checkpoint.py --amp bf16 --grad-accum 2|$BF16"
  "quick|zero stage 3|ranks|zero.py --stage 3|"
  "all|zero stage 1|ranks|zero.py --stage 1|"
  "all|zero stage 2|ranks|zero.py --stage 2|"
  "all|zero stage 3 bf16|ranks|zero.py --stage 3 --mixed-precision|bf16 compute: not fp32's loss"
  # DeepSpeed is optional (requirements-deepspeed.txt): the row runs where it is installed
  "quick|deepspeed_zero stage 3|ranks|deepspeed_zero.py --stage 3|"
  "quick|zero_offload stage 3 disk|ranks|zero_offload.py --stage 3 $DISK|"
  "all|zero_offload stage 3 cpu|ranks|zero_offload.py --stage 3 --offload cpu|"
  "quick|fsdp|ranks|fsdp.py|"
  "all|fsdp mixed precision|ranks|fsdp.py --mixed-precision|bf16 compute: not fp32's loss"
  "all|fsdp_resume dcp|ranks|fsdp_resume.py --dcp $LOGS/dcp|"
  "quick|tensor_parallel|ranks|tensor_parallel.py|"
  "all|tensor_parallel sequence parallel|ranks|tensor_parallel.py --sequence-parallel|"
  "quick|tensor_parallel_zero_r partitioned|ranks|tensor_parallel_zero_r.py $PARTITION|"
  "all|tensor_parallel_zero_r checkpoint|ranks|tensor_parallel_zero_r.py --checkpoint|"
  "quick|context_parallel ring|ranks|context_parallel.py --method ring|"
  "all|context_parallel ulysses|ranks|context_parallel.py --method ulysses|"
  "quick|expert_parallel E=4 k=2|ranks|expert_parallel.py $MOE|MoE model (own Ψ, loss)"
  "all|ddp MoE E=4 k=2|ranks|ddp.py $MOE|MoE model, dense DDP: expert_parallel's numbers"
  "quick|pipeline 1f1b|ranks|pipeline.py --schedule 1f1b --microbatches 4|"
  "all|pipeline naive|ranks|pipeline.py --schedule naive|"
  "all|pipeline gpipe|ranks|pipeline.py --schedule gpipe --microbatches 4|"
  "quick|pipeline_schedules interleaved V=2|ranks|pipeline_schedules.py $INTERLEAVED|"
  "all|pipeline_schedules zb-h1|ranks|pipeline_schedules.py --schedule zb-h1 --microbatches 4|"
  "quick|pipeline_pipedream|ranks|pipeline_pipedream.py --microbatches 4|$ASYNC"
  # nd_parallel: one row per layout (R, S, T, P) = (dp_replicate, dp_shard, tp, pp), at its own W
  "quick|nd_parallel FSDP x PP (1,2,1,2)|ranks:4|nd_parallel.py --dp-shard 2 --pp 2|"
  "all|nd_parallel FSDP x TP (1,2,2,1)|ranks:4|nd_parallel.py --dp-shard 2 --tp 2|"
  "all|nd_parallel HSDP x TP (2,1,2,1)|ranks:4|nd_parallel.py $HSDP --tp 2|"
  "all|nd_parallel HSDP x PP (2,1,1,2)|ranks:4|nd_parallel.py $HSDP --pp 2 --schedule gpipe|"
  "all|nd_parallel TP x PP (1,1,2,2)|ranks:4|nd_parallel.py --dp-shard 1 --tp 2 --pp 2|"
  "all|nd_parallel FSDP x TP x PP (1,2,2,2)|ranks:8|nd_parallel.py --dp-shard 2 --tp 2 --pp 2|"
  "all|nd_parallel HSDP x TP (2,2,2,1)|ranks:8|nd_parallel.py --dp-replicate 2 --dp-shard 2 --tp 2|"
  # hybrid_parallel: this codebase's own sections on one mesh, (D, P, T) = (dp, pp, tp)
  "quick|hybrid_parallel ZeRO-3 x PP (2,2,1)|ranks:4|hybrid_parallel.py $HYBRID_PP|"
  "all|hybrid_parallel ZeRO-1 x TP+SP (2,1,2)|ranks:4|hybrid_parallel.py $HYBRID_SP|"
  "all|hybrid_parallel ZeRO-3 x PP x TP (2,2,2)|ranks:8|hybrid_parallel.py $HYBRID_3D|"
  "all|hybrid_parallel data x ring (2 x 2)|ranks:4|hybrid_parallel.py --dp 2 --cp 2|"
  "all|hybrid_parallel data x expert (2 x 2)|ranks:4|hybrid_parallel.py --dp 2 --ep 2 $MOE|MoE"
  # no training: collectives.py checks every primitive's result and prints its own line below
  "quick|collectives|ranks|collectives.py|"
)

# W ranks run on the CPU (Gloo) when this machine has no GPU, or fewer GPUs than W: NCCL refuses
# two ranks on one GPU, and so do the scripts. gpus_for W prints the variable that hides the GPUs.
on_cpu() {
  (( GPUS == 0 || $1 > GPUS ))
}
gpus_for() {
  if (( GPUS > 0 )) && on_cpu "$1"; then echo "CUDA_VISIBLE_DEVICES="; fi
}

# ranks W LOG SCRIPT ARGS...: W ranks of one script, each given the variables torchrun gives its
# workers (the scripts read them, as under srun), one thread each (torchrun's OMP_NUM_THREADS=1;
# the dp row gets it too, or its two threads fight the other jobs on a busy machine), their output
# appended to LOG. Why not torchrun itself: its agent starts a Python of its own and watches the
# workers, for nothing the table shows. ddp_torchrun.py, whose subject torchrun is, runs under it.
# On the CPU the ranks are forked from one Python that imported torch once for the whole run
# (tests/fork_server.py, the test suite's launcher), instead of each importing it (~5 s of CPU a
# rank here, half of a row's time on 2 cores); on GPUs each is a Python of its own. A failed rank
# fails the row: the fork server kills its peers; Pythons of their own stop at their next
# collective, or at --timeout.
ranks() {
  local world=$1 log=$2 port rank pids=() status=0
  shift 2
  if [ -n "$FORK_SERVER" ] && on_cpu "$world"; then
    python - "$FORK_SERVER" "$world" "$log" "$@" <<'PY'
import json, os, signal, socket, sys

path, world, log, script, *args = sys.argv[1:]
request = dict(script=script, args=args, world=int(world), cwd=os.getcwd(), stdout=log, stderr=log)
with socket.socket(socket.AF_UNIX) as server:
    server.connect(path)
    server.sendall((json.dumps(request) + "\n").encode())
    replies = server.makefile()
    group = int(replies.readline())  # the launch's leader and its ranks
    try:
        answer = replies.readline()
    except KeyboardInterrupt:
        os.killpg(group, signal.SIGKILL)
        raise
returncode = json.loads(answer)["returncode"] if answer else 1
sys.exit(0 if returncode == 0 else 1)
PY
    return
  fi
  port=$(python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')
  for ((rank = 0; rank < world; rank++)); do
    env $(gpus_for "$world") OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
      MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" WORLD_SIZE="$world" LOCAL_WORLD_SIZE="$world" \
      RANK="$rank" LOCAL_RANK="$rank" python "$@" >> "$log" 2>&1 &
    pids+=("$!")
  done
  for pid in "${pids[@]}"; do
    wait "$pid" || status=1
  done
  return "$status"
}

# The fork server, where some row runs on the CPU: without GPUs, or fewer than NPROC. It sees no
# GPU, and must be one thread when it forks (tests/fork_server.py checks both).
FORK_SERVER=""
start=$(date +%s)
if on_cpu "$NPROC" && [ "$(uname -s)" = Linux ]; then   # it reads /proc; forks need Linux here
  socket="$LOGS/fork_server.socket"
  exec {server}< <(
    CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 exec python tests/fork_server.py "$socket"
  )
  server_pid=$!
  trap 'kill "$server_pid" 2> /dev/null' EXIT   # it would leave by itself within a second of us
  if read -r -t 300 -u "$server" ready && [ "$ready" = ready ]; then
    FORK_SERVER=$socket
    echo "ok    $(( $(date +%s) - start ))s  (one Python imports torch for every row's ranks)" >&2
  else
    echo "note: tests/fork_server.py did not start; each rank starts its own Python" >&2
  fi
fi

failed=()
: > "$LOGS/results"
find_deepspeed='import importlib.util; print(importlib.util.find_spec("deepspeed") is not None)'
deepspeed=$(python -c "$find_deepspeed")
for entry in "${RUNS[@]}"; do
  IFS='|' read -r tier name launcher cmd why <<< "$entry"
  [ "$tier" = all ] && [ "$ALL" = 0 ] && continue
  [ -n "${ONLY:-}" ] && ! grep -qE "$ONLY" <<< "$name" && continue
  if [[ $name == deepspeed* ]] && [ "$deepspeed" != True ]; then
    echo "skip  $name: DeepSpeed is not installed (pip install -r requirements-deepspeed.txt)" >&2
    continue
  fi
  log="$LOGS/$(tr -c 'A-Za-z0-9=\n' '_' <<< "$name").log"
  flags=("${COMMON[@]}" "${CLIP[@]}")
  [ "$name" = pipeline_pipedream ] && flags=("${COMMON[@]}")   # it refuses --clip
  [ "$name" = collectives ] && flags=()   # it trains nothing: none of the training flags apply
  case $launcher in
    python) set -- env OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" python $cmd "${flags[@]}" ;;
    torchrun)
      set -- env $(gpus_for "$NPROC") torchrun --standalone --nproc_per_node="$NPROC" $cmd \
        "${flags[@]}" ;;
    ranks) set -- ranks "$NPROC" "$log" $cmd "${flags[@]}" ;;
    ranks:*) set -- ranks "${launcher#ranks:}" "$log" $cmd "${flags[@]}" ;;
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


def measured_and_formula(result, key):
    """The measured bytes, and the formula's next to them where the two differ as printed
    (padding, rank-dependent routing: the script's own summary says why)."""
    measured = result[key]
    formula = result["formula"].get(key)
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


COLUMNS = {  # header: the cell of one row, from its RESULT
    "W": lambda r: r["world_size"],
    "backend": lambda r: r["backend"],
    "data": lambda r: r["data"],
    "steps": lambda r: r["steps"],
    "final loss": lambda r: f"{r['loss']:.4f}",
    "test acc": lambda r: f"{r['test_acc']:.4f}",
    "samples/s": lambda r: f"{r['samples_per_s']:.0f}",
    "params/rank": lambda r: measured_and_formula(r, "param_bytes"),
    "grads/rank": lambda r: measured_and_formula(r, "grad_bytes"),
    "optimizer/rank": lambda r: measured_and_formula(r, "optim_bytes"),
    "comm/step/rank": comm_cell,
}


def collectives_line(r):
    checks = f"{r['checks_passed']}/{r['checks_total']} checks passed"
    ring = f"ring all-reduce of {r['ring_numel']:,} floats"
    sent = size(r["ring_bytes_sent"][0])
    formula = size(r["ring_bytes_formula"])
    return (
        f"collectives.py, W={r['world_size']} {r['backend']}: {checks}; {ring} sends {sent} "
        f"per rank (formula 2(p-1)/p·N = {formula})"
    )


print("| technique | " + " | ".join(COLUMNS) + " | s | differs from ddp by |")
print("|" + "---|" * (len(COLUMNS) + 3))
footer = []
for line in open(sys.argv[1]):
    name, seconds, why, fields = line.rstrip("\n").split("|", 3)
    result = json.loads(fields)
    if result["script"] == "collectives":
        footer.append(collectives_line(result))
        continue
    cells = [name] + [str(cell(result)) for cell in COLUMNS.values()] + [seconds, why]
    print("| " + " | ".join(cells) + " |")
for line in footer:
    print("\n" + line)
PY
load=""
[ -r /proc/loadavg ] && load=" (load average $(cut -d' ' -f1-3 /proc/loadavg))"
echo
echo "$(( $(date +%s) - start )) s in all$load; logs in $LOGS"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'failed: %s\n' "${failed[@]}" >&2
  exit 1
fi
