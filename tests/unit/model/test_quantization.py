"""The quantized base of QLoRA (--load-in-4bit, --load-in-8bit): its settings, loading (a preset and
a model folder give the same values), preparation, sizes (measured == planned), dequantization,
and the run fingerprint."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lmtune.checkpoint.fingerprint import Fingerprint, compare, fingerprint
from lmtune.config.io import build_config
from lmtune.config.settings import TrainConfig
from lmtune.errors import UserError
from lmtune.model.modeling import build_preset, byte_tokenizer, load_model, preset_config
from lmtune.model.quantization import (
    QUANTIZED_LAYERS,
    Quantization,
    conv1d_restored,
    dequantized,
    footprint,
    parameter_count,
    prepare,
    quantization_of,
    quantized_bytes,
    require_bitsandbytes,
)
from lmtune.training.preflight import validate
from tests.conftest import run_lmtune

pytest.importorskip("bitsandbytes")

NF4 = Quantization(bits=4, quant_type="nf4", compute_dtype=torch.float32, storage_dtype=torch.uint8)
INT8 = Quantization(bits=8, quant_type="int8", compute_dtype=torch.float32, storage_dtype=torch.int8)


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset saved as a model folder, as a user's model would be."""
    out = tmp_path_factory.mktemp("base")
    base = build_preset("tiny", 3)
    base.model.save_pretrained(out)
    base.tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"load_in_4bit": True}, "--load-in-4bit: needs --lora"),
        ({"load_in_8bit": True}, "--load-in-8bit: needs --lora"),
        ({"lora": True, "load_in_4bit": True, "load_in_8bit": True}, "--load-in-8bit: is instead of"),
        ({"bnb_4bit_quant_type": "fp4"}, "--bnb-4bit-quant-type: needs --load-in-4bit"),
        ({"bnb_4bit_quant_type": "int3"}, "--bnb-4bit-quant-type: must be one of nf4, fp4"),
        ({"lora": True, "load_in_4bit": True, "strategy": "dp"}, "--load-in-4bit: is not supported under"),
        ({"lora": True, "load_in_8bit": True, "strategy": "fsdp"}, "--load-in-8bit: does not work with"),
    ],
)
def test_quantization_settings_name_the_option(values: dict[str, Any], needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        validate(build_config(values), world_size=1)  # as the CLI and YAML build it


def test_missing_bitsandbytes_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import now fails
    with pytest.raises(UserError, match=r"--load-in-4bit needs bitsandbytes.*pip install 'lmtune\[memory\]'"):
        validate(TrainConfig(lora=True, load_in_4bit=True), world_size=1)


def test_a_device_bitsandbytes_has_no_backend_for_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import bitsandbytes

    monkeypatch.setattr(bitsandbytes, "supported_torch_devices", {"cuda"}, raising=False)
    with pytest.raises(UserError, match=r"--load-in-4bit: bitsandbytes .* has no cpu backend"):
        require_bitsandbytes("--load-in-4bit", torch.device("cpu"))


def test_the_cli_refuses_in_one_line_without_a_traceback(tmp_path: Path) -> None:
    proc = run_lmtune(["train", "--load-in-4bit", "--output-dir", str(tmp_path / "o")], timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "needs --lora" in proc.stderr, proc.stderr


def test_quantization_follows_precision_and_strategy() -> None:
    from lmtune.config.groups import ModelSettings

    q = quantization_of(ModelSettings(load_in_4bit=True, precision="bf16"), "ddp")
    assert q is not None and (q.compute_dtype, q.storage_dtype) == (torch.bfloat16, torch.uint8)
    assert q.description == "nf4, double quant, compute bf16"
    # FSDP2 gathers parameters in the compute dtype: the 4-bit values are packed in it, never cast.
    q = quantization_of(ModelSettings(load_in_4bit=True, precision="bf16"), "fsdp")
    assert q is not None and q.storage_dtype == torch.bfloat16 and "packed in bf16" in q.description
    assert quantization_of(ModelSettings(), "single") is None


def test_a_folder_and_the_preset_quantize_to_the_same_model(folder: Path) -> None:
    from_folder = load_model(str(folder), 3, quantization=NF4)
    from_preset = load_model("tiny", 3, quantization=NF4)
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(_loss(from_folder.model, ids), _loss(from_preset.model, ids))
        full = _loss(build_preset("tiny", 3).model, ids)
        assert float((_loss(from_folder.model, ids) - full).abs()) < 0.05 * float(full)
    model: Any = from_folder.model
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    assert type(model.lm_head).__name__ == "Linear" and model.lm_head.weight.dtype == torch.float32
    assert all(not p.requires_grad for p in model.parameters())
    assert model.name_or_path == str(folder)  # peft names the adapter's base from it
    assert parameter_count(model) == parameter_count(build_preset("tiny", 3).model)


def test_the_starting_weights_hash_is_the_bases_under_any_strategy_and_precision() -> None:
    """FSDP2 packs the 4-bit values in its gather dtype (fp32, bf16): the same bytes, which a
    resume on another strategy or precision refused as another base."""
    from dataclasses import replace

    from lmtune.training.reference import model_digest

    hashes = {
        model_digest(load_model("tiny", 3, quantization=replace(NF4, storage_dtype=s, compute_dtype=c)).model)
        for s, c in (
            (torch.uint8, torch.float32),
            (torch.float32, torch.float32),
            (torch.bfloat16, torch.bfloat16),
        )
    }
    assert len(hashes) == 1
    assert hashes != {model_digest(load_model("tiny", 4, quantization=NF4).model)}


def test_evaluation_does_not_repack_the_weights_for_an_inference_kernel(folder: Path) -> None:
    """On an AVX-512 BF16 CPU bitsandbytes would repack a 4-bit weight at its first eval forward
    into a layout whose kernel has no backward: training after it would lose the base's gradients."""
    import peft

    model = load_model(str(folder), 3, quantization=NF4).model
    torch.manual_seed(0)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(1))

    def first_adapter_grad() -> torch.Tensor:
        adapted.zero_grad()
        _loss(adapted, ids).backward()
        # B (A starts with zero gradient, B being zero): its gradient comes back through the
        # later blocks' quantized layers.
        b = adapted.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
        assert b.grad is not None and float(b.grad.abs().sum()) > 0
        return b.grad.clone()

    before = first_adapter_grad()
    adapted.eval()
    with torch.no_grad():
        _loss(adapted, ids)
    adapted.train()
    assert torch.equal(first_adapter_grad(), before)


def test_a_model_without_linear_layers_is_refused() -> None:
    with pytest.raises(UserError, match="--load-in-4bit: bitsandbytes quantized no layer"):
        prepare(nn.Sequential(nn.Embedding(4, 4)), NF4)


def test_an_already_quantized_model_is_refused(folder: Path, tmp_path: Path) -> None:
    import json
    import shutil

    shutil.copytree(folder, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=r"already quantized \(gptq\); --load-in-4bit"):
        load_model(str(tmp_path / "m"), 0, quantization=NF4)


@pytest.mark.parametrize("q", [NF4, INT8], ids=["nf4", "int8"])
def test_measured_size_is_what_plan_counts(q: Quantization) -> None:
    from lmtune.tools.memory import Setup, _weight_bytes, model_facts

    model = load_model("tiny", 0, quantization=q).model
    quantized, other, adapters = footprint(model)
    assert adapters == 0
    layers = [m for m in model.modules() if type(m).__name__ in QUANTIZED_LAYERS]
    assert quantized == sum(quantized_bytes(q.bits, m.out_features, m.in_features) for m in layers)
    facts = model_facts(preset_config("tiny", byte_tokenizer()), None, "fp32", 16, "cpu")
    setup = Setup("single", "adamw", True, False, "fp32", 1, 16, 1, 1, quantization=q.quant_type)
    assert _weight_bytes(setup, facts)[0] == quantized + other
    full = 4 * parameter_count(model)
    assert quantized + other < (0.2 if q.bits == 4 else 0.32) * full


def test_dequantized_computes_what_the_quantized_model_does(folder: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    quantized = load_model(str(folder), 3, quantization=NF4).model
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = quantized(input_ids=ids).logits
        plain = dequantized(quantized, torch.float32)
        assert not any(type(m).__name__ in QUANTIZED_LAYERS for m in plain.modules())
        assert torch.allclose(plain(input_ids=ids).logits, expected, atol=1e-5)
        plain.save_pretrained(tmp_path / "plain")  # type: ignore[operator]
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
        assert getattr(again.config, "quantization_config", None) is None
        assert torch.allclose(again(input_ids=ids).logits, expected, atol=1e-5)


def test_a_gpt2_base_merges_into_its_own_conv1d_layers(tmp_path: Path) -> None:
    """GPT-2's Conv1D layers are quantized as linear ones (their weight transposed): the merged
    QLoRA model was saved with [out, in] weights where GPT-2 has [in, out], and loaded nowhere."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from lmtune.model.modeling import byte_tokenizer

    tok = byte_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(2))
    quantized = load_model(str(tmp_path / "gpt2"), 3, quantization=NF4).model
    with torch.no_grad():
        expected = quantized(input_ids=ids).logits
        plain = conv1d_restored(dequantized(quantized, torch.float32))
        assert type(plain.get_submodule("transformer.h.0.attn.c_attn")).__name__ == "Conv1D"
        assert torch.allclose(plain(input_ids=ids).logits, expected, atol=1e-5)
        plain.save_pretrained(tmp_path / "plain")  # type: ignore[operator]
        again = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
        assert torch.allclose(again(input_ids=ids).logits, expected, atol=1e-5)


def test_a_bf16_base_is_dequantized_to_bf16_values_kept_in_fp32(folder: Path) -> None:
    """The merged model of a bf16 QLoRA run was cast to bf16 whole (embeddings, norms and head
    that trained in fp32 too) and said so in config.json."""
    from dataclasses import replace

    q = replace(NF4, compute_dtype=torch.bfloat16)
    plain = dequantized(load_model(str(folder), 3, quantization=q).model, torch.bfloat16)
    assert {p.dtype for p in plain.state_dict().values()} == {torch.float32}
    weight = plain.get_submodule("model.layers.0.self_attn.q_proj").weight
    assert torch.equal(weight, weight.to(torch.bfloat16).float())  # bf16's values: what training saw
    norm = build_preset("tiny", 3).model.get_submodule("model.norm").weight  # never quantized
    assert torch.equal(plain.get_submodule("model.norm").weight, norm)
    assert plain.config.dtype == torch.float32


def test_a_resume_with_another_quantization_is_refused() -> None:
    def fp(**values: Any) -> Fingerprint:
        cfg = TrainConfig(lora=True, **values)
        return fingerprint(
            cfg,
            data_key="k",
            examples=8,
            model_config=preset_config("tiny", byte_tokenizer()),
            lr=1e-3,
            total_steps=4,
        )

    nf4, plain = fp(load_in_4bit=True), fp()
    assert compare(nf4, fp(load_in_4bit=True, precision="bf16"), Path("c")) == ["--precision fp32 -> bf16"]
    for saved, now, words in (
        (nf4, plain, "base quantization 4-bit nf4, double quant -> none"),
        (plain, nf4, "base quantization none -> 4-bit nf4, double quant"),
        (nf4, fp(load_in_4bit=True, bnb_4bit_quant_type="fp4"), "4-bit nf4, double quant -> 4-bit fp4"),
        (nf4, fp(load_in_8bit=True), "4-bit nf4, double quant -> 8-bit int8"),
    ):
        # The starting weights' hash differs too, as the quantization does: not said as a change.
        saved.fixed["starting weights (--model)"] = "aaa"
        now.fixed["starting weights (--model)"] = "bbb"
        with pytest.raises(UserError, match=words) as refused:
            compare(saved, now, Path("c"))
        assert "starting weights" not in str(refused.value) and "changed since" not in str(refused.value)


def test_the_model_config_hash_leaves_the_quantization_settings_out(folder: Path) -> None:
    """Precision and strategy may change on resume; they change the quantized config's dtypes."""
    from lmtune.checkpoint.fingerprint import config_hash

    plain = load_model(str(folder), 3).model.config
    bf16 = Quantization(bits=4, quant_type="nf4", compute_dtype=torch.bfloat16, storage_dtype=torch.bfloat16)
    hashes = {config_hash(load_model(str(folder), 3, quantization=q).model.config) for q in (NF4, bf16)}
    assert hashes == {config_hash(plain)}


def test_fsdp_refuses_packed_weights_it_would_cast() -> None:
    from lmtune.parallel.wrap import _check_packed_weights

    model = load_model("tiny", 0, quantization=NF4).model
    _check_packed_weights(model, torch.bfloat16)  # uint8 storage: FSDP2 gathers integers as they are
    packed = Quantization(bits=4, quant_type="nf4", compute_dtype=torch.float32, storage_dtype=torch.float32)
    model = load_model("tiny", 0, quantization=packed).model
    _check_packed_weights(model, None)  # gathered as stored
    with pytest.raises(
        UserError, match=r"holds 4-bit values packed in torch\.float32, which FSDP2 would cast"
    ):
        _check_packed_weights(model, torch.bfloat16)
