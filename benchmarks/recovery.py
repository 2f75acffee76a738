"""Fault recovery, repeated: a fault at a different step each time, for each kind of fault.

Every trial runs `lmtune train --nproc-per-node 2 --max-restarts 1` and strikes once the metrics
show the chosen step:

- worker: SIGKILL of one worker; the run must finish by itself.
- launcher-kill: SIGKILL of the launcher (as the OOM killer would); no worker may outlive it by more
  than 5 s, and the same command run again must finish.
- launcher-term: SIGTERM to the launcher (as a scheduler would); it must save, exit 0, and the same
  command run again must finish.

A trial counts when it ends with the final weights of an uninterrupted run (compared bit for bit),
with no process left behind. Prints one line per trial and the count per fault.

    python benchmarks/recovery.py [--faults worker,launcher-kill,launcher-term] [--trials 20]
        [--steps 200] [--save-every 25]
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


def alive(pids: list[int]) -> list[int]:
    """The processes of ``pids`` still running (zombies are gone for this purpose)."""
    out = []
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(pid)
        except (OSError, IndexError):
            continue
    return out


def strike(fault: str, proc: subprocess.Popen[bytes], trial: int) -> str:
    """Deliver ``fault`` to a running job; returns what was left behind ("" when nothing)."""
    workers = children(proc.pid)
    if fault == "worker":
        if workers:
            os.kill(workers[trial % len(workers)], signal.SIGKILL)
        return ""
    os.kill(proc.pid, signal.SIGKILL if fault == "launcher-kill" else signal.SIGTERM)
    deadline = time.monotonic() + (5 if fault == "launcher-kill" else 60)
    while alive(workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = alive(workers)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return f"{len(left)} workers outlived the launcher" if left else ""


def trial_run(
    fault: str, trial: int, cmd: list[str], out: Path, kill_at: int, env: dict[str, str], timeout: float
) -> tuple[int | None, str]:
    """Run, strike, and (after a launcher fault) run the same command again; (exit code, problem)."""
    out.mkdir(parents=True, exist_ok=True)
    with (out.parent / f"{out.name}.log").open("w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    while steps_done(out) < kill_at and proc.poll() is None:
        time.sleep(0.02)
    if proc.poll() is not None:
        return proc.returncode, "the run ended before the fault: " + _tail(out)
    problem = strike(fault, proc, trial)
    try:
        code: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return None, "hung"
    if fault == "launcher-term" and code != 0:
        return code, f"SIGTERM ended the launcher with exit {code}: " + _tail(out)
    if fault != "worker":
        rerun = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        code = rerun.returncode
        if code != 0:
            problem += " the rerun failed: " + rerun.stderr[-500:]
    return code, problem


def _tail(out: Path) -> str:
    return (out.parent / f"{out.name}.log").read_text()[-800:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--faults", default="worker,launcher-kill,launcher-term")
    p.add_argument("--trials", type=int, default=20, help="per fault")
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
        totals: dict[str, int] = {}
        for fault in args.faults.split(","):
            recovered = 0
            for trial in range(args.trials):
                out = root / f"{fault}-{trial}"
                kill_at = 5 + trial * (args.steps - 20) // max(args.trials, 1)
                started = time.monotonic()
                cmd = command(data, out, args.steps, args.save_every)
                code, problem = trial_run(fault, trial, cmd, out, kill_at, env, args.timeout)
                same = False
                if code == 0 and not problem:
                    got = load_file(out / "final" / "model.safetensors")
                    same = all(torch.equal(got[k], expected[k]) for k in expected)
                recovered += same
                print(
                    f"{fault} trial {trial + 1:>2}: at step {kill_at:>3}: exit {code}, final weights "
                    f"{'identical' if same else 'DIFFERENT'}{', ' + problem if problem else ''}, "
                    f"{time.monotonic() - started:.1f}s",
                    flush=True,
                )
            totals[fault] = recovered
        for fault, recovered in totals.items():
            print(f"{fault}: recovered {recovered}/{args.trials}")
        sys.exit(0 if all(r == args.trials for r in totals.values()) else 1)


if __name__ == "__main__":
    main()
