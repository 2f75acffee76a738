"""A saved optimizer state is loaded only where every entry fits its parameter: the fused AdamW
kernel trusts the shapes it is given, and wrote past its buffers for a crafted optimizer.pt (a
segmentation fault, or "malloc(): unaligned tcache chunk detected")."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lmtune.checkpoint.layout import step_folder
from lmtune.checkpoint.state import ModelParts, checked_optimizer_state
from lmtune.checkpoint.store import load_checkpoint, save_checkpoint
from lmtune.errors import UserError
from lmtune.model.modeling import load_model
from lmtune.objectives.sft import SummedLoss
from lmtune.training.optim import build_optimizer
from tests.unit.checkpoint.test_integrity import ONE, _state


def _stepped(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = SummedLoss(load_model("tiny", 0).model)
    optimizer = build_optimizer(name, model, 1e-3, 0.0, (0.9, 0.999), 1e-8)
    ids = torch.randint(3, 250, (2, 16))
    model(ids, torch.ones_like(ids), ids).sum().backward()
    optimizer.step()
    return model, optimizer


def _optimizers() -> list[str]:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return ["adamw", "sgd"]
    return ["adamw", "sgd", "adamw8bit"]


@pytest.mark.parametrize("name", _optimizers())
def test_the_states_lmtunes_optimizers_save_are_accepted(name: str) -> None:
    model, optimizer = _stepped(name)
    saved = optimizer.state_dict()
    fresh = build_optimizer(name, model, 1e-3, 0.0, (0.9, 0.999), 1e-8)
    fresh.load_state_dict(checked_optimizer_state(saved, fresh, Path("optimizer.pt")))


def _crafted(saved: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
    state = {i: dict(entry) for i, entry in saved["state"].items()}
    state[0][name] = value
    return {"state": state, "param_groups": saved["param_groups"]}


def test_entries_that_do_not_fit_their_parameter_are_named() -> None:
    model, optimizer = _stepped("adamw")
    saved = optimizer.state_dict()
    first = next(model.parameters())
    crafted = {
        "shape [3], the parameter's needs": _crafted(saved, "exp_avg", torch.zeros(3)),
        "exp_avg_sq has shape": _crafted(saved, "exp_avg_sq", torch.zeros(4 * first.numel())),
        "holds int64 values": _crafted(saved, "exp_avg", torch.zeros(first.shape, dtype=torch.int64)),
        "is not a tensor": _crafted(saved, "exp_avg", [1.0, 2.0]),
        "is not a step count": _crafted(saved, "step", "x"),
        "step is not a step count": _crafted(saved, "step", torch.tensor(-5.0)),
        # Its shape, over a 4-byte storage: the kernel wrote past it (a segfault, or 23 GB of memory).
        "exp_avg is not a dense tensor": _crafted(saved, "exp_avg", torch.zeros(1).expand(first.shape)),
        "exp_avg_sq is not a dense tensor": _crafted(
            saved, "exp_avg_sq", torch.zeros(first.shape).to_sparse()
        ),
        "exp_avg holds values that are not finite": _crafted(
            saved, "exp_avg", torch.full(first.shape, float("nan"))
        ),
        "exp_avg_sq holds negative values": _crafted(saved, "exp_avg_sq", torch.full(first.shape, -1.0)),
        "entry lacks exp_avg": {
            "state": {0: {k: v for k, v in saved["state"][0].items() if k != "exp_avg"}},
            "param_groups": saved["param_groups"],
        },
        "evil is not an entry of lmtune's optimizers": _crafted(saved, "evil", torch.zeros(1)),
        "an entry for parameter 999": {"state": {999: {}}, "param_groups": saved["param_groups"]},
        "parameter groups are not this run's": {"state": {}, "param_groups": []},
        "holds no state and param_groups": [1, 2],
    }
    for needle, state in crafted.items():
        with pytest.raises(
            UserError, match=r"optimizer\.pt: not an optimizer state of this run's model"
        ) as e:
            checked_optimizer_state(state, optimizer, Path("optimizer.pt"))
        assert needle in str(e.value), (needle, str(e.value))


def test_a_crafted_optimizer_state_is_refused_on_resume_not_run(tmp_path: Path) -> None:
    """Written into a checkpoint whose manifest was recomputed to match (as an attacker would)."""
    loaded = load_model("tiny", 0)
    parts = ModelParts(loaded.model, loaded.model, sharded=False, lora=False)
    optimizer = build_optimizer("adamw", loaded.model, 1e-3, 0.0, (0.9, 0.999), 1e-8)
    loaded.model(torch.randint(3, 250, (1, 8))).logits.sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path, _state(1), parts, loaded.tokenizer, optimizer, ONE, keep_last=0, records={})
    folder = step_folder(tmp_path, 1)
    saved = torch.load(folder / "optimizer.pt", weights_only=True)
    torch.save(_crafted(saved, "exp_avg", torch.zeros(3)), folder / "optimizer.pt")
    manifest = json.loads((folder / "manifest.json").read_text())
    data = (folder / "optimizer.pt").read_bytes()
    manifest["optimizer.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        UserError, match=r"optimizer.pt: not an optimizer state of this run's model \(parameter 0"
    ):
        load_checkpoint(folder, parts, optimizer, ONE)
