#!/usr/bin/env bash
# The device check (issue 29, item 5; docs/accuracy.md, "Device check"): what autopp has never measured on a GPU,
# in one prepared run of at most 8 minutes on one H100/H200, every result kept under one folder.
#   1. probe    torch, the GPU, its catalog entry (env.json); bf16/fp32 matmul, fp8 matmul (torch._scaled_mm,
#               where it runs), causal attention, copy and GELU, each as a fraction of the catalog's datasheet
#               figure (ops.json; scripts/device_check.py)
#   2. profiles `autopp profile --device cuda` of examples/gpt.py (float32 and bfloat16) and of the Llama-shaped
#               examples/configs/llama-1b.json (1.24 B parameters; bfloat16, sequence 1024) under profiles/
#   3. calibrate `autopp calibrate` of each profile: the analytic roofline's e_c, e_m, t_op, t_call on this GPU
#               and their median error (calibration/)
#   4. memory   memory truth: plan on one GPU, `autopp run` it; the report's torch.cuda.max_memory_allocated
#               against the plan's per-rank prediction (gpt, then llama-1b at sequence 256, float32 as the runner
#               trains; plans/, reports/)
#   5. nccl     with 2 or more GPUs: a 2-rank plan of gpt run over NCCL
# Then a summary table. Each step prints its elapsed time; the first that fails stops the check with one line
# naming its log (logs/STEP.log). Without CUDA, or with --cpu, the same steps run on the CPU at tiny sizes (float32,
# one microbatch size, one timed run; llama-1b replaced by examples/configs/tiny-llama.json, no bfloat16 profile,
# no second memory run, no NCCL) in under a minute: tests/test_device_check.py runs that path.
#
#   scripts/device_check.sh [--cpu] [-o DIR] [--budget SECONDS]     (default DIR device-check-out, budget 480)
#   PYTHON=/path/to/python scripts/device_check.sh                  (default .venv/bin/python, else python3)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=device-check-out
budget=480
cpu=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cpu=1 ;;
    -o) out=${2:?-o needs a folder}; shift ;;
    --budget) budget=${2:?--budget needs seconds}; shift ;;
    *) echo "device_check: unknown argument $1 (usage: scripts/device_check.sh [--cpu] [-o DIR] [--budget S])" >&2
       exit 2 ;;
  esac
  shift
done
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=$(command -v python3)
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$root"  # `python -m autopp` imports this checkout's autopp
mkdir -p "$out/logs" "$out/profiles" "$out/calibration" "$out/plans" "$out/reports"
: > "$out/steps.tsv"
start=$SECONDS

# step NAME COMMAND...: run it with what is left of the budget, its output in logs/NAME.log; stop on failure.
step() {
  local name=$1; shift
  local left=$((budget - (SECONDS - start)))
  local t0=$SECONDS
  if [ "$left" -le 0 ]; then
    echo "device_check: out of time before step $name (budget ${budget} s spent; give --budget)" >&2
    exit 1
  fi
  printf '[%4d s] %-26s ' "$((SECONDS - start))" "$name"
  local rc=0
  timeout "$left" "$@" > "$out/logs/$name.log" 2>&1 || rc=$?
  local took=$((SECONDS - t0))
  if [ "$rc" -ne 0 ]; then
    printf '%s\tFAILED\t%s\n' "$name" "$took" >> "$out/steps.tsv"
    echo "FAILED"
    local why
    why=$(grep -v '^\(profiling\|counting\|running\): ' "$out/logs/$name.log" | tail -n 1 || true)
    [ "$rc" -eq 124 ] && why="ran out of the budget's ${left} s"
    echo "device_check: step $name failed (exit $rc after ${took} s): ${why:-no output}; log $out/logs/$name.log" >&2
    exit 1
  fi
  printf '%s\tok\t%s\n' "$name" "$took" >> "$out/steps.tsv"
  echo "ok (${took} s)"
}
skip() {
  printf '[%4d s] %-26s skipped: %s\n' "$((SECONDS - start))" "$1" "$2"
  printf '%s\tskipped\t0\n' "$1" >> "$out/steps.tsv"
}
autopp=("$py" -m autopp)  # an array, not a function: `timeout` runs it
field() { "$py" -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$@"; }

cpu_flag=()
[ "$cpu" -eq 1 ] && cpu_flag=(--cpu)
step probe "$py" scripts/device_check.py probe "$out" ${cpu_flag[@]+"${cpu_flag[@]}"}
kind=$(field "$out/env.json" kind)
gpus=$(field "$out/env.json" gpus)
head -n 1 "$out/logs/probe.log"

p="$out/profiles"
if [ "$kind" = cuda ]; then
  measure=(--device cuda --warmup 2 --repeats 5)
  step profile-gpt "${autopp[@]}" profile examples/gpt.py "${measure[@]}" --microbatch-sizes 1,4 -o "$p/gpt"
  step profile-gpt-bf16 "${autopp[@]}" profile examples/gpt.py "${measure[@]}" --microbatch-sizes 1,4 \
    --dtype bfloat16 -o "$p/gpt-bf16"
  step profile-llama-1b-bf16 "${autopp[@]}" profile --hf-config examples/configs/llama-1b.json --seq-len 1024 \
    "${measure[@]}" --microbatch-sizes 1,2 --dtype bfloat16 -o "$p/llama-1b-bf16"
  llama=(--hf-config examples/configs/llama-1b.json --seq-len 256)
  mem=$(field "$out/env.json" memory_bytes)
  steps=3
else
  measure=(--device cpu --warmup 0 --repeats 1 --microbatch-size 1)
  step profile-gpt "${autopp[@]}" profile examples/gpt.py "${measure[@]}" -o "$p/gpt"
  skip profile-gpt-bf16 "bfloat16 on this CPU runs ~60x slower than float32 (docs/devices.md)"
  step profile-tiny-llama "${autopp[@]}" profile --hf-config examples/configs/tiny-llama.json --seq-len 16 \
    "${measure[@]}" -o "$p/tiny-llama"
  mem=1GiB
  steps=2
fi

catalog=$(field "$out/env.json" catalog)
for prof in "$p"/*/; do
  name=$(basename "$prof")
  if [ "$catalog" = None ]; then
    skip "calibrate-$name" "the catalog has no entry for this device (docs/devices.md: add one, then rerun)"
  else
    step "calibrate-$name" "${autopp[@]}" calibrate "$prof" -o "$out/calibration/$name.json"
  fi
done

# Memory truth: one rank on one device, as the runner trains (float32, SGD): measured peak vs the plan's.
memory_run() {  # NAME PROFILE GLOBAL_BATCH STEPS
  step "plan-$1" "${autopp[@]}" plan --profile "$2" --devices 1 --memory "$mem" --global-batch "$3" \
    -o "$out/plans/$1.plan.json"
  step "run-$1" "${autopp[@]}" run "$out/plans/$1.plan.json" --steps "$4" --report "$out/reports/$1.report.json" \
    --run-dir "$out/logs/run-$1"
}
memory_run gpt-1gpu "$p/gpt" 8 "$steps"
if [ "$kind" = cuda ]; then
  step profile-llama-1b "${autopp[@]}" profile "${llama[@]}" "${measure[@]}" --microbatch-sizes 1,2 -o "$p/llama-1b"
  memory_run llama-1b-1gpu "$p/llama-1b" 2 2
else
  skip memory-llama "cpu path: gpt's run covers the runner"
fi

if [ "$kind" = cuda ] && [ "$gpus" -ge 2 ]; then
  if [ "$catalog" != None ]; then
    links=(--device "$catalog" --devices 2)
  else  # a GPU the catalog lacks: NCCL moves messages on its own (no per-message overhead or progress delay)
    links=(--devices 2 --memory "$mem" --message-overhead 0 --progress-delay 0)
  fi
  step plan-gpt-nccl "${autopp[@]}" plan --profile "$p/gpt" "${links[@]}" --global-batch 8 \
    -o "$out/plans/gpt-nccl.plan.json"
  step run-gpt-nccl "${autopp[@]}" run "$out/plans/gpt-nccl.plan.json" --steps 5 \
    --report "$out/reports/gpt-nccl.report.json" --run-dir "$out/logs/run-gpt-nccl"
else
  skip nccl "needs 2 or more GPUs ($gpus here)"
fi

echo "done in $((SECONDS - start)) s"
echo
"$py" scripts/device_check.py summary "$out" | tee "$out/summary.txt"
