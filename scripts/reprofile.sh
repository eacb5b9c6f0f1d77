#!/usr/bin/env bash
# Re-measure the shipped profiles (profiles/gpt/, profiles/mlp/) the way scripts/demo.sh measures its own: each
# example profiled beside one co-runner process (`--co-runners 1`), since a rank of a 2-rank CPU run shares its host
# with the other rank. Profiled alone (co_runners 0), planning 2 ranks of examples/gpt.py predicted 0.102 s per step
# where `autopp run` measured 0.227 s (issue 13, point 10); the demo's co-runner profile lands within 5-25 %.
#
# Run it on a QUIET machine: the timings become the shipped profile, so nothing else CPU-bound may run meanwhile.
# It refuses to start while the 1-minute load average exceeds AUTOPP_MAX_LOAD (default 0.5; AUTOPP_MAX_LOAD=inf
# forces it). Usage, from anywhere:
#     ./scripts/reprofile.sh          # every shipped profile (gpt, mlp)
#     ./scripts/reprofile.sh gpt      # only profiles/gpt/
# Idempotent: each profile is measured from scratch with fixed settings and replaces the old one atomically
# (Profile.save: the old one renamed aside, the new one into place), so rerunning it, or running it again after an
# interrupted run, gives the same kind of profile; the profile's model_path is written relative (../../examples/M.py).
# Settings: the defaults the shipped profiles were made with (microbatch sizes 1,4, 2 warm-up and 5 timed runs,
# 1 thread, sgd, float32), plus --co-runners 1. Check afterwards: `git diff --stat profiles/` (co_runners is now 1 in
# each meta.json) and `./scripts/test.sh`. A few minutes per model on the 2-core development machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(gpt mlp)
for m in "${models[@]}"; do
  [ -f "examples/$m.py" ] || { echo "reprofile: no examples/$m.py (shipped profiles: gpt, mlp)" >&2; exit 2; }
done
load=$(cut -d' ' -f1 /proc/loadavg 2>/dev/null || echo 0)
if ! awk -v l="$load" -v m="${AUTOPP_MAX_LOAD:-0.5}" 'BEGIN { exit !(m == "inf" || l <= m) }'; then
  echo "reprofile: load average $load > ${AUTOPP_MAX_LOAD:-0.5}: the timings would be spoiled; wait for a quiet" \
       "machine (or set AUTOPP_MAX_LOAD=inf)" >&2
  exit 2
fi
"$root/scripts/setup.sh"
for m in "${models[@]}"; do
  cmd=(.venv/bin/autopp profile "examples/$m.py" --microbatch-sizes 1,4 --warmup 2 --repeats 5 --threads 1
       --optimizer sgd --dtype float32 --co-runners 1 -o "profiles/$m")
  echo "\$ ${cmd[*]}"
  "${cmd[@]}"
done
