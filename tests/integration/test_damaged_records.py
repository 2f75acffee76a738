"""Records and caches read back are data that may have been edited or damaged: a checkpoint's JSON
with huge or negative counts (its manifest recomputed, so it passes the checksums), a data cache
entry cut short or with ids past the vocabulary, a metrics.jsonl of crafted rows, a FIFO where
run.json belongs. Each is one line with exit code 2, a rebuilt cache entry with a warning naming
it, or a skipped row with a warning; never a traceback, a hang, or a silent loss of 0.0000."""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lmtune.checkpoint import export as export_module
from lmtune.checkpoint.export import save_final
from lmtune.checkpoint.fingerprint import read_fingerprint
from lmtune.checkpoint.layout import write_manifest
from lmtune.checkpoint.state import ModelParts
from lmtune.checkpoint.store import _scaler_state, load_checkpoint, read_state
from lmtune.cli import main
from lmtune.config.groups import ExampleSettings
from lmtune.data.dataset import IDS_FILE, MASK_FILE, OFFSETS_FILE, TokenizedDataset
from lmtune.data.leftovers import remove_stale
from lmtune.data.prepare import prepare
from lmtune.errors import UserError
from lmtune.model.modeling import byte_tokenizer, load_model
from lmtune.outputs.runlog import read_metrics
from lmtune.parallel.distributed import read_dist_env
from lmtune.training.optim import param_groups
from tests.conftest import deadline, tiny_run_with_checkpoint, write_jsonl

ONE = read_dist_env("cpu")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_run_with_checkpoint(tmp_path_factory.mktemp("records"))


def _copy(ckpt: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    for f in ckpt.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    return target


def _edit(folder: Path, name: str, value: Any) -> None:
    """Change a record and recompute the manifest, as someone who knows the format would."""
    (folder / name).write_text(value if isinstance(value, str) else json.dumps(value))
    (folder / "manifest.json").unlink()
    write_manifest(folder)


@pytest.mark.parametrize(
    "changes",
    [
        {"step": 10**30},
        {"step": -2},
        {"global_batch_size": 0},
        {"examples": 0},
        {"epoch": 3},  # more epochs than steps
        {"step_in_epoch": 2**39},  # more samples into the epoch than the data has
        {"world_size": True},
        {"train_seconds": -1.0},
        {"train_seconds": "1 hour"},
    ],
)
def test_an_edited_trainer_state_is_refused(run: Path, tmp_path: Path, changes: dict[str, Any]) -> None:
    folder = _copy(run / "checkpoints" / "step-000002", tmp_path / "c")
    state = json.loads((folder / "trainer.json").read_text())
    _edit(folder, "trainer.json", {**state, **changes})
    with pytest.raises(UserError, match=r"trainer\.json: not a trainer state lmtune wrote") as caught:
        read_state(folder)
    assert "\n" not in str(caught.value)


def test_edited_records_fail_with_one_line(run: Path, tmp_path: Path) -> None:
    folder = _copy(run / "checkpoints" / "step-000002", tmp_path / "c")
    _edit(folder, "fingerprint.json", "[" * 100_000)
    with pytest.raises(UserError, match=r"fingerprint\.json: not valid JSON \(nested too deeply\)"):
        read_fingerprint(folder)
    _edit(folder, "fingerprint.json", {"fixed": [1], "adjustable": {}})
    with pytest.raises(UserError, match=r"fingerprint\.json: unreadable"):
        read_fingerprint(folder)
    for scaler in (
        {
            "scale": -1.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 10,
            "_growth_tracker": 0,
        },
        {
            "scale": 1e400,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 10,
            "_growth_tracker": 0,
        },
        {
            "scale": 1.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": -3,
            "_growth_tracker": 0,
        },
    ):
        (tmp_path / "scaler.json").write_text(json.dumps(scaler))
        with pytest.raises(UserError, match=r"scaler\.json: not a gradient scaler state"):
            _scaler_state(tmp_path / "scaler.json")
    loaded = load_model("tiny", 0)
    parts = ModelParts(loaded.model, loaded.model, sharded=False, lora=False)
    optimizer = torch.optim.AdamW(param_groups(loaded.model, 0.01))
    rng = json.loads((folder / "rng-rank-0.json").read_text())
    for damaged in (
        {**rng, "python": [3, [10**40] * 625, None]},
        {**rng, "numpy": ["MT19937", [1], 0, 0, 0.0]},
    ):
        _edit(folder, "rng-rank-0.json", damaged)
        with pytest.raises(UserError, match=r"rng-rank-0\.json: not the RNG state lmtune wrote") as caught:
            load_checkpoint(folder, parts, optimizer, ONE)
        assert "\n" not in str(caught.value)


def test_a_huge_step_is_one_line_through_the_cli(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = run / "checkpoints" / "step-000002"
    state = json.loads((ckpt / "trainer.json").read_text())
    folder = _copy(ckpt, tmp_path / "c")
    _edit(folder, "trainer.json", {**state, "step": 10**30})
    data = write_jsonl(tmp_path / "d.jsonl", [f"text {i}" for i in range(16)])
    argv = ["train", "--data", str(data), "--output-dir", str(tmp_path / "o"), "--resume", str(folder)]
    assert main([*argv, "--max-steps", "4", "--global-batch-size", "8", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "trainer.json: not a trainer state lmtune wrote" in err


def test_final_that_does_not_fit_is_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = load_model("tiny", 0)
    parts = ModelParts(loaded.model, loaded.model, sharded=False, lora=False)
    real = export_module.shutil.disk_usage
    monkeypatch.setattr(export_module.shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    with pytest.raises(
        UserError, match=r"no space left on device for .*final: about [\d.]+ MB needed, 1.0 MB free"
    ):
        save_final(parts, loaded.tokenizer, tmp_path / "final", ONE)
    assert not (tmp_path / "final").exists()
    monkeypatch.setattr(export_module.shutil, "disk_usage", real)

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loaded.tokenizer, "save_pretrained", full)
    with pytest.raises(UserError, match=r"no space left on device while writing .*final; free some space"):
        save_final(parts, loaded.tokenizer, tmp_path / "final", ONE)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the temporary folder is gone too


def _damage_ids(folder: Path, value: int) -> None:
    ids = np.fromfile(folder / IDS_FILE, dtype=np.int32)
    ids[3] = value
    ids.tofile(folder / IDS_FILE)


def _damage_offsets(folder: Path) -> None:
    offsets = np.load(folder / OFFSETS_FILE)
    offsets[1], offsets[2] = offsets[2], offsets[1]
    np.save(folder / OFFSETS_FILE, offsets)


DAMAGES = {
    "cut short": (lambda f: os.truncate(f / IDS_FILE, 40), "not the .* bytes its offsets imply"),
    "id past the vocabulary": (lambda f: _damage_ids(f, 10**6), "token id 1000000 is outside the vocabulary"),
    "negative id": (lambda f: _damage_ids(f, -7), "token id -7 is outside the vocabulary"),
    "offsets out of order": (_damage_offsets, "offsets do not rise with every example"),
    "nothing to train": (
        lambda f: np.zeros(os.path.getsize(f / MASK_FILE), np.uint8).tofile(f / MASK_FILE),
        "example 0 has no trainable token",
    ),
    "meta missing": (lambda f: (f / "meta.json").unlink(), "meta.json is missing"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_cache_entry_is_named_and_rebuilt(
    damage: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [f"some text {i}" for i in range(20)])
    tok, cache = byte_tokenizer(), tmp_path / "cache"
    first = prepare(str(data), tok, ExampleSettings(), ONE, cache)
    expected = [first.dataset[i].input_ids.tolist() for i in range(len(first.dataset))]
    apply, needle = DAMAGES[damage]
    apply(first.folder)
    with pytest.raises(UserError, match=f"damaged data cache entry {first.folder}: .*{needle}"):
        TokenizedDataset.open(first.folder, len(tok))
    capsys.readouterr()
    again = prepare(str(data), tok, ExampleSettings(), ONE, cache)
    assert again.built and f"damaged data cache entry {first.folder}" in capsys.readouterr().err
    assert [again.dataset[i].input_ids.tolist() for i in range(len(again.dataset))] == expected
    assert sorted(p.name for p in cache.iterdir()) == [first.folder.name]  # nothing set aside is left


def test_stale_temporary_entries_are_removed_and_nothing_else(tmp_path: Path) -> None:
    """Leftovers of killed builders go once no rank waits for them; files of a user's in a folder
    given as --cache-dir that look like them (any *.tmp-*, *.error-*, *.bad-* went) stay."""
    key = "0123456789abcdef01234567"
    old, fresh = tmp_path / f"{key}.tmp-89abcdef-0", tmp_path / f"{key}.tmp-01234567-1"
    names = ("backup.tmp-2024", "notes.error-log.txt", "seeds.bad-1", "k.tmp-abc-0")
    users = [tmp_path / name for name in names]
    for folder in (old, fresh, users[0]):
        folder.mkdir()
        (folder / IDS_FILE).write_bytes(b"1234")
    for path in users[1:]:
        path.write_text("mine")
    markers = [tmp_path / f"{key}.error-89abcdef", tmp_path / f"{key}.error-89abcdef.part-1"]
    markers.append(tmp_path / f"{key}.bad-89abcdef")
    for path in markers:
        path.write_text("x")
    hours_ago = time.time() - 7200
    for path in (old, old / IDS_FILE, *markers, *users, users[0] / IDS_FILE):
        os.utime(path, (hours_ago, hours_ago))
    named_so = tmp_path / f"{key}.tmp-01234567-0"  # a folder of the user's with lmtune's name: its files say
    named_so.mkdir()
    (named_so / "thesis.tex").write_text("mine")
    for path in (named_so, named_so / "thesis.tex"):
        os.utime(path, (hours_ago, hours_ago))
    assert sorted(remove_stale(tmp_path)) == sorted([old, *markers])
    assert (named_so / "thesis.tex").read_text() == "mine"
    assert fresh.is_dir()  # another builder may be writing it
    assert all(p.exists() for p in users)
    assert remove_stale(tmp_path / "not-made-yet") == []


def _rows_folder(folder: Path, extra: list[str]) -> Path:
    folder.mkdir(parents=True)
    good = [{"kind": "train", "step": s, "loss": 2.0 / s, "lr": 1e-3, "tokens": 100} for s in range(1, 6)]
    lines = [json.dumps(r) for r in good] + extra
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


CRAFTED = [
    '{"kind": "eval", "step": 3}',
    '{"kind": "train", "step": "x", "loss": 1}',
    '{"kind": "train", "step": 6, "loss": "high"}',
    '{"kind": "train", "step": 7, "loss": 1e300}',
    '{"kind": "train", "step": 8, "tokens": 1e308}',
    '{"kind": "train", "step": 10000000000000000000000, "loss": 1}',
    '{"kind": "sample", "step": 5, "prompt": {"a": 1}, "completion": null}',
    "[1, 2, 3]",
    "[" * 50_000,
    '{"kind": "train", "step": 9, "loss": 1.0}',
]


def test_report_skips_crafted_rows_and_draws_names_with_dollars(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    folder = _rows_folder(tmp_path / "run $x^2$ and $", CRAFTED)
    page = tmp_path / "r.html"
    assert main(["report", str(folder), "--out", str(page)]) == 0
    err = capsys.readouterr().err
    assert "skipped 7 rows that are not what lmtune writes" in err and err.count("\n") == 1
    assert "run $x^2$ and $" in page.read_text()
    # read back for dashboards on resume: rows that are not objects are left out, not a traceback
    assert [r["step"] for r in read_metrics(folder)][-1] == 9


def test_report_never_blocks_on_a_fifo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _rows_folder(tmp_path / "run", [])
    os.mkfifo(folder / "run.json")
    with deadline(120):
        assert main(["report", str(folder), "--out", str(tmp_path / "r.html")]) == 0
        assert "run.json: not a regular file" in capsys.readouterr().err
        (folder / "metrics.jsonl").unlink()
        os.mkfifo(folder / "metrics.jsonl")
        assert main(["report", str(folder), "--out", str(tmp_path / "r.html")]) == 2


def _crafted_copy(run_checkpoint: Path, folder: Path, change: Any) -> Path:
    """A copy of a checkpoint with one file edited and its manifest recomputed to match, as
    someone crafting it would: verify passes, and the files themselves are what is checked."""
    import shutil

    shutil.copytree(run_checkpoint, folder)
    change(folder)
    (folder / "manifest.json").unlink()
    write_manifest(folder)
    return folder


def _edit_json(name: str, **fields: Any) -> Any:
    def edit(folder: Path) -> None:
        path = folder / name
        path.write_text(json.dumps(json.loads(path.read_text()) | fields))

    return edit


def _truncate(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])


def _renamed_tensor(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    tensors["extra.weight"] = tensors.pop(next(iter(tensors)))
    save_file(tensors, folder / "model.safetensors")


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (_truncate, "model.safetensors does not load (Error while deserializing header"),
        (
            _renamed_tensor,
            "model.safetensors does not load (Error(s) in loading state_dict for LlamaForCausalLM",
        ),
        (
            _edit_json("config.json", num_hidden_layers=-1),
            "config.json: num_hidden_layers must be a whole number",
        ),
        (
            _edit_json("config.json", model_type="nonexistent"),
            "its config.json does not load (The checkpoint",
        ),
        (_edit_json("config.json", hidden_size=10**12), "config.json: hidden_size must be a whole number in"),
        (
            _edit_json("generation_config.json", eos_token_id=1e20),
            "generation_config.json: eos_token_id must be a token id",
        ),
    ],
    ids=["truncated", "renamed-tensor", "layers", "model-type", "hidden-size", "eos"],
)
def test_export_of_a_crafted_checkpoint_names_the_file(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Any, said: str
) -> None:
    """Tracebacks from transformers and safetensors (rc 1) before; an allocation of a hidden_size of
    1e12 was tried."""
    crafted = _crafted_copy(run / "checkpoints" / "step-000002", tmp_path / "crafted", change)
    assert main(["export", str(crafted), str(tmp_path / "exported")]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and err.count("\n") == 1, err
    assert not (tmp_path / "exported").exists()


def test_export_of_a_crafted_lora_checkpoint_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --merge-lora the adapter's files were copied unread: an unusable export, rc 0."""
    data = write_jsonl(tmp_path / "d.jsonl", [f"text {i}" for i in range(16)])
    out = tmp_path / "lora"
    argv = ["train", "--data", str(data), "--output-dir", str(out), "--max-steps", "2", "--save-every", "2"]
    assert main([*argv, "--global-batch-size", "8", "--lora", "--no-progress"]) == 0
    checkpoint = out / "checkpoints" / "step-000002"

    def truncated(folder: Path) -> None:
        (folder / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00")

    cases = {
        "adapter_model.safetensors does not load (Error while deserializing header": truncated,
        "lora_alpha a finite number (got peft_type 'LORA', r -3,": _edit_json("adapter_config.json", r=-3),
        "got peft_type 'IA3'": _edit_json("adapter_config.json", peft_type="IA3"),  # exported, rc 0
        "lora_alpha -inf)": _edit_json("adapter_config.json", lora_alpha=float("-inf")),  # non-finite weights
        "adapter_config.json: r 8, but adapter_model.safetensors holds rank 16": _edit_json(
            "adapter_config.json", r=8
        ),
        "target_modules ['x'] does not name": _edit_json("adapter_config.json", target_modules=["x"]),
    }
    for i, (said, change) in enumerate(cases.items()):
        crafted = _crafted_copy(checkpoint, tmp_path / f"crafted-{i}", change)
        for merge in ([], ["--merge-lora"]):
            assert main(["export", str(crafted), str(tmp_path / "exported"), *merge]) == 2
            err = capsys.readouterr().err
            assert said in err and "Traceback" not in err, err
            assert not (tmp_path / "exported").exists()


def test_a_crafted_checkpoint_on_resume_names_its_file_and_the_one_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its manifest recomputed: the resume said "its state does not fit this run's model", named no
    file, and did not offer the checkpoint before it, as a damaged one's message does."""
    import pickle
    import shutil

    data = write_jsonl(tmp_path / "d.jsonl", [f"text {i}" for i in range(16)])
    base = tmp_path / "base"
    argv = ["train", "--data", str(data), "--save-every", "2", "--keep-last", "0", "--global-batch-size", "8"]
    assert main([*argv, "--output-dir", str(base), "--max-steps", "4", "--no-progress"]) == 0

    def cut(name: str) -> Any:
        return lambda folder: (folder / name).write_bytes((folder / name).read_bytes()[:5000])

    cases: dict[str, Any] = {
        "trainer.json: records --global-batch-size 16, this run's 8; training examples 99, this run's 16":
        # Within the ranges a run writes: only the fingerprint beside it says it is not this run's.
        _edit_json("trainer.json", global_batch_size=16, examples=99),
        "its model.safetensors does not load (Error while deserializing header": cut("model.safetensors"),
        "its optimizer.pt does not load (": cut("optimizer.pt"),
        "optimizer.pt: refused, not plain tensors and values (Unsupported": lambda folder: (
            folder / "optimizer.pt"
        ).write_bytes(pickle.dumps(os.system)),
    }
    for i, (said, change) in enumerate(cases.items()):
        out = tmp_path / f"run-{i}"
        shutil.copytree(base / "checkpoints", out / "checkpoints")
        _crafted_copy(base / "checkpoints" / "step-000004", tmp_path / f"crafted-{i}", change)
        shutil.rmtree(out / "checkpoints" / "step-000004")
        shutil.move(tmp_path / f"crafted-{i}", out / "checkpoints" / "step-000004")
        assert main([*argv, "--output-dir", str(out), "--max-steps", "6", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err and "Warning" not in err, err
        if "does not load" in said:
            assert f"--resume {out / 'checkpoints' / 'step-000002'} continues from the one before it" in err
