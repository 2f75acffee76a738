"""Data preparation on 2 ranks: one process tokenizes, the other waits; bad input stops both.

Launches go through the real CLI (`--nproc-per-node 2`, torch.distributed.run underneath).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import run_lmtune, uneven_texts

pytestmark = pytest.mark.distributed

TRAIN = [
    "train",
    "--nproc-per-node",
    "2",
    "--max-steps",
    "2",
    "--global-batch-size",
    "4",
    "--no-progress",
    "--threads-per-process",
    "1",
]


def test_one_rank_tokenizes_and_the_second_run_hits_the_cache(tmp_path: Path) -> None:
    rows = [{"text": t} for t in uneven_texts(12, seed=3)]
    rows += [{"prompt": "Q: " + t, "completion": " A"} for t in uneven_texts(6, seed=4)]
    rows += [
        {"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": "ok"}]}
        for t in uneven_texts(6, seed=5)
    ]
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = tmp_path / "cache"
    built = []
    for run in ("first", "second"):
        out = tmp_path / run
        proc = run_lmtune([*TRAIN, "--data", str(data), "--cache-dir", str(cache), "--output-dir", str(out)])
        assert proc.returncode == 0, proc.stderr
        info = json.loads((out / "run.json").read_text())["data"]["train"]
        assert info["examples"] == 24 and info["formats"] == {
            "text": 12,
            "prompt_completion": 6,
            "messages": 6,
        }
        built.append(info["built_by_ranks"])
    assert built == [[0], []]  # rank 1 waited for rank 0; the second run tokenized nothing
    entries = [p for p in cache.iterdir() if p.is_dir()]
    assert len(entries) == 1


BAD_INPUTS = {
    "malformed_json": (b'{"text": "a"}\n{"text": \n', "bad.jsonl:2: not valid JSON"),
    "missing_field": (
        b'{"text": "a"}\n{"body": "b"}\n',
        "bad.jsonl:2: cannot tell the format (fields found: 'body'",
    ),
    "non_string": (
        b'{"text": "a"}\n{"text": ["b"]}\n',
        "bad.jsonl:2: record has a non-string (list) 'text' field",
    ),
    "invalid_utf8": (b'{"text": "a"}\n{"text": "\xc3\x28"}\n', "bad.jsonl:2: not valid UTF-8"),
    "empty_file": (b"", "bad.jsonl: holds no records (empty)"),
    "empty_after_filtering": (
        b'{"prompt": "a long prompt", "completion": "x"}\n' * 8,
        # The prompts alone fill --max-length: dropped for their length, with nothing left to train.
        # Named where they are: the first few, and how many more.
        "bad.jsonl:3 and 5 more), 0 with no trainable",
    ),
    "fewer_than_a_batch": (b'{"text": "a"}\n{"text": "b"}\n', "2 examples, fewer than one global batch"),
    "unknown_role": (
        b'{"messages": [{"role": "narrator", "content": "x"}]}\n',
        "bad.jsonl:1: message 1 has unknown role 'narrator'",
    ),
    "missing_file": (None, "--data: no such file or folder:"),
}


def _launch(
    tmp_path: Path, name: str, content: bytes | None
) -> tuple[subprocess.CompletedProcess[str], float]:
    folder = tmp_path / name
    folder.mkdir()
    data = folder / "bad.jsonl"
    if content is not None:
        data.write_bytes(content)
    args = [
        *TRAIN,
        "--data",
        str(data),
        "--cache-dir",
        str(folder / "cache"),
        "--output-dir",
        str(folder / "out"),
        "--max-length",
        "6",
    ]
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "lmtune", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return proc, time.monotonic() - started


def test_every_bad_input_stops_both_ranks_with_one_message(tmp_path: Path) -> None:
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {
            name: pool.submit(_launch, tmp_path, name, content) for name, (content, _) in BAD_INPUTS.items()
        }
        results = {name: f.result() for name, f in futures.items()}
    for name, (proc, elapsed) in results.items():
        expected = BAD_INPUTS[name][1]
        assert proc.returncode == 2, f"{name}: exit {proc.returncode}\n{proc.stderr}"
        assert expected in proc.stderr, f"{name}: {proc.stderr}"
        assert proc.stderr.count("error: ") == 1, f"{name}: {proc.stderr}"
        assert "Traceback" not in proc.stderr + proc.stdout, name
        assert elapsed < 60, f"{name} took {elapsed:.0f}s"


def _trained_ids(out: Path) -> list[int]:
    ids: list[int] = []
    for path in sorted((out / "samples").glob("rank-*.jsonl")):
        ids += [i for line in path.read_text().splitlines() for i in json.loads(line)["ids"]]
    return ids


def test_the_eval_split_is_never_trained_on_whatever_the_world_size(tmp_path: Path) -> None:
    """--eval-split holds out the same examples for 1 and 2 ranks and across a resume."""
    from lmtune.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in uneven_texts(40, seed=8)))
    split = ["--data", str(data), "--eval-split", "0.25", "--record-samples", "--seed", "3"]
    two = tmp_path / "two"
    proc = run_lmtune([*TRAIN, *split, "--max-steps", "16", "--output-dir", str(two)])
    assert proc.returncode == 0, proc.stderr
    one = tmp_path / "one"
    one_args = ["train", *split, "--global-batch-size", "4", "--no-progress", "--keep-last", "0"]
    assert main([*one_args, "--max-steps", "8", "--save-every", "4", "--output-dir", str(one)]) == 0
    assert (
        main([*one_args, "--max-steps", "16", "--save-every", "4", "--output-dir", str(one)]) == 0
    )  # resumed
    from lmtune.config.groups import ExampleSettings
    from lmtune.data.dataset import split_off
    from lmtune.data.prepare import encode_in_memory
    from lmtune.data.readers import iter_records
    from lmtune.data.sources import BadLines, Source
    from lmtune.model.modeling import byte_tokenizer

    records = iter_records(Source("jsonl", str(data)), "text", BadLines(skip=False))
    _, held = split_off(encode_in_memory(records, byte_tokenizer(), ExampleSettings())[0], 0.25, 3)
    held_out = set(held.indices.tolist())
    assert len(held_out) == 10
    for out in (two, one):
        trained = _trained_ids(out)
        assert len(trained) == 16 * 4 and not held_out & set(trained)  # 2 epochs of the other 30
        assert len(set(trained)) >= 28  # each epoch trains 28 of the 30 (7 full global batches)
        run = json.loads((out / "run.json").read_text())
        assert run["data"]["eval"]["examples"] == 10
    evals = [json.loads(r) for r in (one / "metrics.jsonl").read_text().splitlines() if '"eval"' in r]
    assert evals[-1]["eval_examples"] == 10
