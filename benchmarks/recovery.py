"""Fault recovery, repeated: kill one worker with SIGKILL at a different step each time.

Each trial runs `lmtune train --nproc-per-node 2 --max-restarts 1` and kills a worker once the
metrics show the chosen step; the run must finish by itself with the final weights of an
uninterrupted run (compared bit for bit). Prints one line per trial and the count recovered.

    python benchmarks/recovery.py [--trials 20] [--steps 200] [--save-every 25]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(out)


def steps_done(out: Path) -> int:
    try:
        return sum('"kind": "train"' in line for line in (out / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def command(data: Path, out: Path, steps: int, save_every: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "lmtune",
        "train",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--data",
        str(data),
        "--output-dir",
        str(out),
        "--max-steps",
        str(steps),
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "2",
        "--save-every",
        str(save_every),
        "--lr",
        "1e-3",
        "--threads-per-process",
        "1",
        "--no-progress",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=25)
    p.add_argument("--timeout", type=float, default=240, help="seconds before a trial counts as hung")
    args = p.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        env = {**os.environ, "LMTUNE_CACHE_DIR": str(root / "cache")}
        data = root / "train.jsonl"
        data.write_text(
            "".join(
                json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20)))}) + "\n"
                for _ in range(400)
            )
        )
        reference = root / "reference"
        subprocess.run(
            command(data, reference, args.steps, args.save_every), check=True, env=env, capture_output=True
        )
        expected = load_file(reference / "final" / "model.safetensors")
        recovered = 0
        for trial in range(args.trials):
            out = root / f"trial-{trial}"
            kill_at = 5 + trial * (args.steps - 20) // max(args.trials, 1)
            started = time.monotonic()
            proc = subprocess.Popen(
                command(data, out, args.steps, args.save_every),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            while steps_done(out) < kill_at and proc.poll() is None:
                time.sleep(0.02)
            workers = children(proc.pid)
            victim = workers[trial % len(workers)] if workers else None
            if victim is not None:
                os.kill(victim, signal.SIGKILL)
            try:
                code = proc.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = None
            same = False
            if code == 0:
                got = load_file(out / "final" / "model.safetensors")
                same = all(torch.equal(got[k], expected[k]) for k in expected)
            recovered += same
            print(
                f"trial {trial + 1:>2}: killed worker {trial % 2} at step {kill_at:>3}: "
                f"exit {code}, final weights {'identical' if same else 'DIFFERENT'}, "
                f"{time.monotonic() - started:.1f}s",
                flush=True,
            )
        print(f"recovered {recovered}/{args.trials}")
        sys.exit(0 if recovered == args.trials else 1)


if __name__ == "__main__":
    main()
