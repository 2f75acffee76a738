"""A tokenizer with more tokens than its model has embeddings (a token added to the tokenizer, and
the model saved without its embeddings grown): an id past the last row was an IndexError in the
model; now eval and generate name it, and training grows the embeddings (not under LoRA)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmtune.cli import main
from lmtune.model.modeling import load_model
from tests.conftest import one_line_error as _error
from tests.conftest import write_jsonl


@pytest.fixture(scope="module")
def outgrown(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("vocab") / "model"
    loaded = load_model("tiny", 0)
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    loaded.tokenizer.save_pretrained(folder)
    return folder


def test_a_tokenizer_past_the_embeddings_is_named_or_grown(
    outgrown: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", ["hello <|extra|> world"] * 16)
    said = f"{outgrown}: its tokenizer has 260 tokens and its embeddings 259 rows, so ids from 259 on"
    said += " (<|extra|> = 259)"
    for argv in (
        ["eval", str(data), "--model", str(outgrown)],
        ["generate", "--model", str(outgrown), "--prompt", "hi"],
    ):
        err = _error(argv, capsys)
        assert said in err and "resize_token_embeddings" in err
    train = [
        "train",
        "--model",
        str(outgrown),
        "--data",
        str(data),
        "--global-batch-size",
        "8",
        "--max-steps",
        "1",
    ]
    err = _error([*train, "--output-dir", str(tmp_path / "lora"), "--lora", "--no-progress"], capsys)
    assert said in err and "under --lora new embedding rows would stay untrained" in err
    assert main([*train, "--output-dir", str(tmp_path / "full"), "--no-progress"]) == 0
    assert f"{said} have no embedding: grown to 260 rows" in capsys.readouterr().out
    grown = load_model(str(tmp_path / "full" / "final"), 0)
    assert grown.model.get_input_embeddings().weight.shape[0] == len(grown.tokenizer) == 260
