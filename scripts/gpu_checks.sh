#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (CI has no GPU, so it skips them):
#   tests     the CuPy kernels against torch, and the CUDA path end to end
#   kernels   benchmarks/kernels.py, GB/s against a device copy and the torch composition
#   example   a few steps of the main example on cuda:0 (a world of one)
#   compile   benchmarks/compile.py --device cuda (Inductor: minutes)
#   phases    benchmarks/compile_phases.py --device cuda at compile.py's shape: where a world
#             of one's compiled step spends sbp's host time, phase by phase
#   dp        benchmarks/data_parallel.py --device cuda: worlds of 1 and 2 (ranks share a GPU
#             over gloo where there are fewer GPUs than ranks: NCCL needs a GPU per rank)
# Usage: bash scripts/gpu_checks.sh OUT_DIR [PART...]   (all parts by default)
# Uses the `python3` on PATH (it must hold torch with CUDA, CuPy, pytest, hypothesis) and the
# repository's sources, not an installed copy. Each part has a time limit and writes its log
# (and JSON) under OUT_DIR; a failed part does not stop the others.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_checks.sh OUT_DIR [PART...]}
shift
parts=("${@:-tests kernels example dp compile phases}")
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=python3

run() {  # run NAME SECONDS COMMAND...: log to OUT/NAME.log, say how it ended
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/$name.log"
  tail -n 25 "$out/$name.log"
}

nvidia-smi -L
$py -c 'import torch, cupy, hypothesis; print("torch", torch.__version__, torch.version.cuda,
torch.cuda.get_device_name(0), "cupy", cupy.__version__, "hypothesis", hypothesis.__version__)'

for part in ${parts[*]}; do
  case $part in
    tests) run tests 240 $py -m pytest -q -p no:cacheprovider -n 4 \
      tests/test_kernels.py tests/test_kernels_cuda.py ;;
    kernels) run kernels 150 $py benchmarks/kernels.py --out "$out/kernels.json" ;;
    example) run example 120 $py -m sbp.distributed.launch --nproc_per_node 1 \
      examples/cifar10_mobilenet.py --device cuda --data /tmp/sbp_data \
      --synthetic-train 1280 --synthetic-test 256 --max-steps 30 --log-every 5 ;;
    dp) run dp 240 $py benchmarks/data_parallel.py --device cuda --world 2 --steps 20 \
      --out "$out/dp.json" ;;
    compile) run compile 330 $py benchmarks/compile.py --device cuda --rounds 11 \
      --out "$out/compile.json" ;;
    phases) run phases 300 $py benchmarks/compile_phases.py --device cuda --width 1.0 \
      --image 32 --batch 32 --warmup 10 --rounds 100 --out "$out/phases.json" ;;
    *) echo "unknown part $part" ;;
  esac
done
