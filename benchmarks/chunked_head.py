"""The output layer and its loss alone, forward and backward: full logits against the chunked loss
at several chunk sizes, on one device. What the default chunk of a device is chosen from.

    python benchmarks/chunked_head.py --device cuda                  # Qwen2.5-0.5B's head, 4 x 2048
    python benchmarks/chunked_head.py --vocab 32000 --hidden 4096 --tokens 2048 --chunks 512,2048

Reported per way: milliseconds per forward and backward (after warm-up) and the peak memory above
the inputs (CUDA allocator; not measured on CPU). bf16 autocast over fp32 weights, as training runs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from lmtune.model.chunked_loss import default_chunk_size, linear_cross_entropy_sum, targets_of
from lmtune.model.loss import token_loss_sum


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per row")
    parser.add_argument("--chunks", default="256,1024,4096", help="chunk sizes beside the device's default")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device)
    hidden = torch.randn(args.rows, args.tokens, args.hidden, device=device) * 0.5
    labels = torch.randint(0, args.vocab, (args.rows, args.tokens), device=device)
    cuda = device.type == "cuda"

    def full() -> None:
        h = hidden.detach().requires_grad_()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = head(h)
        token_loss_sum(logits, labels)[0].backward()  # lmtune's full-logits loss

    # Picked once, as a step picks them before its decoder runs: not a wait inside the timing.
    targets = targets_of(labels)

    def chunked(chunk: int) -> Callable[[], None]:
        def run() -> None:
            h = hidden.detach().requires_grad_()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = linear_cross_entropy_sum(h, head, targets, chunk)
            loss.backward()

        return run

    default = default_chunk_size(args.vocab, device.type)
    sizes = sorted({default, *(int(c) for c in args.chunks.split(",") if c.strip())})
    ways = [("full logits", full)] + [
        (f"chunks of {c}" + (" (default)" if c == default else ""), chunked(c)) for c in sizes
    ]
    print(f"head {args.hidden} x {args.vocab}, {args.rows} x {args.tokens} tokens, bf16 autocast, {device}")
    print(f"{'':28}{'ms':>9}{'x full':>8}" + (f"{'peak MiB':>12}" if cuda else ""))
    baseline = None
    for name, run in ways:
        for _ in range(3):
            run()
            head.weight.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        start = time.perf_counter()
        for _ in range(args.repeats):
            run()
            head.weight.grad = None
        if cuda:
            torch.cuda.synchronize()
        ms = (time.perf_counter() - start) / args.repeats * 1e3
        baseline = baseline or ms
        peak = f"{(torch.cuda.max_memory_allocated() - base) / 2**20:>12,.0f}" if cuda else ""
        print(f"{name:28}{ms:>9.1f}{ms / baseline:>8.2f}{peak}")


if __name__ == "__main__":
    main()
