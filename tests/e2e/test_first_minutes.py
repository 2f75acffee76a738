"""The first minutes of a user coming from the peers, through the real CLI: no foreign warnings in
the output (and -v shows them), and the README's Python section runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, run_lmtune, write_jsonl

OURS = ("lmtune", "error")


def _foreign(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(OURS)]


def test_commands_print_no_foreign_lines_and_verbose_shows_them(tmp_path: Path) -> None:
    """LoRA (peft, and through it bitsandbytes), the 8-bit optimizer and transformers' schedules: the
    imports and calls that printed bitsandbytes' kernel notice and transformers' FutureWarning."""
    data = str(write_jsonl(tmp_path / "d.jsonl", [f"{i} plus {i}" for i in range(8)]))
    args = ["train", "--lora", "--optimizer", "adamw8bit", "--lr-schedule", "linear", "--max-steps", "1"]
    args += ["--data", data, "--global-batch-size", "8", "--no-progress"]
    quiet = run_lmtune([*args, "--output-dir", str(tmp_path / "quiet")], timeout=300)
    assert quiet.returncode == 0, quiet.stderr
    assert _foreign(quiet.stderr) == []
    loud = run_lmtune([*args, "--output-dir", str(tmp_path / "loud"), "-v"], timeout=300)
    assert loud.returncode == 0, loud.stderr
    assert _foreign(loud.stderr)  # there was something to hide
    for command in (["--help"], ["plan", "--help"], ["data", "audit", data, "--global-batch-size", "8"]):
        proc = run_lmtune(command, timeout=120)
        assert proc.returncode == 0 and _foreign(proc.stderr) == [], (command, proc.stderr)


def _section_code(heading: str) -> str:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    assert found is not None, f"no python block under ## {heading}"
    return found.group(1)


def test_the_python_section_trains_and_reads_run_json(tmp_path: Path) -> None:
    script = tmp_path / "readme.py"
    script.write_text(_section_code("Python"))
    # This checkout's lmtune, wherever the script runs from.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps, eval_loss, trainable = proc.stdout.strip().splitlines()[-1].split()
    assert int(steps) == 20 and float(eval_loss) > 0 and int(trainable) > 0
    assert (tmp_path / "runs" / "py" / "final" / "README.md").is_file()
