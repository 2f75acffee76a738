"""The record of the files lmtune wrote into a folder: what is not in it, or changed since, is the
user's."""

from __future__ import annotations

import os
from pathlib import Path

from lmtune.checkpoint.owned import WRITTEN_RECORD, record_written, users_files


def test_added_or_changed_files_are_the_users(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub" / "model.bin").write_bytes(b"1234")
    assert users_files(tmp_path) == []  # no record: judged as before records, all lmtune's
    record_written(tmp_path)
    assert users_files(tmp_path) == []
    (tmp_path / "serve.py").write_text("mine")
    (tmp_path / "sub" / "notes.txt").write_text("mine")
    assert users_files(tmp_path) == ["serve.py", "sub/notes.txt"]
    (tmp_path / "serve.py").unlink()
    (tmp_path / "sub" / "notes.txt").unlink()
    # Rewritten with the same size, at another time; or the same time with another size.
    (tmp_path / "config.json").write_text("[]")
    st = (tmp_path / "sub" / "model.bin").stat()
    (tmp_path / "sub" / "model.bin").write_bytes(b"12345")
    os.utime(tmp_path / "sub" / "model.bin", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert users_files(tmp_path) == ["config.json", "sub/model.bin"]
    record_written(tmp_path)
    (tmp_path / "link").symlink_to(tmp_path / "config.json")  # listed as itself, never followed
    assert users_files(tmp_path) == ["link"]


def test_a_damaged_record_leaves_every_file_to_the_user(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    for damaged in ("not json", '{"files": [1, 2]}', '{"files": {"config.json": "big"}}', "[]"):
        (tmp_path / WRITTEN_RECORD).write_text(damaged)
        assert users_files(tmp_path) == ["config.json"], damaged
