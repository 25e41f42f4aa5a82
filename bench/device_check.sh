#!/usr/bin/env bash
# The accelerator check (`diloco-bench device`, bench/device_check.py) from a checkout.
#
# Runs with $PYTHON, else the checkout's .venv, else python3, with this checkout first
# on PYTHONPATH. On a machine with an NVIDIA GPU whose JAX has no GPU backend it installs
# the CUDA build of the installed JAX version into that interpreter's environment first;
# without a GPU it is the CPU dry run. Flags go to the command, e.g.
#   bench/device_check.sh --out runs/device.json
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x "$root/.venv/bin/python" ]]; then python="$root/.venv/bin/python"; else python=python3; fi
fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m bench.cli device "$@"
