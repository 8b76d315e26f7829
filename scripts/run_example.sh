#!/usr/bin/env bash
# Set up .venv if missing and train mobilenet_v2 on CIFAR-10 on 2 processes (global tensors).
# Without CIFAR-10 under ./data it writes a small synthetic set in the same format first.
# Extra arguments go to the example, e.g. --ddp, --epochs 3, --data DIR, --download.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/python -m sbp.distributed.launch --nproc_per_node 2 examples/cifar10_mobilenet.py "$@"
