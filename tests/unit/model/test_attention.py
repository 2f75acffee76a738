"""Per-example (varlen) attention: the same loss and gradients as the masked rows, on several
architectures, with nothing computed across examples, and plain sdpa outside training."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from lmtune.data.collate import Batch, Collator
from lmtune.data.packing import PackedCollator, pack_bins
from lmtune.data.tokenize import IGNORE_INDEX
from lmtune.model.attention import VARLEN, _pad_together, flatten, use_varlen
from lmtune.model.modeling import build_preset
from lmtune.objectives.sft import SummedLoss
from tests.conftest import tokenized, uneven_texts


def _model(arch: str) -> tuple[torch.nn.Module, Any]:
    """The tiny preset (Llama), or the same size as GPT-2 (learned positions, fused qkv) or as
    Mistral with grouped-query attention and a sliding window shorter than the longer examples."""
    loaded = build_preset("tiny", seed=0)
    if arch == "llama":
        return loaded.model, loaded.tokenizer
    from transformers import AutoModelForCausalLM, GPT2Config, MistralConfig

    vocab = len(loaded.tokenizer)
    config: Any
    if arch == "gpt2":
        config = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    else:
        config = MistralConfig(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=16,
            max_position_embeddings=128,
        )
    # Dropout off, so that the two forwards compared below see the same network.
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"), loaded.tokenizer


def _data(tokenizer: Any, lengths: str = "uneven") -> Any:
    if lengths == "equal":
        texts = [f"{a} plus {b} is {a + b:3d}" for a, b in zip(range(10, 30), range(40, 60), strict=True)]
    elif lengths == "short":
        texts = [text[:30] for text in uneven_texts(20, seed=3)]
    else:
        texts = [*uneven_texts(20, seed=3), "a longer example " * 6]
    return tokenized(texts, tokenizer, max_length=120)


def _grads(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])


def _loss_and_grads(module: SummedLoss, batch: Batch) -> tuple[float, torch.Tensor]:
    module.zero_grad()
    loss = module(*batch.model_inputs()).sum()
    (loss / batch.target_tokens()).backward()
    return float(loss.detach()), _grads(module)


@pytest.mark.parametrize(
    ("arch", "lengths"),
    [
        ("llama", "uneven"),
        ("gpt2", "uneven"),
        ("mistral", "uneven"),
        ("llama", "equal"),
        ("mistral", "short"),
    ],
)
def test_per_example_attention_equals_the_masked_rows(arch: str, lengths: str) -> None:
    """Uneven lengths run a call per example; equal or short ones one padded call (see
    _pad_together); Mistral's window (16) cuts into the longer examples in both."""
    model, tok = _model(arch)
    masked = SummedLoss(copy.deepcopy(model))
    assert use_varlen(model)
    varlen = SummedLoss(model, varlen=True)
    data = _data(tok, lengths)
    sizes = data.lengths().tolist()
    assert _pad_together(sizes) == (lengths != "uneven")
    examples = [data[i] for i in range(len(data))]
    rows = pack_bins(data.lengths().tolist(), 120)
    packed = PackedCollator(tok.pad_token_id)([[examples[j] for j in row] for row in rows])
    padded = Collator(tok.pad_token_id)(examples)
    # Every layout in each path: padded rows are the reference for both.
    reference_loss, reference_grads = _loss_and_grads(masked, padded)
    for module in (masked, varlen):
        for batch in (packed, padded):
            loss, grads = _loss_and_grads(module, batch)
            assert abs(loss - reference_loss) <= 1e-5 * reference_loss
            assert (grads - reference_grads).abs().max() <= 1e-6


def test_flatten_keeps_real_tokens_and_never_targets_across_examples() -> None:
    _, tok = _model("llama")
    data = _data(tok)
    examples = [data[i] for i in range(6)]
    batch = Collator(tok.pad_token_id)(examples)
    flat = flatten(batch.input_ids, batch.attention_mask, batch.labels)
    lengths = [len(e.input_ids) for e in examples]
    assert flat.input_ids.shape == (1, sum(lengths))
    assert flat.segments.lengths() == lengths
    assert flat.segments.longest == max(lengths)
    assert flat.segments.cumulative.tolist() == list(flat.segments.offsets)
    starts = list(flat.segments.offsets[:-1])
    assert (flat.labels[0, starts] == IGNORE_INDEX).all()
    assert flat.position_ids[0, starts].tolist() == [0] * len(starts)
    # The loss's shift makes label t+1 the target of position t: the same count as the rows.
    assert int((flat.labels[0, 1:] != IGNORE_INDEX).sum()) == batch.target_tokens()


def test_no_example_sees_another() -> None:
    model, tok = _model("llama")
    use_varlen(model)
    module = SummedLoss(model, varlen=True).eval()
    data = _data(tok)
    examples = [data[i] for i in range(4)]
    changed = list(examples)
    ids, labels, eid = changed[1]
    changed[1] = type(changed[1])(ids[::-1].copy(), labels[::-1].copy(), eid)

    def per_example_losses(exs: list[Any]) -> list[float]:
        with torch.no_grad():
            return [float(module(*PackedCollator(tok.pad_token_id)([[e]]).model_inputs())) for e in exs]

    def packed_logits(exs: list[Any]) -> torch.Tensor:
        from lmtune.model.attention import SEGMENTS

        batch = PackedCollator(tok.pad_token_id)([exs])
        flat = flatten(*batch.model_inputs())
        with torch.no_grad():
            return model(
                input_ids=flat.input_ids,
                position_ids=flat.position_ids,
                attention_mask=torch.ones_like(flat.input_ids),
                **{SEGMENTS: flat.segments},
            ).logits[0]

    before, after = packed_logits(examples), packed_logits(changed)
    first = len(examples[0].input_ids)
    second = first + len(examples[1].input_ids)
    assert torch.equal(before[:first], after[:first])
    assert not torch.allclose(before[first:second], after[first:second])
    assert torch.allclose(before[second:], after[second:], atol=1e-6)
    assert per_example_losses(examples) != per_example_losses(changed)


def test_outside_training_it_is_sdpa_and_it_is_not_saved(tmp_path: Path) -> None:
    model, tok = _model("llama")
    reference = copy.deepcopy(model).eval()
    assert use_varlen(model)
    model.eval()
    assert model.config._attn_implementation == VARLEN
    # Generation of a padded batch (a cache, a padding mask, no segments) is sdpa's, token for token.
    tok.padding_side = "left"
    prompts = tok(["alpha beta", "gamma"], return_tensors="pt", padding=True)
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": tok.pad_token_id}
    assert torch.equal(model.generate(**prompts, **settings), reference.generate(**prompts, **settings))
    model.save_pretrained(tmp_path)
    assert VARLEN not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


def test_models_outside_the_attention_interface_keep_their_attention() -> None:
    model, _ = _model("llama")
    model.set_attn_implementation("eager")
    assert not use_varlen(model)
    assert model.config._attn_implementation == "eager"


def test_bf16_autocast_trains_the_same_rows_and_keeps_attention_in_fp32() -> None:
    model, tok = _model("llama")
    masked = SummedLoss(copy.deepcopy(model))
    use_varlen(model)
    varlen = SummedLoss(model, varlen=True)
    data = _data(tok)
    batch = Collator(tok.pad_token_id)([data[i] for i in range(len(data))])
    seen: list[tuple[torch.dtype, bool]] = []
    hook = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append((args[0].dtype, torch.is_autocast_enabled("cpu")))  # autocast would cast to bf16
        return hook(*args, **kwargs)

    losses = []
    for module in (masked, varlen):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if module is varlen:
                torch.nn.functional.scaled_dot_product_attention = spy
            try:
                losses.append(float(module(*batch.model_inputs()).sum()))
            finally:
                torch.nn.functional.scaled_dot_product_attention = hook
    # bf16 rounds the projections differently in the two layouts; the loss agrees to bf16's precision.
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    assert seen and set(seen) == {(torch.float32, False)}


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_bucketed_attention_equals_the_masked_rows(arch: str) -> None:
    """The CPU bf16 path's bucketing (lengths rounded up to 64, examples of one width together,
    their count rounded to a power of two) changes no result: checked in fp32, where it is exact."""
    from lmtune.model.attention import VARLEN_BUCKETED

    model, tok = _model(arch)
    masked = SummedLoss(copy.deepcopy(model))
    assert use_varlen(model, bucketed=True) and model.config._attn_implementation == VARLEN_BUCKETED
    bucketed = SummedLoss(model, varlen=True)
    data = _data(tok, "uneven")
    examples = [data[i] for i in range(len(data))]
    padded = Collator(tok.pad_token_id)(examples)
    rows = pack_bins(data.lengths().tolist(), 120)
    packed = PackedCollator(tok.pad_token_id)([[examples[j] for j in row] for row in rows])
    reference_loss, reference_grads = _loss_and_grads(masked, padded)
    for batch in (packed, padded):
        loss, grads = _loss_and_grads(bucketed, batch)
        assert abs(loss - reference_loss) <= 1e-5 * reference_loss
        assert (grads - reference_grads).abs().max() <= 1e-6


def test_models_that_take_no_mask_of_ours_pad_and_are_told(tmp_path: Path) -> None:
    """BLOOM (and Falcon's ALiBi) crashed on packed rows and on every preference pair; MPT's
    attention read the block mask inverted and trained on what it must not see, without a word;
    LFM2's convolutions and Mamba's state carried packed examples into the next. They pad under
    --packing auto, --packing on is refused, and their pairs run as two rows (the log says so)."""
    from transformers import AutoModelForCausalLM, BloomConfig, Lfm2Config, MambaConfig, MptConfig

    from lmtune.config.settings import TrainConfig
    from lmtune.errors import UserError
    from lmtune.model.masks import mask_obstacle
    from lmtune.training.batch_layout import batching_of, pair_rows_note, unpacked_note

    small = {"vocab_size": 64}
    configs = {
        "bloom": BloomConfig(hidden_size=32, n_layer=1, n_head=2, **small),
        "mpt": MptConfig(d_model=32, n_layers=1, n_heads=2, **small),
        "lfm2": Lfm2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, layer_types=["conv", "full_attention"], **small,
        ),
        "mamba": MambaConfig(hidden_size=32, num_hidden_layers=1, state_size=4, **small),
    }  # fmt: skip
    cfg = TrainConfig(model="tiny", data="d.jsonl", output_dir=str(tmp_path))
    on = TrainConfig(model="tiny", data="d.jsonl", output_dir=str(tmp_path), packing="on")
    for kind, config in configs.items():
        why = mask_obstacle(AutoModelForCausalLM.from_config(config))
        assert why is not None, kind
        assert batching_of(cfg, {"text": 8}, why) == "group"  # auto: not packed
        with pytest.raises(UserError, match=f"--packing on: .*{re.escape(why)}; use off"):
            batching_of(on, {"text": 8}, why)
        assert f"two rows a pair, not one under a mask), as {why}" in str(pair_rows_note(why, pairs=True))
        assert (
            unpacked_note(cfg, {"text": 8}, why) == f"--packing auto: rows are padded, not packed, as {why}"
        )
    # Layer kinds that mix no tokens are no obstacle; attention of a kind the masks do not describe is.
    from transformers import Llama4TextConfig, NemotronHConfig

    nemotron = NemotronHConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        mamba_num_heads=4, mamba_head_dim=8, n_groups=1, ssm_state_size=8, hybrid_override_pattern="M-",
    )  # fmt: skip
    said = mask_obstacle(AutoModelForCausalLM.from_config(nemotron))
    assert said is not None and "mlp" not in said and "layers (as its config names them) carry" in said
    llama4 = Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=2,
    )  # fmt: skip
    assert mask_obstacle(AutoModelForCausalLM.from_config(llama4)) == (
        "llama4_text's chunked_attention layers attend in a way lmtune's masks do not describe"
    )
    tiny, _ = _model("llama")
    assert mask_obstacle(tiny) is None and batching_of(cfg, {"text": 8}, None) == "auto"
    assert unpacked_note(cfg, {"text": 8}, None) is None
    assert pair_rows_note(None, pairs=True) is None and pair_rows_note("why", pairs=False) is None
    mistral, _ = _model("mistral")  # one sliding window for all layers: its mask holds it
    assert mask_obstacle(mistral) is None


def test_a_model_of_its_own_code_is_not_packed() -> None:
    """A --trust-remote-code model with a GRU of its own was packed under --packing auto ("masked
    attention"), its state carrying each example's end into the next one's start. An LSTM or GRU
    is found as the convolutions are; a model whose code came with it and that does not attend
    through transformers' attention functions takes no mask lmtune can trust."""
    from lmtune.model.masks import mask_obstacle

    class Config:
        model_type = "grulm"

    class GruLM(torch.nn.Module):
        config = Config()

        def __init__(self) -> None:
            super().__init__()
            self.rnn = torch.nn.GRU(8, 8)

    assert mask_obstacle(GruLM()) == (
        "grulm's recurrent layers (GRU) carry each token into the next outside attention, where no mask "
        "reaches"
    )

    class Own(torch.nn.Module):
        config = Config()

    assert mask_obstacle(Own()) is None
    Own.__module__ = "transformers_modules.m.f1ca98.modeling_own"
    assert mask_obstacle(Own()) == (
        "grulm's modeling code came with it (--trust-remote-code), and lmtune cannot tell whether its "
        "layers keep examples apart"
    )


def _lfm2(vocab: int) -> torch.nn.Module:
    """A tiny LFM2 (a short convolution, then attention) whose outputs depend on their context."""
    from transformers import AutoModelForCausalLM, Lfm2Config

    config = Lfm2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.mul_(4)
    return model


def test_a_model_mixing_tokens_outside_attention_is_never_flattened() -> None:
    """LFM2 runs sdpa through transformers' attention interface, so per-example attention took it,
    and the flattened rows' convolution read each example's end into the next one's start: the loss
    of the same examples moved with the micro-batch (eval at batch 16 vs 1), without a word. Its
    rows stay rows: the loss of a padded batch is the sum of each example's alone."""
    from lmtune.model.attention import supports_varlen
    from lmtune.model.masks import mask_obstacle

    _, tok = _model("llama")
    model = _lfm2(len(tok))
    assert not supports_varlen(model) and not use_varlen(model)
    assert mask_obstacle(model) == (
        "lfm2's conv layers (as its config names them) carry each token into the next outside attention, "
        "where no mask reaches"
    )
    module = SummedLoss(model, varlen=False).eval()
    data = _data(tok)
    examples = [data[i] for i in range(8)]
    with torch.no_grad():
        together = float(module(*Collator(tok.pad_token_id)(examples).model_inputs()).sum())
        alone = [float(module(*Collator(tok.pad_token_id)([e]).model_inputs()).sum()) for e in examples]
        # What flattening gave: the same examples back to back, restarting positions only.
        flat = flatten(*PackedCollator(tok.pad_token_id)([examples]).model_inputs())
        run_on = float(module(flat.input_ids, torch.ones_like(flat.input_ids), flat.labels).sum())
    assert together == pytest.approx(sum(alone), rel=1e-5)
    assert abs(run_on - sum(alone)) > 1e-3 * sum(alone)  # the leak this guards against is real


def test_a_model_mixing_sliding_and_full_layers_packs_with_a_mask_per_layer_kind() -> None:
    """Gemma 2 runs eager attention (for its logit soft-cap) in sliding and full layers; packing was
    refused. It takes a mask per layer kind, additive as eager attention adds it: packed rows give
    the padded rows' loss and gradients, with a window shorter than the longer examples."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    from lmtune.model.masks import mask_obstacle

    _, tok = _model("llama")
    config = Gemma2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert model.config._attn_implementation == "eager" and mask_obstacle(model) is None
    assert not use_varlen(model)
    module = SummedLoss(model)
    data = _data(tok)
    examples = [data[i] for i in range(len(data))]
    assert max(len(e.input_ids) for e in examples) > 2 * config.sliding_window
    rows = pack_bins(data.lengths().tolist(), 120)
    packed = PackedCollator(tok.pad_token_id)([[examples[j] for j in row] for row in rows])
    reference_loss, reference_grads = _loss_and_grads(module, Collator(tok.pad_token_id)(examples))
    loss, grads = _loss_and_grads(module, packed)
    assert abs(loss - reference_loss) <= 1e-5 * reference_loss
    assert (grads - reference_grads).abs().max() <= 1e-6
