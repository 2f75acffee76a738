#!/usr/bin/env bash
# The GPU checks, as one short command for a lent GPU machine:
#   bash scripts/gpu-check.sh
# Installs lmtune with whatever CUDA build of torch the machine has (or pip's default CUDA build),
# then runs the tests marked `gpu` and one short bf16 training run on the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || pip install -q torch
pip install -q -e '.[dev]'
export HF_HUB_OFFLINE=1
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
python -m pytest -q -m gpu tests/gpu
lmtune train --max-steps 200 --precision bf16 --no-progress --output-dir "${OUT:-/tmp}/gpu-demo"
