#!/usr/bin/env bash
# Create or reuse .venv and install autopp with its test tools. Safe to run again: it reinstalls only on change.
# torch is installed first and pinned (scripts/constraints.txt), so nothing later can swap it for another build.
# AUTOPP_TORCH overrides the torch requirement (default torch==2.13.0; this machine's pip takes a local CPU wheel).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv"
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  echo "setup: creating $venv" >&2
  "$python" -m venv "$venv"
fi
stamp="$venv/.autopp-installed"
want=$(cat "$root/pyproject.toml" "$root/scripts/constraints.txt" "$0" | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
echo "setup: installing torch (CPU) and autopp into $venv" >&2
"${pip[@]}" "${AUTOPP_TORCH:-torch==2.13.0}"
# The test extra includes the models extra (transformers, for examples/hf_*.py): configs only, never hub weights.
# timm is not installed: it needs torchvision, which must stay out (see the check below); examples/vit.py is plain torch.
"${pip[@]}" -c "$root/scripts/constraints.txt" -e "$root[test]"
# torchtitan for tests/export/: its config classes only (tyro and spmd_types come with the test extra); its full
# requirements would pull datasets, wandb, tensorboard and more, which the config parser never imports.
"${pip[@]}" --no-deps "torchtitan==0.3.0"
if "$venv/bin/python" -c "import torchvision" 2>/dev/null; then
  echo "setup: torchvision is installed and breaks next to CPU torch; removing it" >&2
  "$venv/bin/python" -m pip uninstall --quiet -y torchvision
fi
echo "$want" > "$stamp"
