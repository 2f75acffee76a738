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


def test_grown_rows_are_the_mean_of_the_others_whatever_the_generator() -> None:
    """transformers' mean resizing drew the new rows around the mean from the unseeded global
    generator: two identical runs grew other rows, 2 ranks did not train as 1 process, and a DPO
    run's resume found its starting weights changed."""
    import copy

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmtune.model.modeling import byte_tokenizer
    from lmtune.model.tokens import fit_embeddings

    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    config.num_attention_heads = config.num_key_value_heads = 4
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    start, rows = LlamaForCausalLM(copy.deepcopy(config)).state_dict(), config.vocab_size
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    grown = []
    for seed in (1, 2):
        model = LlamaForCausalLM(copy.deepcopy(config))  # resizing sets its config's vocab_size
        model.load_state_dict(start)
        torch.manual_seed(seed)
        assert fit_embeddings(model, tokenizer)
        grown.append({k: v.clone() for k, v in model.state_dict().items()})
    assert all(torch.equal(grown[0][k], grown[1][k]) for k in grown[0])
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weight = grown[0][name]
        assert weight.shape[0] == len(tokenizer)
        expected = start[name].double().mean(dim=0).float()
        assert torch.equal(weight[rows:], expected.expand(len(tokenizer) - rows, -1))
