"""User errors: exit code 2, a one-line message naming the option or file, no traceback."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from lmtune.cli import main
from tests.conftest import one_line_error, run_lmtune, write_jsonl


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--lr", "-0.1"], "--lr: must be > 0"),
        (["--global-batch-size", "10", "--micro-batch-size", "4"], "--global-batch-size 10 does not divide"),
        (["--global-batch-size", "8", "--micro-batch-size", "4", "--nproc-per-node", "3"], "4 x 3 processes"),
        (["--strategy", "zero3"], "--strategy: must be one of"),
        # Another tool's name for a choice (Axolotl's optimizer: adamw_bnb_8bit) is answered with ours.
        (
            ["--optimizer", "adamw_bnb_8bit"],
            "sgd; transformers' adamw_bnb_8bit is adamw8bit here (got 'adamw_bnb_8bit')",
        ),
        (["--data", "missing.jsonl"], "--data: no such file or folder: missing.jsonl"),
        (["--model", "./no-such-model-folder"], "--model ./no-such-model-folder: no such folder"),
        (["--epochs", "two"], "--epochs: expected int"),
        (["--strategy", "dp", "--device", "cpu"], "needs CUDA GPUs"),
        (["--lr", "1e-4", "--learning_rate", "2e-4"], "--lr is set twice (as --lr and --learning_rate)"),
        (["--num-train-epochs", "2", "--epochs", "3"], "--epochs is set twice"),
        # The first file was left unread, without a word.
        (["--config", "a.yaml", "--config=b.yaml"], "--config is given twice; it reads one file"),
        (["--eval-split", "-3"], "--eval-split: must be a fraction in (0, 1) or a whole number of examples"),
        (["--eval-split", "2.5"], "--eval-split: must be a fraction in (0, 1) or a whole number of examples"),
    ],
)
def test_user_errors_exit_2_with_a_message(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main(["train", "--output-dir", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err
    assert err.startswith("error: ") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            ["generate", "--model", "tiny", "--prompt", "1+1=", "--max-new-tokens", "0"],
            "--max-new-tokens must",
        ),
        (
            ["generate", "--model", "tiny", "--prompt", "1+1=", "--max-new-tokens", "100000000"],
            "--max-new-tokens must be in [1, 2**24] (got 100000000)",  # else it runs until stopped
        ),
        (["data", "audit", "sample", "--plot", "out.txt"], "--plot out.txt: name a .png file"),
        (["data", "audit", "sample", "--plot", "hist"], "--plot hist: name a .png file"),
        (["data", "audit", "sample", "--plot", f"{__file__}/h.png"], f": {__file__} is not a folder"),
        (["plan", "--json", "."], "--json .: a folder; name a file"),
        (["report", "no-such-run"], "no-such-run: no such folder"),
    ],
)
def test_other_commands_check_their_options_first(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert needle in one_line_error(argv, capsys)


def test_bad_data_line_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "fine"}\n{"txt": "oops"}\n')
    assert main(["train", "--data", str(data), "--output-dir", str(tmp_path / "o")]) == 2
    said = capsys.readouterr().err
    assert f"{data}:2: cannot tell the format" in said
    # The first bad line stops the run: where the others are found, and how to train without them.
    assert said.rstrip().endswith(
        "; lmtune data audit lists every bad line, and --skip-bad-lines passes over them"
    )


def test_too_few_examples_for_one_global_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", ["a", "b", "c"])
    assert main(["train", "--data", str(data), "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert (
        "3 examples, fewer than one global batch (--global-batch-size 32); give --global-batch-size 3" in err
    )
    assert not (tmp_path / "o").exists()  # the folder it created, still empty, is not left behind
    (tmp_path / "mine").mkdir()  # a folder that was there before stays
    argv = ["train", "--data", str(data), "--micro-batch-size", "2", "--output-dir", str(tmp_path / "mine")]
    assert main(argv) == 2
    assert "give --global-batch-size 2 or less" in capsys.readouterr().err
    assert (tmp_path / "mine").is_dir()
    # What --eval-split holds out is not there to train: the message says so, and what else helps.
    data = write_jsonl(tmp_path / "d6.jsonl", [f"text {i}" for i in range(6)])
    assert main(["train", "--data", str(data), "--eval-split", "0.5", "--global-batch-size", "4"]) == 2
    assert (
        "3 examples left to train on after --eval-split 0.5, fewer than one global batch "
        "(--global-batch-size 4); give --global-batch-size 3 or less, a smaller --eval-split"
    ) in capsys.readouterr().err
    assert main(["train", "--data", str(data), "--eval-split", "5", "--global-batch-size", "4"]) == 2
    assert "d6.jsonl: 1 example left to train on after --eval-split 5, fewer" in capsys.readouterr().err


def test_examples_past_the_last_whole_batch_are_said_to_sit_the_epoch_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As a DistributedSampler with drop_last, an epoch trains whole global batches; the rest sit
    it out, and the log, run.json and the model card say so (the HF Trainer trains a last partial batch)."""
    data = write_jsonl(tmp_path / "d.jsonl", [f"text number {i}" for i in range(11)])
    out = tmp_path / "o"
    argv = ["train", "--data", str(data), "--global-batch-size", "4", "--epochs", "1", "--no-progress"]
    assert main([*argv, "--output-dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert "each epoch trains 8 of the 11 examples (2 steps of 4): the 3 left over" in said
    assert json.loads((out / "run.json").read_text())["resolved"]["left_out_per_epoch"] == 3
    card = (out / "final" / "README.md").read_text()
    assert "the 3 examples past an epoch's last whole batch sit it out" in card


def test_unknown_hub_id_offline_names_what_was_tried(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--model", "nobody/no-such-model-xyz", "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--model nobody/no-such-model-xyz: could not load it as a preset" in err
    assert "hub id nobody/no-such-model-xyz" in err


def test_real_entry_point_prints_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json}\n')
    proc = run_lmtune(["train", "--data", str(bad), "--output-dir", str(tmp_path / "o")], timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert f"{bad}:2: not valid JSON" in proc.stderr


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--no-such-flag"]) == 2
    with pytest.raises(SystemExit) as exc:
        main(["train", "--lr"])  # argparse's own: a missing value
    assert exc.value.code == 2


def test_yaml_config_file_is_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(json.dumps({"lr": -3}))  # JSON is YAML
    assert main(["train", "--config", str(cfg)]) == 2
    assert f"--config {cfg}:1: lr: must be > 0 (got -3)" in capsys.readouterr().err


def test_resume_never_refuses_to_overwrite_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "out" / "checkpoints" / "step-000004").mkdir(parents=True)
    code = main(["train", "--output-dir", str(tmp_path / "out"), "--resume", "never", "--max-steps", "1"])
    assert code == 2
    assert "--resume never, but" in capsys.readouterr().err


def test_fp16_on_cpu_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--precision", "fp16", "--device", "cpu", "--output-dir", str(tmp_path)]) == 2
    assert "--precision: fp16 needs a CUDA GPU" in capsys.readouterr().err
    # From a --config file, the file's line names it, as for the values checked before the run.
    config = tmp_path / "run.yaml"
    config.write_text("seed: 3\nprecision: fp16\n")
    assert main(["train", "--config", str(config), "--output-dir", str(tmp_path)]) == 2
    assert f"--config {config}:2: precision: fp16 needs a CUDA GPU" in capsys.readouterr().err
    if not torch.cuda.is_available():
        config.write_text("device: cuda\n")
        assert main(["train", "--config", str(config), "--output-dir", str(tmp_path)]) == 2
        said = capsys.readouterr().err
        assert f"--config {config}:1: device: cuda: no CUDA device is available" in said
        # A CPU build of PyTorch on a GPU machine says the same: the build is what to change.
        assert ("is built for the CPU alone" in said) is (torch.version.cuda is None)


def test_train_doctor_checks_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["train", "--doctor", "--max-steps", "1", "--no-progress", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "lmtune doctor" in printed and "ok    output folder" in printed
    assert "CPU threads" in printed and re.search(r"\d+ threads?, waiting", printed)
    assert printed.index("lmtune doctor") < printed.index("lmtune: preset tiny")
    assert (
        "; 1 step at lr 0.001 (cosine, the preset's default); precision fp32; optimizer adamw; loss: "
        in printed
    )  # the start line names what the run computes in
    assert main(["doctor", "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "FAIL  data" in capsys.readouterr().out
    # A folder it had to make to check (with the ones above it) is gone after the check.
    assert main(["doctor", "--output-dir", str(tmp_path / "new" / "a" / "b")]) == 0
    assert "ok    free disk" in capsys.readouterr().out and not (tmp_path / "new").exists()
    # A file for the folder: a row of the table (it was the OS's error about a probe inside it).
    (tmp_path / "a-file").write_text("mine")
    assert main(["doctor", "--output-dir", str(tmp_path / "a-file")]) == 2
    said = f"FAIL  output folder     {tmp_path / 'a-file'}: not writable on rank(s) 0 ("
    assert said in (out := capsys.readouterr().out) and "): not a folder" in out
    # The model is loaded (its config) without an output folder too: it passed unread.
    assert main(["doctor", "--model", str(tmp_path / "no-such-model")]) == 2
    assert f"--model {tmp_path / 'no-such-model'}: no such folder" in capsys.readouterr().err
    assert main(["doctor", "--model", "tiny"]) == 0
    assert "ok    model             tiny: 0.9M parameters" in capsys.readouterr().out


def test_model_folder_without_tokenizer_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmtune.model.modeling import build_preset

    folder = tmp_path / "weights-only"
    build_preset("tiny", seed=0).model.save_pretrained(folder)  # config + weights, no tokenizer
    for argv in (
        ["generate", "--model", str(folder), "--prompt", "hi"],
        ["data", "audit", "sample", "--model", str(folder)],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert f"--model {folder}: the folder has no tokenizer" in err
        assert f".save_pretrained('{folder}')" in err
    (folder / "tokenizer_config.json").write_text("{}")  # there, but unusable
    assert main(["generate", "--model", str(folder), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert f"could not load its tokenizer from local folder {folder}: " in err and err.count("\n") == 1


def test_the_command_runs_exit_handlers_flushes_and_keeps_its_exit_code(tmp_path: Path) -> None:
    """`lmtune` leaves without tearing the interpreter down, after its exit handlers and with
    everything it printed; a reader that leaves early (`| head`) gets no traceback."""
    import subprocess
    import sys

    script = (
        "import atexit, sys\n"
        "from lmtune.cli import run\n"
        "atexit.register(lambda: print('handler ran', flush=True))\n"
        "sys.argv = ['lmtune', 'train', '--bogus']\n"
        "run()\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown option --bogus" in proc.stderr and "handler ran" in proc.stdout
    data = write_jsonl(tmp_path / "d.jsonl", ["hi"] * 3)
    audit = [sys.executable, "-m", "lmtune", "data", "audit", str(data)]
    piped = subprocess.Popen(audit, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert piped.stdout is not None and piped.stderr is not None
    piped.stdout.close()  # the reader left before the first line
    assert piped.wait(timeout=120) in (0, 1) and "Traceback" not in piped.stderr.read().decode()


def test_a_micro_batch_alone_says_the_global_batch_is_the_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """HF's per_device_train_batch_size alone is one micro-batch per step there: the log says that
    here the default global batch still applies, and how to ask for one micro-batch per step."""
    data = write_jsonl(tmp_path / "d.jsonl", [f"line {i}" for i in range(40)])
    common = ["train", "--data", str(data), "--max-steps", "1", "--save-every", "0", "--no-progress"]
    assert main([*common, "--per_device_train_batch_size", "4", "--output-dir", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "global batch 32 = 4 x 1 x 8 accumulation" in out
    assert "global batch 32 is the default: --micro-batch-size (HF's per_device_train_batch_size)" in out
    assert "give --global-batch-size 4 for one per step" in out
    assert "packing:" not in out
    # Packing asked for: the batch counts examples still, where TRL's packed batch counts rows.
    packed = ["--global-batch-size", "8", "--packing", "on", "--output-dir", str(tmp_path / "k")]
    assert main([*common, *packed]) == 0
    assert (
        "packing: the global batch counts examples (8 a step, packed into rows of up to --max-length 512 "
        "tokens), not packed rows as TRL's per_device_train_batch_size does under packing"
    ) in capsys.readouterr().out
    # A resume keeps its global batch: nothing to advise there (it advised what a resume refuses).
    first = ["train", "--data", str(data), "--no-progress", "--output-dir", str(tmp_path / "r")]
    assert main([*first, "--max-steps", "1"]) == 0
    capsys.readouterr()
    assert main([*first, "--max-steps", "2", "--micro-batch-size", "4"]) == 0
    assert "resuming from" in (out := capsys.readouterr().out) and "for one per step" not in out
    # A global batch given, also the default's 32 (in the file or as a flag), is the user's choice.
    config = tmp_path / "run.yaml"
    config.write_text("global_batch_size: 32\n")
    for given in (["--global-batch-size", "8"], ["--global-batch-size", "32"], ["--config", str(config)]):
        out_dir = ["--output-dir", str(tmp_path / f"b{len(given[1])}")]
        assert main([*common, "--micro-batch-size", "4", *given, *out_dir, "--overwrite"]) == 0
        assert "is the default" not in capsys.readouterr().out
    # From Python the same (it said nothing: whether 32 was given was taken as unknown).
    import lmtune

    py = {"data": str(data), "max_steps": 1, "save_every": 0, "progress": False}
    lmtune.train(lmtune.TrainConfig(**py, per_device_train_batch_size=4, output_dir=str(tmp_path / "p")))
    assert "give --global-batch-size 4 for one per step" in capsys.readouterr().out
    cfg = lmtune.TrainConfig(**py, micro_batch_size=4, global_batch_size=32, output_dir=str(tmp_path / "q"))
    lmtune.train(cfg)
    assert "is the default" not in capsys.readouterr().out


def test_max_prompt_length_is_for_preference_pairs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--max-prompt-length", "16", "--output-dir", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "--max-prompt-length: applies to preference pairs (--objective dpo" in capsys.readouterr().err
    config = tmp_path / "sft.yaml"  # TRL's key in a config file: named by its line there
    config.write_text("lr: 1.0e-4\nmax_prompt_length: 16\n")
    assert main(["train", "--config", str(config), "--output-dir", str(tmp_path / "o")]) == 2
    assert "sft.yaml:2: max_prompt_length: applies to preference pairs" in capsys.readouterr().err
    # A key whose value says an lmtune setting (TRL's precompute_ref_log_probs: false is --reference
    # live) is named by its own line, not by the flag the file never wrote.
    config.write_text("lr: 1.0e-4\nprecompute_ref_log_probs: false\n")
    assert main(["train", "--config", str(config), "--output-dir", str(tmp_path / "o")]) == 2
    said = "sft.yaml:2: precompute_ref_log_probs (reference live in lmtune): applies to objective dpo"
    assert said in capsys.readouterr().err
    # A path the file names that is not there: by its line too (the model's was by its flag alone).
    config.write_text("seed: 1\nmodel: ./no-such-model\n")
    assert main(["train", "--config", str(config), "--output-dir", str(tmp_path / "o")]) == 2
    assert "sft.yaml:2: model ./no-such-model: no such folder (presets:" in capsys.readouterr().err
    argv = ["train", "--config", str(config), "--model", "./given", "--output-dir", str(tmp_path / "o")]
    assert main(argv) == 2
    assert "error: --model ./given: no such folder" in capsys.readouterr().err  # the flag's: by the flag
    # A reference model's folder that is not there: said before the data and the model are built.
    config.write_text("objective: dpo\nreference_model: ./no-such-ref\n")
    assert main(["train", "--config", str(config), "--output-dir", str(tmp_path / "o")]) == 2
    said = capsys.readouterr()
    assert "sft.yaml:2: reference_model ./no-such-ref: no such folder (presets:" in said.err
    assert "train data" not in said.out


def test_ddp_or_fsdp_in_one_process_says_it_runs_the_single_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", "--strategy", "fsdp", "--max-steps", "1", "--save-every", "0", "--no-progress"]
    assert main([*args, "--output-dir", str(tmp_path / "out")]) == 0
    assert ", single (--strategy fsdp in one process) on 1 x cpu" in capsys.readouterr().out


def test_a_new_adapter_on_an_adapter_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its adapter_config.json could name no base that holds the first adapter; the merged model
    is named where the first run wrote one."""
    import json

    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    (final / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "tiny"}))
    argv = ["train", "--model", str(final), "--lora", "--output-dir", str(tmp_path / "out")]
    assert "a LoRA adapter; a new adapter trained on it with --lora" in one_line_error(argv, capsys)
    (final / "merged").mkdir()
    (final / "merged" / "config.json").write_text("{}")
    assert f"Give the merged model ({final / 'merged'}) as --model" in one_line_error(argv, capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("prompt", [[], ["--prompt", "-"]], ids=["piped", "dash"])
def test_generate_reads_a_piped_prompt(
    prompt: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`echo "1+2=" | lmtune generate --model M`, as its help says; nothing piped is a user error."""
    import io

    argv = ["generate", "--model", "tiny", "--max-new-tokens", "2", *prompt]
    monkeypatch.setattr("sys.stdin", io.StringIO("1+2=\n"))
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("1+2=")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    assert "nothing came on stdin" in one_line_error(argv, capsys)


@pytest.mark.parametrize("chat", [[], ["--chat"]], ids=["completion", "chat"])
def test_an_empty_answer_is_explained(
    chat: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A blank line alone reads as the tool failing: the note says the model stopped at once."""
    monkeypatch.setattr("lmtune.model.generate.complete", lambda *a, **k: "")
    assert main(["generate", "--model", "tiny", "--prompt", "1+2=", *chat]) == 0
    said = capsys.readouterr()
    assert said.out.strip() == ("" if chat else "1+2=")
    assert "the model's answer is empty: the first token it generated was a stop token" in said.err
    # Whitespace it did generate is no stop token (a chat reply, shown trimmed, was said to be one).
    monkeypatch.setattr("lmtune.model.generate.complete", lambda *a, **k: " \n ")
    assert main(["generate", "--model", "tiny", "--prompt", "1+2=", *chat]) == 0
    assert "the model's answer is only whitespace (3 characters:  \\n )" in capsys.readouterr().err
    monkeypatch.setattr("lmtune.model.generate.complete", lambda *a, **k: "3")
    assert main(["generate", "--model", "tiny", "--prompt", "1+2=", *chat]) == 0
    assert "empty" not in capsys.readouterr().err


def test_other_commands_take_snake_case_options_as_train_does(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "generate",
        "--model",
        "tiny",
        "--prompt",
        "1+2=",
        "--max_new_tokens",
        "2",
        "--top_p=0.5",
        "--temperature",
        "1",
    ]
    assert main(argv) == 0 and capsys.readouterr().out.startswith("1+2=")
    assert "unknown option --max-new-tokenz" in one_line_error([*argv, "--max_new_tokenz", "1"], capsys)


def test_generate_past_the_models_positions(capsys: pytest.CaptureFixture[str]) -> None:
    """A learned position table cannot run past its end: refused; rotary positions: a warning."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, GPT2Config

    from lmtune.cli.generation import _check_answer_length
    from lmtune.errors import UserError
    from lmtune.model.modeling import byte_tokenizer

    gpt2 = AutoModelForCausalLM.from_config(
        GPT2Config(vocab_size=260, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    )
    loaded = SimpleNamespace(model=gpt2, tokenizer=byte_tokenizer())
    _check_answer_length(loaded.model, loaded.tokenizer, "1+2=", 50)
    with pytest.raises(
        UserError, match=r"--max-new-tokens 70: with the prompt's \d+ tokens, past the model's 64"
    ):
        _check_answer_length(loaded.model, loaded.tokenizer, "1+2=", 70)
    from lmtune.model.modeling import load_model

    tiny = load_model("tiny", seed=0)
    _check_answer_length(tiny.model, tiny.tokenizer, "1+2=", 1030)  # the generate command's check
    assert "past the model's 1024 positions: it never saw positions that far" in capsys.readouterr().err


def test_a_max_length_that_cuts_off_the_stop_token_is_warned_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Text cut by --max-length loses its EOS: the run says so, as it does for chat data."""
    data = write_jsonl(tmp_path / "d.jsonl", [f"a longer line of text, number {i}" for i in range(8)])
    argv = ["train", "--data", str(data), "--max-length", "8", "--global-batch-size", "8", "--max-steps", "1"]
    assert main([*argv, "--no-progress", "--output-dir", str(tmp_path / "o")]) == 0
    assert (
        "warning: 8 of 8 training examples train no stop token (--max-length 8 cut it off; --truncation "
        "left keeps the ends)"
    ) in capsys.readouterr().out


def test_bench_under_a_launcher_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """torchrun -m lmtune bench ran every combination on every rank, each in its own folder, and
    blamed the user for the folders differing."""
    for name, value in (("RANK", "1"), ("LOCAL_RANK", "1"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    assert main(["bench"]) == 2
    assert "run it directly, not under torchrun" in capsys.readouterr().err


def test_bench_that_can_run_nothing_here_is_refused_before_anything_is_said_or_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bench --precisions fp16` on a CPU skipped every combination, exit 0, and wrote its empty
    table over an earlier bench.json of real figures; an unknown strategy was refused only after
    "results go to bench.json"."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("fp16 runs on a GPU")
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--precisions", "fp16"]) == 2
    said = capsys.readouterr()
    assert "no combination of --strategies and --precisions runs here (fp16 needs a CUDA GPU" in said.err
    assert not (tmp_path / "bench.json").exists() and "results go to" not in said.out
    assert main(["bench", "--strategies", "foo"]) == 2
    assert "results go to" not in capsys.readouterr().out
    (tmp_path / "bench.json").write_text('{"mine": 1}')  # the bad value is named before this file
    assert main(["bench", "--strategies", "foo"]) == 2
    assert "--strategies: unknown strategy 'foo'" in capsys.readouterr().err
    for command in (
        ["bench"],
        ["plan", "--model", "tiny"],
        ["eval", "sample", "--model", "tiny"],
    ):  # an empty name was the default bench.json
        assert main([*command, "--json", ""]) == 2
        assert "--json: give a file's name (got an empty one)" in capsys.readouterr().err


def test_a_prompt_that_names_a_file_is_warned_of_and_prompt_file_is_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--prompt-file prompts.txt` was answered "did you mean --prompt?", and `--prompt prompts.txt`
    (or `@prompts.txt`) then continued the text "prompts.txt" without a word."""
    import lmtune.model.generate as generate

    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("1+1=\n")
    assert main(["generate", "--model", "tiny", "--prompt-file", "prompts.txt"]) == 2
    assert "--prompt-file: a file's text comes on standard input: lmtune generate --model M < FILE" in (
        capsys.readouterr().err
    )
    monkeypatch.setattr(generate, "complete", lambda *a, **k: "2")
    assert main(["generate", "--model", "tiny", "--prompt", "prompts.txt", "--max-new-tokens", "1"]) == 0
    said = capsys.readouterr()
    assert said.out == "prompts.txt2\n"
    assert "--prompt prompts.txt: continuing the text 'prompts.txt', which names a file" in said.err
    # curl's @FILE was continued as the text "@prompts.txt" without a word.
    assert main(["generate", "--model", "tiny", "--prompt", "@prompts.txt", "--max-new-tokens", "1"]) == 0
    assert "which names a file; for the file's text: lmtune generate ... < prompts.txt" in (
        capsys.readouterr().err
    )
    (tmp_path / "my prompts.txt").write_text("1+1=\n")  # the command it suggests quotes the name
    assert main(["generate", "--model", "tiny", "--prompt", "my prompts.txt", "--max-new-tokens", "1"]) == 0
    assert "lmtune generate ... < 'my prompts.txt'" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--prompt", "1+1=", "--max-new-tokens", "1"]) == 0
    assert "names a file" not in capsys.readouterr().err
    # A prompt longer than a file name can be is a prompt (checking it as a path raised ENAMETOOLONG).
    assert main(["generate", "--model", "tiny", "--prompt", "a" * 400, "--max-new-tokens", "1"]) == 0
    assert capsys.readouterr().out == "a" * 400 + "2\n"


def test_generated_control_characters_are_printed_as_escapes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model that generated NUL bytes printed them raw to the terminal (``27+45=^@^@^@``); a
    terminal's escape sequence would act on it. Newlines and tabs stay."""
    import lmtune.model.generate as generate

    monkeypatch.setattr(generate, "complete", lambda *a, **k: "\x00\x1b[2Jok\r\n\tend\x7f")
    assert main(["generate", "--model", "tiny", "--prompt", "1+1=", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out == "1+1=\\x00\\x1b[2Jok\\x0d\n\tend\\x7f\n"


def test_a_flag_that_turns_a_feature_off_sets_aside_the_config_files_settings_of_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--config lora.yaml --no-lora` (a full fine-tune from the same file) was refused: the file's
    lora.rank "applies with --lora only". A flag of that feature with it off still is."""
    config = tmp_path / "lora.yaml"
    config.write_text("lora:\n  enabled: true\n  rank: 4\nmax_steps: 1\nsave_every: 0\n")
    out = ["--output-dir", str(tmp_path / "out"), "--no-progress"]
    assert main(["train", "--config", str(config), "--no-lora", *out]) == 0
    assert "886,272 parameters, all trainable" in capsys.readouterr().out
    # Axolotl's QLoRA: --no-lora is a full fine-tune, of a base it does not quantize.
    qlora = tmp_path / "qlora.yaml"
    qlora.write_text("adapter: qlora\nlora_r: 4\nmax_steps: 1\nsave_every: 0\n")
    assert main(["train", "--config", str(qlora), "--no-lora", *out, "--overwrite"]) == 0
    assert "886,272 parameters, all trainable" in capsys.readouterr().out
    assert main(["train", "--config", str(config), "--no-lora", "--lora-rank", "8", *out]) == 2
    assert "--lora-rank: applies with --lora only" in capsys.readouterr().err
