"""A checkpoint folder's layout: its file names, where step N lives, the manifest, and verify(),
which treats every folder read back as hostile (a manifest must list every file, inside the folder,
no links, sizes and SHA-256 matching); and what a folder is: a run's, or inside one."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from lmtune.checkpoint.owned import listed as names_listed
from lmtune.config.files import read_json
from lmtune.errors import UserError
from lmtune.model.lora import ADAPTER_CONFIG, ADAPTER_FILE

CHECKPOINTS = "checkpoints"
LOCK_FILE = ".lmtune.lock"  # the run holding an output folder (lmtune.checkpoint.rundir)
MANIFEST = "manifest.json"
SCALER_FILE = "scaler.json"  # the fp16 gradient scaler's state: plain numbers
FINGERPRINT_FILE = "fingerprint.json"
# The settings each resume changed, oldest first, up to the checkpoint's step (see resume.py).
CHANGES_FILE = "resume_changes.json"
GENERATION_CONFIG = "generation_config.json"
_STEP_NAME = re.compile(r"step-(\d+)")
# Written first into every temporary folder lmtune makes (a checkpoint's, final.tmp), removed before
# it is renamed into place: a leftover is removed only with it (or with lmtune's manifest or trainer
# state), never a user's folder that happens to bear the name.
TEMPORARY_MARK = ".lmtune-temporary"
SHARDED_DIR = "sharded"  # torch.distributed.checkpoint folder: one file per rank + .metadata
SHARDED_METADATA = f"{SHARDED_DIR}/.metadata"
MODEL_FILE, OPTIMIZER_FILE, STATE_FILE = "model.safetensors", "optimizer.pt", "trainer.json"
JOB_KEY = "job"  # trainer.json's run id of the launch that saved it (torchrun's TORCHELASTIC_RUN_ID)
SAVED_AT_KEY = "saved_at"  # trainer.json's wall-clock time of the save (time.time())
MANIFEST_BYTES = 16 << 20


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_write(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def step_folder(output_dir: Path, step: int) -> Path:
    return output_dir / CHECKPOINTS / f"step-{step:06d}"


def checkpoint_of(folder: Path, output_dir: Path) -> bool:
    """Whether the checkpoint ``folder`` is one of ``output_dir``'s (OUTPUT/checkpoints/step-N)."""
    return folder.resolve().parent.parent == output_dir.resolve()


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Checkpoint folders by step number, oldest first (hidden temporary folders, and folders kept
    aside, are not checkpoints)."""
    root = output_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_NAME.fullmatch(p.name)) and p.is_dir()
    ]
    return [p for _, p in sorted(found, key=lambda item: item[0])]


NOT_LISTED = "is not in the manifest"  # verify's reason for a file put into a checkpoint since


def verify(folder: Path, hashes: bool = True) -> str | None:
    """Why ``folder`` is not a complete checkpoint, or None when its manifest checks out.

    The manifest must list every file of the folder, by plain relative names inside it; no entry
    may be a link. ``hashes`` False checks the files' sizes only (a quick look, as for a report).
    """
    if folder.is_symlink() or not folder.is_dir():
        return "not a folder"
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file() or manifest_path.is_symlink():
        return "no manifest (the save did not finish)"
    try:
        manifest = read_json(manifest_path, limit=MANIFEST_BYTES)
    except UserError as e:
        return f"{MANIFEST} is unreadable ({str(e).removeprefix(f'{manifest_path}: ')})"
    if not isinstance(manifest, dict) or not all(isinstance(e, dict) for e in manifest.values()):
        return f"{MANIFEST} is not a manifest"
    if STATE_FILE not in manifest:
        return f"manifest lists no {STATE_FILE}"
    layouts = ((MODEL_FILE, OPTIMIZER_FILE), (ADAPTER_FILE, OPTIMIZER_FILE), (SHARDED_METADATA,))
    if not any(all(name in manifest for name in layout) for layout in layouts):
        return "manifest lists no model and optimizer state"
    for path in folder.rglob("*"):
        name = path.relative_to(folder).as_posix()
        if path.is_symlink():
            return f"{name} is a symbolic link"
        if path.is_file() and name != MANIFEST and name not in manifest:
            return f"{name} {NOT_LISTED}"
    root = folder.resolve()
    for name, entry in manifest.items():
        path = folder / name
        if name.startswith("/") or "\\" in name or ".." in Path(name).parts or not name:
            return f"manifest entry {name!r} is not a plain path inside the checkpoint"
        if not path.is_file():
            return f"{name} is missing"
        if root not in path.resolve().parents:
            return f"manifest entry {name!r} is not inside the checkpoint"
        size = path.stat().st_size
        if type(entry.get("bytes")) is not int or size != entry["bytes"]:
            return f"{name} has {size} bytes, the manifest says {entry.get('bytes')}"
        if hashes and sha256(path) != entry.get("sha256"):
            return f"{name} does not match its checksum"
    return None


def _umask() -> int:
    try:  # Linux: read, not set (setting it to read it back races with other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def open_to_umask(folder: Path) -> None:
    """Give the files of a saved folder the permissions of the user's umask. safetensors writes
    its files 0600 (through a private temporary file), so weights that every other file beside
    them lets a serving account read would be readable by their owner only."""
    mode = 0o666 & ~_umask()
    for path in folder.rglob("*"):
        private = path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 == 0o600
        if private and mode != 0o600:
            path.chmod(mode)


def write_manifest(folder: Path) -> None:
    """Every file's size and SHA-256, written last: a folder without it is an unfinished save."""
    open_to_umask(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    manifest = {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in files
    }
    fsync_write(folder / MANIFEST, json.dumps(manifest, indent=2))


def lmtune_wrote(folder: Path) -> bool:
    """Whether lmtune saved ``folder`` as a checkpoint, complete or damaged since (it writes the
    manifest and the trainer state into every one), or began to (its temporary mark). A user's
    folder named step-N (or .step-N.tmp) is neither: never pruned, deleted by --overwrite or called
    damaged; nor is a link to a checkpoint (another run's: deleting "its" files deleted the target's)."""
    return not folder.is_symlink() and any(
        (folder / name).is_file() for name in (MANIFEST, STATE_FILE, TEMPORARY_MARK)
    )


def saved_checkpoints(output_dir: Path) -> list[Path]:
    """The checkpoint folders lmtune wrote in ``output_dir`` (:func:`lmtune_wrote`), oldest first."""
    return [p for p in list_checkpoints(output_dir) if lmtune_wrote(p)]


def lmtunes_folder(path: Path) -> bool:
    """A folder (not a link to one) that lmtune wrote or began to: a checkpoint, or a temporary one."""
    return path.is_dir() and not path.is_symlink() and lmtune_wrote(path)


def resume_instead(older: list[Path], otherwise: str) -> str:
    """What to do about a checkpoint that cannot be continued: the one before it (the last of
    ``older``), if any, else ``otherwise``."""
    return f"--resume {older[-1]} continues from the one before it" if older else otherwise


def begin_temporary(folder: Path) -> None:
    """Make ``folder``, lmtune's temporary one, marked as such; one an earlier attempt left is
    replaced, a user's of that name is refused.

    Raises:
        UserError: when something lmtune did not make is in the way.
    """
    problem = in_the_way(folder)
    if problem:
        raise UserError(problem)
    if folder.exists():  # an earlier attempt's
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / TEMPORARY_MARK).touch()


def in_the_way(folder: Path) -> str:
    """Why lmtune may not make its temporary ``folder`` ("" when it may: nothing there, or a
    leftover of its own)."""
    if lmtunes_folder(folder):
        return ""
    if folder.exists() or folder.is_symlink():
        return (
            f"{folder}: lmtune writes its temporary folder there, and this is not one it made; move it "
            "elsewhere (lmtune keeps what it did not write)"
        )
    return ""


def temporary_of(folder: Path) -> Path:
    """Where ``folder`` (final/, final/merged/) is written before it is renamed into place."""
    return folder.with_name(folder.name + ".tmp")


def end_temporary(folder: Path) -> None:
    """``folder`` is complete: its mark goes before it is renamed into place."""
    (folder / TEMPORARY_MARK).unlink(missing_ok=True)


def remove_checkpoint(folder: Path) -> list[Path]:
    """Delete a checkpoint lmtune wrote (:func:`lmtune_wrote`): the files its manifest lists and the
    manifest; what else is in it was put there since (a user's notes) and is kept, and returned.
    One without a manifest (being written, or damaged) is lmtune's alone, and goes whole; a folder
    lmtune did not write is kept whole."""
    if not lmtune_wrote(folder):
        return [folder]
    try:
        listed = read_json(folder / MANIFEST, limit=MANIFEST_BYTES)
    except (OSError, UserError):
        listed = None
    if not isinstance(listed, dict):
        shutil.rmtree(folder, ignore_errors=True)
        return []
    for name in [*listed, MANIFEST]:
        path = folder / name
        if path.is_file() or path.is_symlink():
            path.unlink()
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir() and not p.is_symlink()), reverse=True):
        if not any(sub.iterdir()):
            sub.rmdir()
    kept = sorted(folder.rglob("*"))
    if not kept:
        folder.rmdir()
    return kept


def refuse_users_steps(output_dir: Path, option: str) -> None:
    """A user's own ``checkpoints/step-N`` folder (not :func:`lmtune_wrote`) is in the way of a run
    that starts over there: its checkpoints would meet it, and a rerun would take it for one.

    Raises:
        UserError: naming the first, before anything is deleted.
    """
    theirs = [p for p in list_checkpoints(output_dir) if not lmtune_wrote(p)]
    if links := [p for p in theirs if p.is_symlink()]:
        raise UserError(f"{option}: {link_in_the_way(links[0])}")
    if theirs:
        more = f" (and {len(theirs) - 1} more)" if len(theirs) > 1 else ""
        raise UserError(
            f"{option}: {theirs[0]}{more} holds no checkpoint of lmtune's (no {MANIFEST} or {STATE_FILE}: "
            "a folder of yours, or your files left where lmtune pruned its own), and this run saves its "
            f"checkpoints beside it: move it out of {theirs[0].parent} first"
        )
    # Files of the user's inside one of lmtune's checkpoints would outlive it (only what its manifest
    # lists is deleted) as a step-N folder of theirs, which the new run would then refuse.
    for folder in list_checkpoints(output_dir):
        if added := _not_listed(folder):
            raise UserError(
                f"{option}: {folder} holds {names_listed(added, 3)}, which lmtune did not write; it deletes "
                f"that checkpoint and keeps what is yours: move it out of {folder} first"
            )


def link_in_the_way(link: Path) -> str:
    """What to do about a link named like a checkpoint among a run's checkpoints."""
    return (
        f"{link} is a link (to {os.readlink(link)}), not a checkpoint this run saved: lmtune never prunes, "
        "replaces or resumes a checkpoint through a link; remove the link (its target stays), and give "
        "--resume TARGET to continue a checkpoint of another folder here"
    )


def _not_listed(folder: Path) -> list[str]:
    """The files in lmtune's checkpoint ``folder`` that its manifest does not list (put there
    since); none for a checkpoint without a readable manifest (it is lmtune's alone)."""
    try:
        manifest = read_json(folder / MANIFEST, limit=MANIFEST_BYTES)
    except (OSError, UserError):
        return []
    if not isinstance(manifest, dict):
        return []
    found = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() or p.is_symlink())
    return sorted(name for name in found if name not in manifest and name != MANIFEST)


def holds_a_run(folder: Path) -> bool:
    """Whether ``folder`` holds what an lmtune run writes (its records, lock or checkpoints)."""
    records = any((folder / name).is_file() for name in ("run.json", "metrics.jsonl", LOCK_FILE))
    return records or bool(list_checkpoints(folder))


def not_a_checkpoint(folder: Path) -> str:
    """What ``folder``, given where a checkpoint is wanted, is instead, with the checkpoint meant
    ("" when it is a checkpoint, damaged or not): a model folder (a run's final/, an export), a run's
    folder or its checkpoints/ folder, or any other folder."""
    folder = folder.resolve() if folder.is_symlink() else folder  # a link is judged by what it names
    if lmtune_wrote(folder):  # a checkpoint, damaged or not: it is said to be damaged, not taken for another
        return ""
    has = {p.name for p in folder.iterdir() if p.is_file()}
    weights = any(name.endswith((".safetensors", ".bin")) for name in has)
    if ("config.json" in has and weights) or {ADAPTER_FILE, ADAPTER_CONFIG} <= has:
        return "a model folder (a run's final/ or an export), not a training checkpoint"
    if lmtune_wrote(folder.parent):  # a part of one (FSDP's sharded/, as torch's DCP tools take it)
        return f"a part of the checkpoint {folder.parent}, not a checkpoint: give {folder.parent}"
    if holds_a_run(folder):
        run = folder
    elif folder.name == "checkpoints" and holds_a_run(folder.parent):
        run = folder.parent
    else:
        return f"not a checkpoint (no {MANIFEST} or {STATE_FILE}, which lmtune writes into every one)"
    newest = list_checkpoints(run)[-1:]
    which = f"{newest[0]} is its newest" if newest else "it has none: train with --save-every"
    what = "a run's folder" if run == folder else "the folder of a run's checkpoints"
    return f"{what}, not a checkpoint ({which})"


def enclosing_run(path: Path) -> Path | None:
    """The nearest of ``path`` (resolved) and the folders above it that holds a run, or None."""
    for folder in (path, *path.parents):
        if folder.is_dir() and holds_a_run(folder):
            return folder
    return None
