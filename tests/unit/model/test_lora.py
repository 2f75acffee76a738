"""LoRA through peft: the saved adapter holds the adapters only, and a merge computes what base
and adapter computed, also where an adapted head or input embedding shares its weight with the other."""

from __future__ import annotations

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
