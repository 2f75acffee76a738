"""The record of the files lmtune wrote into a folder: what is not in it, or changed since, is the
user's; a copy of the folder is as its original."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from lmtune.checkpoint import owned
from lmtune.checkpoint.owned import WRITTEN_RECORD, record_written, users_files


def test_added_or_changed_files_are_the_users(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub" / "tokenizer.json").write_bytes(b"1234")
    assert users_files(tmp_path) == []  # no record: judged as before records, all lmtune's
    record_written(tmp_path)
    assert users_files(tmp_path) == []
    (tmp_path / "serve.py").write_text("mine")
    (tmp_path / "sub" / "notes.txt").write_text("mine")
    assert users_files(tmp_path) == ["serve.py", "sub/notes.txt"]
    (tmp_path / "serve.py").unlink()
    (tmp_path / "sub" / "notes.txt").unlink()
    (tmp_path / "config.json").write_text("[]")  # the same size, another content
    (tmp_path / "sub" / "tokenizer.json").write_bytes(b"12345")
    assert users_files(tmp_path) == ["config.json", "sub/tokenizer.json"]
    record_written(tmp_path)
    (tmp_path / "link").symlink_to(tmp_path / "config.json")  # listed as itself, never followed
    assert users_files(tmp_path) == ["link"]


def test_a_copy_is_as_its_original_and_weights_are_judged_by_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(owned, "HASHED_UP_TO", 8)
    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text("{}")
    (final / "model.safetensors").write_bytes(b"w" * 64)
    record_written(final)
    copy = tmp_path / "copy"
    shutil.copytree(final, copy, copy_function=shutil.copyfile)  # new times, as cp -r gives
    assert users_files(copy) == []
    (copy / "model.safetensors").write_bytes(b"v" * 64)  # weights: judged by size only
    assert users_files(copy) == []
    (copy / "model.safetensors").write_bytes(b"v" * 65)
    assert users_files(copy) == ["model.safetensors"]


def test_a_damaged_record_leaves_every_file_to_the_user(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    for damaged in ("not json", '{"files": [1, 2]}', '{"files": {"config.json": [2, 3]}}', "[]"):
        (tmp_path / WRITTEN_RECORD).write_text(damaged)
        assert users_files(tmp_path) == ["config.json"], damaged
