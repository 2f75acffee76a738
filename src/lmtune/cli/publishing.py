"""`lmtune export` and `lmtune push`: a model folder out of a run's checkpoint, and onto the hub."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from pathlib import Path

from lmtune.errors import UserError


def export(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from lmtune.checkpoint.export import export

    for given, name in ((args.checkpoint, "CHECKPOINT"), (args.out, "DIR")):
        if not given.strip():  # Path("") is the working folder
            raise UserError(f"lmtune export: {name} is empty; give a folder")
    note = export(
        Path(args.checkpoint), Path(args.out), args.trust_remote_code, args.overwrite, args.merge_lora
    )
    print(f"wrote {args.out}")
    if note:
        print(note)
    return 0


def push(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from lmtune.checkpoint.card import card_for_repo, lmtunes_card
    from lmtune.checkpoint.layout import lmtune_wrote
    from lmtune.outputs.hub import check_push, push_folder

    folder = Path(args.folder)
    if not ((folder / "config.json").is_file() or (folder / "adapter_config.json").is_file()):
        final = folder / "final"  # a run folder: its model (or adapter) is final/
        saved = any((final / name).is_file() for name in ("config.json", "adapter_config.json"))
        run = f"; a run folder: push its final model, {final}" if saved else ""
        raise UserError(f"{folder}: not a model folder (no config.json or adapter_config.json){run}")
    if lmtune_wrote(folder):  # its optimizer state, RNG and manifest are no model repo's
        raise UserError(
            f"{folder}: a training checkpoint; export it first (lmtune export "
            f"{shlex.quote(str(folder))} DIR), then push DIR"
        )
    check_push(args.repo_id, option="lmtune push")
    card = None  # the folder's own README.md, pushed as it is
    if lmtunes_card(folder):
        card = card_for_repo(folder, args.repo_id)
    else:
        print(f"{folder}/README.md was not written by lmtune: pushed as it is")
    try:
        url = push_folder(
            folder,
            args.repo_id,
            private=args.private,
            message=args.message or f"Upload {folder.name} (lmtune)",
            card=card,
        )
    except Exception as e:  # huggingface_hub's: credentials, network, quota
        said = " ".join(str(e).split())[:300] or type(e).__name__
        raise UserError(f"pushing {folder} to {args.repo_id} failed ({type(e).__name__}: {said})") from None
    print(f"pushed {folder} to {url}")
    return 0
