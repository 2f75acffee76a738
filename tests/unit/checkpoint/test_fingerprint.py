"""A resume's comparison with its checkpoint says each difference as saved -> now."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmtune.checkpoint.fingerprint import Fingerprint, compare
from lmtune.errors import UserError


def test_an_unset_setting_is_said_none_not_python_none() -> None:
    saved = Fingerprint({"--reference-model": None, "--seed": 1}, {"--beta": 0.1})
    changed = Fingerprint({"--reference-model": "/models/ref", "--seed": 1}, {"--beta": 0.1})
    with pytest.raises(UserError, match="--reference-model none -> /models/ref"):
        compare(saved, changed, Path("c"))
    now = Fingerprint({"--reference-model": None, "--seed": 1}, {"--beta": 0.2})
    assert compare(saved, now, Path("c")) == ["--beta 0.1 -> 0.2"]


def test_a_differing_hash_names_the_settings_behind_it() -> None:
    """A model config or data hash says only that they differ; the recorded settings say how."""
    hashed = {"model config": "aaa", "--seed": 1}
    saved = Fingerprint(hashed, {}, {"--model": "tiny", "--data": "d.jsonl", "--max-prompt-length": 4})
    now = Fingerprint({**hashed, "model config": "bbb"}, {}, {**saved.described, "--model": "small"})
    with pytest.raises(
        UserError, match=r"model config aaa -> bbb \(of the settings behind them: --model tiny -> small\)"
    ):
        compare(saved, now, Path("c"))
    # Settings the checkpoint did not record (older ones) are not guessed at; a plain refusal stays plain.
    with pytest.raises(UserError, match=r"model config aaa -> bbb\. Use the same"):
        compare(Fingerprint(hashed, {}), now, Path("c"))
    with pytest.raises(UserError, match=r"--seed 1 -> 2\. Use the same"):
        compare(saved, Fingerprint({**hashed, "--seed": 2}, {}, now.described), Path("c"))
    # A supervised run's checkpoint names no objective: it was sft.
    dpo = {**hashed, "--objective": "dpo", "--reference": "logprobs", "--reference-model": None}
    with pytest.raises(
        UserError, match=r"--objective sft -> dpo\. To tune .* start a new run from it: --model c "
    ):
        compare(saved, Fingerprint(dpo, {}, saved.described), Path("c"))
    with pytest.raises(UserError, match=r"--objective dpo -> simpo; --reference logprobs -> none\. To tune"):
        compare(
            Fingerprint(dpo, {}),
            Fingerprint({**dpo, "--objective": "simpo", "--reference": None}, {}),
            Path("c"),
        )


def test_the_reference_weights_are_checked_once_known() -> None:
    """The --reference-model is loaded after a finished run is recognised and the checkpoint
    first checked: those leave its hash out; the resume, once it is known, compares it."""
    from lmtune.checkpoint.finished import fingerprint_hash

    early = Fingerprint({"--reference-model": "ref", "--seed": 1}, {})
    saved = early.with_reference("aaa")
    assert fingerprint_hash(saved.fixed) == fingerprint_hash(early.fixed)
    assert compare(saved, early, Path("c")) == []
    assert compare(saved, early.with_reference("aaa"), Path("c")) == []
    with pytest.raises(
        UserError, match=r"reference weights \(--reference-model\) aaa -> bbb .* --reference-model ref"
    ):
        compare(saved, early.with_reference("bbb"), Path("c"))
    assert compare(early, early.with_reference("bbb"), Path("c")) == []  # an older checkpoint: unrecorded
    # Copied or moved elsewhere: the same weights by their hash resume; before they are known the
    # name is left to them; other weights under another name say both.
    moved = Fingerprint({"--reference-model": "copy/of/ref", "--seed": 1}, {})
    assert compare(saved, moved, Path("c")) == []
    assert compare(saved, moved.with_reference("aaa"), Path("c")) == []
    with pytest.raises(UserError, match=r"--reference-model ref -> copy/of/ref; reference weights .* -> bbb"):
        compare(saved, moved.with_reference("bbb"), Path("c"))
    with pytest.raises(UserError, match=r"--reference-model ref -> copy/of/ref\. "):  # nothing to tell by
        compare(early, moved, Path("c"))


def test_a_starting_weights_hash_that_follows_from_another_change_is_not_said() -> None:
    """A DPO run of its own reference resumed with a --reference-model: the starting weights' hash
    went to none, and the refusal said the weights of --model had changed."""
    saved = Fingerprint({"--reference-model": None, "starting weights (--model)": "aaa"}, {})
    now = Fingerprint({"--reference-model": "models/other"}, {}, {"--model": "models/base"})
    with pytest.raises(UserError) as refused:
        compare(saved, now, Path("c"))
    said = str(refused.value)
    assert "--reference-model none -> models/other" in said
    assert "starting weights" not in said and "changed since" not in said


def test_an_older_cosine_checkpoint_resumed_says_its_warmup_is_now_transformers() -> None:
    """Cosine's warmup is transformers' now (from 0, a step later to the learning rate): a resume
    of a checkpoint saved under the former one says so, as it applies from the resume step."""
    from transformers import LlamaConfig

    from lmtune.checkpoint.fingerprint import COSINE_WARMUP, fingerprint
    from lmtune.config.settings import TrainConfig

    def made(schedule: str) -> Fingerprint:
        cfg = TrainConfig(lr_schedule=schedule, warmup_steps=3)
        return fingerprint(cfg, data_key="k", examples=8, model_config=LlamaConfig(), lr=1e-3, total_steps=9)

    now = made("cosine")
    older = Fingerprint(now.fixed, {k: v for k, v in now.adjustable.items() if k != COSINE_WARMUP})
    assert compare(older, now, Path("c")) == ["cosine warmup (step+1)/warmup -> step/warmup"]
    assert compare(now, now, Path("c")) == []
    linear = made("linear")  # its warmup was always transformers'
    assert COSINE_WARMUP not in linear.adjustable and compare(linear, linear, Path("c")) == []
    # Only a cosine warmup on both sides, resumed within it, is the formula's change.
    for saved, resumed in ((now, linear), (linear, now), (older, linear)):
        assert compare(saved, resumed, Path("c")) == [
            "--lr-schedule " + " -> ".join(s.adjustable["--lr-schedule"] for s in (saved, resumed))
        ]
    assert compare(older, now, Path("c"), step=2) != [] and compare(older, now, Path("c"), step=3) == []
