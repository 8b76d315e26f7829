#!/usr/bin/env bash
# Create .venv (if missing) with the pinned torch/torchvision and sbp installed editable.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import sbp, torch, torchvision, transformers, pytest, hypothesis, cloudpickle, expecttest" 2>/dev/null; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.14.1" "torchvision==0.29.1"
  .venv/bin/python -m pip install -q -e ".[dev,vision,hf]"
fi
