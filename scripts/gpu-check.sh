#!/usr/bin/env bash
# The GPU checks, as one prepared command for a lent GPU machine that has no network:
#   OUT=/some/dir bash scripts/gpu-check.sh
# Installs nothing: lmtune runs from this tree (PYTHONPATH=src) on the machine's own torch,
# transformers and peft; checks needing a missing optional package (bitsandbytes) are skipped.
# Each step's output goes to $OUT; the script goes on after a failing step and exits non-zero.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export LMTUNE_CACHE_DIR="${OUT:-/tmp/lmtune-gpu}/cache"
OUT="${OUT:-/tmp/lmtune-gpu}"
mkdir -p "$OUT"
failed=0
step() {  # step NAME COMMAND...: run it, keep its log, note a failure
    local name=$1
    shift
    echo "=== $name"
    if ! timeout 240 "$@" > "$OUT/$name.log" 2>&1; then
        echo "FAILED: $name (log: $OUT/$name.log)"
        failed=1
    fi
    tail -n 15 "$OUT/$name.log"
}
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU here'; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.device_count(), 'GPU(s)')" \
    || exit 1
# Single GPU, bf16, DataParallel (2+ GPUs), LoRA, plan vs the allocator peak, the varlen kernel.
step gpu-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu
step demo-bf16 python3 -m lmtune train --max-steps 200 --precision bf16 --no-progress --output-dir "$OUT/demo" --overwrite
# DDP and FSDP2 over NCCL need two GPUs (one process per GPU; with one, both fall back to single).
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    step ddp-nccl python3 -m lmtune train --max-steps 50 --nproc-per-node 2 --precision bf16 --no-progress \
        --output-dir "$OUT/ddp" --overwrite
    step fsdp-nccl python3 -m lmtune train --max-steps 30 --nproc-per-node 2 --strategy fsdp --precision bf16 \
        --no-progress --output-dir "$OUT/fsdp" --overwrite
fi
# The chunked loss on a Qwen2.5-0.5B-shaped model at 4 x 2048 tokens: allocator peak both ways, plan.
step vocab-memory python3 benchmarks/vocab_memory.py --layers 24 --micro-batch-size 4 --length 2048 \
    --precision bf16 --device cuda --steps 4 --json "$OUT/vocab_memory.json"
# QLoRA against LoRA on a ~1B model: peak memory, step time, loss and plan (bitsandbytes' CUDA kernels).
if python3 -c "import bitsandbytes" > /dev/null 2>&1; then
    step qlora python3 benchmarks/qlora.py --size 1b --device cuda --precision bf16 --steps 10 \
        --micro-batch-size 4 --length 512 --json "$OUT/qlora.json"
else
    echo "=== qlora: skipped, bitsandbytes is not installed here (carry a bitsandbytes wheel to run it)"
fi
# Throughput and MFU against the measured bf16 peak.
step bench python3 -m lmtune bench --model small --strategies single --precisions bf16 --steps 10 \
    --json "$OUT/bench.json"
exit $failed
