"""QLoRA (LoRA on a 4-bit base) end to end: it tracks plain LoRA, 2 ranks (DDP, FSDP2) train as one
process, resume is exact (also across world size), and what it saves loads elsewhere: the adapter
with peft on the unquantized base, the merged model with transformers.

The runs are launched once per module (real CLI, real launcher, gloo on CPU); every check reads them.
The base is a local model folder (the tiny preset saved), as a user's model would be.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import assert_same_training, run_lmtune, train_rows, uneven_texts, write_jsonl

pytestmark = pytest.mark.distributed
pytest.importorskip("bitsandbytes")

STEPS = 6
GLOBAL_BATCH = 8
TIMEOUT = 600


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "final" / "adapter_model.safetensors")


def _losses(out: Path) -> list[float]:
    return [r["loss"] for r in train_rows(out)]


def _resume_copy(source: Path, step: int, dest: Path) -> Path:
    """A fresh output folder holding only ``source``'s checkpoint of ``step``."""
    name = f"step-{step:06d}"
    (dest / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / name, dest / "checkpoints" / name)
    return dest


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from lmtune.model.modeling import build_preset

    root = tmp_path_factory.mktemp("qlora")
    base = build_preset("tiny", 5)
    base.model.save_pretrained(root / "base")
    base.tokenizer.save_pretrained(root / "base")
    train = write_jsonl(root / "train.jsonl", uneven_texts(STEPS * GLOBAL_BATCH + 3, seed=31))
    evald = write_jsonl(root / "eval.jsonl", uneven_texts(7, seed=32))
    prompts = root / "prompts.jsonl"
    prompts.write_text(json.dumps("alpha beta") + "\n" + json.dumps({"prompt": "gamma"}) + "\n")
    common = [
        *("--model", str(root / "base"), "--data", str(train), "--eval-data", str(evald), "--seed", "5"),
        *("--global-batch-size", str(GLOBAL_BATCH), "--micro-batch-size", "4", "--epochs", "1"),
        *("--eval-every", "3", "--save-every", "3", "--keep-last", "0", "--lr", "3e-3"),
        *("--warmup-ratio", "0.2", "--max-length", "64", "--threads-per-process", "1", "--no-progress"),
        *("--loss-chunk-size", "16", "--lora", "--lora-rank", "4", "--lora-dropout", "0"),
    ]
    two = ["--nproc-per-node", "2"]
    samples = ["--sample-prompts", str(prompts), "--sample-every", "3", "--sample-max-new-tokens", "4"]
    q4 = ["--load-in-4bit"]
    plan: dict[str, list[str]] = {
        "lora": [],
        # One process, 2 micro-steps per step; 2 ranks, one each (with recomputed activations).
        "qlora": [*q4, "--merge-lora", *samples],
        "qlora_ddp": [*q4, *two, "--activation-checkpointing", *samples],
        "qlora_fsdp": [*q4, *two, "--strategy", "fsdp"],
        "qlora_fsdp_bf16": [*q4, *two, "--strategy", "fsdp", "--precision", "bf16"],
        # The other savers at once (rank 32: bitsandbytes keeps fp32 state under 4096 elements).
        "qlora_savers": [
            *q4,
            *two,
            *("--optimizer", "adamw8bit", "--lora-rank", "32", "--packing", "on"),
            *("--report-to", "tensorboard"),
        ],
        "qlora_8bit": ["--load-in-8bit"],
    }
    outs: dict[str, Any] = {"root": root, "base": root / "base", "common": common}
    for name, extra in plan.items():
        outs[name] = root / name
        proc = run_lmtune(["train", *common, *extra, "--output-dir", str(outs[name])], timeout=TIMEOUT)
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    # Resumed from step 3: in the same world size, and DDP's and FSDP2's checkpoints in one process
    # (FSDP2 packs the 4-bit values in fp32: the same base, refused as another one before).
    resumed = (("qlora_resumed", "qlora"), ("qlora_from_ddp", "qlora_ddp"), ("qlora_from_fsdp", "qlora_fsdp"))
    for name, source in resumed:
        outs[name] = _resume_copy(outs[source], 3, root / name)
        proc = run_lmtune(["train", *common, *q4, "--output-dir", str(outs[name])], timeout=TIMEOUT)
        assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        assert "resuming from" in proc.stdout + proc.stderr
    return outs


def test_qlora_tracks_plain_lora(runs: dict[str, Any]) -> None:
    lora, qlora = _losses(runs["lora"]), _losses(runs["qlora"])
    assert len(qlora) == STEPS and qlora[-1] < qlora[0]
    for step, (q, p) in enumerate(zip(qlora, lora, strict=True), start=1):
        assert abs(q - p) <= 0.05 * p, f"step {step}: QLoRA {q} vs LoRA {p}"
    assert qlora != lora  # the base really is quantized


def test_two_ranks_train_as_one_process(runs: dict[str, Any]) -> None:
    one = _losses(runs["qlora"])
    for name in ("qlora_ddp", "qlora_fsdp"):
        assert _losses(runs[name]) == pytest.approx(one, abs=1e-5), name
        assert_same_training(_adapter(runs[name]), _adapter(runs["qlora"]), name)
    evals = [r["eval_loss"] for r in train_rows(runs["qlora"], "eval")]
    assert len(evals) == 2
    for name in ("qlora_ddp", "qlora_fsdp"):
        assert [r["eval_loss"] for r in train_rows(runs[name], "eval")] == pytest.approx(evals, abs=1e-5)


def test_resume_is_exact_and_crosses_world_sizes(runs: dict[str, Any]) -> None:
    resumed, whole = _adapter(runs["qlora_resumed"]), _adapter(runs["qlora"])
    assert all(torch.equal(resumed[k], whole[k]) for k in whole)
    assert _losses(runs["qlora_resumed"]) == _losses(runs["qlora"])[3:]
    # Saved by 2 ranks, continued by one: the same steps to fp32 rounding.
    assert _losses(runs["qlora_from_ddp"]) == pytest.approx(_losses(runs["qlora"])[3:], abs=1e-5)
    assert_same_training(_adapter(runs["qlora_from_ddp"]), whole, "2 ranks -> 1 process")
    assert _losses(runs["qlora_from_fsdp"]) == pytest.approx(_losses(runs["qlora"])[3:], abs=1e-5)
    assert_same_training(_adapter(runs["qlora_from_fsdp"]), whole, "FSDP2 on 2 ranks -> 1 process")


def test_run_json_names_the_quantization(runs: dict[str, Any]) -> None:
    names = ("lora", "qlora", "qlora_fsdp_bf16", "qlora_8bit")
    resolved = {n: json.loads((runs[n] / "run.json").read_text())["resolved"] for n in names}
    assert resolved["qlora"]["quantization"] == "nf4, double quant, compute fp32"
    packed = "nf4, double quant, compute bf16, packed in bf16 (for FSDP2)"
    assert resolved["qlora_fsdp_bf16"]["quantization"] == packed
    assert resolved["qlora_8bit"]["quantization"].startswith("int8")
    assert resolved["lora"]["quantization"] is None
    # The parameters the 4-bit base stands for, and the bytes it takes.
    assert resolved["qlora"]["parameters"] == resolved["lora"]["parameters"]
    size = resolved["qlora"]["base_bytes"]
    assert size["quantized"] + size["full_precision"] < 0.25 * 4 * resolved["lora"]["parameters"]


def test_fsdp_bf16_and_the_other_savers_train(runs: dict[str, Any]) -> None:
    fp32 = _losses(runs["qlora"])
    bf16 = _losses(runs["qlora_fsdp_bf16"])
    assert bf16 == pytest.approx(fp32, rel=0.02)  # packed in bf16, gathered as is: not garbage
    for name in ("qlora_savers", "qlora_8bit"):
        losses = _losses(runs[name])
        assert len(losses) == STEPS and losses[-1] < losses[0], name
    assert list((runs["qlora_savers"] / "tensorboard").glob("**/events.out.tfevents.*"))
    for name in ("qlora", "qlora_ddp"):
        samples = train_rows(runs[name], "sample")
        assert [(r["step"], r["prompt"]) for r in samples] == [
            (step, prompt) for step in (3, 6) for prompt in ("alpha beta", "gamma")
        ], name


def test_the_adapter_loads_with_peft_on_the_unquantized_base(runs: dict[str, Any]) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = runs["qlora"] / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(runs["base"])
    base = AutoModelForCausalLM.from_pretrained(runs["base"]).eval()
    ids = torch.tensor([[257, 97, 108, 112, 104, 97]])
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, final).eval()
        assert float((adapted(input_ids=ids).logits - plain).abs().max()) > 1e-3
        out = adapted.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    AutoTokenizer.from_pretrained(final).decode(out[0])


def test_merged_is_the_dequantized_base_with_the_adapter(runs: dict[str, Any], tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from lmtune.checkpoint.export import export
    from lmtune.model.modeling import load_model
    from lmtune.model.quantization import Quantization, dequantized

    merged = AutoModelForCausalLM.from_pretrained(runs["qlora"] / "final" / "merged").eval()
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    q = Quantization(bits=4, quant_type="nf4", compute_dtype=torch.float32, storage_dtype=torch.uint8)
    trained = dequantized(load_model(str(runs["base"]), 5, quantization=q).model, torch.float32)
    trained = PeftModel.from_pretrained(trained, runs["qlora"] / "final").eval()
    original = AutoModelForCausalLM.from_pretrained(runs["base"]).eval()
    ids = torch.tensor([[257, 97, 108, 112, 104, 97]])
    with torch.no_grad():
        m, t, o = (x(input_ids=ids).logits for x in (merged, trained, original))
    assert float((m - t).abs().max()) <= 1e-4
    assert float((m - o).abs().max()) > 1e-3  # merged into the 4-bit values, not the original weights
    # The adapter folders as --model (generate, a reference model) merge as --merge-lora did, and
    # an exported adapter too.
    export(runs["qlora"] / "checkpoints" / "step-000006", tmp_path / "exported")
    for folder in ("final", "checkpoints/step-000006", str(tmp_path / "exported")):
        adapted = load_model(str(runs["qlora"] / folder), 5)
        assert "(4-bit nf4, as trained) + adapter" in adapted.source  # eval's line: a 4-bit base's loss
        loaded = adapted.model.eval()
        with torch.no_grad():
            assert float((loaded(input_ids=ids).logits - m).abs().max()) <= 1e-4, folder


def test_export_of_a_qlora_checkpoint_is_the_adapter(runs: dict[str, Any], tmp_path: Path) -> None:
    from lmtune.checkpoint.export import export

    export(runs["qlora"] / "checkpoints" / "step-000006", tmp_path / "exported")
    exported = load_file(tmp_path / "exported" / "adapter_model.safetensors")
    final = _adapter(runs["qlora"])
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)


def test_resuming_with_another_quantization_is_refused(runs: dict[str, Any], tmp_path: Path) -> None:
    out = _resume_copy(runs["qlora"], 3, tmp_path / "o")
    proc = run_lmtune(["train", *runs["common"], "--output-dir", str(out)], timeout=TIMEOUT)
    assert proc.returncode == 2, proc.stderr
    assert "base quantization 4-bit nf4, double quant -> none" in proc.stderr
    assert "changed since the checkpoint" not in proc.stderr  # the weights did not: their storage did
    assert "Traceback" not in proc.stderr
