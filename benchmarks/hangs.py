"""Time to diagnosis of a stalled rank: N stalls (SIGSTOP) at random moments and ranks of 2-rank
runs with default settings; each must end with exit code 3, a hang-report.txt naming the stopped
rank, and no worker left. Prints each stall's time to the job's end and the worst case.

    python benchmarks/hangs.py            # 10 stalls
    python benchmarks/hangs.py --stalls 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def workers_of(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's workers (its children with RANK in their environment)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, StopIteration):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                continue
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
            found[int(next(e[5:] for e in environ if e.startswith(b"RANK=")))] = int(stat.parent.name)
    return found


def one_stall(work: Path, rng: random.Random) -> tuple[float, bool, str]:
    out = work / f"run-{rng.randrange(10**9)}"
    command = [sys.executable, "-m", "lmtune", "train", "--nproc-per-node", "2", "--max-steps", "100000"]
    # Evaluations on the way (watched batch by batch); no saves: a stall inside a save is given
    # 10 minutes (a large checkpoint is one long write).
    command += ["--no-progress", "--output-dir", str(out), "--eval-every", "40"]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while not (out / "metrics.jsonl").is_file() or len((out / "metrics.jsonl").read_text().splitlines()) < 3:
        time.sleep(0.2)
    time.sleep(rng.uniform(0.0, 8.0))  # a random moment: any phase, evaluation included
    workers = workers_of(job.pid)
    rank = rng.choice(sorted(workers))
    os.kill(workers[rank], signal.SIGSTOP)
    stalled = time.time()
    try:
        job.communicate(timeout=900)
    finally:
        for pid in workers.values():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    seconds = time.time() - stalled
    report = (out / "hang-report.txt").read_text() if (out / "hang-report.txt").is_file() else ""
    ok = job.returncode == 3 and f"rank {rank} stopped advancing" in report
    phase = report.split("phase ", 1)[1].split(" ", 1)[0] if "phase " in report else "?"
    return seconds, ok, f"rank {rank} in {phase}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stalls", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="lmtune-hangs-"))
    times = []
    for i in range(args.stalls):
        seconds, ok, where = one_stall(work, rng)
        times.append(seconds)
        print(
            f"stall {i + 1}: {where}: ended after {seconds:.1f} s, {'diagnosed' if ok else 'NOT DIAGNOSED'}",
            flush=True,
        )
    print(
        f"worst {max(times):.1f} s, median {sorted(times)[len(times) // 2]:.1f} s (target: worst under 60 s)"
    )


if __name__ == "__main__":
    main()
