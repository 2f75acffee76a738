"""The model card's rows say what the run did, not only what its settings said."""

from __future__ import annotations

import pytest

from lmtune.checkpoint.card_rows import training_rows


@pytest.mark.parametrize(("objective", "shown"), [("sft", "dropout 0.05,"), ("dpo", "dropout off,")])
def test_the_lora_row_says_dropout_is_off_under_a_preference_objective(objective: str, shown: str) -> None:
    config = {"objective": objective, "lora": True, "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.05}
    lora = dict(training_rows({"config": {**config, "lora_target_modules": "all-linear"}}))["LoRA"]
    assert lora.startswith(f"rank 8, alpha 16, {shown} targets all-linear")
