"""Settings given to the launcher that started lmtune (torchrun, accelerate launch), which lmtune
does not read, are refused naming lmtune's option instead of ignored."""

from __future__ import annotations

import pytest

from lmtune.config.settings import TrainConfig
from lmtune.errors import UserError
from lmtune.training.preflight import validate


@pytest.mark.parametrize(
    ("env", "settings", "needle"),
    [
        ({"ACCELERATE_MIXED_PRECISION": "bf16"}, {}, "--mixed_precision bf16 (give --precision bf16)"),
        ({"ACCELERATE_USE_FSDP": "true"}, {}, "--use_fsdp (give --strategy fsdp)"),
        ({"ACCELERATE_USE_DEEPSPEED": "true"}, {}, "DeepSpeed (lmtune does not run it"),
        ({"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, {}, "--dynamo_backend (give --compile)"),
        ({"LOCAL_WORLD_SIZE": "2"}, {"nproc_per_node": 4}, "--nproc-per-node 4, but the launcher started 2"),
    ],
)
def test_a_launchers_own_settings_are_refused(
    env: dict[str, str], settings: dict[str, object], needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(UserError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        validate(TrainConfig(**settings), world_size=1)


def test_what_agrees_with_lmtunes_options_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "ACCELERATE_USE_FSDP": "true",
        "ACCELERATE_DYNAMO_BACKEND": "NO",
        "LOCAL_WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(name, value)
    validate(TrainConfig(precision="bf16", strategy="fsdp"), world_size=1)
    validate(TrainConfig(precision="bf16", strategy="fsdp", nproc_per_node=2), world_size=1)
