#!/usr/bin/env bash
# Run the test suite (sets up .venv first): both tiers by default; `--unit` runs only the fast unit tier (in-process,
# shipped profiles, under a minute), `--integration` only the multi-process / real-model tier. Other arguments go to
# pytest (`./scripts/test.sh --unit tests/solve`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
tier=()
case "${1:-}" in
  --unit) tier=(-m "not integration"); shift ;;
  --integration) tier=(-m integration); shift ;;
esac
"$root/scripts/setup.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest ${tier[@]+"${tier[@]}"} "$@"
