"""The tokenized-data cache: what its key depends on, and build once then hit."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmtune.config.groups import ExampleSettings
from lmtune.data.prepare import cache_key, prepare
from lmtune.data.sources import resolve_sources
from lmtune.errors import UserError
from lmtune.model.modeling import byte_tokenizer
from lmtune.parallel.distributed import read_dist_env
from tests.conftest import write_jsonl


def key(spec: str, tok: object = None, **settings: object) -> str:
    return cache_key(resolve_sources(spec), tok or byte_tokenizer(), ExampleSettings(**settings))[0]  # type: ignore[arg-type]


def test_the_data_key_a_checkpoint_records_outlives_a_new_cache_version(tmp_path: Path) -> None:
    """A new cache version (the same data tokenized otherwise) names new entries, and leaves the
    data key of the checkpoints an older lmtune saved as it was: they still resume."""
    import json

    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "one"}) + "\n" + json.dumps({"text": "two"}) + "\n")
    data, entry = cache_key(resolve_sources(str(f)), byte_tokenizer(), ExampleSettings())
    assert data == "0a3e720bc1310325bdce0a0a"  # as lmtune's first cache version computed it
    assert entry != data


def test_key_is_stable_and_changes_with_every_input(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "d.jsonl", ["one", "two"])
    base = key(str(f))
    assert key(str(f)) == base
    templated = byte_tokenizer()
    templated.chat_template = "{{ messages }}"
    changed = {
        "max_length": key(str(f), max_length=64),
        "truncation": key(str(f), truncation="left"),
        "format": key(str(f), format="text"),
        "field": key(str(f), text_field="body"),
        "field map": key(str(f), field_map="prompt=question"),
        "template": key(str(f), templated),
    }
    assert base not in changed.values() and len(set(changed.values())) == len(changed)
    copy = write_jsonl(tmp_path / "copy.jsonl", ["one", "two"])
    assert key(str(copy)) == base  # content, not the path
    write_jsonl(f, ["one", "three"])
    assert key(str(f)) != base


def test_second_prepare_is_a_cache_hit(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "d.jsonl", ["alpha", "beta", "gamma"])
    env = read_dist_env("cpu")
    first = prepare(str(f), byte_tokenizer(), ExampleSettings(), env, tmp_path / "cache")
    second = prepare(str(f), byte_tokenizer(), ExampleSettings(), env, tmp_path / "cache")
    assert first.built and not second.built and first.folder == second.folder
    assert [list(second.dataset[i][0]) for i in range(3)] == [list(first.dataset[i][0]) for i in range(3)]
    assert second.dataset.meta["examples"] == 3


def test_empty_data_is_a_user_error_and_leaves_no_entry(tmp_path: Path) -> None:
    f = tmp_path / "empty.jsonl"
    f.write_text("\n\n")
    env = read_dist_env("cpu")
    with pytest.raises(UserError, match=r"--data .*empty\.jsonl: holds no records \(empty\)"):
        prepare(str(f), byte_tokenizer(), ExampleSettings(), env, tmp_path / "cache")
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    f.write_text('{"prompt": "a long prompt", "completion": "x"}\n' * 2)  # each prompt fills --max-length
    with pytest.raises(
        UserError, match=r"no examples left \(2 longer .*; a larger --max-length \(now 4\) keeps"
    ):
        prepare(str(f), byte_tokenizer(), ExampleSettings(max_length=4), env, tmp_path / "cache")
    # No answer at all: no length would keep them, so none is suggested.
    f.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n' * 2)
    with pytest.raises(UserError, match=r"2 with no trainable tokens.*\); those with no trainable") as e:
        prepare(str(f), byte_tokenizer(), ExampleSettings(), env, tmp_path / "cache")
    assert "--max-length (now" not in str(e.value)


def test_worker_processes_do_not_run_the_users_script_again(tmp_path: Path) -> None:
    """Spawned workers re-imported ``__main__``: a script without an ``if __name__ ==
    "__main__":`` guard ran again in each (there lmtune.train failed on the run's lock and the
    pool started another worker, without end, on data of 16 MiB or more)."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(
        "import sys\n"
        "print('SCRIPT BODY', flush=True)\n"
        "from lmtune.config.groups import ExampleSettings\n"
        "from lmtune.data.prepare import _ListSink, encode_into\n"
        "from lmtune.data.sources import BadLines, Record\n"
        "from lmtune.model.modeling import byte_tokenizer\n"
        "recs = [Record('mem', i + 1, {'text': f'example {i}'}) for i in range(3000)]\n"
        "sink = _ListSink()\n"
        "encode_into(recs, byte_tokenizer(), ExampleSettings(), sink, BadLines(skip=False), workers=2)\n"
        "print(len(sink.examples), sys.modules['__main__'].__file__ == __file__, __spec__, flush=True)\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["SCRIPT BODY", "3000 True None"]


def test_worker_processes_give_the_same_result_and_the_same_errors() -> None:
    from lmtune.data.prepare import _ListSink, encode_into
    from lmtune.data.sources import BadLines, Record

    rows = [
        {"text": f"example {i}"} if i % 3 else {"prompt": f"q{i} ", "completion": "a"} for i in range(5000)
    ]
    recs = [Record("mem", i + 1, r) for i, r in enumerate(rows)]
    one, two = _ListSink(), _ListSink()
    s1 = encode_into(recs, byte_tokenizer(), ExampleSettings(), one, BadLines(skip=False), workers=1)
    s2 = encode_into(recs, byte_tokenizer(), ExampleSettings(), two, BadLines(skip=False), workers=2)
    assert s1 == s2
    assert all(
        (a.ids == b.ids).all() and (a.trainable == b.trainable).all()
        for a, b in zip(one.examples, two.examples, strict=True)
    )
    bad = [*recs[:4000], Record("mem", 4001, {"nothing": 1}), *recs[4000:]]
    with pytest.raises(UserError, match="mem:4001: cannot tell the format"):
        encode_into(bad, byte_tokenizer(), ExampleSettings(), _ListSink(), BadLines(skip=False), workers=2)


def test_a_node_builder_of_another_copy_of_the_data_refuses_to_build_under_rank_0s_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--cache-per-node: node 1's builder stored its own, other copy of the files under rank 0's key
    (a cache entry poisoned for every later run), and the job trained on two data sets unsaid."""
    import torch

    from lmtune.parallel.distributed import DistEnv

    data = write_jsonl(tmp_path / "d.jsonl", [{"text": f"row {i}"} for i in range(8)])
    node_builder = DistEnv(rank=1, local_rank=0, world_size=2, local_world_size=1, device=torch.device("cpu"),
                           backend="gloo")  # fmt: skip
    # Rank 0's verdict, of its own copy: another key than this node's files have.
    monkeypatch.setattr("lmtune.data.prepare.decided_by_main", lambda *a: ("0" * 64, "entry-of-rank-0", "n"))
    cache = tmp_path / "cache"
    with pytest.raises(UserError, match=r"d.jsonl: this node's copy of the data differs from rank 0's"):
        prepare(str(data), byte_tokenizer(), ExampleSettings(), node_builder, cache, per_node=True)
    said = (cache / "entry-of-rank-0.error-n").read_text()  # the ranks waiting on this node read it
    assert "differs from rank 0's" in said and not (cache / "entry-of-rank-0").exists()
