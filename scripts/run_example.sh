#!/usr/bin/env bash
# Set up .venv if missing and run the main example on 2 processes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/python -m sbp.distributed.launch --nproc_per_node 2 examples/train_mobilenet.py "$@"
