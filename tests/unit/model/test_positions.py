"""Sequences longer than a model's positions: refused for a learned table, warned for rotary."""

from __future__ import annotations

import pytest
import transformers

from lmtune.errors import UserError
from lmtune.model.tokens import check_positions, position_limit


def _gpt2(positions: int) -> transformers.PreTrainedModel:
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=positions)
    return transformers.GPT2LMHeadModel(config)


def _llama(positions: int) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=positions,
    )
    return transformers.LlamaForCausalLM(config)


def test_a_learned_position_table_refuses_longer_sequences() -> None:
    model = _gpt2(128)
    assert position_limit(model) == (128, True)
    check_positions(model, 128, print)  # exactly the table: fine
    with pytest.raises(
        UserError, match=r"up to 129 tokens, but the model has 128 positions.*--max-length 128"
    ):
        check_positions(model, 129, print)


def test_rotary_positions_past_the_trained_ones_are_a_warning() -> None:
    model = _llama(256)
    assert position_limit(model) == (256, False)
    said: list[str] = []
    check_positions(model, 256, said.append)
    assert said == []
    check_positions(model, 300, said.append)
    assert len(said) == 1 and said[0].startswith(
        "warning: examples of up to 300 tokens, past the model's 256"
    )


def test_a_prompt_past_a_learned_table_is_what_generate_asks_to_shorten() -> None:
    """A prompt that filled the table alone was answered "give 0 or fewer" --max-new-tokens, which
    the option refuses."""
    from types import SimpleNamespace

    from lmtune.cli.generation import _check_answer_length
    from lmtune.model.modeling import byte_tokenizer

    loaded = SimpleNamespace(model=_gpt2(16), tokenizer=byte_tokenizer())
    with pytest.raises(UserError, match=r"--max-new-tokens 8: .* give 5 or fewer$"):
        _check_answer_length(loaded.model, loaded.tokenizer, "x" * 10, 8)  # 11 tokens with the BOS
    with pytest.raises(
        UserError, match=r"--prompt: its 20 tokens fill the model's 16 positions .* shorter prompt$"
    ):
        _check_answer_length(loaded.model, loaded.tokenizer, "x" * 19, 1)
