#!/usr/bin/env bash
# Run the test suite (sets up .venv first): both tiers by default; `--unit` runs only the fast unit tier (in-process,
# shipped profiles, under a minute), `--integration` only the multi-process / real-model tier. Other arguments go to
# pytest (`./scripts/test.sh --unit tests/solve`; `-n 0` runs in one process). Two pytest-xdist workers share the
# tests (work stealing: a worker that runs out takes the other's), so single-threaded tests run beside each other and
# beside the ranks of multi-process ones: 15.3 min in one process on this 2-core machine (2026-12-05), 7.6 min in
# two since CPU ranks are forked from a server that imported torch once (2026-12-06).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tier=()
case "${1:-}" in
  --unit) tier=(-m "not integration"); shift ;;
  --integration) tier=(-m integration); shift ;;
esac
"$root/scripts/setup.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest -n 2 --dist worksteal ${tier[@]+"${tier[@]}"} "$@"
