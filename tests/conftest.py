from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Tests never reach the hub: models are built from presets, data is generated here.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# Tokenized-data caches go to a folder of this test session, never the user's ~/.cache.
TEST_CACHE = tempfile.mkdtemp(prefix="lmtune-test-cache-")
os.environ["LMTUNE_CACHE_DIR"] = TEST_CACHE
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


# Markers by folder: the quick subset (-m "not distributed and not e2e") leaves out the tests that
# launch several processes and the long end-to-end runs; gpu tests skip without CUDA.
FOLDER_MARKERS = {"distributed": "distributed", "e2e": "e2e", "gpu": "gpu"}


def pytest_unconfigure(config: Any) -> None:
    """The session's cache folder goes with the session (it held only what the tests wrote)."""
    import shutil

    shutil.rmtree(TEST_CACHE, ignore_errors=True)


def pytest_collection_modifyitems(items: list[Any]) -> None:
    """tests/unit/ mirrors the packages (in process), tests/integration/ runs the CLI in process or
    briefly in a subprocess, tests/distributed/, tests/e2e/ and tests/gpu/ carry their marker."""
    import pytest

    for item in items:
        folder = Path(str(item.path)).relative_to(REPO).parts[1]
        if folder in FOLDER_MARKERS:
            item.add_marker(getattr(pytest.mark, FOLDER_MARKERS[folder]))


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts), encoding="utf-8")
    return path


def uneven_texts(n: int, seed: int = 0) -> list[str]:
    """Texts of very different lengths, so batches carry a lot of padding."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "12", "+", "="]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(1, 14))) for _ in range(n)]


def tokenized(texts: list[str], tokenizer: Any, max_length: int = 512) -> Any:
    """Plain texts as a tokenized data set, without a cache."""
    from lmtune.config.groups import ExampleSettings
    from lmtune.data.prepare import encode_in_memory
    from lmtune.data.sources import Record

    recs = [Record("mem", i + 1, {"text": t}) for i, t in enumerate(texts)]
    return encode_in_memory(recs, tokenizer, ExampleSettings(max_length=max_length))[0]


def run_lmtune(
    args: list[str],
    timeout: float = 300,
    launcher: list[str] | None = None,
    cwd: Path | None = None,
    env_extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run the real CLI in a fresh process (optionally under a launcher such as torchrun)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    cmd = [*(launcher or [sys.executable, "-m"]), "lmtune", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


def child_pids(pid: int) -> list[int]:
    """Direct children of a process (Linux /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return sorted(children)


def train_rows(out: Path, kind: str = "train") -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return [r for r in rows if r["kind"] == kind]


@contextmanager
def mounted_tmpfs(folder: Path, options: str) -> Iterator[Path]:
    """A small file system of its own at ``folder`` (a full or read-only disk, for real); the test
    is skipped where this process may not mount one."""
    import pytest

    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small file system here: {done.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=False)


def lmtune_cmd(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "lmtune", *args]


def assert_same_training(a: dict[str, Any], b: dict[str, Any], label: str = "") -> None:
    """Two trainings' weights agree to fp32 rounding.

    Differently grouped matrix products (another world size, micro-batch or sequence layout) round
    differently, and Adam divides each gradient by its own running scale, so a coordinate whose
    gradient is near zero can carry such a rounding difference into its update at lr's scale.
    Hence: every weight within 5e-5, and all but two in 10,000 within 1e-6 (QLoRA's 2 ranks against
    one process on an AVX-512 CPU: 1.2e-4 of a small adapter's weights). A real difference (a wrong
    normalisation, a skipped example) moves far more than that.
    """
    import torch

    assert a.keys() == b.keys(), label
    diff = torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in a])
    assert float(diff.max()) <= 5e-5, f"{label}: max abs diff {float(diff.max())}"
    far = float((diff > 1e-6).float().mean())
    assert far <= 2e-4, f"{label}: {far:.2e} of the weights differ by more than 1e-6"


def free_port() -> int:
    """A free port below the ephemeral range: a port the kernel hands out as a source port could
    be taken by a client's own outgoing connection (a TCP self-connect) before the store binds it."""
    low, _ = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    rng = random.Random(os.getpid())
    for _ in range(200):
        port = rng.randrange(20000, min(low, 32768))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def deadline(seconds: int) -> Any:
    """A context that fails a test instead of letting it hang (a blocking read of a FIFO is
    interrupted by SIGALRM)."""
    import signal
    from contextlib import contextmanager

    @contextmanager
    def limited() -> Any:
        def expired(signum: int, frame: Any) -> None:
            raise TimeoutError(f"still running after {seconds} s")

        previous = signal.signal(signal.SIGALRM, expired)
        signal.alarm(seconds)
        try:
            yield
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)

    return limited()


def one_line_error(argv: list[str], capsys: Any) -> str:
    """Run the CLI in this process and expect a user error: exit code 2 and one line on stderr."""
    from lmtune.cli import main

    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error") and err.count("\n") == 1, err[:2000]
    return str(err)


def tiny_run_with_checkpoint(root: Path) -> Path:
    """A 2-step run of the tiny preset with a checkpoint of step 2: ROOT/out."""
    from lmtune.cli import main

    data = write_jsonl(root / "d.jsonl", [f"text {i}" for i in range(16)])
    out = root / "out"
    argv = ["train", "--data", str(data), "--output-dir", str(out), "--max-steps", "2", "--save-every", "2"]
    assert main([*argv, "--global-batch-size", "8", "--no-progress"]) == 0
    return out
