"""Which checkpoint a run continues, and whether it may (its fingerprint: lmtune.checkpoint.fingerprint),
loading it, and the record of what each resume changed."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from lmtune.checkpoint.fingerprint import Fingerprint, compare, read_fingerprint
from lmtune.checkpoint.finished import began_from
from lmtune.checkpoint.layout import (
    CHECKPOINTS,
    JOB_KEY,
    MANIFEST,
    NOT_LISTED,
    SAVED_AT_KEY,
    SHARDED_METADATA,
    STATE_FILE,
    link_in_the_way,
    list_checkpoints,
    lmtune_wrote,
    resume_instead,
    saved_checkpoints,
    verify,
)
from lmtune.checkpoint.state import ModelParts, TrainerState
from lmtune.checkpoint.store import check_layout, load_checkpoint, read_state, resume_note
from lmtune.config.files import read_json_object
from lmtune.config.run_groups import CheckpointSettings, names_checkpoint
from lmtune.errors import NoSpace, UserError, one_line
from lmtune.model.paths import PATHS_FILE
from lmtune.outputs.runlog import InfoLog
from lmtune.parallel.distributed import DistEnv, decided_by_main
from lmtune.parallel.launch import warn
from lmtune.parallel.launched import launch_started, run_id


def resume_point(resume: str, output_dir: Path, env: DistEnv) -> Path | None:
    """The checkpoint to continue from, decided by rank 0 (which checks the manifests) for all.

    A newest checkpoint that does not check out stops the run rather than falling back in silence:
    the user decides which earlier one to continue (``--resume PATH``).
    """
    chosen = decided_by_main(lambda: _chosen_checkpoint(resume, output_dir), "", env)
    return Path(chosen) if chosen else None


def _chosen_checkpoint(resume: str, output_dir: Path) -> str:
    found = list_checkpoints(output_dir)
    if resume == "never":
        if links := [p for p in found if p.is_symlink()]:  # --overwrite would refuse it too
            raise UserError(f"--resume never: {link_in_the_way(links[0])}")
        if found:
            raise UserError(
                f"--resume never, but {output_dir / CHECKPOINTS} holds checkpoints of an earlier "
                "run; remove them, choose another --output-dir, or --overwrite"
            )
        return ""
    if resume == "auto":
        if not found:
            return ""
        # A damaged one points at the one saved before it, never at a link among them.
        _check_valid(
            found[-1], "the newest checkpoint in --output-dir", [p for p in found[:-1] if lmtune_wrote(p)]
        )
        return str(found[-1])
    given = Path(resume)
    if given.is_symlink():  # a link given by name (a user's "latest") is read where it points
        given = given.resolve()
    saved = saved_checkpoints(given.parent.parent) if given.parent.name == CHECKPOINTS else []
    _check_valid(given, "--resume", saved[: saved.index(given)] if given in saved else [])
    return str(given)


def rerun_outcome(output_dir: Path, resume: Any, overwrite: bool = False) -> str:
    """What the same command does in a stopped run's folder, by :func:`resume_point`'s rules (for
    ``lmtune report``): continue the checkpoint its --resume names, else the folder's newest one,
    refused when that one is damaged (checked by the sizes its manifest lists: hashing every file
    is too slow for a report). With --overwrite it starts over, and the rest is what it does
    without."""
    without = _rerun_without_overwrite(output_dir, resume)
    if without.endswith("starts over"):
        return without
    rest = without.removeprefix("the same command ")
    said = f"it {rest}" if rest != without else without
    if overwrite:
        return f"the same command starts over (--overwrite); without --overwrite, {said}"
    if resume == "never":
        return f"the same command refuses its checkpoints (--resume never); without --resume never, {said}"
    return without


def _rerun_without_overwrite(output_dir: Path, resume: Any) -> str:
    saved = list_checkpoints(output_dir)
    # The command the run began with goes on from the run's own newest checkpoint (the manager's
    # _same_command); another --resume continues that checkpoint again.
    if names_checkpoint(resume) and not (saved and began_from(output_dir, resume)):
        return f"the same command resumes from --resume {resume} again"
    if not saved:
        return "no checkpoint was saved: the same command starts over"
    if verify(saved[-1], hashes=False) is None:
        return f"the same command resumes from {saved[-1].name}"
    if saved[-1].is_symlink():
        return f"its newest checkpoint, {saved[-1].name}, is a link, which the same command refuses"
    older = [p for p in saved[:-1] if verify(p, hashes=False) is None]
    instead = resume_instead(older, "remove it to start over")
    return f"its newest checkpoint, {saved[-1].name}, is damaged: {instead}"


def _check_valid(folder: Path, what: str, older: list[Path]) -> None:
    if folder.is_symlink() and folder.parent.name == CHECKPOINTS:
        raise UserError(f"{what}: {link_in_the_way(folder)}")
    reason = verify(folder)
    if reason is None:
        return
    if folder.is_dir() and not lmtune_wrote(folder):  # a user's: neither damaged nor lmtune's to remove
        raise UserError(
            f"{what}, {folder}, is not one lmtune saved (no {MANIFEST} or {STATE_FILE}): move it out of "
            f"{folder.parent}; {resume_instead(older, 'or start afresh with another --output-dir')}"
        )
    if reason.endswith(NOT_LISTED):  # a file of the user's put into it: the checkpoint is whole
        added = reason.removesuffix(NOT_LISTED).strip()
        raise UserError(
            f"{what}, {folder}, holds {added}, which lmtune did not write (it is not in the checkpoint's "
            f"{MANIFEST}), and resumes only from what it saved: move {added} out of the checkpoint"
        )
    instead = resume_instead(older, "remove it")
    raise UserError(
        f"{what}, {folder}, is damaged: {reason}. It is left as it is; {instead}, or start afresh with "
        "another --output-dir"
    )


def check_continuable(folder: Path, now: Fingerprint, parts: ModelParts) -> list[str]:
    """The adjustable settings that changed since ``folder`` was saved, as ``name old -> new``.

    Raises:
        UserError: when this run's model cannot load it (LoRA or not, sharded or not) or a setting
            that defines the run differs.
    """
    check_layout(folder, parts)  # LoRA vs full and sharding first: the clearest words for them
    saved = read_fingerprint(folder)
    if saved is None:  # written before fingerprints: what its trainer state records must match
        saved_state = read_state(folder)
        keys = ("--global-batch-size", "--seed", "training examples")
        recorded = (saved_state.global_batch_size, saved_state.seed, saved_state.examples)
        saved = Fingerprint(dict(zip(keys, recorded, strict=True)), now.adjustable)
        now = Fingerprint({k: now.fixed[k] for k in keys}, now.adjustable)
    return compare(saved, now, folder, read_state(folder).step)


def continue_from(
    folder: Path,
    *,
    now: Fingerprint,
    parts: ModelParts,
    optimizer: torch.optim.Optimizer,
    env: DistEnv,
    scaler: torch.amp.GradScaler | None,
    log: InfoLog,
) -> tuple[TrainerState, list[str]]:
    """Load ``folder`` when this run may continue it; the settings that changed are applied and
    listed (and returned, as ``name old -> new``), the ones that define the run must be the same."""
    if read_fingerprint(folder) is None:
        log.info(f"{folder} predates run fingerprints: only the batch, seed and example count are checked")
    changes = check_continuable(folder, now, parts)
    was_sharded = SHARDED_METADATA in check_layout(folder, parts)
    saved = load_checkpoint(folder, parts, optimizer, env, scaler)
    _check_state_agrees(folder, saved, now)
    state = replace(saved, world_size=env.world_size)
    # Not the training's numbers (N processes train as one), but what run.json and reports describe
    # is the last attempt's layout: the change says which steps ran on another.
    if saved.world_size != env.world_size:
        changes.append(f"{LAYOUT_CHANGES[0]} {saved.world_size} -> {env.world_size}")
    if was_sharded != parts.sharded:
        changes.append(f"{LAYOUT_CHANGES[1]} {_sharding(was_sharded)} -> {_sharding(parts.sharded)}")
    log.info(
        f"resuming from {folder}: step {state.step}, epoch {state.epoch + 1}, sample "
        f"{state.samples_in_epoch} of its order (saved by {saved.world_size} rank"
        f"{'' if saved.world_size == 1 else 's'}, now {env.world_size})"
    )
    if changes:
        total = now.adjustable.get("total steps")
        # A run asked to end at or before its checkpoint has no step left to apply anything from.
        ends = isinstance(total, int) and total <= state.step
        when = (
            f"at step {state.step}, where the run ends (no step left)"
            if ends
            else f"from step {state.step + 1}"
        )
        log.info(f"changed since the checkpoint, applied {when}: " + "; ".join(changes))
    return state, changes


def _check_state_agrees(folder: Path, saved: TrainerState, now: Fingerprint) -> None:
    """The trainer state records the run the fingerprint (checked already) describes: an edited
    trainer.json with another batch or example count would put the sample order elsewhere."""
    recorded = {
        "--global-batch-size": saved.global_batch_size,
        "--seed": saved.seed,
        "training examples": saved.examples,
    }
    differ = [f"{k} {v}, this run's {now.fixed[k]}" for k, v in recorded.items() if now.fixed.get(k, v) != v]
    if differ:
        raise UserError(
            f"{folder / STATE_FILE}: records {'; '.join(differ)}, unlike the checkpoint's fingerprint: "
            "not as lmtune saved it"
        )


LAYOUT_CHANGES = ("processes", "sharding")  # the names of a resume's changes of layout


def _sharding(sharded: bool) -> str:
    return "fsdp" if sharded else "none"


def earlier_layouts(changed: Any) -> str:
    """The resumes that changed the processes or the sharding, from a run.json's
    ``changed_on_resume`` (read as hostile data), as a note to the last attempt's layout; "" if none."""
    moves = []
    for entry in read_changes({"resumes": changed}):
        layout = [c for c in entry["changes"] if c.startswith(LAYOUT_CHANGES)]
        if layout:
            moves.append(f"after step {entry['step']}: {', '.join(layout)}")
    return f" (the last attempt's; changed on resume: {'; '.join(moves)})" if moves else ""


def resume_changes(changed: Any) -> str:
    """Every resume's changes, from a run.json's ``changed_on_resume`` (read as hostile data), as
    ``after step 4: --lr 0.001 -> 0.0005, ...``; "" if none."""
    entries = read_changes({"resumes": changed})
    return "; ".join(f"after step {e['step']}: {', '.join(e['changes'])}" for e in entries)


def read_changes(record: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The resumes' changes a checkpoint carries (``{"resumes": [{"step", "changes"}, ...]}``); what
    is not of that shape is left out (a record read as hostile data)."""
    entries = record.get("resumes") if record is not None else None
    if not isinstance(entries, list):
        return []
    return [
        {"step": e["step"], "changes": [one_line(c, 200) for c in e["changes"]]}
        for e in entries
        if isinstance(e, dict)
        and type(e.get("step")) is int
        and isinstance(e.get("changes"), list)
        and all(isinstance(c, str) for c in e["changes"])
    ]


def read_continued(record: dict[str, Any] | None) -> list[Path]:
    """The checkpoints folders of other runs a checkpoint's run continued (``{"continued": [...]}``),
    absolute paths; a checkpoint is looked for there only where its manifest is (and verified
    when loaded). What is not of that shape is left out (a record read as hostile data)."""
    folders = record.get("continued") if record is not None else None
    if not isinstance(folders, list):
        return []
    named = [f for f in folders[:100] if isinstance(f, str) and 0 < len(f) < 4096]
    return [Path(f) for f in named if Path(f).is_absolute()]


def recorded_paths(settings: CheckpointSettings, env: DistEnv) -> dict[str, Any] | None:
    """The CPU bf16 paths (``paths.json``, see lmtune.model.paths) that the run of the checkpoint
    this run would continue took, which the model is built with again instead of deciding anew, so
    that a resume stays bit-identical; None for a fresh run (``--overwrite`` of this folder's run
    included) or a checkpoint saved before paths were recorded. Read before the model exists, so
    before :func:`resume_point` checks the checkpoint (a damaged one stops the run there); read by
    rank 0 for all."""
    resume, output_dir = settings.resume, Path(settings.output_dir)
    if resume == "auto" and settings.overwrite:  # its checkpoints are deleted once the run is built
        resume = "never"

    def recorded() -> dict[str, Any] | None:
        found = (
            [] if resume == "never" else list_checkpoints(output_dir) if resume == "auto" else [Path(resume)]
        )
        if found and (found[-1] / PATHS_FILE).is_file():
            return read_json_object(found[-1] / PATHS_FILE)
        return None

    return decided_by_main(recorded, None, env)


@contextmanager
def resumable_when_full(output_dir: Path) -> Iterator[None]:
    """A disk that fills while the run writes its records into ``output_dir``: the message also says
    what the same command resumes from."""
    try:
        yield
    except NoSpace as e:
        if not e.path.is_relative_to(output_dir):
            raise
        raise NoSpace(f"{e}; {resume_note(output_dir)}", e.path) from None


def restart_settings(settings: CheckpointSettings, env: DistEnv) -> CheckpointSettings:
    """The checkpoint settings a worker decides by: ``settings`` as given, but in a launch that has
    saved a checkpoint here already (a worker ``--max-restarts`` started again), ``--overwrite`` off
    and ``--resume`` auto: it goes on from that checkpoint (a restart applied --overwrite again and
    deleted the job's own checkpoints). A ``--resume PATH`` stays: the run's record says it began
    there, so it continues from its own newest checkpoint (CheckpointManager._same_command).

    Decided from what every rank sees alike (the newest checkpoint's record, the launch's run id
    and start), not from torchrun's restart count, which each node's agent counts for itself."""
    job = run_id()
    if not job or not _saved_by_launch(Path(settings.output_dir), job):
        return settings  # a first start; or a restart before its first checkpoint, as the first start
    resume = settings.resume if names_checkpoint(settings.resume) else "auto"
    changed = replace(settings, overwrite=False, resume=resume)
    if changed != settings and env.is_main:
        warn("a restart goes on from the newest checkpoint (--overwrite and --resume: the first start's)")
    return changed


def _saved_by_launch(output_dir: Path, job: str) -> bool:
    """Whether the newest checkpoint in ``output_dir`` was saved by this launch: its run id, and saved
    after the launch began (run ids repeat: torchrun's `none`, lmtune's default --rdzv-id, a
    tutorial's fixed id; a checkpoint of an earlier job of that id predates this launch)."""
    found = list_checkpoints(output_dir)
    started = launch_started()
    if not found or started is None:
        return False
    try:
        record = read_json_object(found[-1] / STATE_FILE)
    except (UserError, OSError):
        return False
    saved = record.get(SAVED_AT_KEY)
    # Not from the future either: a checkpoint copied from a machine whose clock is ahead.
    fresh = isinstance(saved, (int, float)) and not isinstance(saved, bool) and started < saved <= time.time()
    return record.get(JOB_KEY) == job and fresh
