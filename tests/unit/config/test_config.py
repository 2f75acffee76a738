from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lmtune.cli.commands import train_config as _train_config
from lmtune.cli.parser import build_parser
from lmtune.config.io import build_config, load_yaml
from lmtune.config.settings import TrainConfig, config_fields, micro_batch_size, option_name, setting_named
from lmtune.errors import UserError
from lmtune.training.batch_layout import epochs
from lmtune.training.preflight import validate

REPO = Path(__file__).resolve().parents[3]


def parse(argv: list[str]) -> TrainConfig:
    args = build_parser().parse_args(["train", *argv])
    cfg: TrainConfig = _train_config(args)
    return cfg


def test_defaults_are_valid() -> None:
    validate(TrainConfig(), world_size=1)


def test_flags_override_yaml(tmp_path: Path) -> None:
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("lr: 0.01\nmicro-batch-size: 4\nepochs: 2\n")
    cfg = parse(["--config", str(cfg_file), "--lr", "0.5", "--max-steps", "7", "--no-progress"])
    assert cfg.lr == 0.5  # flag wins
    assert cfg.micro_batch_size == 4  # from YAML
    assert cfg.epochs == 2
    assert cfg.max_steps == 7
    assert cfg.progress is False


def test_help_lists_every_setting_with_its_default() -> None:
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]  # type: ignore[union-attr]
    text = train.format_help().replace("\n", " ")
    text = " ".join(text.split())
    for f in config_fields():
        assert option_name(f.name) in text
        # An unset one says what it means, once: not "Default: the tokenizer's own ... (default: None)".
        said = "" if f.default is None and "efault" in f.help else f"(default: {f.default})"
        assert said.replace("None", "none") in text
    assert "(default: None)" not in text and "(default: none)" in text


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"lr": -1.0}, "--lr"),
        ({"strategy": "horovod"}, "--strategy"),
        ({"global_batch_size": 30, "micro_batch_size": 8}, "--global-batch-size 30"),
        ({"data": "/no/such/file.jsonl"}, "--data: no such file or folder: /no/such/file.jsonl"),
        ({"eval_data": "/missing.jsonl"}, "--eval-data"),
        ({"resume": ""}, "--resume: empty; give a checkpoint folder"),  # it read the working folder
        ({"precision": "fp8"}, "--precision"),
        ({"max_length": 1}, "--max-length"),
        # 1e22 packed rows forever, past SIGTERM, growing without bound.
        ({"max_length": 2**24 + 1}, r"--max-length: must be at most 2\*\*24 \(16,777,216\)"),
        ({"greater_is_better": True}, "--greater-is-better: needs --metric-for-best"),
        (
            {"load_best_at_end": True, "data": "d.jsonl"},
            "--load-best-at-end: needs --eval-data or --eval-split",
        ),
        ({"decay_ratio": 0.3}, "--decay-ratio: applies to --lr-schedule wsd only"),
        # 1.0 held out one example, where all of the data (or 100%) was more likely meant.
        ({"eval_split": 1.0}, r"--eval-split: 1.0 must be a fraction below 1 or a number of examples"),
        ({"eval_split": "2.0"}, r"--eval-split: '2.0' must be .*without a decimal point \(2\)"),
        # A DatasetDict's split name: it said "expected float" alone.
        ({"eval_split": "test"}, r"got 'test' \(a share .* --eval-data: DIR/test .* NAME:test"),
        ({"lr_schedule": "constant", "min_lr_ratio": 0.5}, "--min-lr-ratio: applies to --lr-schedule cosine"),
        ({"hub_private": True}, "--hub-private: applies with --push-to-hub only"),
        # Recorded (and "applied" on resume) but used by no optimizer of the run.
        ({"momentum": 0.5}, r"--momentum: applies to --optimizer sgd only \(AdamW's is --adam-beta1\)"),
        ({"optimizer": "sgd", "adam_beta2": 0.95}, "--adam-beta2: applies to the AdamW optimizers only"),
        ({"sample_temperature": 0.7}, "--sample-temperature: applies with --sample-prompts only"),
        ({"early_stopping_threshold": 0.1}, "--early-stopping-threshold: needs --early-stopping-patience"),
        ({"warmup_steps": 5, "warmup_ratio": 0.5}, "--warmup-ratio: is instead of --warmup-steps: give one"),
        # Refused for any process count: a config checked on one process holds on many.
        ({"optimizer": "adamw8bit", "strategy": "fsdp"}, "--optimizer: does not work with --strategy fsdp"),
        # A setting that would have no effect is refused rather than ignored.
        ({"lora_rank": 8}, "--lora-rank: applies with --lora only .LoRA is off: every weight would train."),
        ({"lora_target_modules": "q_proj"}, "--lora-target-modules: applies with --lora only"),
        (
            {"lora_alpha": 32},
            r"--lora-alpha: applies with --lora only .LoRA is off: every weight would train. \(got 32\)$",
        ),
        ({"lora_dropout": 0.1}, "--lora-dropout: applies with --lora only .LoRA is off"),
        ({"beta": 0.3}, "--beta: applies to --objective dpo, ipo, simpo only"),
        # TRL's ORPOConfig.beta is ORPO's weight: a TRL user's beta would have changed no loss.
        ({"objective": "orpo", "beta": 0.2}, r"--beta: under --objective orpo: .*is --orpo-lambda"),
        ({"objective": "dpo", "simpo_gamma": 1.0}, "--simpo-gamma: applies to --objective simpo only"),
        ({"objective": "simpo", "orpo_lambda": 0.5}, "--orpo-lambda: applies to --objective orpo only"),
        ({"objective": "orpo", "reference": "live"}, "--reference: applies to --objective dpo and ipo only"),
        ({"objective": "dpo", "neftune_alpha": 5.0}, "--neftune-alpha: applies to --objective sft only"),
        # A preference objective turns dropout off: a nonzero LoRA dropout would be recorded, not applied.
        (
            {"objective": "dpo", "lora": True, "lora_dropout": 0.1},
            "--lora-dropout: has no effect under --objective dpo, which turns all dropout off",
        ),
        (
            {"objective": "orpo", "train_on_prompt": True},
            "--train-on-prompt: applies to --objective sft only",
        ),
        ({"neftune_alpha": -1.0}, "--neftune-alpha: must be >= 0"),
        # It held out pieces of documents whose other pieces trained.
        (
            {"eval_split": 0.1, "truncation": "split"},
            "--eval-split: holds out examples, and --truncation split",
        ),
        (
            {"objective": "dpo", "max_prompt_length": 512},
            r"--max-prompt-length: must be in \[1, --max-length\)",
        ),
    ],
)
def test_invalid_settings_name_the_option(values: dict[str, object], needle: str) -> None:
    with pytest.raises(UserError, match=needle.replace("+", r"\+")):
        validate(build_config(values), world_size=1)


def test_a_ratio_of_no_warmup_beside_warmup_steps_asks_nothing() -> None:
    """transformers 4's dumps write warmup_ratio 0.0 beside warmup_steps (HF takes the steps): it
    was "give one"."""
    for steps in (0, 5):
        cfg = build_config({"warmup_ratio": 0.0, "warmup_steps": steps})
        validate(cfg, world_size=1)
        assert cfg.schedule.warmup_steps == steps


def test_a_setting_given_for_a_feature_that_is_off_is_refused_at_its_default(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An Axolotl config's LoRA keys without `adapter: lora` (all at lmtune's defaults) trained every
    weight; TRL's `beta: 0.1` under sft trained no preference. Given at all, they are refused."""
    from lmtune.cli import main

    config = tmp_path / "axolotl.yaml"
    config.write_text("base_model: tiny\nlora_r: 16\nlora_alpha: 32\nlora_dropout: 0.05\nmax_steps: 1\n")
    assert main(["train", "--config", str(config), "--output-dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"--config {config}:2: lora_r: applies with lora only (LoRA is off" in err, err
    assert not (tmp_path / "out").exists()
    assert main(["plan", "--config", str(config), "--memory-per-device", "1GB"]) == 2
    assert f"{config}:2: lora_r: applies with lora only" in capsys.readouterr().err
    refused = {
        "beta": 0.1,
        "bnb_4bit_quant_type": "nf4",
        "lora_target_modules": "all-linear",
        "lora_dropout": 0.05,  # Axolotl's usual value, and lmtune's default
    }
    for name, value in refused.items():
        with pytest.raises(UserError, match=f"{option_name(name)}: (applies|needs)"):
            validate(build_config({name: value}), world_size=1, given=frozenset({name}))
    # What is the run's behaviour anyway, spelled out, is not refused: prompt masking under DPO,
    # LoRA's dropout where the objective turns dropout off, a zero NEFTune.
    for values in (
        {"objective": "dpo", "train_on_prompt": False},
        {"objective": "dpo", "lora": True, "lora_dropout": 0.05},
        {"objective": "dpo", "neftune_alpha": 0.0},
    ):
        validate(build_config(values), world_size=1, given=frozenset(values))


def test_a_switch_is_named_without_its_value() -> None:
    with pytest.raises(UserError) as refused:
        validate(build_config({"merge_lora": True}), world_size=1)
    assert str(refused.value).startswith("--merge-lora: needs --lora") and "got" not in str(refused.value)


def test_settings_that_apply_are_accepted_at_any_value() -> None:
    for values in (
        {"lora": True, "lora_rank": 8, "lora_target_modules": "q_proj"},
        {"objective": "simpo", "beta": 2.0, "simpo_gamma": 1.0},
        {"objective": "orpo", "orpo_lambda": 0.5},
        {"objective": "ipo", "reference": "live"},
        {"objective": "dpo", "lora": True, "lora_dropout": 0.0},
        {"neftune_alpha": 5.0},
    ):
        validate(build_config(values), world_size=1)


def test_global_batch_must_divide_by_world_size() -> None:
    cfg = build_config({"global_batch_size": 8, "micro_batch_size": 4})
    validate(cfg, world_size=2)
    with pytest.raises(UserError, match="4 x 3 processes"):
        validate(cfg, world_size=3)


def test_default_micro_batch_is_the_per_process_share() -> None:
    cfg = build_config({"global_batch_size": 32})
    assert micro_batch_size(cfg, 1) == 32 and micro_batch_size(cfg, 4) == 8
    # Resuming, "use a multiple of 3" cannot be followed: the global batch is the run's.
    with pytest.raises(UserError, match=r"does not divide over 3 processes; .* that divides 32"):
        validate(cfg, world_size=3)
    # Below the world size, one multiple to give (it said "such as 4 or 4").
    with pytest.raises(UserError, match=r"multiple of 4 \(such as 4\), or"):
        validate(build_config({"global_batch_size": 2}), world_size=4)


def test_sample_data_trains_longer_by_default() -> None:
    assert epochs(build_config({})) == 8
    assert epochs(build_config({"data": "my.jsonl"})) == 3
    assert epochs(build_config({"epochs": 1})) == 1


def test_bad_types_and_unknown_keys() -> None:
    with pytest.raises(UserError, match="--epochs: expected int"):
        build_config({"epochs": "many"})
    with pytest.raises(UserError, match="--epochs: expected int"):
        build_config({"epochs": 1.5})
    with pytest.raises(UserError, match=r"run\.yaml: unknown setting eval_splt; did you mean eval_split\?"):
        build_config({"eval_splt": 1}, "run.yaml")
    assert build_config({"learning_rate": 1e-4}).optim.lr == 1e-4  # HF Trainer's name, same meaning
    assert build_config({"lr": "1e-4", "progress": "false"}).progress is False


def test_yaml_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--config: no such file"):
        load_yaml(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: [1,\n")
    with pytest.raises(UserError, match=r"bad.yaml:\d+: not valid YAML"):
        load_yaml(str(bad))
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(UserError, match="expected a mapping"):
        load_yaml(str(listy))
    empty = tmp_path / "empty.yaml"
    for text in ("", "# lr: 1e-4\n"):  # not a run of the built-in demo
        empty.write_text(text)
        with pytest.raises(UserError, match=r"empty\.yaml: holds no settings \(empty, or only comments\)"):
            load_yaml(str(empty))


def test_every_shipped_config_parses() -> None:
    shipped = sorted((REPO / "examples").glob("*.yaml"))
    assert shipped, "examples/ should ship at least one config"
    for path in shipped:
        cfg = build_config(load_yaml(str(path)), str(path))
        assert dataclasses.is_dataclass(cfg)


def test_nnodes_and_resume_options(tmp_path: Path) -> None:
    from lmtune.config.settings import parse_nnodes

    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:4") == (1, 4)
    for bad in ("0", "3:2", "x"):
        with pytest.raises(UserError, match="--nnodes"):
            parse_nnodes(bad)
    with pytest.raises(UserError, match="--rdzv-endpoint: is needed"):
        validate(build_config({"nnodes": "2"}), world_size=2)
    # What torchrun reads (an IPv6 host in brackets or before the last colon; no port: its 29400),
    # and nothing its rendezvous would refuse with a ValueError's traceback.
    for good in ("node0:29500", "10.0.0.1:1", "node0", "[::1]:29500", "::1:29500", "[::1]"):
        validate(build_config({"nnodes": "2", "rdzv_endpoint": good}), world_size=2)
    for bad in ("node0:99999", "node0:abc", ":29500", "node0:", "node 0:1", "node0:0", ""):
        with pytest.raises(UserError, match=r"--rdzv-endpoint: must be HOST:PORT .* from 1 to 65535"):
            validate(build_config({"nnodes": "2", "rdzv_endpoint": bad}), world_size=2)
    with pytest.raises(UserError, match="--resume: no such checkpoint folder"):
        validate(build_config({"resume": str(tmp_path / "nope")}), world_size=1)
    (tmp_path / "train.jsonl").write_text("{}\n")  # a file is no checkpoint: said so, not "no such"
    with pytest.raises(UserError, match=r"train\.jsonl: not a folder; it takes a checkpoint"):
        validate(build_config({"resume": str(tmp_path / "train.jsonl")}), world_size=1)
    with pytest.raises(UserError, match="--on-nan"):
        validate(build_config({"on_nan": "ignore"}), world_size=1)


def test_model_help_names_every_preset() -> None:
    from lmtune.config.settings import setting_named
    from lmtune.model.modeling import PRESETS

    shown = setting_named("model").help
    assert all(name in shown for name in PRESETS), shown


@pytest.mark.parametrize("values", [{"eval_every": 5}, {"metric_for_best": "eval_loss"}])
def test_evaluation_settings_without_evaluation_data_are_refused(
    values: dict[str, object], tmp_path: Path
) -> None:
    """HF's eval_steps with no eval data evaluated nothing, silently; the built-in sample has its
    held-out split, and --eval-split makes one."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a"}\n')
    option = "--eval-every" if "eval_every" in values else "--metric-for-best"
    with pytest.raises(UserError, match=f"{option}: needs --eval-data or --eval-split"):
        validate(build_config({"data": str(data), **values}), world_size=1)
    validate(build_config({"data": str(data), "eval_split": 0.5, **values}), world_size=1)
    validate(build_config(values), world_size=1)  # the built-in sample


@pytest.mark.parametrize("name", ["lr", "neftune_alpha", "max_grad_norm"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_the_python_api_refuses_what_the_cli_refuses_as_not_finite(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"TrainConfig: {name}: must be a finite number"):
        TrainConfig(**{name: value})  # type: ignore[arg-type]
    group = setting_named(name).group
    assert group is not None
    cfg = TrainConfig()
    on_group = TrainConfig(
        **{group: dataclasses.replace(getattr(cfg, group), **{setting_named(name).field: value})}
    )
    with pytest.raises(UserError, match=f"{option_name(name)}: must be a finite number"):  # set on a group
        validate(on_group, world_size=1)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        # No str past 4,300 digits: a ValueError from Python itself where the message shows it.
        ("max_steps", 10**5000, r"is too large \(got an integer of 5,001 digits\)$"),
        ("lr", 10**5000, r"must be a finite number \(got an integer of 5,001 digits\)$"),
    ],
    ids=["max_steps", "lr"],  # pytest's ids would take the values' str
)
def test_the_python_api_refuses_integers_with_no_str(name: str, value: int, message: str) -> None:
    with pytest.raises(ValueError, match=f"^TrainConfig: {name}: {message}"):
        TrainConfig(**{name: value})


@pytest.mark.parametrize("name", ["max_steps", "epochs"])
def test_step_counts_past_what_a_checkpoint_records_are_refused(name: str) -> None:
    """1e30 steps warmed up for 5e28 of them: the run trained nothing, at a learning rate of 1e-29."""
    said = rf"^{option_name(name)}: must be at most 2\*\*40 \(1,099,511,627,776\)"
    with pytest.raises(UserError, match=said):
        validate(TrainConfig(**{name: 10**30}), world_size=1)
    validate(TrainConfig(**{name: 2**40}), world_size=1)


def test_hf_trainers_null_neftune_noise_alpha_is_off(tmp_path: Path) -> None:
    """Configs written from TrainingArguments or SFTConfig hold ``neftune_noise_alpha: null``."""
    path = tmp_path / "sft.yaml"
    path.write_text("neftune_noise_alpha: null\nlearning_rate: 2.0e-5\n")
    cfg = build_config(load_yaml(str(path)))
    assert cfg.objective.neftune_alpha == 0.0 and cfg == TrainConfig(lr=2e-5)


def test_load_best_at_end_takes_the_loss_unless_a_metric_is_given() -> None:
    """As the HF Trainer's load_best_model_at_end (it was refused without --metric-for-best)."""
    assert TrainConfig(load_best_at_end=True).eval.metric_for_best == "eval_loss"
    given = TrainConfig(load_best_at_end=True, metric_for_best="eval_perplexity")
    assert given.eval.metric_for_best == "eval_perplexity"
    assert TrainConfig().eval.metric_for_best is None


def test_a_key_with_a_space_around_it_is_its_name(tmp_path: Path) -> None:
    """JSON's "lr " was "unknown setting lr; did you mean lr?" where "learning_rate " was taken."""
    path = tmp_path / "run.json"
    path.write_text('{"lr ": 0.005, " learning_rate": 0.006}')
    with pytest.raises(UserError, match=r"lr is set twice"):
        load_yaml(str(path))
    path.write_text('{"lr ": 0.005, "max_steps ": 3, "lora": {" rank": 4}}')
    assert load_yaml(str(path)) == {"lr": 0.005, "max_steps": 3, "lora_rank": 4}


def test_a_key_yaml_reads_as_a_value_or_written_as_a_flag_is_said_so(tmp_path: Path) -> None:
    """YAML 1.1's unquoted `NO:` was "unknown setting False" (no line), `--lr:` "unknown setting
    __lr"."""
    path = tmp_path / "run.yaml"
    for text, said in (
        ("lr: 0.1\nNO: 3\n", r"run.yaml:2: the key NO reads as false, not a setting's name .*quote it"),
        ("on: 1\n", r"run.yaml:1: the key on reads as true"),
        ("--max-steps: 3\n", r"run.yaml:1: --max-steps is written as a flag: a file's key is max_steps$"),
        # A number with a dot lost its line, and of several such keys only the first was said.
        (
            "lr: 0.1\n3.5: x\nnull: 3\n",
            r"^--config \S*run.yaml:2: the key 3.5 reads as 3.5, .*\n"
            r"--config \S*run.yaml:3: the key null reads as null,",
        ),
    ):
        path.write_text(text)
        with pytest.raises(UserError, match=said):
            load_yaml(str(path))
    path.write_text("'NO': 3\n")  # quoted: a name, answered as one
    with pytest.raises(UserError, match="unknown setting NO"):
        load_yaml(str(path))


def test_a_run_record_read_from_another_folder_finds_the_runs_relative_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each source of a data spec (its name and escaped commas kept) and each single path is read
    from the folder the run started in where it names nothing here; a path is one path, commas and
    `=` in it included (split as a data spec, an output folder `lr=1e-3` was a source named lr)."""
    from lmtune.config.replay import recorded_settings

    origin, here = tmp_path / "origin", tmp_path / "here"
    for made in ("data/a,1.jsonl", "b.jsonl", "runs/a,b/x", "runs/a/x", "lr=1e-3/x"):
        (origin / made).parent.mkdir(parents=True, exist_ok=True)
        (origin / made).write_text("{}")
    here.mkdir()
    (here / "b.jsonl").write_text("{}")  # named here too: read here
    monkeypatch.chdir(here)
    run = {
        "config": {
            "data": "chat=data/a\\,1.jsonl,b.jsonl,sample",
            "output_dir": "runs/a,b",
            "model": "Qwen/Qwen2.5-0.5B",
        },
        "resolved": {},
        "environment": {"working_folder": str(origin)},
    }
    settings, _ = recorded_settings(run, {})
    assert settings["data"] == f"chat={origin / 'data' / 'a'}\\,1.jsonl,b.jsonl,sample"
    assert settings["output_dir"] == str(origin / "runs/a,b") and settings["model"] == "Qwen/Qwen2.5-0.5B"
    run["config"]["output_dir"] = "lr=1e-3"
    assert recorded_settings(run, {})[0]["output_dir"] == str(origin / "lr=1e-3")
