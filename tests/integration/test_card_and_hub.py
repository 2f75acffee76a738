"""What a finished run hands over: the count of what trained, a model card the hub reads (and
whose code runs), and the upload to the hub (huggingface_hub's HfApi mocked: nothing leaves here)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import huggingface_hub
import pytest
import torch
from huggingface_hub import ModelCard

from lmtune.cli import main
from lmtune.config.run_groups import CheckpointSettings
from lmtune.errors import UserError
from lmtune.outputs import hub

REPO_ID = "someone/tiny-chat"
CHAT = [{"role": "user", "content": f"what is {i}+1?"} for i in range(6)]


def _write_chat(path: Path) -> Path:
    rows = [{"messages": [m, {"role": "assistant", "content": f"{i + 1}."}]} for i, m in enumerate(CHAT)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@contextlib.contextmanager
def fake_hub(fail: Exception | None = None) -> Iterator[Any]:
    """HfApi with the real one's signatures (autospec), a token, and the hub not offline."""
    api = mock.create_autospec(huggingface_hub.HfApi, instance=True, spec_set=True)
    api.create_repo.side_effect = fail or (lambda repo_id, **kw: f"https://huggingface.co/{repo_id}")

    class FakeApi:  # a class, as modules that annotate with HfApi need
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            return api

    with (
        mock.patch.object(huggingface_hub, "HfApi", FakeApi),
        mock.patch.object(huggingface_hub, "get_token", lambda: "hf_fake"),
        mock.patch.object(huggingface_hub.constants, "HF_HUB_OFFLINE", False),
    ):
        yield api


def _train(argv: list[str], api_fail: Exception | None = None) -> tuple[int, str, Any]:
    out = io.StringIO()
    with fake_hub(api_fail) as api, contextlib.redirect_stdout(out):
        code = main(["train", "--no-progress", *argv])
    return code, out.getvalue(), api


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, Any]:
    tmp = tmp_path_factory.mktemp("lora")
    data = str(_write_chat(tmp / "chat.jsonl"))
    out = tmp / "out"
    argv = ["--lora", "--merge-lora", "--data", data, "--eval-data", data, "--max-steps", "2"]
    argv += ["--global-batch-size", "3", "--output-dir", str(out), "--push-to-hub", REPO_ID, "--hub-private"]
    code, stdout, api = _train(argv)
    assert code == 0, stdout
    return out, stdout, api


def _lora_parameters(model: str) -> int:
    """LoRA's parameters, counted from the preset's shapes: r x (in + out) per adapted linear layer."""
    from lmtune.model.modeling import PRESETS

    p, r = PRESETS[model], 16
    per_block = 4 * r * (p.hidden_size + p.hidden_size) + 3 * r * (p.hidden_size + p.intermediate_size)
    return p.num_layers * per_block


def test_the_start_line_and_run_json_count_what_trains(lora_run: tuple[Path, str, Any]) -> None:
    out, stdout, _ = lora_run
    resolved = json.loads((out / "run.json").read_text())["resolved"]
    trainable = _lora_parameters("tiny")
    assert resolved["trainable_parameters"] == trainable == 163_840
    total = resolved["parameters"]
    share = 100 * trainable / total
    assert f"{total:,} parameters ({trainable:,} trainable: {share:.1f}%, the LoRA adapters)" in stdout
    assert "sample:eval" not in stdout


def _front_matter(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = ModelCard.load(path).data.to_dict()  # as the hub reads it
    return data


def test_cards_say_how_it_was_trained_and_load(lora_run: tuple[Path, str, Any]) -> None:
    out, _, _ = lora_run
    run = json.loads((out / "run.json").read_text())
    adapter, merged = out / "final" / "README.md", out / "final" / "merged" / "README.md"
    meta = _front_matter(adapter)
    assert meta["library_name"] == "peft" and {"lmtune", "lora"} <= set(meta["tags"])
    assert "base_model" not in meta  # a preset has no hub id to name
    assert _front_matter(merged)["library_name"] == "transformers"
    text = adapter.read_text()
    for needed in ("## Training", "## Results", "## Chat template and stop tokens", "## How to use"):
        assert needed in text
    assert f"{run['result']['eval']['loss']:.4f}" in text  # the final evaluation
    assert "rank 16, alpha 32.0" in text and "163,840 of" in text
    assert "`<|eos|>`" in text  # the stop token, by name
    assert "only lmtune builds" in text  # an adapter of a preset: load the merged model
    merged_text = merged.read_text()
    assert f'from_pretrained("{REPO_ID}")' in merged_text  # the pushed folder loads from the repo
    assert f'from_pretrained("{out / "final"}")' not in merged_text


def test_export_merge_lora_writes_what_train_merged(
    lora_run: tuple[Path, str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lmtune export CHECKPOINT DIR --merge-lora` rebuilds the base from the run's record (a
    preset: from its seed) and merges the checkpoint's adapter: final/merged's very weights."""
    from safetensors.torch import load_file

    out, _, _ = lora_run
    last = sorted((out / "checkpoints").iterdir())[-1]
    assert main(["export", str(last), str(tmp_path / "merged"), "--merge-lora"]) == 0
    exported = load_file(tmp_path / "merged" / "model.safetensors")
    trained = load_file(out / "final" / "merged" / "model.safetensors")
    assert exported.keys() == trained.keys()
    assert all(torch.equal(exported[k], trained[k]) for k in trained)
    moved = tmp_path / "elsewhere" / "checkpoints" / last.name  # away from its run's run.json
    shutil.copytree(last, moved)
    capsys.readouterr()
    assert main(["export", str(moved), str(tmp_path / "m2"), "--merge-lora"]) == 2
    said = capsys.readouterr().err
    assert "rebuilds the base from the run that saved the checkpoint, and it is not in a run's folder" in said
    # The preset base is built by lmtune alone: peft's merge, which needs the base, is not offered.
    assert said.rstrip().endswith("; export it from its run's folder") and "peft" not in said
    # The adapter alone, of a preset base that names no base model: the export says how to load it.
    assert main(["export", str(last), str(tmp_path / "adapter")]) == 0
    said = capsys.readouterr().out
    assert "is a LoRA adapter of a built-in preset, which only lmtune builds" in said
    assert f"`lmtune export {last} DIR --merge-lora` writes a model that loads anywhere" in said


def test_an_adapter_of_a_preset_is_evaluated_on_the_base_its_run_built(
    lora_run: tuple[Path, str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lmtune eval --model RUN/final` of a LoRA run on a preset was refused (the adapter names no
    base): its run.json names the preset and the seed that built it, so it scores what the run
    evaluated last, as its checkpoint does."""
    out, _, _ = lora_run
    run = json.loads((out / "run.json").read_text())
    data = run["config"]["eval_data"]
    last = sorted((out / "checkpoints").iterdir())[-1]
    for model in (out / "final", last):
        capsys.readouterr()
        assert main(["eval", data, "--model", str(model), "--json", str(tmp_path / "e.json")]) == 0
        scored = json.loads((tmp_path / "e.json").read_text())["loss"]
        assert scored == pytest.approx(run["result"]["eval"]["loss"], abs=1e-6), model
    # A checkpoint moved into the folder of a run of another seed is not loaded on that run's base.
    other = tmp_path / "other"
    shutil.copytree(last, other / "checkpoints" / last.name)
    (other / "run.json").write_text(json.dumps({**run, "config": {**run["config"], "seed": 7}}))
    assert main(["eval", data, "--model", str(other / "checkpoints" / last.name)]) == 2
    assert "away from its run's run.json" in capsys.readouterr().err


def test_the_cards_code_runs(lora_run: tuple[Path, str, Any]) -> None:
    out, _, _ = lora_run
    folder = out / "final" / "merged"
    code = re.search(r"```python\n(.*?)```", (folder / "README.md").read_text(), re.S)
    assert code is not None
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code.group(1).replace(REPO_ID, str(folder)), {})  # the same code, on the local copy
    assert printed.getvalue().endswith("\n")  # it printed the reply (the untrained model's, maybe empty)


def test_push_to_hub_uploads_the_merged_model_at_the_end(lora_run: tuple[Path, str, Any]) -> None:
    out, stdout, api = lora_run
    api.create_repo.assert_called_once_with(REPO_ID, repo_type="model", private=True, exist_ok=True)
    (call,) = api.upload_folder.call_args_list
    assert call.kwargs["repo_id"] == REPO_ID and Path(call.kwargs["folder_path"]) == out / "final" / "merged"
    assert f"pushed {out / 'final' / 'merged'} to https://huggingface.co/{REPO_ID}" in stdout


def test_a_failed_push_is_a_warning_with_the_command_to_retry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "final").mkdir()
    settings = CheckpointSettings(push_to_hub=REPO_ID, hub_private=True)
    with fake_hub(fail=OSError("connection reset\nby peer")):
        assert not hub.push_final(tmp_path, settings, merged=False, log=mock.Mock())
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "OSError: connection reset by peer" in err
    assert f"to retry: lmtune push {tmp_path / 'final'} {REPO_ID} --private" in err


def test_full_model_card_export_card_and_lmtune_push(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = str(_write_chat(tmp_path / "chat.jsonl"))
    out = tmp_path / "out"
    argv = ["--data", data, "--eval-data", data, "--max-steps", "2", "--global-batch-size", "3"]
    argv += ["--neftune-alpha", "5"]
    code, log, _ = _train([*argv, "--save-every", "1", "--keep-last", "0", "--output-dir", str(out)])
    assert code == 0 and "; NEFTune noise alpha 5\n" in log
    final = out / "final"
    assert _front_matter(final / "README.md")["library_name"] == "transformers"
    assert "; NEFTune noise on the input embeddings (alpha 5.0)" in (final / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", (final / "README.md").read_text(), re.S)
    assert snippet is not None and f'from_pretrained("{final}")' in snippet.group(1)
    exec(snippet.group(1), {})
    # lmtune export: the card of the checkpoint, with the results of its own step.
    exported = tmp_path / "step1"
    assert main(["export", str(out / "checkpoints" / "step-000001"), str(exported)]) == 0
    card = (exported / "README.md").read_text()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step1 = next(r for r in rows if r["kind"] == "train" and r["step"] == 1)
    assert "Exported from the checkpoint of step 1" in card and f"{step1['loss']:.4f}" in card
    assert card.count(f'from_pretrained("{exported}")') == 2 and "# step1\n" in card  # not its .tmp name
    capsys.readouterr()
    assert (
        main(["export", str(out / "checkpoints" / "step-000001"), str(tmp_path / "m"), "--merge-lora"]) == 2
    )
    assert "holds the whole model, no LoRA adapter to merge (--merge-lora)" in capsys.readouterr().err
    # lmtune push: any saved folder, with a card for the repo uploaded in place of the folder's
    # (the folder itself is not touched, pushed or not); a user's own README is pushed as it is.
    before = {p: p.read_bytes() for p in final.iterdir() if p.is_file()}
    with fake_hub() as api:
        assert main(["push", str(final), REPO_ID]) == 0
    assert api.upload_folder.call_args.kwargs["folder_path"] == final
    assert "README.md" in api.upload_folder.call_args.kwargs["ignore_patterns"]
    (card_call,) = api.upload_file.call_args_list
    assert card_call.kwargs["path_in_repo"] == "README.md" and card_call.kwargs["repo_id"] == REPO_ID
    assert f'from_pretrained("{REPO_ID}")' in card_call.kwargs["path_or_fileobj"].decode()
    with fake_hub(fail=OSError("no network")):
        assert main(["push", str(final), REPO_ID]) == 2
    assert {p: p.read_bytes() for p in final.iterdir() if p.is_file()} == before
    # ... so the run's records of what it wrote still hold: it continues, replacing final/.
    capsys.readouterr()
    code, _, _ = _train([*argv, "--max-steps", "3", "--save-every", "1", "--output-dir", str(out)])
    assert code == 0, capsys.readouterr().err
    checkpoint = out / "checkpoints" / "step-000001"
    assert main(["push", str(checkpoint), REPO_ID]) == 2
    assert f"{checkpoint}: a training checkpoint; export it first" in capsys.readouterr().err
    assert main(["push", str(out), REPO_ID]) == 2
    assert (
        f"(no config.json or adapter_config.json); a run folder: push its final model, {final}"
        in capsys.readouterr().err
    )
    # An export's card is pushed with what export wrote of its run and step (it was made again
    # from the folder alone: "an unrecorded model", no results), loading from the repo.
    with fake_hub() as api:
        assert main(["push", str(exported), REPO_ID]) == 0
    pushed = api.upload_file.call_args.kwargs["path_or_fileobj"].decode()
    assert pushed == card.replace(f'"{exported}"', f'"{REPO_ID}"').replace(
        f"--model {exported}", f"--model {REPO_ID}"
    ).replace("\n# step1\n", "\n# tiny-chat\n")
    assert str(exported) not in pushed and "Exported from the checkpoint of step 1" in pushed
    assert (exported / "README.md").read_text() == card
    (exported / "README.md").write_text("# mine\n")
    with fake_hub() as api:
        assert main(["push", str(exported), REPO_ID, "--private"]) == 0
    assert "README.md" not in api.upload_folder.call_args.kwargs["ignore_patterns"]
    assert not api.upload_file.called
    assert (exported / "README.md").read_text() == "# mine\n"
    assert "was not written by lmtune" in capsys.readouterr().out


def test_push_needs_a_token_a_repo_id_and_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_hub():
        hub.check_push(REPO_ID)
        with pytest.raises(UserError, match="--push-to-hub no/such/repo: not a hub repo id"):
            hub.check_push("no/such/repo")
        with (
            mock.patch.object(huggingface_hub, "get_token", lambda: None),
            pytest.raises(UserError, match="--push-to-hub: no Hugging Face token; set HF_TOKEN or log in"),
        ):
            hub.check_push(REPO_ID)
    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set"):
        hub.check_push(REPO_ID)  # the tests run offline
    code = main(["train", "--push-to-hub", REPO_ID, "--output-dir", str(tmp_path / "o")])
    assert code == 2 and not (tmp_path / "o").exists()  # refused before anything ran
    from lmtune.config.io import MEASURING_RUN

    assert MEASURING_RUN["push_to_hub"] is None  # plan's and bench's own runs never upload


def test_an_adapter_on_a_model_folder_gets_loading_code(tmp_path: Path) -> None:
    """The adapter names its local base by absolute path, which peft loads; only a preset's adapter
    (no base named) points to the merged model instead."""
    from lmtune.checkpoint.card import model_card

    final = tmp_path / "final"
    final.mkdir()
    run = {"config": {"model": str(tmp_path / "base"), "lora": True}}
    (final / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(tmp_path / "base")})
    )
    card = model_card(final, run)
    assert "AutoPeftModelForCausalLM.from_pretrained" in card and "built-in preset" not in card
    (final / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": None}))
    card = model_card(final, {"config": {"model": "tiny", "lora": True}})
    assert "built-in preset `tiny`" in card and "AutoPeftModelForCausalLM" not in card


def test_the_card_says_the_base_was_quantized_and_how_the_data_was_mixed(tmp_path: Path) -> None:
    from lmtune.checkpoint.card import model_card

    final = tmp_path / "final"
    final.mkdir()
    (final / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": None}))
    mixture = [
        {"name": "chat", "examples": 300, "per_epoch": 700, "share": 0.7, "repeats": 700 / 300},
        {"name": "code", "examples": 700, "per_epoch": 300, "share": 0.3, "repeats": 300 / 700},
    ]
    run = {
        "config": {"model": "tiny", "lora": True, "data": "chat=a.jsonl,code=b.jsonl"},
        "resolved": {
            "quantization": "nf4, double quant, compute bf16",
            "base_bytes": {"quantized": 58_510_000, "full_precision": 840_000, "adapters": 9_000_000},
        },
        "data": {"train": {"spec": "chat=a.jsonl,code=b.jsonl", "examples": 1000, "mixture": mixture}},
    }
    run["resolved"] |= {"total_steps": 2, "steps_per_epoch": 31, "epochs": 1}
    card = model_card(final, run)
    assert "2 of 2 (0.06 epochs of 31 steps planned)" in card  # a --max-steps run: part of an epoch
    assert "| quantized base | nf4, double quant, compute bf16 (the adapters trained on it: QLoRA); " in card
    assert "55.8 MiB quantized, 0.8 MiB kept in full precision" in card
    assert "- qlora" in card  # a hub tag
    assert "| data mixture | chat 70.0% of an epoch: 700 drawn from 300 examples (each x2.33); " in card
    assert "code 30.0% of an epoch: 300 drawn from 700 examples (each x0.43) |" in card


def test_a_model_not_tuned_on_conversations_is_not_shown_as_a_chat_model(tmp_path: Path) -> None:
    """A preset's tokenizer carries a chat template whatever the model learned; the card's code
    prompts as the model was trained (the quick start's addition model answers a chat prompt badly)."""
    from lmtune.checkpoint.card import model_card
    from lmtune.data.formats import BUILTIN_CHAT_TEMPLATE

    final = tmp_path / "final"
    final.mkdir()
    (final / "chat_template.jinja").write_text(BUILTIN_CHAT_TEMPLATE)
    plain = model_card(
        final, {"config": {"model": "tiny"}, "data": {"train": {"formats": {"prompt_completion": 9}}}}
    )
    assert "--chat" not in plain and "apply_chat_template" not in plain and "```jinja" not in plain
    assert "lmtune generate --model" in plain and '--prompt "Once upon a time"' in plain
    chat = model_card(final, {"config": {"model": "tiny"}, "data": {"train": {"formats": {"messages": 9}}}})
    assert "--chat" in chat and "apply_chat_template" in chat and "## Chat template and stop tokens" in chat
    assert "apply_chat_template" in model_card(final, None)  # no run record: the template says chat
    spaced = tmp_path / "my runs" / "final"  # its path pasted unquoted was two arguments
    shutil.copytree(final, spaced)
    assert f"lmtune generate --model '{spaced}' --chat --prompt" in model_card(spaced, None)


def test_the_card_says_what_an_eval_split_held_out(tmp_path: Path) -> None:
    from lmtune.checkpoint.card import model_card

    final = tmp_path / "final"
    final.mkdir()
    train = {"spec": "a.jsonl", "examples": 100, "tokens": 882, "target_tokens": 292}
    train |= {"formats": {"prompt_completion": 100}, "held_out": 10, "training_examples": 90}
    run = {"config": {"model": "tiny", "eval_split": 0.1}, "data": {"train": train}}
    card = model_card(final, run)
    assert (
        "| training data | `a.jsonl`: 100 examples (prompt_completion), 882 tokens, 292 of them targets; "
        "10 held out for evaluation, so 90 trained on |"
    ) in card


def test_a_card_of_the_best_model_marks_the_last_steps_figures_as_another_models() -> None:
    from lmtune.checkpoint.card_rows import result_rows

    result = {
        "steps": 4,
        "last_loss": 1.5,
        "eval": {"loss": 5.1, "perplexity": 164.0, "examples": 8},
        "best": {"metric": "eval_loss", "value": 4.9, "step": 2},
    }
    rows = dict(result_rows({"config": {"load_best_at_end": True}, "result": result}))
    assert rows["train loss at step 4 (the last step's model, not this one)"] == "1.5000"
    assert rows["evaluation at step 4 (the last step's model, not this one)"].startswith("loss 5.1000")
    assert rows["best evaluation"] == "eval_loss 4.9000 at step 2 (this is that model)"
    kept_last = dict(result_rows({"config": {}, "result": result}))  # final/ is the last step's model
    assert "train loss at step 4" in kept_last and "evaluation" in kept_last


def test_a_checkpoints_card_dates_the_evaluation_it_shows(tmp_path: Path) -> None:
    """An exported checkpoint shows the last evaluation at or before its step, named by that step,
    and a preference run's figures count pairs."""
    from lmtune.checkpoint.card import checkpoint_record
    from lmtune.checkpoint.card_rows import result_rows

    out = tmp_path / "run"
    checkpoint = out / "checkpoints" / "step-000003"
    checkpoint.mkdir(parents=True)
    (out / "run.json").write_text(json.dumps({"config": {"model": "tiny"}}))
    rows = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in (1, 2, 3, 4)]
    rows += [
        {"kind": "eval", "step": 2, "eval_loss": 0.5, "eval_rewards/accuracies": 0.75, "eval_examples": 8}
    ]
    rows += [{"kind": "eval", "step": 4, "eval_loss": 0.4, "eval_examples": 8}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = checkpoint_record(checkpoint, 3)
    assert record is not None
    shown = dict(result_rows(record))
    assert shown["train loss at step 3"] == "0.3333"
    assert shown["evaluation at step 2 (the last one before this checkpoint)"] == (
        "loss 0.5000, reward accuracy 0.7500 (8 pairs)"
    )
    assert "evaluation" in dict(result_rows(checkpoint_record(checkpoint.with_name("step-000004"), 4) or {}))


@pytest.mark.parametrize(
    ("micro", "batch"),
    [
        (2, "8 examples = 2 per micro-batch x 2 processes x 2 accumulation"),
        (None, "8 examples over 2 processes"),
    ],
)
def test_a_checkpoints_card_shows_the_layout_that_trained_it(
    tmp_path: Path, micro: int | None, batch: str
) -> None:
    """A run trained to step 3 on 2 FSDP ranks, then resumed on 1 process: the step-3 checkpoint's
    card names the 2 ranks and FSDP, not the last attempt's layout that run.json describes (with
    --micro-batch-size auto the checkpoint's split is not known, and not guessed)."""
    from lmtune.checkpoint.card import checkpoint_record
    from lmtune.checkpoint.card_rows import training_rows

    out = tmp_path / "run"
    checkpoint = out / "checkpoints" / "step-000003"
    checkpoint.mkdir(parents=True)
    state = {"step": 3, "epoch": 0, "step_in_epoch": 3, "global_batch_size": 8, "world_size": 2}
    (checkpoint / "trainer.json").write_text(json.dumps({**state, "seed": 0, "examples": 100}))
    (checkpoint / "manifest.json").write_text(json.dumps({"sharded/.metadata": {"bytes": 1}}))
    adjustable = {"--micro-batch-size": micro or "auto"}  # what the checkpoint was saved under
    (checkpoint / "fingerprint.json").write_text(json.dumps({"fixed": {}, "adjustable": adjustable}))
    resolved = {"global_batch_size": 8, "micro_batch_size": 2, "accumulation": 4}
    run = {  # the resume on 1 process, with --micro-batch-size 2 given
        "config": {"model": "tiny", "micro_batch_size": 2},
        "resolved": {**resolved, "world_size": 1, "strategy": "single"},
        "environment": {"world_size": 1, "device": "cpu"},
    }
    (out / "run.json").write_text(json.dumps(run))
    rows = dict(training_rows(checkpoint_record(checkpoint, 3) or {}))
    assert rows["hardware"] == "2 CPU processes, strategy fsdp"
    assert rows["global batch"] == batch
    (checkpoint / "manifest.json").write_text(json.dumps({"model.safetensors": {"bytes": 1}}))
    assert dict(training_rows(checkpoint_record(checkpoint, 3) or {}))["hardware"].endswith("strategy ddp")
