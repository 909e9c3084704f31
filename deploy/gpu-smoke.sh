#!/usr/bin/env bash
# One command for a GPU machine with the full stack (./install.sh gpu): the CUDA tests, then a 20-step
# job of a real model on one GPU. Exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0))"
"$PY" -m pytest -q tests/gpu
"$(dirname "$PY")/stableasync" prepare-model smollm2-135m
"$(dirname "$PY")/stableasync" train deploy/jobs/gpu-smoke.yaml
