"""Uploading a model folder to the Hugging Face hub: `--push-to-hub` at the end of a run and
`lmtune push` for any saved folder. The token, the repo id and the hub's reachability are checked
before a run starts (in every process: the nodes of a job share their environment).

The token is huggingface_hub's own (``HF_TOKEN``, or the one ``hf auth login`` saved): it is never
an option, so it stays out of run.json and the process list. The repo is created when missing.
At the end of a run a failed upload is a warning with the command that retries it: the run is
saved either way.
"""

from __future__ import annotations

from pathlib import Path

from lmtune.config.run_groups import CheckpointSettings
from lmtune.config.verbosity import quiet_calls
from lmtune.errors import UserError
from lmtune.outputs.runlog import InfoLog
from lmtune.parallel.launch import warn

# What a run's final/ holds that is not its own model: the merged model (pushed on its own), and
# lmtune's records of the files it wrote (final/'s, an export's: lmtune.checkpoint.owned).
NOT_PUSHED = ["merged/*", "merged/**", ".lmtune-*"]
CARD_FILE = "README.md"  # where the hub, and so every model folder, keeps its model card


def check_push(repo_id: str, option: str = "--push-to-hub") -> None:
    """Before anything runs: a valid repo id, the hub reachable in principle, a token to write with.

    Raises:
        UserError: naming ``option``, with what to do.
    """
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id  # type: ignore[attr-defined]

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise UserError(f"{option} {repo_id}: not a hub repo id such as user/model-name ({e})") from None
    if constants.HF_HUB_OFFLINE:
        raise UserError(f"{option}: HF_HUB_OFFLINE is set, so nothing can be uploaded; unset it to push")
    if get_token() is None:
        raise UserError(
            f"{option}: no Hugging Face token; set HF_TOKEN or log in with `hf auth login` "
            "(lmtune reads it as huggingface_hub does)"
        )


def push_folder(folder: Path, repo_id: str, *, private: bool, message: str, card: str | None = None) -> str:
    """Upload ``folder``'s files (a run's merged/ left out) to ``repo_id``, creating it when
    missing, with ``card`` as the repo's README.md in place of the folder's (the folder is left as
    it is: a card written there for the repo, and the upload failing, changed a saved folder that
    lmtune's records then called changed); returns the repo's address. huggingface_hub's errors
    pass through."""
    from huggingface_hub import HfApi

    api = HfApi()
    with quiet_calls():
        url = api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            repo_type="model",
            commit_message=message,
            ignore_patterns=NOT_PUSHED + ([CARD_FILE] if card is not None else []),
        )
        if card is not None:
            api.upload_file(
                path_or_fileobj=card.encode("utf-8"),
                path_in_repo=CARD_FILE,
                repo_id=repo_id,
                repo_type="model",
                commit_message=f"{message}: model card",
            )
    return str(url)


def retry_command(folder: Path, repo_id: str, private: bool) -> str:
    return f"lmtune push {folder} {repo_id}" + (" --private" if private else "")


def push_final(output_dir: Path, settings: CheckpointSettings, merged: bool, log: InfoLog) -> bool:
    """After a run (rank 0, final/ saved with its card): upload final/ (final/merged/ when the run
    merged its adapter). A failure is a warning that says how to retry; False then."""
    repo_id = settings.push_to_hub
    assert repo_id is not None
    folder = output_dir / "final" / "merged" if merged else output_dir / "final"
    try:
        url = push_folder(
            folder, repo_id, private=settings.hub_private, message=f"Upload {folder.name} (lmtune)"
        )
    except Exception as e:  # network, credentials, quota: the run is saved; the upload can be redone
        said = " ".join(str(e).split())[:300] or type(e).__name__
        warn(
            f"pushing {folder} to the hub as {repo_id} failed ({type(e).__name__}: {said}); the run is "
            f"saved; to retry: {retry_command(folder, repo_id, settings.hub_private)}"
        )
        return False
    log.info(f"pushed {folder} to {url}")
    return True
