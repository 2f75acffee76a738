#!/usr/bin/env bash
# The GPU checks, as one prepared command for a lent GPU machine that has no network:
#   OUT=/some/dir bash scripts/gpu-check.sh
# Installs nothing: lmtune runs from this tree (PYTHONPATH=src) on the machine's own torch,
# transformers and peft; checks needing a missing optional package (bitsandbytes) are skipped
# (install its wheel into a folder on PYTHONPATH first to run them).
# Each step's output goes to $OUT; the script goes on after a failing step and exits non-zero.
# Steps run in order of what they prove, so that a run cut short has checked the most.
# STEPS="qlora bench" runs only the steps named (eval-bf16 and the dpo steps need demo-bf16's model),
# to split the checks over calls that each fit a device's time limit; STEP_TIMEOUT (seconds, 240)
# bounds each step.
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
    local start=$SECONDS
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then
        return 0
    fi
    echo "=== $name"
    if ! timeout "${STEP_TIMEOUT:-240}" "$@" > "$OUT/$name.log" 2>&1; then
        echo "FAILED: $name (log: $OUT/$name.log)"
        failed=1
    fi
    tail -n 15 "$OUT/$name.log"
    echo "--- $name: $((SECONDS - start)) s"
}
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU here'; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), torch.cuda.device_count(), 'GPU(s)')" \
    || exit 1
python3 - <<'EOF'
import importlib.metadata as m
for name in ("transformers", "peft", "accelerate", "bitsandbytes", "datasets"):
    try:
        print(name, m.version(name))
    except m.PackageNotFoundError:
        print(name, "not installed")
EOF
# Single GPU, bf16, DataParallel (2+ GPUs), LoRA, plan vs the allocator peak, the varlen kernel.
step gpu-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu -k 'not plan_predicts'
step gpu-plan python3 -m pytest -q -s -p no:cacheprovider -m gpu tests/gpu -k plan_predicts
step demo-bf16 python3 -m lmtune train --max-steps 200 --precision bf16 --no-progress --output-dir "$OUT/demo" --overwrite
# lmtune eval on CUDA of that run's model, on the built-in data it trained on.
step eval-bf16 python3 -m lmtune eval sample --model "$OUT/demo/final" --precision bf16 --json "$OUT/eval.json"
# DPO from that model on pairs of its own task (a right and a wrong sum), the reference's log-probs
# computed once on the GPU: the first loss must be ln 2 (policy == reference).
python3 - "$OUT/pairs.jsonl" <<'EOF'
import json, random, sys
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    for _ in range(256):
        a, b = rng.randrange(100), rng.randrange(100)
        wrong = a + b + rng.choice([-11, -10, -1, 1, 10, 11])
        f.write(json.dumps({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong)}) + "\n")
EOF
step dpo-bf16 python3 -m lmtune train --objective dpo --model "$OUT/demo/final" --data "$OUT/pairs.jsonl" \
    --precision bf16 --lr 1e-4 --global-batch-size 16 --micro-batch-size 8 --max-steps 16 --no-progress \
    --output-dir "$OUT/dpo" --overwrite
step dpo-first-loss python3 -c "import json, math, sys; rows = [json.loads(x) for x in open(sys.argv[1])]; \
first = next(r['loss'] for r in rows if r['kind'] == 'train'); print('first DPO loss', first); \
assert abs(first - math.log(2)) < 2e-3, first" "$OUT/dpo/metrics.jsonl"
# DDP and FSDP2 over NCCL need two GPUs (one process per GPU; with one, both fall back to single).
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
    step ddp-nccl python3 -m lmtune train --max-steps 50 --nproc-per-node 2 --precision bf16 --no-progress \
        --output-dir "$OUT/ddp" --overwrite
    step fsdp-nccl python3 -m lmtune train --max-steps 30 --nproc-per-node 2 --strategy fsdp --precision bf16 \
        --no-progress --output-dir "$OUT/fsdp" --overwrite
fi
# The output layer and its loss alone at Qwen2.5-0.5B's head: full logits and chunk sizes (seconds).
step chunked-head python3 benchmarks/chunked_head.py --device cuda
# The chunked loss on a Qwen2.5-0.5B-shaped model at 4 x 2048 tokens: allocator peak and step time
# with full logits, the default chunk and larger ones (a GPU's default is chosen from these), plan.
step vocab-memory python3 benchmarks/vocab_memory.py --layers 24 --micro-batch-size 4 --length 2048 \
    --precision bf16 --device cuda --steps 6 --chunk-sizes 1024,4096 --json "$OUT/vocab_memory.json"
# Throughput and MFU against the measured bf16 peak.
step bench python3 -m lmtune bench --model small --strategies single --precisions bf16 --steps 10 \
    --json "$OUT/bench.json"
# QLoRA against LoRA on a ~1B model: peak memory, step time, loss and plan (bitsandbytes' CUDA kernels).
if python3 -c "import bitsandbytes" > /dev/null 2>&1; then
    step qlora python3 benchmarks/qlora.py --size 1b --device cuda --precision bf16 --steps 10 \
        --micro-batch-size 4 --length 512 --json "$OUT/qlora.json"
else
    echo "=== qlora: skipped, bitsandbytes is not installed here (carry a bitsandbytes wheel to run it)"
fi
exit $failed
