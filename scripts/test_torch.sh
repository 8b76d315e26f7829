#!/usr/bin/env bash
# The tests that lean on torch's internals (Dynamo, c10d's group naming, autograd's backward
# formulas) under a second torch, in .venv-torch-VERSION: by default 2.11.0, the torch of
# the GPU machines this project is checked on (.venv holds 2.14.1). Extra args go to pytest.
# Usage: bash scripts/test_torch.sh            SBP_TORCH=2.12.0 SBP_TORCHVISION=0.27.0 bash ...
set -euo pipefail
cd "$(dirname "$0")/.."
torch=${SBP_TORCH:-2.11.0}
vision=${SBP_TORCHVISION:-0.26.0}
venv=.venv-torch-$torch
if ! "$venv/bin/python" -c "import sbp, torch, torchvision, transformers, pytest, hypothesis, cloudpickle
assert torch.__version__.split('+')[0] == '$torch'" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q "torch==$torch" "torchvision==$vision"
  "$venv/bin/python" -m pip install -q -e ".[dev,vision,hf]"
fi
echo "torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
exec "$venv/bin/python" -m pytest -q tests/test_compile.py tests/test_data_parallel.py \
  tests/test_comm.py tests/test_ops.py tests/test_optim_step.py tests/test_checkpoint.py \
  tests/test_tensor.py tests/test_fast_path_outputs.py tests/test_transformers_fast_path.py \
  tests/test_recurrent.py tests/test_sharded_path.py tests/test_sharded_edge_cases.py "$@"
