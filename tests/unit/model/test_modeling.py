from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lmtune.checkpoint.export import save_hf_folder
from lmtune.errors import UserError
from lmtune.model.modeling import build_preset, byte_tokenizer, load_model


def test_byte_tokenizer_round_trips_any_text() -> None:
    tok = byte_tokenizer()
    text = "héllo, wörld 12+3=15 \n\t ☃"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_preset_is_reproducible_from_the_seed() -> None:
    a, b, c = (build_preset("tiny", s).model for s in (1, 1, 2))
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_saved_folder_loads_back_with_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = build_preset("tiny", 0)
    save_hf_folder(loaded.model, loaded.tokenizer, tmp_path / "final")
    assert (tmp_path / "final" / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    tok = AutoTokenizer.from_pretrained(tmp_path / "final")
    x = torch.tensor([tok("12+3=")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(x).logits, loaded.model.eval()(x).logits)
    again = load_model(str(tmp_path / "final"), seed=0)
    assert again.tokenizer.eos_token_id == loaded.tokenizer.eos_token_id


def test_model_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such folder"):
        load_model(str(tmp_path / "missing") + "/", seed=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"has no config\.json"):
        load_model(str(tmp_path / "empty"), seed=0)


def test_a_typo_under_a_folder_offline_names_the_folder_meant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run/fnial reads as a hub id; offline it ended in transformers' URL cut mid-sentence."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "run" / "final").mkdir(parents=True)
    with pytest.raises(UserError) as e:
        load_model("run/fnial", seed=0)
    assert str(e.value).endswith(
        "(HF_HUB_OFFLINE is set, so only the local cache; no folder run/fnial here, though run is one: "
        "did you mean run/final?): not in the local cache"
    )


def test_plan_reads_an_adapter_folder_as_its_base(tmp_path: Path) -> None:
    """`lmtune plan --model RUN/final` of a LoRA run plans what train would load: the base's
    shapes (base and adapter merged), or train's own message for an adapter on a preset."""
    import json

    from lmtune.model.modeling import load_config, model_description

    base = build_preset("small", 0)
    base.model.config.save_pretrained(tmp_path / "base")
    adapter = tmp_path / "final"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(tmp_path / "base")})
    )
    assert load_config(str(adapter)).hidden_size == base.model.config.hidden_size
    assert model_description(str(adapter)).endswith(
        f"(a LoRA adapter, merged into its base {tmp_path / 'base'}, as train loads it)"
    )
    assert model_description("tiny") == "tiny"
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": None}))
    said = r"a LoRA adapter folder that names no base model .*lmtune export RUN/checkpoints/step-N DIR"
    with pytest.raises(UserError, match=said):
        load_config(str(adapter))
    (adapter / "merged").mkdir()  # a run with --merge-lora wrote the merged model beside it
    (adapter / "merged" / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"use the merged model instead: .*final/merged, beside it"):
        load_config(str(adapter))


def test_a_training_checkpoint_given_as_a_model_says_what_it_is(tmp_path: Path) -> None:
    tiny = build_preset("tiny", 0)
    tiny.model.config.save_pretrained(tmp_path)  # a LoRA checkpoint's config and tokenizer, no weights
    tiny.tokenizer.save_pretrained(tmp_path)
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / "trainer.json").write_text("{}")
    with pytest.raises(UserError) as refused:
        load_model(str(tmp_path), seed=0)
    assert str(refused.value) == (  # transformers' reason (no weights file) would only be noise before it
        f"--model {tmp_path}: a training checkpoint, not a model folder: `lmtune export {tmp_path} DIR` "
        "writes a model folder from it"
    )
    # A LoRA run's checkpoint is an adapter folder (the base's config beside it is for export).
    (tmp_path / "adapter_config.json").write_text('{"base_model_name_or_path": null}')
    with pytest.raises(UserError, match=r"a LoRA adapter folder that names no base model .*lmtune export"):
        load_model(str(tmp_path), seed=0)  # away from a run: export cannot rebuild its base either
    # In a run's folder whose run.json names no preset LoRA run, still refused, and said why.
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000002"
    shutil.copytree(tmp_path, checkpoint, ignore=shutil.ignore_patterns("run"))
    (tmp_path / "run" / "run.json").write_text('{"config": {"model": "tiny", "seed": 3}}')  # no lora
    with pytest.raises(UserError, match=r"\(trained on a preset\), away from its run's run.json"):
        load_model(str(checkpoint), seed=0)


def test_what_is_no_complete_causal_model_is_refused(tmp_path: Path) -> None:
    """A checkpoint missing a weight, an encoder (BERT) and an encoder-decoder (BART) trained
    without a word: the first from random weights, BERT looking both ways, BART without its
    encoder. Remote code and a cut-short weights file say what to do."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import BartConfig, BertConfig, BertForMaskedLM

    tok = byte_tokenizer()
    saved = build_preset("tiny", 0)
    saved.model.save_pretrained(tmp_path / "partial")
    tok.save_pretrained(tmp_path / "partial")
    weights = tmp_path / "partial" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"lack 1 the model needs \(model.layers.1.mlp.down_proj.weight\)"):
        load_model(str(tmp_path / "partial"), 0)
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.full((128, 384), float("nan"))
    save_file(tensors, weights, metadata={"format": "pt"})  # said at once, not as a non-finite loss
    with pytest.raises(UserError, match=r"NaN or infinite values \(the first: model.layers.1.mlp.down_proj"):
        load_model(str(tmp_path / "partial"), 0)
    bert = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    BertForMaskedLM(bert).save_pretrained(tmp_path / "bert")
    BartConfig(vocab_size=len(tok), d_model=32).save_pretrained(tmp_path / "bart")
    for name, said in (("bert", r"an encoder \(bert\)"), ("bart", r"an encoder-decoder model \(bart\)")):
        tok.save_pretrained(tmp_path / name)
        with pytest.raises(UserError, match=said):
            load_model(str(tmp_path / name), 0)
    remote = json.loads((tmp_path / "partial" / "config.json").read_text())
    remote |= {"model_type": "mine", "auto_map": {"AutoConfig": "configuration_mine.MyConfig"}}
    (tmp_path / "partial" / "config.json").write_text(json.dumps(remote))
    with pytest.raises(UserError, match="runs only with --trust-remote-code"):
        load_model(str(tmp_path / "partial"), 0)
    saved.model.save_pretrained(tmp_path / "cut")
    tok.save_pretrained(tmp_path / "cut")
    (tmp_path / "cut" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(UserError, match=r"a weights file \(model.safetensors\) is damaged or incomplete"):
        load_model(str(tmp_path / "cut"), 0)


def test_a_model_of_its_own_code_that_cannot_generate_is_named_and_the_demo_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A --trust-remote-code model whose code does not take transformers' generate (its config had
    no num_hidden_layers) ended a finished run with a traceback, at the demo's answers, and so
    did `lmtune generate`: the model's failure is a user error there, and the demo says it and
    ends (the model is saved); lmtune's own models keep their tracebacks."""
    import lmtune.training.demo as demo
    from lmtune.model.generate import _its_own

    class Own(torch.nn.Module):
        def generate(self, **_: object) -> None:
            raise AttributeError("'GRUConfig' object has no attribute 'num_hidden_layers'")

    Own.__module__ = "transformers_modules.gru.abc123.modeling_gru"
    said_of_it = r"model's own code \(--trust-remote-code\) could not generate .*num_hidden_layers"
    with pytest.raises(UserError, match=said_of_it), _its_own(Own()):
        Own().generate()
    with pytest.raises(AttributeError), _its_own(torch.nn.Linear(1, 1)):
        raise AttributeError("lmtune's own bug stays one")

    def cannot(*_: object, **__: object) -> list[str]:
        raise UserError("it cannot")

    said: list[str] = []
    monkeypatch.setattr(demo, "complete_greedy", cannot)
    demo.show_answers(torch.nn.Linear(1, 1), None, SimpleNamespace(info=said.append))
    assert said == ["warning: no held-out answers: it cannot"]
