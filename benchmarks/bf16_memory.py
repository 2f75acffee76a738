"""A long CPU bf16 run on varied lengths: peak memory every 50 steps, and step time against fp32.

Examples of 8 to 200 characters (the tiny preset's tokenizer: one token per byte), two per step,
no packing: a new token count at almost every step. On a CPU with bf16 matrix units (AMX,
AVX-512 BF16) PyTorch's bf16 kernels keep a compiled kernel per matrix shape, which grew such a
run by ~5 MB a step; lmtune bounds the shapes (see lmtune.model.products.token_bucket). Runs, one
after the other: fp32; bf16 on the paths this CPU takes; bf16 with bf16 products and attention
forced (where the CPU has bf16 units); and with ``--baseline-src`` the same fp32 and bf16 runs of
another lmtune source tree (``git archive <commit> src | tar -x -C DIR``, then ``DIR/src``).

Printed: the peak resident set size every ``--every`` steps per run, each run's growth from step
100 to the end (flat: within 5%), and the median step time with its ratio to fp32 in the same
invocation (never an absolute time as a verdict). Exits 1 when a run of this tree grew more than
5% after step 100.

    python benchmarks/bf16_memory.py --steps 2000
    python benchmarks/bf16_memory.py --steps 500 --baseline-src /tmp/before/src
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

FLAT = 0.05  # growth from step 100 to the end that still counts as flat
WARM_UP = 100


@dataclass
class Result:
    name: str
    paths: str
    peaks: dict[int, float] = field(default_factory=dict)  # step -> MiB
    step_ms: float = 0.0
    baseline: bool = False

    def growth(self) -> float:
        last = max(self.peaks)
        return self.peaks[last] / self.peaks[min(WARM_UP, last)] - 1


def write_data(path: Path, examples: int) -> None:
    rng = random.Random(0)
    texts = ["".join(rng.choices("abcdefgh ", k=rng.randint(8, 200))) for _ in range(examples)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def run(name: str, work: Path, args: argparse.Namespace, env: dict[str, str], src: str | None) -> Result:
    out = work / name.replace(" ", "-")
    cmd = [sys.executable, "-m", "lmtune", "train", "--model", args.model, "--data", str(work / "data.jsonl")]
    cmd += ["--precision", env.pop("PRECISION"), "--max-steps", str(args.steps), "--global-batch-size", "2"]
    cmd += ["--packing", "off", "--no-progress", "--output-dir", str(out)]
    cmd += ["--threads-per-process", str(args.threads), "--save-every", "0", "--seed", "0"]
    full_env = {**os.environ, **env, "LMTUNE_CACHE_DIR": str(work / "cache")}
    if src is not None:
        full_env["PYTHONPATH"] = src
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    resolved = json.loads((out / "run.json").read_text())["resolved"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["kind"] == "train"]
    elapsed = [r["elapsed_s"] for r in rows]
    result = Result(
        name, f"{resolved['products']}; {resolved['attention']} attention", baseline=src is not None
    )
    result.peaks = {r["step"]: r["peak_memory_bytes"] / 2**20 for r in rows if r["step"] % args.every == 0}
    result.step_ms = 1e3 * statistics.median(b - a for a, b in itertools.pairwise(elapsed[10:]))
    print(f"  {name}: {result.paths}; {result.step_ms:.1f} ms/step", flush=True)
    return result


def report(results: list[Result]) -> bool:
    """The table and the verdicts; True when every run of this tree stayed flat."""
    steps = sorted(results[0].peaks)
    print("\npeak memory (MiB) after step")
    print(f"{'step':>6}" + "".join(f"{r.name:>16}" for r in results))
    for step in steps:
        print(f"{step:>6}" + "".join(f"{r.peaks.get(step, float('nan')):>16,.0f}" for r in results))
    fp32 = {r.baseline: r.step_ms for r in results if r.name.startswith("fp32")}
    print(f"\n{'run':<22}{'growth after ' + str(WARM_UP):>18}{'step ms':>10}{'x fp32':>8}  paths")
    flat = True
    for r in results:
        growth = r.growth()
        flat &= r.baseline or growth <= FLAT
        ratio = r.step_ms / fp32[r.baseline] if r.baseline in fp32 else float("nan")
        print(f"{r.name:<22}{100 * growth:>17.1f}%{r.step_ms:>10.1f}{ratio:>8.2f}  {r.paths}")
    print(f"\nevery run of this tree flat within {FLAT:.0%} after step {WARM_UP}: {'yes' if flat else 'NO'}")
    return flat


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--baseline-src", default=None, help="another lmtune src/ to run the same way")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    from lmtune.model.paths import cpu_units

    units = cpu_units()
    work = Path(tempfile.mkdtemp(prefix="lmtune-bf16-memory-"))
    write_data(work / "data.jsonl", args.examples)
    print(f"{args.steps} steps of {args.model}, CPU matrix units: {units.describe()}; work in {work}")
    plans: list[tuple[str, dict[str, str], str | None]] = [
        ("fp32", {"PRECISION": "fp32"}, None),
        ("bf16", {"PRECISION": "bf16"}, None),
    ]
    if units.bf16:
        forced = {"PRECISION": "bf16", "LMTUNE_CPU_PRODUCTS": "bf16", "LMTUNE_CPU_ATTENTION": "bf16"}
        plans.append(("bf16 kernels", forced, None))
    if args.baseline_src:
        plans += [("fp32 before", {"PRECISION": "fp32"}, args.baseline_src)]
        plans += [("bf16 before", {"PRECISION": "bf16"}, args.baseline_src)]
    results = [run(name, work, args, env, src) for name, env, src in plans]
    flat = report(results)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=1))
    sys.exit(0 if flat else 1)


if __name__ == "__main__":
    main()
