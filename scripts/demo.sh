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
step plan --profile "$out/gpt-profile" --devices 2 --memory 1GiB --global-batch 8 -o "$out/gpt.plan.json"
step run "$out/gpt.plan.json" --steps 3 --report "$out/gpt.report.json"
