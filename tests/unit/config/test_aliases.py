"""The names users bring from HF Trainer, TRL and Axolotl: accepted where they mean the same, else a
hint that names what to do (exit 2); typos get the closest names. Flags and YAML alike."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from lmtune.cli import main
from lmtune.cli.argv import hub_flags
from lmtune.cli.commands import train_config
from lmtune.cli.parser import build_parser
from lmtune.config.aliases import ALIASES
from lmtune.config.hints import HINTS
from lmtune.config.io import build_config, load_yaml
from lmtune.config.settings import TrainConfig, config_fields, setting_named, to_dict
from lmtune.errors import UserError

SETTINGS = {s.name for s in config_fields()}


def _value(name: str) -> Any:
    """A value of setting ``name`` other than its default."""
    s = setting_named(name)
    if s.choices:
        return next(c for c in s.choices if c != s.default)
    if s.type is bool:
        return not s.default
    if s.type is int:
        return 3
    if s.type is float:
        return 0.25
    return "eval_other/value" if name == "metric_for_best" else "other/value"  # as HF, eval_ is added


def _flag_args(flag: str, name: str) -> list[str]:
    value = _value(name)
    if isinstance(value, bool):
        return [flag] if value else ["--no-" + flag[2:]]
    return [flag, str(value)]


def test_the_table_names_real_settings_and_nothing_twice() -> None:
    assert set(ALIASES.values()) <= SETTINGS
    assert not (set(ALIASES) | set(HINTS)) & SETTINGS  # a setting's own name is no foreign name
    assert not set(ALIASES) & set(HINTS)
    for peer in ("learning_rate", "num_train_epochs", "per_device_train_batch_size", "max_seq_length"):
        assert peer in ALIASES
    for peer in ("gradient_accumulation_steps", "bf16", "lr_scheduler_type"):
        assert peer in HINTS


@pytest.mark.parametrize(("foreign", "ours"), sorted(ALIASES.items()))
def test_an_alias_sets_the_same_setting_by_flag_and_yaml(foreign: str, ours: str, tmp_path: Path) -> None:
    expected = TrainConfig(**{ours: _value(ours)})
    for flag in (f"--{foreign.replace('_', '-')}", f"--{foreign}"):
        cfg = train_config(build_parser().parse_args(["train", *_flag_args(flag, ours)]))
        assert cfg == expected, flag
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(json.dumps({foreign: _value(ours)}))
    cfg = build_config(load_yaml(str(yaml_file)))
    assert cfg == expected
    assert foreign not in to_dict(cfg) and to_dict(cfg)[ours] == _value(ours)  # run.json: lmtune's name


@pytest.mark.parametrize("foreign", sorted(HINTS))
def test_a_name_with_another_meaning_is_refused_with_a_hint(
    foreign: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flag = f"--{foreign.replace('_', '-')}"
    assert main(["train", flag, "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: lmtune train: {flag}: ") and err.count("\n") == 1
    assert "{" not in err  # every placeholder filled with a flag
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text(f"seed: 1\n{foreign}: 1\n")
    with pytest.raises(UserError, match=rf"--config {yaml_file}:2: {foreign}: ") as refused:
        load_yaml(str(yaml_file))
    assert "--" not in str(refused.value).split(f"{foreign}: ", 1)[1]  # YAML names in a YAML hint


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["train", "--eval-splt", "0.1"], "unknown option --eval-splt; did you mean --eval-split?"),
        (["train", "--learning-rat", "1"], "did you mean --lr?"),
        (["train", "--gradient-accumulation-step", "4"], "derives gradient accumulation from --global-batch"),
        (["plan", "--per-device-train-batch-size", "4", "--bf16"], "--bf16: set the precision with"),
        (["bench", "--learning-rate", "1e-4"], "--learning-rate is --lr in lmtune, which lmtune bench"),
        (["data", "audit", "x.jsonl", "--num-train-epochs", "2"], "is --epochs in lmtune, which lmtune data"),
        (["data", "audit", "x.jsonl", "--max-seq-lenght", "8"], "did you mean --max-length?"),
        (["train", "--zzz-top"], "unknown option --zzz-top (`lmtune train --help` lists them)"),
        (["train", "-q"], "unknown option -q (`lmtune train --help` lists them)"),
        (["report", "runs/a", "--output", "r.html"], "unknown option --output; did you mean --out?"),
        (["report", "runs/a", "-o", "r.html"], "unknown option -o; did you mean --out?"),
        (["bench", "-o", "b.json"], "unknown option -o; did you mean --json?"),
        (["train", "-o", "runs/a"], "unknown option -o; did you mean --output-dir?"),
        (["bench", "--precision", "fp32"], "which lmtune bench does not take; it takes --precisions"),
        (["train", "--bnb_4bit_compute_dtype", "bfloat16"], "4-bit layers compute in --precision's dtype"),
        (["train", "stray.jsonl"], "unexpected argument stray.jsonl"),
        # torchtune's key=value overrides: the option to give, or what the name is here.
        (
            ["train", "epochs=1"],
            "epochs=1: options are --name value here, not key=value overrides (give --epochs 1)",
        ),
        (["train", "optimizer.lr=2e-5"], "optimizer.lr=2e-5: options are --name value here, not key=value"),
        (["train", "--lr", "1", "optimizer.lr=2e-5"], "not key=value overrides (give --lr 2e-5)"),
        (["train", "max_steps_per_epoch=10"], "not key=value overrides (--max-steps N ends the run after N"),
        (
            ["train", "optimizer.lr=2e-5", "lr=1e-3"],
            "optimizer.lr=2e-5: options are --name value here, not "
            "key=value overrides (give --lr 2e-5); lr=1e-3: ",
        ),
        (["train", "dataset._component_=my.Data"], "not key=value overrides (data: a JSONL file (text"),
        (["train", "epochs="], "not key=value overrides (give --epochs VALUE)"),
        # Dotted names, as torchtune's and litgpt's command lines take them: the last part's option.
        (["train", "--optimizer.lr", "2e-5"], "--optimizer.lr: options are not dotted here (give --lr 2e-5)"),
        (
            ["train", "--train.save_interval=8"],
            "--train.save_interval=8: options are not dotted here (give --save-every 8)",
        ),
        (["train", "eval.interval=100"], "not key=value overrides (give --eval-every 100)"),
        (["train", "--eval.max_iters", "9"], "not dotted here (lmtune evaluates on all of eval_data"),
        (["chat"], "lmtune chat: not a command of lmtune; lmtune generate --model FOLDER --chat talks"),
        # litgpt's and torchtune's commands: lmtune's way to do the same.
        (["finetune", "checkpoints/x"], "lmtune finetune: not a command of lmtune; lmtune train fine-tunes"),
        (["run", "lora_finetune_single_device"], "lmtune run: not a command of lmtune; lmtune train takes"),
        (["preprocess", "ax.yaml"], "lmtune preprocess: not a command of lmtune; lmtune data audit DATA"),
        (["merge-lora", "ax.yaml"], "lmtune merge-lora: not a command of lmtune; lmtune export CHECKPOINT"),
        (["train", "precision=bf16-mixed"], "not key=value overrides (give --precision fp32 | bf16 | fp16)"),
        # litgpt takes the model as an argument; an unknown option's value is not a stray argument.
        (["train", "ckpt/x"], "unexpected argument ckpt/x (the model is --model PATH, the data --data FILE"),
        (["train", "foo", "--bogus", "1"], "lists them); unexpected argument foo (the model is --model PATH"),
        (["train", "model.lora_rank=8"], "not key=value overrides (give --lora --lora-rank 8)"),
        (["train", "--betas", "0.9,0.95"], "--betas: AdamW's betas are --adam-beta1 and --adam-beta2"),
        (
            ["train", "batch_size=2", "gradient_accumulation_steps=8"],
            "2 per device x 8 accumulation on one device is --global-batch-size 16, --micro-batch-size 2",
        ),
        # What the value given asks for: lmtune's default already, TRL's name of an objective, none.
        (["train", "--bf16", "false"], "--bf16: lmtune's default --precision is fp32 already: remove it"),
        (["train", "--bf16"], "--bf16: set the precision with --precision bf16"),
        (["train", "--loss-type", "sigmoid"], "--loss-type: TRL's sigmoid loss is --objective dpo"),
        (["train", "--adapter", "qlora"], "--adapter: Axolotl's adapter qlora is --lora with --load-in-4bit"),
        (
            ["train", "--adapter", "lorra"],
            "are lora and qlora (here --lora, and --load-in-4bit for qlora); lorra",
        ),
        # ... and beside the setting it means: it adds nothing.
        (
            ["train", "--objective", "dpo", "--loss_type", "sigmoid"],
            "--objective dpo; --objective dpo is given, so drop --loss-type",
        ),
        (["train", "--bf16", "--precision", "bf16"], "--precision bf16 is given, so drop --bf16"),
        (["train", "--loss_type=hinge"], "(TRL's sigmoid) | ipo | simpo | orpo; TRL's hinge is none of them"),
        (["train", "--eval-strategy", "no"], "evaluates only when given --eval-data or --eval-split"),
        (["train", "--evals-per-epoch", "2"], "--evals-per-epoch: --eval-every N evaluates every N"),
        (["train", "--lr-scheduler-type", "cosine"], "--lr-schedule cosine is lmtune's default; it decays"),
        (["train", "--precompute-ref-log-probs", "true"], "log-probs by default (--reference logprobs)"),
        (
            ["train", "--gradient_accumulation_steps", "2", "--global-batch-size", "4"],
            "--global-batch-size 4 with 2 accumulation on one device is --micro-batch-size 2",
        ),
        # torchtune's per-device batch_size is the micro-batch of its accumulation.
        (
            ["train", "--batch_size", "16", "--gradient_accumulation_steps", "2"],
            "16 per device x 2 accumulation on one device is --global-batch-size 32, --micro-batch-size 16",
        ),
        # A near name's hint is offered as that name's, not as this one's meaning.
        (
            ["train", "--saves-per-epoc", "2"],
            "--saves-per-epoc; did you mean --saves-per-epoch? (--saves-per-epoch: --save-every N saves",
        ),
    ],
)
def test_unknown_options_are_explained_in_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("error: lmtune ") and err.count("\n") == 1
    assert "usage:" not in err


def test_a_glob_the_shell_expanded_is_answered_with_quoting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = [tmp_path / f"part-{i}.jsonl" for i in range(3)]
    for f in files:
        f.write_text('{"text": "a"}\n')
    assert main(["train", "--data", *map(str, files)]) == 2
    err = capsys.readouterr().err
    assert f"unexpected arguments {files[1]} {files[2]} (" in err
    assert "quote a glob, as --data 'data/*.jsonl': lmtune expands it)" in err
    assert main(["train", "--data", str(files[0]), "foo"]) == 2  # not files: no word of a glob
    assert "quote a glob" not in capsys.readouterr().err


def test_peers_first_options_train_as_lmtunes() -> None:
    peer = ["--learning-rate", "1e-4", "--num-train-epochs", "2", "--per-device-train-batch-size", "4"]
    peer += ["--max_seq_length", "256", "--lora_r", "8", "--use-peft", "--output_dir", "out"]
    ours = ["--lr", "1e-4", "--epochs", "2", "--micro-batch-size", "4", "--max-length", "256"]
    ours += ["--lora-rank", "8", "--lora", "--output-dir", "out"]
    parse = build_parser().parse_args
    assert train_config(parse(["train", *peer])) == train_config(parse(["train", *ours]))


def test_yaml_names_twice_and_typos(tmp_path: Path) -> None:
    twice = tmp_path / "twice.yaml"
    twice.write_text("lr: 1.0e-4\nlearning_rate: 2.0e-4\n")
    with pytest.raises(UserError, match=r"twice.yaml:2: lr is set twice \(as lr and learning_rate\)"):
        load_yaml(str(twice))
    typo = tmp_path / "typo.yaml"
    typo.write_text("model: tiny\n\nwarmup_step: 3\n")
    with pytest.raises(
        UserError, match=r"typo.yaml:3: unknown setting warmup_step; did you mean warmup_steps"
    ):
        load_yaml(str(typo))
    mapped = tmp_path / "mapped.yaml"
    mapped.write_text("field_map: {messages: dialog, role: speaker}\npacking: true\n")
    cfg = build_config(load_yaml(str(mapped)))
    assert cfg.examples.field_map == "messages=dialog,role=speaker" and cfg.batch.packing == "on"


def test_python_config_names_the_setting_it_meant() -> None:
    with pytest.raises(TypeError, match="did you mean 'lr'"):
        TrainConfig(lerning_rate=1e-4)
    with pytest.raises(TypeError, match="derives gradient accumulation"):
        TrainConfig(gradient_accumulation_steps=4)
    # With the per-device batch beside it, the numbers to give (as the CLI and YAML answer them).
    with pytest.raises(TypeError, match=r"on one device is 'global_batch_size': 8, 'micro_batch_size': 4,"):
        TrainConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    with pytest.raises(TypeError, match="'tokenizer': lmtune loads the tokenizer saved with the model"):
        TrainConfig(tokenizer="gpt2")  # was "did you mean 'tokenizer_type'?"
    # The value is answered as the CLI and YAML answer it (was the general list of optimizers).
    with pytest.raises(TypeError, match=r"'optim': transformers' adamw_8bit is 'optimizer' adamw8bit$"):
        TrainConfig(optim="adamw_8bit")


def test_help_shows_lmtune_names_only(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = capsys.readouterr().out
    assert "--lr LR" in shown and "--learning-rate" not in shown and "--max_steps" not in shown


def test_yes_no_options_take_true_and_false_as_hf_examples_write_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lmtune.cli.argv import spelled_out_flags

    parser = build_parser()
    argv = ["train", "--gradient_checkpointing", "True", "--lora", "false", "--load-best-at-end", "1"]
    argv += ["--progress", "off"]
    args, extra = parser.parse_known_args(argv)
    assert extra == ["True", "false", "1", "off"]
    cfg = train_config(parser.parse_args(spelled_out_flags(args.parser, argv)))
    assert cfg == TrainConfig(
        activation_checkpointing=True, lora=False, load_best_at_end=True, progress=False
    )
    assert main(["train", "--bf16", "True", "--lora-target-modules", "q_proj", "v_proj"]) == 2
    err = capsys.readouterr().err
    assert "--bf16: set the precision with --precision bf16" in err and "True" not in err


def test_packing_takes_trls_true_and_false() -> None:
    parse = build_parser().parse_args
    assert train_config(parse(["train", "--packing", "True"])).batch.packing == "on"
    assert train_config(parse(["train", "--packing", "false"])).batch.packing == "off"
    assert train_config(parse(["train", "--packing", "yes"])).batch.packing == "on"  # as YAML takes it
    # TRL's bare --packing (a bool there): on, before another option too.
    assert train_config(parse(["train", "--packing"])).batch.packing == "on"
    assert train_config(parse(["train", "--packing", "--lr", "1e-3"])).batch.packing == "on"


def test_max_steps_minus_one_is_hfs_unset(tmp_path: Path) -> None:
    parse = build_parser().parse_args
    assert train_config(parse(["train", "--max-steps", "-1"])).schedule.max_steps is None
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("max_steps: -1\nnum_train_epochs: 2\n")
    cfg = build_config(load_yaml(str(yaml_file)))
    assert cfg.schedule.max_steps is None and cfg.schedule.epochs == 2


def test_a_config_from_another_tool_has_all_its_unknown_keys_named_at_once(tmp_path: Path) -> None:
    yaml_file = tmp_path / "axolotl.yaml"
    yaml_file.write_text("base_model: tiny\ndatasets: [x]\ngradient_accumulation_steps: 4\nbf16: auto\n")
    with pytest.raises(UserError) as refused:
        load_yaml(str(yaml_file))
    lines = str(refused.value).splitlines()
    assert [line.split(": ")[1] for line in lines] == ["datasets", "gradient_accumulation_steps", "bf16"]
    assert lines[0].startswith(f"--config {yaml_file}:2: ") and lines[2].startswith(
        f"--config {yaml_file}:4: "
    )


def test_axolotls_datasets_are_answered_with_the_data_that_reads_them(tmp_path: Path) -> None:
    """Axolotl's datasets list of local files: the answer gives lmtune's data and field map for it;
    its loader classes that are lmtune's own (model_type: AutoModelForCausalLM) ask nothing."""
    yaml_file = tmp_path / "axolotl.yaml"
    yaml_file.write_text(
        "model_type: AutoModelForCausalLM\ntokenizer_type: AutoTokenizer\ndatasets:\n"
        "  - path: /data/chat.jsonl\n    type: chat_template\n    field_messages: conversations\n"
        "    message_field_role: from\n  - path: more.jsonl\n    type: chat_template\n"
        "    field_messages: conversations\n    message_field_role: from\n"
    )
    with pytest.raises(UserError) as refused:
        load_yaml(str(yaml_file))
    (line,) = str(refused.value).splitlines()
    assert line.startswith(f"--config {yaml_file}:3: datasets: give the files as lmtune's data")
    assert line.endswith(
        "; here: data: /data/chat.jsonl,more.jsonl, field_map: messages=conversations,role=from"
    )
    # A datasets loader with its files (path: json was answered data: json, which reads every JSON
    # file under the working folder), Axolotl's newer field and role names, and test_datasets.
    yaml_file.write_text(
        "datasets:\n  - path: json\n    data_files: [a.jsonl, b.jsonl]\n    type: chat_template\n"
        "    field_messages: dialog\n    message_property_mappings: {role: speaker, content: text}\n"
        "    roles: {user: [human, user], assistant: [bot, model]}\n"
        "test_datasets:\n  - path: json\n    data_files: c.jsonl\n    split: train\n"
    )
    with pytest.raises(UserError) as refused:
        load_yaml(str(yaml_file))
    lines = str(refused.value).splitlines()
    field_map = "messages=dialog,role=speaker,content=text,user=human,assistant=bot,assistant=model"
    assert lines[0].endswith(f"; here: data: a.jsonl,b.jsonl, field_map: {field_map}")
    assert lines[1].endswith(
        "test_datasets: give the evaluation files as lmtune's eval_data; here: eval_data: c.jsonl"
    )
    yaml_file.write_text("datasets: [{path: json}]\n")  # no files named: no line to give
    with pytest.raises(UserError) as refused:
        load_yaml(str(yaml_file))
    assert "here:" not in str(refused.value)
    yaml_file.write_text("model_type: LlamaForCausalLM\ndatasets: [{path: a.jsonl}, tatsu-lab/alpaca]\n")
    with pytest.raises(UserError) as refused:
        load_yaml(str(yaml_file))
    assert "model_type: lmtune loads every model" in str(refused.value) and "here:" not in str(refused.value)


def test_accumulation_in_a_config_is_translated_with_its_own_numbers(tmp_path: Path) -> None:
    yaml_file = tmp_path / "trl.yaml"
    yaml_file.write_text("per_device_train_batch_size: 4\ngradient_accumulation_steps: 2\n")
    with pytest.raises(
        UserError,
        match="; 4 per device x 2 accumulation on one device is global_batch_size: 8, micro_batch_size: 4",
    ):
        load_yaml(str(yaml_file))
    # With a global batch given too, which the accumulation contradicts: it was not named.
    yaml_file.write_text(
        "per_device_train_batch_size: 4\ngradient_accumulation_steps: 8\nglobal_batch_size: 64\n"
    )
    with pytest.raises(
        UserError, match=r"\(the global_batch_size: 64 given with it is 16 accumulation steps on one"
    ):
        load_yaml(str(yaml_file))


def test_torchtunes_batch_size_is_the_micro_batch_of_its_accumulation(tmp_path: Path) -> None:
    yaml_file = tmp_path / "torchtune.yaml"
    yaml_file.write_text("batch_size: 16\ngradient_accumulation_steps: 2\nmax_steps_per_epoch: 10\n")
    with pytest.raises(UserError) as refused:
        load_yaml(str(yaml_file))
    said = str(refused.value)
    assert (
        "16 per device x 2 accumulation on one device is global_batch_size: 32, micro_batch_size: 16" in said
    )
    assert "max_steps_per_epoch: max_steps N ends the run after N optimizer steps; lmtune has no cap" in said


@pytest.mark.parametrize(
    "flags",
    [
        ["--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "4"],
        ["--gradient_accumulation_steps=4", "--micro-batch-size", "2"],
    ],
)
def test_accumulation_flags_are_translated_with_their_own_numbers(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", *flags]) == 2
    assert "; 2 per device x 4 accumulation on one device is --global-batch-size 8, --micro-batch-size 2" in (
        capsys.readouterr().err
    )


def test_accumulation_alone_is_translated_once_with_hf_trainers_default_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["train", "--gradient-accumulation-steps", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("accumulation on one device") == 1
    assert (
        "8 per device x 4 accumulation on one device is --global-batch-size 32, --micro-batch-size 8" in err
    )


def test_a_train_setting_another_command_does_not_take_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["data", "audit", "x.jsonl", "--lr", "1"]) == 2
    assert (
        "--lr is a setting of lmtune train, which lmtune data audit does not take" in capsys.readouterr().err
    )
    assert main(["data", "audit", "--data", "x.jsonl"]) == 2  # train's way of naming the files
    assert "(give it as arguments: lmtune data audit DATA ...)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["export", "ckpt", "d", "--dtype", "bf16"],
            "--dtype: lmtune export writes the checkpoint",
        ),
        (["export", "ckpt", "d", "--precision", "bf16"], "--precision: lmtune export writes the checkpoint"),
        (["export", "ckpt", "--output_dir", "d"], "the folder is lmtune export's second argument"),
        (["export", "ckpt", "d", "--push_to_hub", "me/x"], "afterwards with lmtune push DIR REPO_ID"),
        (
            ["generate", "--model", "m", "--max_length", "9"],
            "--max-length: --max-new-tokens N caps",
        ),
        (["eval", "d.jsonl", "--eval-split", "20"], "lmtune eval scores DATA whole; to score the examples"),
        (["export", "ckpt", "d", "--out", "x"], "(give it as arguments: lmtune export CHECKPOINT DIR)"),
        (["generate", "--model", "m", "--do_sample"], "--do-sample: --temperature T above 0 samples"),
    ],
)
def test_a_name_another_command_means_otherwise_is_answered_there(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """export's --dtype was answered with train's --precision, which export refuses in turn."""
    assert main(argv) == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    ("lines", "push"),
    [
        ("push_to_hub: true\nhub_model_id: me/tuned\n", "me/tuned"),
        ("hub_model_id: me/tuned\npush_to_hub: yes\n", "me/tuned"),
        ("push_to_hub: false\nhub_model_id: me/tuned\n", None),  # HF uploads nothing then
        ("push_to_hub: false\n", None),
        ("push_to_hub: me/tuned\n", "me/tuned"),
    ],
)
def test_hf_trainers_yes_no_push_to_hub_becomes_lmtunes(tmp_path: Path, lines: str, push: str | None) -> None:
    yaml_file = tmp_path / "hf.yaml"
    yaml_file.write_text(lines)
    assert build_config(load_yaml(str(yaml_file))).checkpoint.push_to_hub == push


def test_push_to_hub_yes_without_a_repository_is_refused(tmp_path: Path) -> None:
    yaml_file = tmp_path / "hf.yaml"
    yaml_file.write_text("max_steps: 3\npush_to_hub: true\n")
    with pytest.raises(UserError, match=r":2: push_to_hub takes the repository to upload to \(NAME/REPO"):
        load_yaml(str(yaml_file))
    with pytest.raises(UserError, match="--push-to-hub: takes the repository"):
        hub_flags(["train", "--push_to_hub", "--lr", "1e-4"])


@pytest.mark.parametrize(
    ("lines", "lora", "four_bit"),
    [
        ("adapter: lora\n", True, False),
        ("adapter: qlora\nload_in_4bit: true\n", True, True),  # Axolotl's QLoRA configs say both
        ("adapter: qlora\n", True, True),
        ("adapter:\n", False, False),  # left empty: no adapter, as in Axolotl
    ],
)
def test_axolotls_adapter_switches_lora(tmp_path: Path, lines: str, lora: bool, four_bit: bool) -> None:
    yaml_file = tmp_path / "axolotl.yaml"
    yaml_file.write_text(lines)
    cfg = build_config(load_yaml(str(yaml_file)))
    assert (cfg.lora.enabled, cfg.model.load_in_4bit) == (lora, four_bit)


def test_bitsandbytes_and_cpo_settings_that_say_what_lmtune_does_are_taken(tmp_path: Path) -> None:
    """A QLoRA config as peft, TRL and Axolotl write it, and TRL's SimPO recipe (CPOConfig with
    cpo_alpha 0): refused although lmtune does what they say."""
    yaml_file = tmp_path / "qlora.yaml"
    yaml_file.write_text(
        "adapter: qlora\nbf16: true\nbnb_4bit_compute_dtype: bfloat16\nbnb_4bit_use_double_quant: true\n"
        "loss_type: simpo\ncpo_alpha: 0.0\n"
    )
    cfg = build_config(load_yaml(str(yaml_file)))
    assert (cfg.model.load_in_4bit, cfg.model.precision, cfg.objective.name) == (True, "bf16", "simpo")
    yaml_file.write_text("adapter: qlora\nbnb_4bit_compute_dtype: torch.float32\n")
    assert build_config(load_yaml(str(yaml_file))).model.precision == "fp32"
    # The HF Trainer's checkpointing as its docs advise it (was refused: "non-reentrant already").
    yaml_file.write_text(
        "gradient_checkpointing: true\ngradient_checkpointing_kwargs:\n  use_reentrant: false\n"
    )
    assert build_config(load_yaml(str(yaml_file))).model.activation_checkpointing
    yaml_file.write_text(
        "gradient_checkpointing: true\ngradient_checkpointing_kwargs: {use_reentrant: true}\n"
    )
    with pytest.raises(
        UserError, match="gradient_checkpointing_kwargs: activation_checkpointing true checkpoints non-re"
    ):
        load_yaml(str(yaml_file))
    # TRL's SFTConfig and the Trainer's, saying what lmtune does by default.
    yaml_file.write_text("completion_only_loss: true\nassistant_only_loss: true\ntf32: false\n")
    assert not build_config(load_yaml(str(yaml_file))).examples.train_on_prompt
    for lines, refusal in (
        (
            "adapter: qlora\nbf16: true\nbnb_4bit_compute_dtype: float32\n",
            r":3: bnb_4bit_compute_dtype: float32 is",
        ),
        (
            "adapter: qlora\nbf16: false\nbnb_4bit_compute_dtype: bfloat16\n",
            r":3: bnb_4bit_compute_dtype: .* turns off",
        ),
        (
            "adapter: lora\nbnb_4bit_compute_dtype: bfloat16\n",
            r":2: bnb_4bit_compute_dtype: bfloat16 applies to a 4-bit",
        ),
        ("loss_type: simpo\n", r":1: loss_type: simpo with cpo_alpha 1.0 \(its default\) is TRL's CPO-SimPO"),
        (
            "loss_type: sigmoid\ncpo_alpha: 0\n",
            r":2: cpo_alpha: 0 is a setting of TRL's CPOConfig, whose loss_type",
        ),
        (
            "bnb_4bit_use_double_quant: false\n",
            r":1: bnb_4bit_use_double_quant: load_in_4bit always quantizes",
        ),
        (
            "cpo_alpha: 1.0\n",
            r":1: cpo_alpha: 1.0 is a setting of TRL's CPOConfig, whose loss_type sigmoid \(its default\)",
        ),
        ("quantization_config:\n  load_in_4bit: true\n", r":1: quantization_config: lmtune's load_in_4bit"),
        ("assistant_only_loss: false\n", r":1: assistant_only_loss: lmtune trains only assistant turns"),
        (
            "adapter: qlora\nload_in_8bit: true\n",
            r":1: adapter: qlora is LoRA on a 4-bit base .* adapter: lora",
        ),
    ):
        yaml_file.write_text(lines)
        with pytest.raises(UserError, match=refusal):
            build_config(load_yaml(str(yaml_file)))


@pytest.mark.parametrize(
    ("lines", "objective", "reference"),
    [
        ("loss_type: sigmoid\n", "dpo", "logprobs"),
        ("loss_type: ipo\nobjective: ipo\n", "ipo", "logprobs"),
        ("loss_type: [sigmoid]\n", "dpo", "logprobs"),  # TRL 1.x's list of losses, of one
        ("loss_type: simpo\ncpo_alpha: 0\n", "simpo", "logprobs"),  # TRL's CPOConfig, as its docs give SimPO
        ("objective: dpo\nprecompute_ref_log_probs: false\n", "dpo", "live"),
        ("objective: dpo\nprecompute_ref_log_probs: true\n", "dpo", "logprobs"),
        ("rl: dpo\n", "dpo", "logprobs"),  # Axolotl's
        ("rl: orpo\norpo_alpha: 0.2\n", "orpo", "logprobs"),
        ("rl: true\n", "dpo", "logprobs"),  # Axolotl's first releases
    ],
)
def test_trls_values_that_lmtune_settings_say_are_taken(
    tmp_path: Path, lines: str, objective: str, reference: str
) -> None:
    yaml_file = tmp_path / "trl.yaml"
    yaml_file.write_text(lines)
    cfg = build_config(load_yaml(str(yaml_file)))
    assert (cfg.objective.name, cfg.objective.reference) == (objective, reference)


@pytest.mark.parametrize(
    ("lines", "precision"),
    [
        ("bf16: true\n", "bf16"),
        ("bf16: true\nfp16: false\n", "bf16"),  # as Axolotl's and the Trainer's configs say both
        ("fp16: true\nbf16: false\n", "fp16"),
        ("bf16: false\nfp16: false\n", "fp32"),
        ("bf16: true\nprecision: bf16\n", "bf16"),
    ],
)
def test_half_precision_switches_in_a_config_set_the_precision(
    tmp_path: Path, lines: str, precision: str
) -> None:
    yaml_file = tmp_path / "axolotl.yaml"
    yaml_file.write_text(lines)
    assert build_config(load_yaml(str(yaml_file))).model.precision == precision


@pytest.mark.parametrize(
    ("lines", "refusal"),
    [
        (
            "bf16: true\nfp16: true\n",
            r":2: fp16: true is precision fp16 in lmtune, which the file sets to bf16",
        ),
        (
            "precision: fp32\nbf16: true\n",
            r":2: bf16: true is precision bf16 in lmtune, which the file sets to fp32",
        ),
        ("bf16: auto\n", r":1: bf16: lmtune takes the precision as given: precision bf16"),
    ],
)
def test_half_precision_switches_that_disagree_or_guess_are_refused(
    tmp_path: Path, lines: str, refusal: str
) -> None:
    yaml_file = tmp_path / "axolotl.yaml"
    yaml_file.write_text(lines)
    with pytest.raises(UserError, match=refusal):
        load_yaml(str(yaml_file))


def test_axolotls_preference_keys_set_lmtunes(tmp_path: Path) -> None:
    yaml_file = tmp_path / "axolotl.yaml"
    for beta in ("rl_beta", "dpo_beta"):
        yaml_file.write_text(f"rl: ipo\n{beta}: 0.25\nadapter: lora\nlora_target_linear: true\n")
        cfg = build_config(load_yaml(str(yaml_file)))
        assert (cfg.objective.name, cfg.objective.beta, cfg.lora.target_modules) == (
            "ipo",
            0.25,
            "all-linear",
        )
    yaml_file.write_text("rl: orpo\norpo_alpha: 0.3\n")
    assert build_config(load_yaml(str(yaml_file))).objective.orpo_lambda == 0.3
    yaml_file.write_text("rl: kto\n")  # not one of lmtune's: answered with the ones it has
    with pytest.raises(
        UserError, match=r":1: rl: preference tuning is objective dpo \| ipo \| simpo \| orpo"
    ):
        load_yaml(str(yaml_file))


def test_axolotls_lora_target_linear_with_the_named_layers(tmp_path: Path) -> None:
    yaml_file = tmp_path / "axolotl.yaml"
    yaml_file.write_text("adapter: lora\nlora_target_linear: false\nlora_target_modules: [q_proj, v_proj]\n")
    assert build_config(load_yaml(str(yaml_file))).lora.target_modules == "q_proj,v_proj"
    # true adds every linear layer to the named ones, as in Axolotl: all of them
    yaml_file.write_text("adapter: lora\nlora_target_linear: true\nlora_target_modules: [q_proj, v_proj]\n")
    assert build_config(load_yaml(str(yaml_file))).lora.target_modules == "all-linear"
    yaml_file.write_text("adapter: lora\nlora_target_linear: false\n")  # not lmtune's default quietly
    with pytest.raises(
        UserError, match=r":2: lora_target_linear: false adapts the layers lora_target_modules"
    ):
        load_yaml(str(yaml_file))


def test_axolotls_adapter_against_the_files_own_switch_is_refused(tmp_path: Path) -> None:
    yaml_file = tmp_path / "axolotl.yaml"
    yaml_file.write_text("max_steps: 3\nadapter: qlora\nload_in_4bit: false\n")
    with pytest.raises(
        UserError, match=r":2: adapter: qlora is load_in_4bit true in lmtune, which the file sets to false"
    ):
        load_yaml(str(yaml_file))


def test_empty_keys_are_unset_as_axolotl_reads_them(tmp_path: Path) -> None:
    """Another tool's key left empty asks nothing; lmtune's own takes its default where that is
    "none" (0, off), and is refused where a value was more likely left out (the model)."""
    yaml_file = tmp_path / "axolotl.yaml"
    yaml_file.write_text(
        "fp16:\nxformers_attention:\nearly_stopping_patience:\nwarmup_steps:\nmax_steps: 3\nlearning_rate:\n"
    )
    cfg = build_config(load_yaml(str(yaml_file)))
    assert cfg.model.precision == "fp32" and cfg.eval.early_stopping_patience == 0
    assert cfg.optim.lr is None  # lmtune's default for the model, as without the key
    yaml_file.write_text("val_set_size: 0\n")  # Axolotl's default: no evaluation split
    assert build_config(load_yaml(str(yaml_file))).data.eval_split is None
    for left_out in ("base_model:\n", "lora_r:\n"):
        yaml_file.write_text(left_out)
        with pytest.raises(UserError, match="needs a value"):
            build_config(load_yaml(str(yaml_file)))


def test_other_tools_names_of_choices_are_answered(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--optimizer", "adamw_torch_fused"]) == 2
    assert "transformers' adamw_torch_fused is adamw here" in capsys.readouterr().err
    assert main(["train", "--optimizer", "adamw_bnb_8bit"]) == 2
    assert "transformers' adamw_bnb_8bit is adamw8bit here" in capsys.readouterr().err
    # Under the HF Trainer's own key (optim, a group of settings here), as an HF user writes it.
    assert main(["train", "--optim", "adamw_bnb_8bit"]) == 2
    assert "--optim: transformers' adamw_bnb_8bit is --optimizer adamw8bit" in capsys.readouterr().err
    assert main(["train", "--optim", "sgd"]) == 2
    assert "--optim: the optimizer is --optimizer sgd (optim groups its settings)" in capsys.readouterr().err
    # litgpt's and Lightning's precisions: lmtune's bf16 and fp16 are their mixed ones.
    for theirs, ours in (("bf16-mixed", "bf16 here"), ("16-mixed", "fp16 here"), ("32-true", "fp32 here")):
        assert main(["train", "--precision", theirs]) == 2
        assert f"Lightning's (litgpt's) {theirs} is {ours} (got" in capsys.readouterr().err
    assert main(["train", "--precision", "bf16-true"]) == 2
    assert "bf16-true is bf16 here, which keeps the weights in fp32" in capsys.readouterr().err
    # PyTorch's dtypes, capitals, and a GPU by its common name ("the closest is cpu").
    for argv, said in (
        (["--precision", "float32"], "PyTorch's dtype float32 is fp32 here"),
        (["--precision", "half"], "PyTorch's dtype half is fp16 here"),
        (["--precision", "BF16"], "; in lower case: bf16 (got 'BF16')"),
        (["--device", "gpu"], "; gpu is cuda here (a process per GPU: --nproc-per-node N)"),
    ):
        assert main(["train", *argv]) == 2
        assert said in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--push_to_hub", "--hub_model_id", "me/t", "--lr", "1"], ["--lr", "1", "--push-to-hub", "me/t"]),
        (["--hub-model-id=me/t", "--push_to_hub", "True"], ["--push-to-hub", "me/t"]),
        (["--push_to_hub=false", "--hub_model_id", "me/t", "--lr", "1"], ["--lr", "1"]),
        (["--push-to-hub", "me/t", "--lr", "1"], ["--push-to-hub", "me/t", "--lr", "1"]),  # lmtune's own
        (["--hub_model_id", "me/t"], ["--hub_model_id", "me/t"]),  # alone: answered (below)
    ],
)
def test_hf_trainers_push_flags_become_lmtunes(argv: list[str], expected: list[str]) -> None:
    assert hub_flags(["train", *argv]) == ["train", *expected]


def test_hub_model_id_alone_uploads_nothing_in_hf_so_it_is_answered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--hub_model_id", "me/t", "--max-steps", "1"]) == 2
    assert "--hub-model-id: the HF Trainer uploads there only with push_to_hub; lmtune's --push-to-hub" in (
        capsys.readouterr().err
    )
    yaml_file = tmp_path / "hf.yaml"
    yaml_file.write_text("max_steps: 3\nhub_model_id: me/tuned\n")
    with pytest.raises(
        UserError, match=r":2: hub_model_id: the HF Trainer uploads there only with push_to_hub"
    ):
        load_yaml(str(yaml_file))


def test_a_yaml_key_given_twice_is_refused_not_last_wins(tmp_path: Path) -> None:
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("lr: 1.0e-3\nseed: 3\nlr: 2.0e-3\n")
    with pytest.raises(UserError, match=r":3: lr is set twice \(also on line 1\)"):
        load_yaml(str(yaml_file))


def test_a_list_option_given_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--data a --data b would train on b alone; a scalar repeated is argparse's last-wins."""
    assert main(["train", "--data", "a.jsonl", "--data", "b.jsonl"]) == 2
    assert "--data is given twice; give its items once, comma-separated (--data a.jsonl,b.jsonl)" in (
        capsys.readouterr().err
    )
    args, _ = build_parser().parse_known_args(["train", "--lr", "1e-3", "--lr", "2e-3"])
    assert train_config(args).optim.lr == 2e-3


def test_a_negative_list_value_is_the_options_value(capsys: pytest.CaptureFixture[str]) -> None:
    """argparse read "-1,2" as an option ("expected one argument"); lmtune says what is wrong with it."""
    assert main(["train", "--data", "a=a.jsonl,b=b.jsonl", "--data-weights", "-1,2"]) == 2
    assert "--data-weights: every weight must be a positive number (got '-1')" in capsys.readouterr().err
    assert main(["plan", "--memory-per-device", "-5GiB"]) == 2  # a size with its unit
    assert "--memory-per-device: must be more than 0, got '-5GiB'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["train", "--LR", "1"], "lmtune train: --LR: names are lower case; did you mean --lr?"),
        (["train", "--Learning-Rate", "1"], "--Learning-Rate: names are lower case; did you mean --lr?"),
        (["train", "--Zlr", "1"], "unknown option --Zlr; did you mean --lr?"),
    ],
)
def test_a_name_in_capitals_is_shown_as_written_with_its_lower_case(
    argv: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert needle in capsys.readouterr().err
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("LR: 0.1\n")
    with pytest.raises(UserError, match=f"--config {yaml_file}:1: LR: names are lower case; did you mean lr"):
        load_yaml(str(yaml_file))


def test_hf_shares_of_the_run_below_1_are_answered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The HF Trainer takes save_steps: 0.25 as a quarter of the run's steps; lmtune counts steps."""
    yaml_file = tmp_path / "hf.yaml"
    yaml_file.write_text("save_steps: 0.25\n")
    with pytest.raises(UserError, match=r":1: save_steps: expected int, got 0.25 \(the HF Trainer's share"):
        load_yaml(str(yaml_file))
    yaml_file.write_text("num_epochs: 0.5\n")
    # Other settings named as the file names them (a flag's spelling was said in YAML).
    with pytest.raises(UserError, match=r"got 0.5 \(lmtune trains whole epochs: max_steps N stops within"):
        load_yaml(str(yaml_file))
    yaml_file.write_text("warmup_steps: 0.1\n")  # transformers 5's ratio
    with pytest.raises(UserError, match=r"got 0.1 \(a share of the training steps is warmup_ratio\)$"):
        load_yaml(str(yaml_file))
    assert main(["train", "--eval_steps", "0.1"]) == 2
    assert "--eval-every: expected int, got '0.1' (the HF Trainer's share" in capsys.readouterr().err
    # A whole number written as HF's float arguments are (num_train_epochs is a float there): taken
    # on the command line, in YAML and from Python, as it was in YAML alone.
    parsed = build_parser().parse_args(["train", "--num_train_epochs", "3.0", "--max_steps", " 7. "])
    assert (train_config(parsed).schedule.epochs, train_config(parsed).schedule.max_steps) == (3, 7)
    assert TrainConfig(num_train_epochs=2.0).schedule.epochs == 2
    assert type(TrainConfig(num_train_epochs=2.0).schedule.epochs) is int
    assert main(["train", "--num_train_epochs", "1.5"]) == 2
    assert "got '1.5' (lmtune trains whole epochs" in capsys.readouterr().err
    with pytest.raises(UserError, match=r"expected int \(got 1.5\) \(lmtune trains whole epochs"):
        TrainConfig(num_train_epochs=1.5)  # from Python with the reason too
    # Scientific notation, which YAML reads as text without a dot: a whole number is taken, exactly.
    yaml_file.write_text("max_steps: 2E3\nsave_every: 5e0\n")
    parsed = build_parser().parse_args(["train", "--config", str(yaml_file)])
    assert (train_config(parsed).schedule.max_steps, train_config(parsed).checkpoint.save_every) == (2000, 5)
    parsed = build_parser().parse_args(["train", "--max_steps", "1e2", "--num_train_epochs", "3.0e0"])
    assert (train_config(parsed).schedule.max_steps, train_config(parsed).schedule.epochs) == (100, 3)
    for written in ("1.5e0", "1e35", "1e-1"):
        assert main(["train", "--max-steps", written]) == 2
        assert f"--max-steps: expected int, got '{written}'" in capsys.readouterr().err


TORCHTUNE_RECIPE = """\
model:
  _component_: torchtune.models.llama3_2.lora_llama3_2_1b
  lora_rank: 64
  apply_lora_to_mlp: True
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  max_seq_len: null
optimizer:
  _component_: torch.optim.AdamW
  lr: 3e-4
  weight_decay: 0.01
profiler:
  _component_: torchtune.training.setup_torch_profiler
custom:
  _component_: my.module.Thing
batch_size: 4
epochs: 1
enable_activation_checkpointing: false
"""


def test_a_torchtune_recipe_is_answered_group_by_group_at_once(tmp_path: Path) -> None:
    """A recipe's _component_ groups name Python objects torchtune builds: each is answered with
    lmtune's settings (its entries that are lmtune's named), and the file's other keys in the same
    message; nothing a file names is imported."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(TORCHTUNE_RECIPE)
    with pytest.raises(UserError) as refused:
        load_yaml(str(recipe))
    lines = str(refused.value).splitlines()
    assert lines[0].startswith(
        f"--config {recipe}:1: model: 'torchtune.models.llama3_2.lora_llama3_2_1b' is a torchtune component; "
        "model: a Hugging Face model folder or hub id"
    )
    assert lines[0].endswith(
        "; lora_rank: lmtune's settings, given at the top level; apply_lora_to_mlp: lora_target_modules: "
        "all-linear adapts the MLP's layers too (LoRA is switched on by "
        "lora: true; lora_target_modules names the layers by the model's names)"
    )
    assert (
        lines[1].startswith(f"--config {recipe}:5: tokenizer: ") and "max_seq_len is max_length" in lines[1]
    )
    assert lines[2].endswith("| sgd; lr, weight_decay: lmtune's settings, given at the top level")
    assert lines[3].endswith(
        "profiler: 'torchtune.training.setup_torch_profiler' is a torchtune component; "
        "profile: true times each step's phases"
    )
    assert lines[4].endswith(
        "custom: 'my.module.Thing' is a torchtune component; lmtune takes settings by "
        "name (lmtune train --help), not components"
    )
    # The other keys: torchtune's per-device batch_size is answered; its aliases are taken.
    assert lines[5:] == [
        f"--config {recipe}:16: batch_size: micro_batch_size is the examples per process "
        "in one forward; global_batch_size the examples of an optimizer step over all processes"
    ]
    recipe.write_text("enable_activation_checkpointing: true\nlog_every_n_steps: 5\nmodel:\n  name: tiny\n")
    cfg = build_config(load_yaml(str(recipe)))
    assert cfg.model.activation_checkpointing and cfg.logging.log_every == 5 and cfg.model.name == "tiny"


LITGPT_CONFIG = """\
out_dir: out/finetune
lora_query: true
data:
  class_path: litgpt.data.Alpaca2k
  init_args:
    seed: 42
train:
  save_interval: 800
  micro_batch_size: 1
  min_lr: 6.0e-05
eval:
  interval: 100
  max_iters: 10
optimizer:
  class_path: torch.optim.AdamW
  init_args:
    lr: 0.0002
    betas: [0.9, 0.95]
"""


def test_a_litgpt_config_is_answered_group_by_group_at_once(tmp_path: Path) -> None:
    """litgpt's class_path groups and its train: and eval: groups (whose names collide with lmtune's
    own data and eval groups) are answered with lmtune's names, with the other keys, at once."""
    config = tmp_path / "lora.yaml"
    config.write_text(LITGPT_CONFIG)
    with pytest.raises(UserError) as refused:
        load_yaml(str(config))
    lines = [line.removeprefix(f"--config {config}:") for line in str(refused.value).splitlines()]
    assert lines == [
        "3: data: 'litgpt.data.Alpaca2k' is a litgpt component; data: a JSONL file (text, prompt/completion "
        "or chat messages) or a hub data set name; seed: lmtune's settings, given at the top level",
        "7: train: litgpt's group of settings; save_interval (save_every), micro_batch_size: lmtune's "
        "settings, given at the top level; min_lr: min_lr_ratio is where the schedule ends as a fraction "
        "of lr (min_lr / lr; 0.1 by default)",
        "11: eval: litgpt's group of settings; interval (eval_every): lmtune's settings, given at the "
        "top level; max_iters: lmtune evaluates on all of eval_data (or eval_split)",
        "14: optimizer: 'torch.optim.AdamW' is a litgpt component; optimizer: adamw (the default) | "
        "adamw8bit | paged_adamw8bit | sgd; lr: lmtune's settings, given at the top level; betas: "
        "AdamW's betas are adam_beta1 and adam_beta2 (0.9 and 0.999 by default)",
        "2: lora_query: lora switches LoRA on; lora_target_modules names its layers as the model does "
        "(q_proj,v_proj)",
    ]
    config.write_text("1:\n  class_path: x\n")  # keys of any type, as a hostile file has them
    with pytest.raises(UserError, match=r"1: 1: 'x' is a litgpt component; lmtune takes settings by name"):
        load_yaml(str(config))
    config.write_text("seed: null\n")  # torchtune's: a random seed
    with pytest.raises(UserError, match=r"seed: needs a value \(got null\) \(torchtune's null seed"):
        load_yaml(str(config))
    config.write_text("max_length: null\n")  # as torchtune's max_seq_len: null, lmtune's default is named
    with pytest.raises(UserError, match=r"max_length: needs a value \(got null\); remove it for the default"):
        load_yaml(str(config))
    config.write_text("resume: false\n")  # litgpt's
    with pytest.raises(UserError, match=r"resume: expected str, got False \(auto \| never \| PATH; never"):
        load_yaml(str(config))
    # Without those groups, lmtune's own eval group is read as before; out_dir is output_dir.
    config.write_text("out_dir: out/x\neval:\n  every: 5\n")
    cfg = build_config(load_yaml(str(config)))
    assert str(cfg.checkpoint.output_dir) == "out/x" and cfg.eval.every == 5


@pytest.mark.parametrize(("value", "packing"), [("true", "on"), ("false", "off")])
def test_axolotls_sample_packing_is_packing(tmp_path: Path, value: str, packing: str) -> None:
    yaml_file = tmp_path / "axolotl.yaml"
    yaml_file.write_text(f"sample_packing: {value}\n")
    assert build_config(load_yaml(str(yaml_file))).batch.packing == packing


def test_a_trainer_or_sft_config_dump_is_taken_where_it_says_what_lmtune_does(tmp_path: Path) -> None:
    """TrainingArguments.to_dict() and SFTConfig dumps: save_total_limit null (keep every one) was
    "remove it for the default, 3", the opposite; gradient_checkpointing beside its new name with
    the same value was "set twice" and hid every other answer; loss_type nll (SFT's own) was "none of
    the preference losses"; metric_for_best_model loss (the HF Trainer reads eval_loss) was refused."""
    dump = tmp_path / "dump.yaml"
    dump.write_text(
        "save_total_limit: null\nactivation_checkpointing: true\ngradient_checkpointing: true\n"
        "loss_type: nll\ndataloader_drop_last: true\naverage_tokens_across_devices: true\n"
        "metric_for_best_model: loss\neval_split: 10\n"
    )
    cfg = build_config(load_yaml(str(dump)))
    assert (cfg.checkpoint.keep_last, cfg.model.activation_checkpointing, cfg.objective.name) == (
        0,
        True,
        "sft",
    )
    assert cfg.eval.metric_for_best == "eval_loss"
    assert TrainConfig(metric_for_best="perplexity").eval.metric_for_best == "eval_perplexity"
    # Their defaults that say what lmtune does: taken (each was answered, one per key of a dump).
    dump.write_text(
        "label_smoothing_factor: 0.0\nshuffle_dataset: false\nuse_cpu: false\ndisable_tqdm: false\n"
        "eval_strategy: 'no'\npacking_strategy: bfd\n"
    )
    assert build_config(load_yaml(str(dump))) == TrainConfig()
    # Names that differ are refused, with every other answer of the file at once.
    dump.write_text("lr: 1e-3\nlearning_rate: 2e-3\npacking_strategy: wrapped\nlabel_smoothing_factor: 0.1\n")
    with pytest.raises(UserError) as refused:
        load_yaml(str(dump))
    lines = str(refused.value).splitlines()
    assert len(lines) == 3 and lines[0].endswith(
        "dump.yaml:2: lr is set twice (as lr and learning_rate); give it once"
    )
    assert "packing_strategy: lmtune packs by its own rule" in lines[1]
    assert "label_smoothing_factor: lmtune's supervised loss has no label smoothing" in lines[2]


@pytest.mark.parametrize(
    ("written", "answer"),
    [
        ("lr_scheduler_type: constant", "lr_schedule constant with warmup_steps 0 (lmtune warms up over 5%"),
        ("lr_scheduler_type: linear", "add warmup_steps 0 for theirs"),
        ("lr_scheduler_type: cosine_with_min_lr", "lr_schedule cosine, with its min_lr_rate as min_lr_ratio"),
        ("lr_scheduler_kwargs: {min_lr_rate: 0.1}", "min_lr_ratio (transformers' min_lr_rate)"),
        ("dataloader_drop_last: false", "lmtune always trains whole global batches"),
        ("loss_type: dft", "lmtune's losses are objective sft (TRL's nll) | dpo"),
    ],
)
def test_trainer_and_sft_settings_lmtune_has_otherwise_are_answered(
    tmp_path: Path, written: str, answer: str
) -> None:
    """Answered by the closest name's hint before (packing_strategy was "did you mean
    logging_strategy?"), or not at all; the schedules' answers leave out lmtune's default warmup."""
    path = tmp_path / "run.yaml"
    path.write_text(written + "\n")
    with pytest.raises(UserError, match=re.escape(answer)):
        load_yaml(str(path))


def test_one_value_under_two_names_is_taken_everywhere_and_read_as_the_setting_reads_it(
    tmp_path: Path,
) -> None:
    """The same value under two names was "set twice" where YAML read it as text (1e-4 beside
    0.0001), under two peers' names in TrainConfig, beside a null, as metric names HF reads alike,
    and on the command line; True beside 1 was taken in one order and refused in the other."""
    from lmtune.cli.argv import spelled_twice

    dump = tmp_path / "dump.yaml"
    for text, read in [
        ("learning_rate: 1e-4\nlr: 0.0001\n", lambda c: c.optim.lr == 1e-4),
        ("metric_for_best_model: null\nmetric_for_best: eval_loss\n", lambda c: c.eval.metric_for_best),
        ("metric_for_best_model: eval_loss\nmetric_for_best: loss\n", lambda c: c.eval.metric_for_best),
        # transformers 4's dumps: steps 0 beside a ratio is the ratio, as its Trainer takes it.
        ("warmup_ratio: 0.1\nwarmup_steps: 0\n", lambda c: c.schedule.warmup_steps is None),
        ("sample_packing: true\npacking: true\n", lambda c: c.batch.packing == "on"),
        ("adapter: qlora\nload_in_4bit: 'yes'\n", lambda c: c.model.load_in_4bit),
    ]:
        dump.write_text(text)
        assert read(build_config(load_yaml(str(dump)))), text
    for first, second in (("true", "1"), ("1", "true")):
        dump.write_text(f"activation_checkpointing: {first}\ngradient_checkpointing: {second}\n")
        with pytest.raises(UserError, match="activation_checkpointing is set twice"):
            load_yaml(str(dump))
    assert TrainConfig(num_train_epochs=2, num_epochs=2).epochs == 2
    assert (
        TrainConfig(metric_for_best_model="eval_loss", metric_for_best="loss").eval.metric_for_best
        == "eval_loss"
    )
    assert TrainConfig(warmup_steps=0, warmup_ratio=0.1).schedule.warmup_ratio == 0.1
    assert TrainConfig(warmup_steps=0).schedule.warmup_steps == 0  # alone: no warmup
    with pytest.raises(TypeError, match=r"epochs is set twice \(as num_train_epochs and num_epochs\)"):
        TrainConfig(num_train_epochs=2, num_epochs=3)
    parser = build_parser()._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    assert spelled_twice(parser, ["--lr", "1e-4", "--learning-rate=0.0001"]) is None
    assert spelled_twice(parser, ["--gradient-checkpointing", "--activation-checkpointing"]) is None
    assert "set twice" in str(spelled_twice(parser, ["--lr", "1e-4", "--learning-rate", "2e-4"]))
    assert "set twice" in str(
        spelled_twice(parser, ["--gradient-checkpointing", "--no-activation-checkpointing"])
    )


def test_eval_strategy_no_beside_what_makes_lmtune_evaluate_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The HF Trainer never evaluates under eval_strategy no, whatever eval_steps says; lmtune took
    it as asking nothing and evaluated. TRL's loss_type nll on the command line said it was none
    of lmtune's losses, after naming it as sft."""
    dump = tmp_path / "dump.yaml"
    dump.write_text("eval_strategy: 'no'\neval_steps: 2\nval_set_size: 0.1\n")
    with pytest.raises(UserError, match=r"dump.yaml:1: eval_strategy: no never evaluates in the HF Trainer"):
        load_yaml(str(dump))
    dump.write_text("evaluation_strategy: no\neval_steps: null\n")  # YAML's unquoted no: false
    assert build_config(load_yaml(str(dump))) == TrainConfig()
    assert main(["train", "--loss_type", "nll"]) == 2
    assert "TRL's nll loss (SFTConfig's) is --objective sft, lmtune's default" in capsys.readouterr().err
