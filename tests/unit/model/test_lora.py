"""LoRA through peft: the saved adapter holds the adapters only, and a merge computes what base
and adapter computed, also where an adapted head or input embedding shares its weight with the other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmtune.config.groups import LoraSettings
from lmtune.model.lora import adapter_state, add_lora, merged_model, save_adapter
from lmtune.model.modeling import build_preset

pytest.importorskip("peft")


def _trained_adapter(targets: str, folder: Path) -> torch.Tensor:
    """Logits of the tiny preset under an adapter with nonzero updates, saved to ``folder``."""
    model = add_lora(build_preset("tiny", 0).model, LoraSettings(enabled=True, target_modules=targets))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name or "lora_embedding_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # as training would leave them: away from zero
    state = adapter_state(model)
    assert state and all("lora_" in key for key in state), sorted(state)[:4]  # no embedding copies
    save_adapter(model, folder, state)
    model.eval()  # no LoRA dropout
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=torch.arange(1, 30)[None]).logits
    return logits


@pytest.mark.parametrize(
    ("targets", "tied_after"),
    [
        ("lm_head,q_proj", False),
        ("q_proj,v_proj", True),
        ("embed_tokens", False),
        ("embed_tokens,lm_head", False),
    ],
    ids=["head", "no-head", "embeddings", "both"],
)
def test_merge_computes_what_base_and_adapter_did(targets: str, tied_after: bool, tmp_path: Path) -> None:
    expected = _trained_adapter(targets, tmp_path / "adapter")
    merged = merged_model(build_preset("tiny", 0).model, tmp_path / "adapter")
    embed, head = merged.get_input_embeddings(), merged.get_output_embeddings()  # type: ignore[operator]
    assert (head.weight is embed.weight) == tied_after
    # Trained on from an adapter folder without --lora, every weight of the merged model trains.
    assert all(p.requires_grad for p in merged.parameters())
    ids = torch.arange(1, 30)[None]
    merged.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
    merged.save_pretrained(tmp_path / "merged")
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_a_target_name_that_matches_nothing_is_refused_beside_one_that_does() -> None:
    """peft adapts q_proj alone for q_proj,v_prj; lmtune names the misspelled one."""
    from lmtune.errors import UserError

    with pytest.raises(
        UserError, match=r"v_prj matched no layer of this model \(its linear layers: down_proj"
    ):
        add_lora(build_preset("tiny", 0).model, LoraSettings(enabled=True, target_modules="q_proj,v_prj"))
    full_names = "model.layers.0.self_attn.q_proj,v_proj"  # a full name, and one every block has
    add_lora(build_preset("tiny", 0).model, LoraSettings(enabled=True, target_modules=full_names))
    # None matching (Llama's names on GPT-2): the same words, not peft's.
    with pytest.raises(
        UserError, match=r"q_prj, v_prj matched no layer of this model \(its linear layers: down_proj"
    ):
        add_lora(build_preset("tiny", 0).model, LoraSettings(enabled=True, target_modules="q_prj,v_prj"))


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        ("all-linear", "all-linear"),
        (" all-linear, ", "all-linear"),
        ("q_proj, v_proj,", ["q_proj", "v_proj"]),
    ],
)
def test_target_modules_as_peft_takes_them(written: str, expected: str | list[str]) -> None:
    """A trailing comma (accepted by the settings' check) leaves all-linear what it means."""
    from lmtune.model.lora import target_modules

    assert target_modules(LoraSettings(enabled=True, target_modules=written)) == expected


def test_default_lora_adapts_moe_experts_without_dropout_and_leaves_mambas_unadaptable_layers(
    tmp_path: Path,
) -> None:
    """Under transformers 5 a MoE's experts are weights, not linear layers: peft adapts them (its
    all-linear, as it did their linear layers) only without dropout, and refused the default 0.05
    at start ("ParamWrapper does not work with lora_dropout != 0"). Mamba's out_proj and conv1d
    peft refuses. The default runs, saying what it changed; a dropout given (the default's value too,
    where the CLI says it was given) is refused with the fix;
    the saved MoE adapter passes a checkpoint's checks (export refused it)."""
    from transformers import AutoModelForCausalLM, MambaConfig, Qwen3MoeConfig

    from lmtune.checkpoint.checkpoint_files import _check_adapter
    from lmtune.errors import SettingError

    moe = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    said: list[str] = []
    model = add_lora(AutoModelForCausalLM.from_config(moe), LoraSettings(enabled=True), said.append)
    assert said == [
        "LoRA: no dropout (--lora-dropout 0): peft adapts this model's MoE expert weights only without it"
    ]
    assert any(".experts." in name and "lora_A" in name for name, _ in model.named_parameters())
    save_adapter(model, tmp_path / "moe", adapter_state(model))
    _check_adapter(tmp_path / "moe")
    with pytest.raises(SettingError, match=r"--lora-dropout 0\.1: peft adapts .* give --lora-dropout 0"):
        add_lora(AutoModelForCausalLM.from_config(moe), LoraSettings(enabled=True, dropout=0.1))
    # The default's value given on the command line is given: refused too, as the CLI knows it was.
    given = LoraSettings(enabled=True)
    with pytest.raises(SettingError, match=r"--lora-dropout 0\.05: peft adapts"):
        add_lora(AutoModelForCausalLM.from_config(moe), given, dropout_given=True)
    said.clear()
    mamba = AutoModelForCausalLM.from_config(MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1))
    adapted = add_lora(mamba, LoraSettings(enabled=True), said.append)
    assert said == [
        "LoRA: all-linear leaves out mamba's out_proj and conv1d, which peft does not adapt there"
    ]
    names = {
        name.rpartition(".lora_A")[0].rpartition(".")[2]
        for name, _ in adapted.named_parameters()
        if "lora_A" in name
    }
    assert names and not names & {"out_proj", "conv1d"}
    # Its adapter_config.json names only layers that have an adapter (peft listed out_proj too).
    save_adapter(adapted, tmp_path / "mamba", adapter_state(adapted))
    listed = json.loads((tmp_path / "mamba" / "adapter_config.json").read_text())["target_modules"]
    assert {t.rpartition(".")[2] for t in listed} == names
    _check_adapter(tmp_path / "mamba")
    moe_model = AutoModelForCausalLM.from_config(moe)
    said.clear()  # refused for its targets: no word of the dropout it would have changed
    with pytest.raises(SettingError, match=r"down_proj, gate_up_proj: MoE expert weights, which all-linear"):
        add_lora(moe_model, LoraSettings(enabled=True, target_modules="gate_up_proj,down_proj"), said.append)
    assert said == []


def test_default_lora_leaves_out_linear_layers_with_a_forward_of_their_own() -> None:
    """Llama 4's router is a linear layer whose forward returns a tuple: LoRA on it crashed the first
    step. Experts peft has no mapping for (Llama 4's, GPT-OSS's) were left as they are, unsaid.
    Falcon's linear layers have a forward of their own too, and stay adapted."""
    from transformers import AutoModelForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=2,
    )  # fmt: skip
    said: list[str] = []
    model = add_lora(AutoModelForCausalLM.from_config(config), LoraSettings(enabled=True), said.append)
    assert said == [
        "LoRA: all-linear leaves out Llama4Router: linear layers whose forward returns more than their "
        "output",
        "LoRA: the MoE experts (Llama4TextExperts: weights, not linear layers) are not adapted, as peft maps "
        "such weights for some models only; the adapter trains the other linear layers",
    ]
    ids = torch.arange(1, 20)[None]
    model(input_ids=ids, labels=ids).loss.backward()  # the step that crashed
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    from transformers import FalconConfig

    falcon = FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    said.clear()
    adapted = add_lora(AutoModelForCausalLM.from_config(falcon), LoraSettings(enabled=True), said.append)
    assert not said and any("query_key_value.lora_A" in name for name, _ in adapted.named_parameters())


def test_gpt2s_conv1d_layers_take_lora_without_peft_s_warning(recwarn: pytest.WarningsRecorder) -> None:
    """peft's "fan_in_fan_out is set to False but the target module is 'Conv1D'" showed on every
    GPT-2 LoRA run: it sets the flag itself, as it should."""
    import transformers

    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    model = add_lora(transformers.GPT2LMHeadModel(config), LoraSettings(enabled=True))
    assert any("lora_A" in name for name, _ in model.named_parameters())
    assert not [w for w in recwarn if "fan_in_fan_out" in str(w.message)]
