#!/usr/bin/env bash
# The GPU check: the torch backend on device: cuda in float32, float16 and bfloat16 (SDPA's flash, memory-efficient
# and math kernels as user code, the tool's own torch engine), a broken kernel that must fail, a directional check
# at training scale (B=1, Hq=32, Hkv=8, n=8192, d=128), and the context-parallel ring on NCCL when there are several
# GPUs; one summary table (scenario, verdict, time, peak GPU memory), written to benchmarks/results-gpu.txt.
# Under 8 minutes on one GPU.
#
#   bash benchmarks/gpu_check.sh              # on a GPU machine (installs a CUDA build of torch 2.13.0 if needed)
#   bash benchmarks/gpu_check.sh --dry-run    # every step on device: cpu at small sizes (CI runs this)
#   bash benchmarks/gpu_check.sh --no-install # use the torch already installed
#
# Exit 0 when every verdict is the expected one (pass for correct kernels, fail for the broken one), 1 otherwise,
# 2 on bad usage or when no CUDA device is visible (without --dry-run).
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0
install=1
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    --no-install) install=0 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "error: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done
if [ "$dry" = 1 ]; then
  exec python benchmarks/gpu/check.py --dry-run
fi
if [ "$install" = 1 ] && ! python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  # pinned, as everywhere here; the registry's Linux wheel of torch 2.13.0 is the CUDA build
  python -m pip install --quiet 'torch==2.13.0'
  python -m pip install --quiet -e .
fi
python benchmarks/gpu/check.py --out benchmarks/results-gpu.txt
