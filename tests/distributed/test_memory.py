"""Memory savers under every strategy: FSDP2 == DDP, LoRA under DDP/FSDP2 == LoRA in one process,
sharded and adapter checkpoints that resume, and the folders they export.

The runs are launched once per module (real CLI, real launcher, gloo on CPU); every check reads them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import run_lmtune, train_rows, uneven_texts, write_jsonl

pytestmark = pytest.mark.distributed

STEPS = 6
GLOBAL_BATCH = 8
SAMPLE_PROMPTS = ["the ", {"prompt": "a b"}, {"messages": [{"role": "user", "content": "hi"}]}]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model or adapter folder (one file or Hugging Face's sharded layout)."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    assert out, f"no safetensors in {folder}"
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _resume_copy(source: Path, step: int, dest: Path) -> Path:
    """A fresh output folder holding only ``source``'s checkpoint of ``step``."""
    name = f"step-{step:06d}"
    (dest / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / name, dest / "checkpoints" / name)
    return dest


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("memory")
    train = write_jsonl(root / "train.jsonl", uneven_texts(STEPS * GLOBAL_BATCH + 3, seed=21))
    evald = write_jsonl(root / "eval.jsonl", uneven_texts(7, seed=22))  # odd: FSDP ranks hold 4 and 3
    common = [
        *("--model", "tiny", "--data", str(train), "--eval-data", str(evald), "--seed", "5"),
        *("--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", "2", "--epochs", "1"),
        *("--eval-every", "3", "--save-every", "3", "--keep-last", "0", "--lr", "1e-3"),
        *("--warmup-ratio", "0.2", "--max-length", "64", "--threads-per-process", "1", "--no-progress"),
        *("--loss-chunk-size", "16"),  # the chunked loss, in many chunks, under every strategy
    ]
    lora = ["--lora", "--lora-rank", "4", "--lora-dropout", "0", "--lr", "3e-3"]
    two = ["--nproc-per-node", "2"]
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in SAMPLE_PROMPTS))
    samples = ["--sample-prompts", str(prompts), "--sample-every", "4", "--sample-max-new-tokens", "6"]
    plan: dict[str, list[str]] = {
        "ddp": [*two, "--strategy", "ddp", *samples],
        "fsdp": [*two, "--strategy", "fsdp", *samples],
        "ddp_full_logits": [*two, "--strategy", "ddp", "--loss-chunk-size", "0"],
        "fsdp_ckpt": [*two, "--strategy", "fsdp", "--activation-checkpointing"],
        "fsdp_bf16": [*two, "--strategy", "fsdp", "--precision", "bf16"],
        "lora_single": [*lora, "--merge-lora"],
        "lora_ddp": [*two, *lora],
        "lora_fsdp": [*two, *lora, "--strategy", "fsdp"],
        # Every saver at once under DDP.
        # (Rank 32: bitsandbytes keeps fp32 state for tensors under 4096 elements, as rank 4's are.)
        "ddp_all_savers": [
            *two,
            *lora,
            "--lora-rank",
            "32",
            "--optimizer",
            "adamw8bit",
            "--activation-checkpointing",
        ],
    }
    # A base model in a local folder, as a hub model would be: the adapter then names its base.
    from lmtune.model.modeling import load_model

    base = load_model("tiny", 5)
    base.model.save_pretrained(root / "base")
    base.tokenizer.save_pretrained(root / "base")
    plan["lora_folder_base"] = [*lora, "--model", str(root / "base")]
    outs: dict[str, Path] = {"base": root / "base"}
    for name, extra in plan.items():
        outs[name] = root / name
        proc = run_lmtune(["train", *common, *extra, "--output-dir", str(outs[name])])
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    # Resumed from step 3: FSDP's sharded checkpoint in one process (DCP reshards), LoRA's adapter.
    resumed = {
        "fsdp_resumed_single": ("fsdp", ["--strategy", "fsdp"]),
        "lora_resumed": ("lora_single", lora),
    }
    for name, (source, extra) in resumed.items():
        outs[name] = _resume_copy(outs[source], 3, root / name)
        proc = run_lmtune(["train", *common, *extra, "--output-dir", str(outs[name])])
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
        assert "resuming from" in proc.stdout + proc.stderr
    outs["common_args"] = root  # for the error case below
    (root / "common.json").write_text(json.dumps(common))
    return outs


def test_fsdp_trains_like_ddp(runs: dict[str, Path]) -> None:
    ddp, fsdp = train_rows(runs["ddp"]), train_rows(runs["fsdp"])
    assert [r["step"] for r in fsdp] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in fsdp] == pytest.approx([r["loss"] for r in ddp], abs=1e-6)
    assert [r["target_tokens"] for r in fsdp] == [r["target_tokens"] for r in ddp]
    assert _max_diff(_weights(runs["fsdp"] / "final"), _weights(runs["ddp"] / "final")) <= 1e-5
    run = json.loads((runs["fsdp"] / "run.json").read_text())
    assert run["resolved"]["strategy"] == "fsdp" and run["resolved"]["accumulation"] == 2


def test_the_chunked_loss_trains_like_full_logits(runs: dict[str, Path]) -> None:
    chunked, full = train_rows(runs["ddp"]), train_rows(runs["ddp_full_logits"])
    assert [r["loss"] for r in chunked] == pytest.approx([r["loss"] for r in full], rel=1e-6)
    assert [r["grad_norm"] for r in chunked] == pytest.approx([r["grad_norm"] for r in full], rel=1e-5)
    assert _max_diff(_weights(runs["ddp"] / "final"), _weights(runs["ddp_full_logits"] / "final")) <= 1e-5
    resolved = {
        k: json.loads((runs[k] / "run.json").read_text())["resolved"] for k in ("ddp", "ddp_full_logits")
    }
    assert resolved["ddp"]["loss"] == "chunked linear cross-entropy (16 tokens per chunk)"
    assert resolved["ddp_full_logits"]["loss"] == "full logits (--loss-chunk-size 0)"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_samples_are_generated_at_their_steps(runs: dict[str, Path], strategy: str) -> None:
    """--sample-every 4 of 6 steps: at step 4 and at the end; under FSDP every rank decodes in
    lockstep (a rank that left early would hang the others), under DDP rank 0 alone."""
    rows = [json.loads(line) for line in (runs[strategy] / "metrics.jsonl").read_text().splitlines()]
    samples = [r for r in rows if r["kind"] == "sample"]
    assert [(r["step"], r["prompt"]) for r in samples] == [
        (step, prompt) for step in (4, 6) for prompt in ("the ", "a b", "hi")
    ]
    assert all(0 <= r["tokens"] <= 6 and isinstance(r["completion"], str) for r in samples)
    assert all(r["stopped"] or r["tokens"] == 6 for r in samples)


def test_fsdp_with_activation_checkpointing_trains_the_same(runs: dict[str, Path]) -> None:
    plain, ckpt = train_rows(runs["fsdp"]), train_rows(runs["fsdp_ckpt"])
    assert [r["loss"] for r in ckpt] == pytest.approx([r["loss"] for r in plain], abs=1e-6)
    assert _max_diff(_weights(runs["fsdp_ckpt"] / "final"), _weights(runs["fsdp"] / "final")) <= 1e-5


def test_fsdp_bf16_keeps_fp32_master_weights_and_trains(runs: dict[str, Path]) -> None:
    losses = [r["loss"] for r in train_rows(runs["fsdp_bf16"])]
    assert losses[-1] < losses[0]
    assert [r["loss"] for r in train_rows(runs["fsdp"])] == pytest.approx(losses, rel=0.05)
    assert all(t.dtype == torch.float32 for t in _weights(runs["fsdp_bf16"] / "final").values())


def test_fsdp_shards_optimizer_state(runs: dict[str, Path]) -> None:
    def state_bytes(name: str) -> list[int]:
        result: dict[str, Any] = json.loads((runs[name] / "run.json").read_text())["result"]
        return list(result["optimizer_state_bytes_per_rank"])

    ddp, fsdp = state_bytes("ddp"), state_bytes("fsdp")
    assert ddp[0] == ddp[1]
    assert sum(fsdp) == pytest.approx(ddp[0], rel=0.01)  # each rank holds about half
    assert max(fsdp) < 0.6 * ddp[0]


def test_fsdp_eval_counts_every_example_once(runs: dict[str, Path]) -> None:
    evals = {k: train_rows(runs[k], "eval") for k in ("ddp", "fsdp")}
    for a, b in zip(evals["ddp"], evals["fsdp"], strict=True):
        assert a["eval_examples"] == b["eval_examples"] == 7
        assert b["eval_loss"] == pytest.approx(a["eval_loss"], abs=1e-6)


def test_fsdp_final_is_a_sharded_hugging_face_folder(runs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    final = runs["fsdp"] / "final"
    assert (final / "model.safetensors.index.json").is_file()
    assert len(list(final.glob("model-*-of-*.safetensors"))) == 4 + 1  # 4 blocks + the rest
    model = AutoModelForCausalLM.from_pretrained(final)
    loaded = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert _max_diff(loaded, _weights(final)) == 0.0


def test_fsdp_checkpoint_resumes_in_one_process(runs: dict[str, Path]) -> None:
    ckpt = runs["fsdp"] / "checkpoints" / "step-000003"
    assert sorted(p.name for p in (ckpt / "sharded").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    diff = _max_diff(_weights(runs["fsdp_resumed_single"] / "final"), _weights(runs["fsdp"] / "final"))
    assert diff <= 1e-5
    resumed = train_rows(runs["fsdp_resumed_single"])
    assert [r["step"] for r in resumed] == [4, 5, 6]
    expected = [r["loss"] for r in train_rows(runs["fsdp"])[3:]]
    assert [r["loss"] for r in resumed] == pytest.approx(expected, abs=1e-6)
    # The steps before ran on 2 sharding ranks: run.json's layout is the last attempt's.
    record = json.loads((runs["fsdp_resumed_single"] / "run.json").read_text())["resolved"]
    moved = ["processes 2 -> 1", "sharding fsdp -> none"]
    assert record["changed_on_resume"] == [{"step": 3, "changes": moved}]


def test_export_of_a_sharded_checkpoint_equals_final(runs: dict[str, Path], tmp_path: Path) -> None:
    from lmtune.checkpoint.export import export

    export(runs["fsdp"] / "checkpoints" / "step-000006", tmp_path / "exported")
    exported = _weights(tmp_path / "exported")
    final = _weights(runs["fsdp"] / "final")
    assert _max_diff({k: exported[k] for k in final}, final) == 0.0


def test_lora_under_ddp_and_fsdp_equals_one_process(runs: dict[str, Path]) -> None:
    single = _weights(runs["lora_single"] / "final")
    assert all("lora_" in k for k in single)
    for other in ("lora_ddp", "lora_fsdp"):
        assert _max_diff(_weights(runs[other] / "final"), single) <= 1e-5, other
        rows = train_rows(runs[other])
        assert [r["loss"] for r in rows] == pytest.approx(
            [r["loss"] for r in train_rows(runs["lora_single"])], abs=1e-6
        )
    lora_losses = [r["loss"] for r in train_rows(runs["lora_single"])]
    assert lora_losses[-1] < lora_losses[0]


def test_lora_trains_only_the_adapter(runs: dict[str, Path]) -> None:
    run = json.loads((runs["lora_ddp"] / "run.json").read_text())
    full = json.loads((runs["ddp"] / "run.json").read_text())
    trainable = run["resolved"]["trainable_parameters"]
    assert 0 < trainable < 0.1 * full["resolved"]["trainable_parameters"]
    ratio = (
        run["result"]["optimizer_state_bytes_per_rank"][0]
        / full["result"]["optimizer_state_bytes_per_rank"][0]
    )
    assert ratio == pytest.approx(trainable / full["resolved"]["trainable_parameters"], rel=0.01)
    ckpt = runs["lora_ddp"] / "checkpoints" / "step-000006"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()


def test_lora_checkpoint_resumes_bit_identically(runs: dict[str, Path]) -> None:
    assert _max_diff(_weights(runs["lora_resumed"] / "final"), _weights(runs["lora_single"] / "final")) == 0.0


def test_lora_final_loads_with_peft_and_merged_with_transformers(runs: dict[str, Path]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lmtune.model.modeling import load_model

    final = runs["lora_single"] / "final"
    adapted = PeftModel.from_pretrained(load_model("tiny", 5).model, final).eval()
    merged = AutoModelForCausalLM.from_pretrained(final / "merged").eval()
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        a, b = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
        base = load_model("tiny", 5).model.eval()(input_ids=ids).logits
    assert float((a - b).abs().max()) <= 1e-4
    assert float((a - base).abs().max()) > 1e-3  # the adapter changed something


def test_resuming_a_lora_checkpoint_without_lora_is_a_clear_error(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    common = json.loads((runs["common_args"] / "common.json").read_text())
    out = _resume_copy(runs["lora_single"], 3, tmp_path / "o")
    proc = run_lmtune(["train", *common, "--output-dir", str(out)])
    assert proc.returncode == 2, proc.stderr
    assert (
        "saved by LoRA under single/ddp; this run (full fine-tuning under single/ddp) cannot" in proc.stderr
    )
    assert "Traceback" not in proc.stderr


def test_all_savers_together_under_ddp(runs: dict[str, Path]) -> None:
    losses = [r["loss"] for r in train_rows(runs["ddp_all_savers"])]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    run = json.loads((runs["ddp_all_savers"] / "run.json").read_text())
    fp32_adamw = 8 * run["resolved"]["trainable_parameters"]
    assert run["result"]["optimizer_state_bytes_per_rank"][0] <= 0.3 * fp32_adamw


def test_8bit_with_fsdp_is_refused_with_the_reason(runs: dict[str, Path], tmp_path: Path) -> None:
    common = json.loads((runs["common_args"] / "common.json").read_text())
    args = ["--nproc-per-node", "2", "--strategy", "fsdp", "--optimizer", "adamw8bit"]
    proc = run_lmtune(["train", *common, *args, "--output-dir", str(tmp_path / "o")], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("--optimizer: does not work with --strategy fsdp") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_adapter_folder_loads_as_a_model_through_its_base(runs: dict[str, Path], tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lmtune.checkpoint.export import export
    from lmtune.model.modeling import load_model

    final = runs["lora_folder_base"] / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(runs["base"])
    merged = load_model(str(final), seed=0).model.eval()  # what `lmtune generate --model final` loads
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(runs["base"]), final).eval()
    ids = torch.tensor([[1, 50, 51, 52]])
    with torch.no_grad():
        assert float((merged(input_ids=ids).logits - adapted(input_ids=ids).logits).abs().max()) <= 1e-4
    export(runs["lora_folder_base"] / "checkpoints" / "step-000006", tmp_path / "adapter")
    assert _max_diff(_weights(tmp_path / "adapter"), _weights(final)) == 0.0
    # Its last checkpoint, an adapter beside the base's config, loads as final/ does (generate, --model).
    checkpoint = load_model(
        str(runs["lora_folder_base"] / "checkpoints" / "step-000006"), seed=0
    ).model.eval()
    with torch.no_grad():
        assert torch.equal(checkpoint(input_ids=ids).logits, merged(input_ids=ids).logits)
    # An adapter of a preset names no base: its run's run.json does, with the seed that built it
    # (not the caller's 0): the very model --merge-lora wrote.
    preset_adapter = load_model(str(runs["lora_single"] / "final"), seed=0).model.eval()
    written = load_model(str(runs["lora_single"] / "final" / "merged"), seed=0).model.eval()
    with torch.no_grad():
        assert torch.equal(preset_adapter(input_ids=ids).logits, written(input_ids=ids).logits)


def test_a_planted_payload_in_a_sharded_checkpoint_runs_nothing(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    """DCP's index is a pickle: a crafted one (with a manifest made to match) is refused on resume
    and on export, and its code never runs."""
    import pickle

    from tests.integration.test_resume_rules import _rewrite_manifest
    from tests.unit.checkpoint.test_integrity import Payload

    common = json.loads((runs["common_args"] / "common.json").read_text())
    out = _resume_copy(runs["fsdp"], 3, tmp_path / "o")
    ckpt = out / "checkpoints" / "step-000003"
    marker = tmp_path / "ran"
    (ckpt / "sharded" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    _rewrite_manifest(ckpt)
    resumed = run_lmtune(["train", *common, "--strategy", "fsdp", "--output-dir", str(out)])
    exported = run_lmtune(["export", str(ckpt), str(tmp_path / "exported")])
    for proc in (resumed, exported):
        assert proc.returncode == 2, proc.stderr
        assert "sharded/.metadata: refused" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists()
