"""CheckpointManager: the one owner of a run's checkpoints.

It decides where a run starts (a fresh state, the checkpoint it continues, loaded and checked
against the run's fingerprint, or nothing to do: the folder holds this run, finished), when it
saves (every ``--save-every`` steps, when a component asks, and at the end of a run that saves
periodically; at most once per step), what a checkpoint carries
besides the model (the fingerprint, the fp16 scaler, and the records of the run's components, such
as the best-model tracker), which checkpoints pruning keeps (the newest ``--keep-last`` and the
protected one, the best), loading a saved step back (the best model at the end), and the final
save (``final/``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import torch

from lmtune.checkpoint.attempts import earlier_attempts
from lmtune.checkpoint.export import save_final
from lmtune.checkpoint.fingerprint import Fingerprint
from lmtune.checkpoint.finished import Finished, began_from, finished_record, read_finished
from lmtune.checkpoint.layout import (
    CHANGES_FILE,
    FINGERPRINT_FILE,
    MANIFEST,
    SCALER_FILE,
    checkpoint_of,
    saved_checkpoints,
    step_folder,
)
from lmtune.checkpoint.resume import (
    check_continuable,
    continue_from,
    read_changes,
    read_continued,
    resume_point,
)
from lmtune.checkpoint.state import ModelParts, TrainerState
from lmtune.checkpoint.store import Saves, check_room, load_checkpoint, prune, read_state, save_checkpoint
from lmtune.config.files import read_json_object
from lmtune.config.groups import OptimSettings
from lmtune.config.run_groups import CheckpointSettings, names_checkpoint
from lmtune.errors import UserError
from lmtune.outputs.runlog import InfoLog
from lmtune.parallel.distributed import DistEnv, broadcast_object, decided_by_main


class CheckpointRecord(Protocol):
    """Part of the run's state that its checkpoints carry beside the model, as a small JSON file,
    and that a resumed run restores (the best-model tracker, ...)."""

    @property
    def file_name(self) -> str: ...

    def to_json(self) -> dict[str, Any]: ...

    def restore(self, record: dict[str, Any], step: int) -> None:
        """Take ``record``, saved with the checkpoint of ``step``.

        Raises:
            UserError: starting with :attr:`file_name`, when it is not what lmtune saved.
        """


@dataclass(frozen=True)
class Trainable:
    """What a checkpoint saves and loads: the model's parts, its optimizer and fp16 scaler, and the
    tokenizer (so that a checkpoint is a self-contained model folder)."""

    parts: ModelParts
    optimizer: torch.optim.Optimizer
    tokenizer: Any
    scaler: torch.amp.GradScaler | None = None


@dataclass(kw_only=True)
class CheckpointManager:
    output_dir: Path
    settings: CheckpointSettings  # save_every, keep_last, resume
    env: DistEnv
    trainable: Trainable
    fingerprint: Fingerprint  # what a checkpoint of this run must match to be continued
    log: InfoLog
    records: list[CheckpointRecord] = field(default_factory=list)
    protected_step: Callable[[], int | None] = lambda: None  # pruning keeps this step's checkpoint
    patient: Callable[[], AbstractContextManager[object]] = nullcontext  # long collective timeouts
    beat: Callable[[str], None] = lambda phase: None  # the heartbeat's phase while saving
    resumed_from: Path | None = None  # the checkpoint this run continues (after resume())
    # The settings changed by each resume of the run so far, oldest first: {"step", "changes"}.
    changed: list[dict[str, Any]] = field(default_factory=list)
    # How each earlier attempt of this folder's run ended, oldest first (rank 0's).
    attempts: list[dict[str, Any]] = field(default_factory=list)
    # The checkpoints folders of other runs this one continued (--resume of their checkpoint),
    # oldest first: kept across resumes, so that a best checkpoint there is found at the end.
    continued: list[Path] = field(default_factory=list)
    _saved_step: int = -1
    _start_step: int = 0

    @cached_property
    def _earlier(self) -> Finished | None:
        """This very run (the same fingerprint), finished earlier: run.json read once, by rank 0
        for all ranks (a collective: every rank asks at the same point)."""
        earlier = read_finished(self.output_dir, self.fingerprint.fixed, self.env)
        # Another run: its checkpoints' fingerprints refuse it, naming why.
        return earlier if earlier is not None and earlier.same_run else None

    def finished_already(self, total_steps: int) -> Finished | None:
        """The record of this very run, finished, where no more than its steps are asked for:
        nothing to do, whatever checkpoints the folder holds. Known before anything costly is
        prepared (reference log-probs)."""
        earlier = self._earlier
        if earlier is None or total_steps > earlier.total_steps:
            return None
        if self._another_resume:
            self._refuse_elsewhere(earlier)
            raise UserError(
                f"--resume {self.settings.resume}: {self.output_dir} holds this run, finished at step "
                f"{earlier.step} (its model in final/), and no more steps are asked for, so nothing would "
                "train from that checkpoint; to train from it again, give a new --output-dir (this run "
                "stays), or more steps (--max-steps, --epochs: they retrain the steps after it here)"
            )
        return earlier

    def finished_or_checked(self, total_steps: int) -> Finished | None:
        """:meth:`finished_already`; otherwise the checkpoint :meth:`resume` will continue, if any,
        is checked to be one this run may continue, before the costly preparation that comes first
        (reference log-probs of the starting weights)."""
        done = self.finished_already(total_steps)
        if done is None and (folder := self._resume_folder) is not None:
            with self._found(folder):
                check_continuable(folder, self.fingerprint, self.trainable.parts)
        return done

    @contextmanager
    def _found(self, folder: Path) -> Iterator[None]:
        """An error that names ``folder`` as ``--resume FOLDER``, where the run found it itself
        (--resume auto, the default): named as found, not as an option the user never gave."""
        try:
            yield
        except UserError as e:
            head = f"--resume {folder}:"
            if self.settings.resume != "auto" or not str(e).startswith(head):
                raise
            found = f"{folder}, the newest checkpoint in {self.output_dir} (continued by default):"
            raise UserError(found + str(e)[len(head) :]) from None

    @cached_property
    def _resume_folder(self) -> Path | None:
        """The checkpoint to continue (a collective: every rank asks at the same point), decided
        once: deciding verifies the newest checkpoint's files, and both the early check and
        :meth:`resume` need it."""
        earlier, resume = self._earlier, self.settings.resume
        if self._another_resume:
            if earlier is not None:
                self._refuse_elsewhere(earlier)
            return resume_point(resume, self.output_dir, self.env)
        if earlier is not None:  # a longer run continues from its last step (--resume never refuses)
            newest = resume_point("never" if resume == "never" else "auto", self.output_dir, self.env)
            return self._final_state_of(earlier, newest)
        if self._same_command:  # continued again: from its own newest checkpoint, else where it began
            return resume_point("auto", self.output_dir, self.env) or resume_point(
                resume, self.output_dir, self.env
            )
        return resume_point(resume, self.output_dir, self.env)

    def _refuse_elsewhere(self, earlier: Finished) -> None:
        """A checkpoint of another folder would train this finished run's steps again over it."""
        given = Path(self.settings.resume)
        if not checkpoint_of(given, self.output_dir):
            raise UserError(
                f"--resume {given}: a checkpoint of another folder, and {self.output_dir} holds this run, "
                f"finished at step {earlier.step} (its model in final/): to continue it, leave --resume out "
                f"(it goes on from its own step {earlier.step}); to train from {given.name} again, give a "
                "new --output-dir"
            )

    @cached_property
    def _same_command(self) -> bool:
        """Whether --resume names the checkpoint this folder's run began from (run.json records it,
        read by rank 0 for all: a collective): the same command again, which continues the run from
        where it got to, not from that checkpoint again."""
        resume = self.settings.resume
        if not names_checkpoint(resume):
            return False
        return decided_by_main(lambda: began_from(self.output_dir, resume), False, self.env)

    @property
    def _another_resume(self) -> bool:
        """--resume names another checkpoint than the one the folder's run began from: the user's
        choice (an earlier step, the way on when the last checkpoint is damaged)."""
        return names_checkpoint(self.settings.resume) and not self._same_command

    def finished_record(self, step: int, total_steps: int) -> dict[str, Any]:
        """What run.json records of this run once it finished (:meth:`finished_already` reads it)."""
        return finished_record(step, total_steps, self.fingerprint.fixed)

    def resume(self, fresh: TrainerState, total_steps: int, reference: str | None = None) -> TrainerState:
        """Where this run starts: ``fresh``, or the checkpoint it continues, loaded (the model, the
        optimizer, the scaler, this rank's RNG streams and every record). ``reference``: the
        --reference-model's weights' hash, known once it is loaded, part of the fingerprint from here.

        A folder whose run.json says this very run finished is judged one way
        (:meth:`finished_already`): with no more steps asked for, nothing is loaded; with more,
        the run continues from a checkpoint of its final state, and without one the user is told
        what to do.
        """
        done = self.finished_already(total_steps)
        if done is not None:
            return replace(fresh, step=done.step)
        self.fingerprint = self.fingerprint.with_reference(reference)
        folder = self._resume_folder
        self.resumed_from = folder
        if folder is None:
            self._start_step = fresh.step
            return fresh
        t = self.trainable
        with self._found(folder):
            state, changes = continue_from(
                folder,
                now=self.fingerprint,
                parts=t.parts,
                optimizer=t.optimizer,
                env=self.env,
                scaler=t.scaler,
                log=self.log,
            )
        for record in self.records:
            saved = _read_record(folder / record.file_name)
            if saved is not None:
                try:
                    record.restore(saved, state.step)
                except UserError as e:  # named by its file alone: said with its checkpoint
                    raise UserError(f"{folder / str(e)}") from None
        history = _read_record(folder / CHANGES_FILE)
        self.changed, self.continued = read_changes(history), read_continued(history)
        if changes:
            self.changed.append({"step": state.step, "changes": changes})
        if self.env.is_main:  # before this attempt's records replace the last one's
            self.attempts = earlier_attempts(self.output_dir, folder, state.step)
        self._start_step = state.step
        # A checkpoint of another folder's run is not this folder's: its end saves one here, so
        # that a longer run continues in this folder even when this one trained nothing.
        here = checkpoint_of(folder, self.output_dir)
        self._saved_step = state.step if here else -1
        if not here:
            self.continued.append(folder.resolve().parent)
        return state

    def _final_state_of(self, earlier: Finished, newest: Path | None) -> Path:
        """The checkpoint of a finished run's last step, which a longer run continues from."""
        if newest is not None and read_state(newest).step == earlier.step:
            return newest
        raise UserError(
            f"--output-dir {self.output_dir} holds this run, finished at step {earlier.step}, and no "
            f"checkpoint of that step to train on from (--save-every {self.settings.save_every}); "
            "start afresh with --overwrite, or in another --output-dir"
        )

    def check_room(self, start: TrainerState, total_steps: int, optim: OptimSettings, merged: bool) -> None:
        """Before the first step (from ``start``): the disk holds the checkpoints the run keeps at
        once and its final model (``merged``: and the merged one) (:func:`check_room`)."""
        if start.step < total_steps:
            copies = self._copies(start.step, total_steps)
            saves = Saves(copies, optim.name, optim.momentum != 0, self.settings.keep_last, merged)
            t = self.trainable
            check_room(self.output_dir, t.parts, t.optimizer, self.env, saves)

    def _copies(self, start: int, total: int) -> int:
        """How many more checkpoints the disk holds at once, at most, as the run goes from ``start``
        to ``total``: each is written before the oldest beyond --keep-last goes (0: all stay)."""
        every, keep = self.settings.save_every, self.settings.keep_last
        if not every:
            return 0
        ahead = total // every - start // every + (1 if total % every else 0)  # the last step saves too
        if not keep:
            return ahead
        held = len(saved_checkpoints(self.output_dir))
        return max(1, min(held + ahead - 1, keep) + 1 - held)

    def after_step(self, state: TrainerState, *, asked: bool, last: bool) -> Path | None:
        """Save when asked (a new best, a stop), or every ``--save-every`` steps; not at the run's
        last step, whose checkpoint :meth:`at_end` writes after the final evaluation."""
        every = self.settings.save_every
        due = bool(every) and state.step % every == 0 and not last
        return self._save(state) if asked or due else None

    def at_end(self, state: TrainerState, *, asked: bool) -> Path | None:
        """The end of a run: saved when asked, or when the run saves periodically and this folder
        holds no checkpoint of its last step (it trained, or continued another folder's)."""
        due = bool(self.settings.save_every) and state.step != self._saved_step
        return self._save(state) if asked or due else None

    def _save(self, state: TrainerState) -> Path | None:
        if state.step == self._saved_step:
            return None
        self.beat("save")
        t = self.trainable
        records: dict[str, Any] = {FINGERPRINT_FILE: self.fingerprint.to_json()}
        records |= {r.file_name: r.to_json() for r in self.records}
        if t.scaler is not None:
            records[SCALER_FILE] = t.scaler.state_dict()
        if self.changed or self.continued:
            records[CHANGES_FILE] = {"resumes": self.changed, "continued": [str(c) for c in self.continued]}
        with self.patient():
            path = save_checkpoint(
                self.output_dir,
                state,
                t.parts,
                t.tokenizer,
                t.optimizer,
                self.env,
                keep_last=0,
                records=records,
            )
        if self.env.is_main:
            protected = self.protected_step()
            keep = step_folder(self.output_dir, protected) if protected is not None else None
            prune(self.output_dir, self.settings.keep_last, keep)
        self._saved_step = state.step
        self.log.info(f"step {state.step}: saved checkpoint {path}")
        return path

    def holding(self, step: int) -> Path | None:
        """The checkpoint of ``step``: this folder's, else that of a run this one continued (a
        --resume of another folder's checkpoint, before this run's own resumes), the latest first,
        else None (pruned, removed, or never saved)."""
        places = [step_folder(self.output_dir, step)]
        places += [c / places[0].name for c in reversed(self.continued)]
        found = next((p for p in places if (p / MANIFEST).is_file()), None)
        return broadcast_object(found, self.env)  # rank 0's view: every rank loads, or none does

    def load(self, folder: Path) -> TrainerState:
        """Load the checkpoint in ``folder`` (:meth:`holding`) into the model and optimizer."""
        t = self.trainable
        with self.patient():
            return load_checkpoint(folder, t.parts, t.optimizer, self.env, t.scaler)

    def save_final(self) -> Path:
        """``final/``: the model as a Hugging Face folder, or the LoRA adapter (collective)."""
        final = self.output_dir / "final"
        self.beat("save")
        with self.patient():
            save_final(self.trainable.parts, self.trainable.tokenizer, final, self.env)
        return final


def _read_record(path: Path) -> dict[str, Any] | None:
    """A record saved in a verified checkpoint (its manifest checked its size and hash), read as
    hostile data all the same (bounded, a JSON object), or None when the checkpoint carries none
    (saved without that component)."""
    try:
        return read_json_object(path)
    except FileNotFoundError:
        return None
