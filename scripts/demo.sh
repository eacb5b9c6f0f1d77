#!/usr/bin/env bash
# The main job: profile, plan, run and validate examples/gpt.py on 2 CPU processes. Output goes to demo-out/.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
out=demo-out
mkdir -p "$out"
autopp=("$root/.venv/bin/autopp")
step() { echo; echo "\$ autopp $*"; "${autopp[@]}" "$@"; }
# The 2 ranks will share this host: profile beside one process training the model, as the other rank will.
step profile examples/gpt.py --co-runners 1 -o "$out/gpt-profile"
# Everything else is searched (schedule, microbatches, ZeRO, recomputation, ...); --dp 1 keeps both ranks a pipeline.
step plan --profile "$out/gpt-profile" --devices 2 --memory 1GiB --global-batch 8 --dp 1 -o "$out/gpt.plan.json"
step run "$out/gpt.plan.json" --steps 3 --report "$out/gpt.report.json"
# What to look at next, and how to read the tables above.
cat <<NEXT

Next steps:
  $root/.venv/bin/autopp show $out/gpt.plan.json     # simulated timeline: one row per rank, F/I/W boxes with
                                                       # microbatch numbers, each rank's memory over the step
  $root/.venv/bin/autopp show $out/gpt.report.json   # the measured timeline drawn above the predicted one

Reading the plan table ("autopp plan" above): each row is a split of the model into stages, judged by the same
simulator. "autopp" is the chosen split; "even", "params" and "time" are naive splits (equal unit counts,
balanced parameters, balanced measured time) for comparison. "step time" is the predicted time of one training
step, "bubble" the share of the pipeline's time that ranks sit idle, "efficiency" = ideal / step time, and
"ideal" = the model's work / devices, a bound no schedule can beat. In the run report, "step time measured vs
predicted" says how close the prediction came on this machine, and the verdict compares every loss and gradient
with a one-process run.
Let autopp choose data parallelism too (and pin any other choice with its flag, e.g. --schedule 1F1B):
  $root/.venv/bin/autopp plan --profile $out/gpt-profile --devices 2 --memory 1GiB --global-batch 8
NEXT
