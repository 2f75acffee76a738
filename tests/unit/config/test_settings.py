"""One owner per setting: allowed values in the field metadata, flags for subprocesses from to_argv
(round-trip), plan's own --help, no abbreviated options."""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from lmtune.cli import main
from lmtune.cli.commands import train_config
from lmtune.cli.parser import build_parser
from lmtune.config.groups import SAMPLE_EPOCHS
from lmtune.config.io import build_config, load_yaml, to_argv
from lmtune.config.settings import (
    PLAN_SETTINGS,
    TrainConfig,
    choices,
    config_fields,
    field_type,
    option_name,
    setting_named,
)
from lmtune.errors import UserError, WrongType, WrongValue
from lmtune.training.preflight import validate

REPO = Path(__file__).resolve().parents[3]


def _different(f: Any) -> Any:
    """A value of field ``f`` other than its default (strings start with "-" on purpose)."""
    kind, default = field_type(f), f.default
    if choices(f.name):  # a setting with one allowed value keeps it
        return next((c for c in choices(f.name) if c != default), default)
    if kind is bool:
        return not default
    if kind is int:
        return 3 if default is None else default + 2
    if kind is float:
        return 0.375 if default is None else default * 0.5 + 1e-7
    return f"-odd {f.name}, with = and spaces"


def test_every_setting_survives_to_argv_and_back() -> None:
    cfg = TrainConfig(**{f.name: _different(f) for f in config_fields()})
    assert all(getattr(cfg, f.name) != f.default for f in config_fields() if len(choices(f.name)) != 1)
    argv = to_argv(cfg)
    assert train_config(build_parser().parse_args(["train", *argv])) == cfg
    assert to_argv(TrainConfig()) == []  # defaults are not repeated


def test_allowed_values_live_in_the_field_and_are_checked_and_shown() -> None:
    with_choices = [f.name for f in config_fields() if choices(f.name)]
    assert {"strategy", "precision", "optimizer", "data_format", "truncation", "packing"} <= set(with_choices)
    help_text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()  # type: ignore[union-attr]
    for name in with_choices:
        assert "{" + ",".join(choices(name)) + "}" in help_text
        with pytest.raises(WrongValue, match=f"TrainConfig: {name}: must be one of"):  # a ValueError
            TrainConfig(**{name: "nonsense"})
        with pytest.raises(UserError, match=f"{option_name(name)}: must be one of"):
            build_config({name: "nonsense"})


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lr": "abc"}, "TrainConfig: lr: expected float (got 'abc')"),
        ({"max_steps": "3"}, "TrainConfig: max_steps: expected int (got '3')"),
        ({"lora": True, "lora_rank": 8.5}, "TrainConfig: lora_rank: expected int (got 8.5)"),  # 8.0 is 8
        ({"lora": "yes"}, "TrainConfig: lora: expected bool (got 'yes')"),
        ({"beta": "x"}, "TrainConfig: beta: expected float (got 'x')"),
    ],
)
def test_the_python_api_refuses_a_value_of_the_wrong_type_where_it_is_given(
    settings: dict[str, Any], message: str
) -> None:
    """The CLI and YAML convert values; TrainConfig takes them as given, so it refuses a wrong type
    at once (the user's line in the traceback), a TypeError as Python's own, not deep in the run."""
    with pytest.raises(WrongType) as refused:
        TrainConfig(**settings)
    assert str(refused.value) == message and isinstance(refused.value, TypeError)
    assert isinstance(refused.value, UserError)
    with pytest.raises(WrongType, match=re.escape(message)):
        TrainConfig().replace(**settings)


def test_the_python_api_refuses_a_split_of_1_0_as_the_cli_does() -> None:
    """eval_split=1.0 held out one example from Python (a count), where the CLI refuses "1.0"."""
    with pytest.raises(WrongValue, match=r"^TrainConfig: eval_split: must be a fraction below 1 or a "):
        TrainConfig(eval_split=1.0)
    assert TrainConfig(eval_split=1).data.eval_split == 1
    assert TrainConfig(eval_split=0.25).data.eval_split == 0.25


def test_a_path_is_one_value_and_a_list_only_where_a_setting_takes_several() -> None:
    """Path("a,b.jsonl") was two sources; output_dir=["a", "b"] made a folder "a,b"; None for a
    setting with a default got past TrainConfig and failed at train() as a message, not a TypeError."""
    assert TrainConfig(data=Path("a,b.jsonl")).data.train == "a\\,b.jsonl"
    assert TrainConfig(output_dir=Path("x,y")).checkpoint.output_dir == "x,y"
    for settings in ({"output_dir": ["a", "b"]}, {"model": ("tiny",)}, {"output_dir": None}, {"data": None}):
        with pytest.raises(WrongType, match=r"^TrainConfig: \w+: expected str \(got "):
            TrainConfig(**settings)
    with pytest.raises(UserError, match=r"^--output-dir: expected str, got \['a', 'b'\]"):
        build_config({"output_dir": ["a", "b"]})  # YAML's list
    assert TrainConfig(cache_dir=None).data.cache_dir is None  # unset: its default


def test_the_python_api_refuses_a_feature_setting_given_at_its_default_as_the_cli_does() -> None:
    """beta=0.1 (DPO's default) under sft, lora_rank=16 without lora: the CLI refused them, Python
    trained without a word, as only a changed value was seen."""
    for settings, said in (
        ({"beta": 0.1}, "--beta: applies to --objective dpo, ipo, simpo only"),
        ({"lora_rank": 16}, "--lora-rank: applies with --lora only"),
    ):
        with pytest.raises(UserError, match=f"^{re.escape(said)}"):
            validate(TrainConfig(**settings), 1)
    validate(TrainConfig(lora_rank=16).replace(lora=True), 1)  # given in two steps


def test_the_python_api_takes_the_peers_switches_as_yaml_does() -> None:
    cfg = TrainConfig(push_to_hub=True, hub_model_id="me/model", bf16=True, adapter="qlora")
    assert cfg.checkpoint.push_to_hub == "me/model" and cfg.model.precision == "bf16"
    assert cfg.lora.enabled and cfg.model.load_in_4bit
    assert TrainConfig(push_to_hub=False).checkpoint.push_to_hub is None
    with pytest.raises(UserError, match=r"^TrainConfig: push_to_hub takes the repository to upload to"):
        TrainConfig(push_to_hub=True)
    with pytest.raises(
        UserError, match=r"^TrainConfig: bf16: true is precision bf16 in lmtune, which the call "
    ):
        TrainConfig(bf16=True, precision="fp32")  # no file to name
    # TRL's packing=True and HF's report_to list, as YAML takes them ("expected str" before).
    assert (TrainConfig(packing=True).packing, TrainConfig(packing=False).packing) == ("on", "off")
    assert TrainConfig(report_to=["tensorboard", "wandb"]).logging.report_to == "tensorboard,wandb"


def test_a_folder_lmtune_makes_expands_its_tilde_and_refuses_a_variable() -> None:
    """`output_dir: ~/runs/a` in a file made ./~/runs/a, `${HOME}/a` a folder named ${HOME}."""
    import os

    assert TrainConfig(output_dir="~/runs/a").checkpoint.output_dir == os.path.expanduser("~/runs/a")
    assert TrainConfig(cache_dir="~/c").data.cache_dir == os.path.expanduser("~/c")
    for path in ("${HOME}/runs/a", "$HOME/a", "${UNSET_HERE}/a"):
        with pytest.raises(UserError, match=r"^TrainConfig: output_dir: names a variable, which lmtune"):
            TrainConfig(output_dir=path)
    # No variable of that name is set ($b), or none is named ($): a folder's own name, taken.
    for path in ("runs/a$", "runs/a$b_UNSET_HERE", "runs/$HOMEx"):
        assert TrainConfig(output_dir=path).checkpoint.output_dir == path
    # ~nosuch stayed as written, then "Could not determine home directory" with a traceback.
    with pytest.raises(UserError, match=r"^TrainConfig: output_dir: '~nosuch_here/a': no user 'nosuch_here'"):
        TrainConfig(output_dir="~nosuch_here/a")


def test_a_wrong_type_set_on_a_group_is_refused_before_the_run() -> None:
    packing = setting_named("packing")
    assert packing.group is not None
    group = replace(getattr(TrainConfig(), packing.group), **{packing.field: True})
    with pytest.raises(UserError, match=r"^--packing: expected str \(got True\)$"):
        validate(TrainConfig(**{packing.group: group}), 1)


def test_the_python_api_takes_lists_and_mappings_as_yaml_does() -> None:
    cfg = TrainConfig(data=["a.jsonl", "b, c.jsonl"], field_map={"prompt": "question"}, data_weights=[3, 1])
    assert (cfg.data.train, cfg.examples.field_map, cfg.data.weights) == (
        "a.jsonl,b\\, c.jsonl",
        "prompt=question",
        "3,1",
    )
    assert (
        TrainConfig(lora=True, lora_target_modules=("q_proj", "v_proj")).lora.target_modules
        == "q_proj,v_proj"
    )


def test_numbers_of_either_kind_are_floats_and_none_is_unset() -> None:
    validate(TrainConfig(lr=1, max_grad_norm=0, max_steps=None), 1)


def test_plan_help_lists_only_what_plan_reads(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    shown = capsys.readouterr().out
    for f in config_fields():
        assert (option_name(f.name) + " " in shown or option_name(f.name) + "\n" in shown) == (
            f.name in PLAN_SETTINGS
        ), f.name
    assert "--calibrate" in shown and "--memory-per-device" in shown


@pytest.mark.parametrize(
    "argv", [["train", "--max-st", "2"], ["plan", "--glob", "8"], ["data", "audit", "x", "--max-len", "3"]]
)
def test_abbreviated_options_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"unknown option {argv[-2]}; did you mean --" in err and err.count("\n") == 1


def test_calibration_runs_the_users_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """plan --calibrate's real runs get every setting of the plan (not a hand-picked few)."""
    from lmtune.tools import plan
    from lmtune.tools.memory import Setup

    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        out = Path(next(a.split("=", 1)[1] for a in cmd if a.startswith("--output-dir=")))
        out.mkdir(parents=True)
        (out / "run.json").write_text(json.dumps({"result": {"peak_memory_per_rank": [123, 456]}}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    cfg = TrainConfig(
        data="d.jsonl",
        data_format="messages",
        text_field="body",
        truncation="left",
        txt_mode="block",
        train_on_prompt=True,
        trust_remote_code=True,
        compile=True,
        seed=7,
        report_to="tensorboard",
    )
    setup = Setup(
        strategy="single",
        optimizer="sgd",
        lora=False,
        activation_checkpointing=True,
        precision="bf16",
        micro_batch_size=2,
        length=64,
        world_size=1,
        accumulation=2,
        loss_chunk=16,
    )
    assert plan.measure_peak(cfg, setup, tmp_path) == 456
    ran = train_config(build_parser().parse_args(seen[0][3:]))
    expected = replace(
        cfg,
        micro_batch_size=2,
        global_batch_size=4,
        optimizer="sgd",
        precision="bf16",
        strategy="single",
        activation_checkpointing=True,
        loss_chunk_size=16,
        **plan.CALIBRATION_RUN,
        output_dir=ran.output_dir,
    )
    assert ran == expected


def test_bench_runs_the_settings_of_a_train_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmtune.config.io import MEASURING_RUN

    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "boom")

    monkeypatch.setattr(subprocess, "run", fake_run)
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("lr_schedule: wsd\nlora: true\nreport_to: wandb\nmax_length: 64\n")
    argv = ["bench", "--config", str(yaml_file), "--max-length", "96", "--strategies", "single"]
    argv += ["--precisions", "fp32", "--steps", "2", "--warmup", "1", "--json", str(tmp_path / "b.json")]
    assert main(argv) == 0
    assert "failed: boom" in capsys.readouterr().out
    ran = train_config(build_parser().parse_args(seen[0][3:]))
    expected = TrainConfig(lr_schedule="wsd", lora=True, max_length=96, strategy="single", precision="fp32")
    expected = replace(expected, max_steps=3, profile=True, **MEASURING_RUN, output_dir=ran.output_dir)
    assert ran == expected


def test_bench_json_to_stdout_is_json_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--json -` (as for `jq`): standard output carries the JSON only, the table goes to standard
    error, and no file named "-" appears."""
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "boom"))
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "--strategies", "single", "--precisions", "fp32", "--steps", "2", "--json", "-"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)
    assert [(r["strategy"], r["written_by"]) for r in rows] == [("single", "lmtune bench")]
    assert "failed: boom" in err and list(tmp_path.iterdir()) == []


def test_settings_live_in_groups_with_flat_names(tmp_path: Path) -> None:
    from lmtune.config.groups import LoraSettings
    from lmtune.config.io import build_config, load_yaml
    from lmtune.config.settings import GROUPS, to_dict

    cfg = TrainConfig(lr=1e-4, lora=True, lora_rank=8, model="small", eval_data="e.jsonl")
    assert (cfg.optim.lr, cfg.lora.enabled, cfg.lora.rank, cfg.model.name) == (1e-4, True, 8, "small")
    assert (cfg.lr, cfg.lora_rank, cfg.eval_data) == (1e-4, 8, "e.jsonl")  # flat reads, for scripts
    assert TrainConfig(lora=LoraSettings(enabled=True, rank=8)).lora == LoraSettings(enabled=True, rank=8)
    assert cfg.replace(lora_rank=4).lora == LoraSettings(enabled=True, rank=4)  # the rest of the group kept
    assert cfg.replace(model="tiny").model.name == "tiny" and cfg.replace(seed=1).optim.lr == 1e-4
    # A peer's name is taken as on the command line and in YAML; under both names it is refused.
    assert TrainConfig(learning_rate=1.0, lora_r=4).optim.lr == 1.0 and TrainConfig(lora_r=4).lora.rank == 4
    with pytest.raises(TypeError, match=r"lr is set twice \(as learning_rate and lr\)"):
        TrainConfig(learning_rate=1.0, lr=2.0)
    # One value under both (a TRL dump's gradient_checkpointing beside its new name) is taken, as in
    # YAML; so is HF's save_total_limit=None, its default: every checkpoint kept.
    assert TrainConfig(
        gradient_checkpointing=True, activation_checkpointing=True
    ).model.activation_checkpointing
    assert TrainConfig(learning_rate=1.0, lr=1.0).optim.lr == 1.0
    assert TrainConfig(save_total_limit=None).checkpoint.keep_last == 0
    # In a group's mapping and by a flat name (one would be dropped without a word), in either order.
    with pytest.raises(TypeError, match=r"lora_rank is set twice \(as lora=\{'rank': \.\.\.\} and lora_r\)"):
        TrainConfig(lora={"enabled": True, "rank": 8}, lora_r=4)
    with pytest.raises(TypeError, match=r"lr is set twice \(as lr and optim=\{'lr': \.\.\.\}\)"):
        TrainConfig(lr=5e-4, optim={"lr": 1e-3})
    assert TrainConfig(lora={"rank": 8}, lora_alpha=4).lora == LoraSettings(rank=8, alpha=4)
    with pytest.raises(TypeError, match="unknown setting 'lerning_rate'"):
        TrainConfig(lerning_rate=1.0)
    with pytest.raises(UserError, match="unknown setting 'lerning_rate'"):  # as the CLI's exit 2
        TrainConfig(lerning_rate=1.0)
    # As YAML writes them: a group as a mapping, a weighted list of sources; paths as Path.
    assert TrainConfig(lora={"enabled": True, "rank": 8}).lora == LoraSettings(enabled=True, rank=8)
    with pytest.raises(UserError, match=r"lora: unknown 'rnak' \(its settings: enabled, rank"):
        TrainConfig(lora={"rnak": 8})
    mixed = TrainConfig(data=[{"path": "a.jsonl", "weight": 3}, {"path": "b.jsonl", "weight": 1}])
    assert (mixed.data.train, mixed.data.weights) == ("a.jsonl,b.jsonl", "3,1")
    weighted = TrainConfig(
        data=[{"path": Path("a.jsonl"), "weight": 3}, {"path": Path("b,c.jsonl"), "weight": 1}]
    )
    assert (weighted.data.train, weighted.data.weights) == (mixed.data.train.replace("b", r"b\,c"), "3,1")
    with pytest.raises(UserError, match=r"data: entry 2 has no weight, and 1 of the 2 have one: give each"):
        TrainConfig(data=[{"path": "a.jsonl", "weight": 3}, Path("b.jsonl")])
    paths = TrainConfig(data=[Path("a.jsonl"), "b.jsonl"], output_dir=tmp_path / "out")
    assert (paths.data.train, paths.checkpoint.output_dir) == ("a.jsonl,b.jsonl", str(tmp_path / "out"))
    assert len(to_dict(cfg)) == len(config_fields()) and {s.group for s in config_fields()} == {*GROUPS, None}
    # A YAML file may nest by group (a group's own field names or the flat names), flat, or both.
    nested = tmp_path / "nested.yaml"
    nested.write_text(
        "model: {name: small}\nlora: {enabled: true, rank: 8}\noptim: {lr: 1.0e-4}\neval_data: e.jsonl\n"
    )
    assert build_config(load_yaml(str(nested))) == cfg
    flat = tmp_path / "flat.yaml"
    flat.write_text("model: small\nlora: true\nlora_rank: 8\nlr: 1.0e-4\neval-data: e.jsonl\n")
    assert build_config(load_yaml(str(flat))) == cfg
    twice = tmp_path / "twice.yaml"
    twice.write_text("lora: {rank: 8}\nlora_rank: 4\n")
    with pytest.raises(
        UserError,
        match=r"twice.yaml:2: lora_rank is set twice \(as lora.rank on line 1 and lora_rank\); give it once",
    ):
        load_yaml(str(twice))
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("model: small\noptim: {learning_rate: 1.0}\n")
    with pytest.raises(
        UserError, match=r"wrong\.yaml:2: optim: unknown setting 'learning_rate' \(its settings: name, lr"
    ):
        load_yaml(str(wrong))


def test_a_group_written_as_a_block_names_each_keys_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each problem of a group written as a block names its own key's line; all named the group's."""
    block = tmp_path / "block.yaml"
    for text, said in (
        (
            "batch:\n  packing: auto\n  global_batch_size: 0\n",
            "block.yaml:3: batch.global_batch_size: must be >= 1",
        ),
        ("batch:\n  packing: auto\n  packin: on\n", "block.yaml:3: batch: unknown setting 'packin'"),
        (
            "batch:\n  packing: auto\n  packing: off\n",
            "block.yaml:3: batch.packing is set twice (also on line 2)",
        ),
        (
            "lr: 1.0\noptim:\n  name: adamw\n  lr: 2.0\n",
            "block.yaml:4: lr is set twice (as lr on line 1 and optim.lr)",
        ),
    ):
        block.write_text(text)
        assert main(["train", "--config", str(block), "--output-dir", str(tmp_path / "out")]) == 2
        assert said in capsys.readouterr().err, text


def test_help_shows_the_groups(capsys: pytest.CaptureFixture[str]) -> None:
    from lmtune.config.settings import GROUPS

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    shown = capsys.readouterr().out
    titles = [line.split(" settings:")[0] for line in shown.splitlines() if line.endswith(" settings:")]
    assert titles == [*GROUPS, "run"]
    lora = shown.split("lora settings:")[1].split("eval settings:")[0]
    assert all(option_name(s.name) in lora for s in config_fields() if s.group == "lora")


def test_the_lazy_names_are_offered_by_dir() -> None:
    """Completion in a REPL or an IDE lists dir(lmtune): the API's names are loaded lazily."""
    import lmtune

    assert {"TrainConfig", "train", "__version__"} <= set(dir(lmtune))


def test_a_model_or_data_in_memory_is_answered_with_how_to_give_it() -> None:
    """An HF user's model=model, data=dataset or data=[records] said "expected str"."""
    import datasets
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16))
    with pytest.raises(
        TypeError, match=r"^TrainConfig: model: takes a model's name or folder, not a loaded "
    ):
        TrainConfig(model=model)
    with pytest.raises(TypeError, match=r"save it with dataset.save_to_disk\(DIR\), then give DIR"):
        TrainConfig(data=datasets.Dataset.from_dict({"text": ["a"]}))
    # A DatasetDict is a mapping: taken as the data group's fields, then "expected str" at the run.
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})})
    with pytest.raises(
        TypeError, match=r"^TrainConfig: data: takes files or folders, not a loaded DatasetDict"
    ):
        TrainConfig(data=splits)
    with pytest.raises(TypeError, match=r"^TrainConfig: eval_data: takes files or folders, not records: "):
        TrainConfig(eval_data=[{"prompt": "1+1=", "completion": "2"}])
    # Streamed data (a generator, datasets' IterableDataset) got a bare "expected str".
    streamed = datasets.Dataset.from_dict({"text": ["a"]}).to_iterable_dataset()
    for given in (streamed, ({"text": t} for t in "ab")):
        with pytest.raises(TypeError, match=r"^TrainConfig: data: takes files or folders, not an iterable"):
            TrainConfig(data=given)
    assert TrainConfig(data=["a.jsonl", Path("b.jsonl")]).data.train  # paths are not streams
    # Another setting is named as a call names it (it said --warmup-ratio).
    with pytest.raises(TypeError, match=r"\(got 0.1\) \(a share of the training steps is warmup_ratio\)$"):
        TrainConfig(warmup_steps=0.1)


def test_a_runs_setting_error_from_python_names_the_settings_as_python_gives_them(tmp_path: Path) -> None:
    """lmtune.train said "--micro-batch-size 5: --global-batch-size 32 does not divide ..." to a
    caller who wrote micro_batch_size=5."""
    import lmtune

    cfg = TrainConfig(model="tiny", max_steps=1, output_dir=str(tmp_path / "o"), micro_batch_size=5)
    with pytest.raises(
        UserError, match=r"^TrainConfig: micro_batch_size: global_batch_size 32 does not divide"
    ):
        lmtune.train(cfg)
    assert not (tmp_path / "o").exists()


def test_a_dump_of_a_config_is_taken_back_as_the_config_it_was() -> None:
    """``TrainConfig(**asdict(cfg))`` and run.json's config compared equal and were refused: every
    setting of the dump counted as given, so ``lora_rank`` at its default asked for LoRA."""
    import dataclasses

    from lmtune.config.settings import to_dict

    cfg = TrainConfig(data="sample", max_steps=2, output_dir="runs/x")
    for dump in (dataclasses.asdict(cfg), to_dict(cfg)):
        again = TrainConfig(**dump)
        assert again == cfg
        validate(again, 1)
        changed = dict(dump)  # a changed value of a feature that is off is still refused
        if isinstance(changed["lora"], dict):  # asdict's groups; to_dict's flat names
            changed["lora"] = {**changed["lora"], "rank": 8}
        else:
            changed["lora_rank"] = 8
        with pytest.raises(UserError, match=r"^--lora-rank: applies with --lora only"):
            validate(TrainConfig(**changed), 1)
    with pytest.raises(UserError, match=r"^--lora-rank: applies with --lora only"):  # not a whole group
        validate(TrainConfig(lora={"enabled": False, "rank": 16}), 1)


def test_the_python_api_answers_every_unknown_name_at_once() -> None:
    """A TrainingArguments dump was answered one key per exception (YAML lists them all)."""
    with pytest.raises(TypeError) as caught:
        TrainConfig(lr=1e-3, lr_scheduler_kwargs={}, train_dataset="a.jsonl", lrr=1, ddp_backend=None)
    lines = str(caught.value).splitlines()
    assert len(lines) == 3 and all(line.startswith("TrainConfig: ") for line in lines)  # None asks nothing
    assert "'train_dataset': give the files as lmtune's 'data'" in lines[1]
    assert "unknown setting 'lrr'; did you mean 'lr'?" in lines[2]
    # A YAML file's spelling, and a group's name given a value, said "did you mean" the same name.
    with pytest.raises(TypeError, match=r"'output-dir' is 'output_dir' in Python; TrainConfig.from_file "):
        TrainConfig(**{"output-dir": "x"})
    with pytest.raises(TypeError, match=r"'batch' is a group of settings \(global_batch_size, "):
        TrainConfig(batch=5)
    with pytest.raises(
        TypeError, match=r"unknown setting 'batch_eval_metrics'$"
    ):  # not "did you mean 'batch'?"
        TrainConfig(batch_eval_metrics=True)
    with pytest.raises(TypeError, match=r"'peft_config': LoRA is lmtune's 'lora' with 'lora_rank' \(peft"):
        TrainConfig(peft_config=object())


def test_from_file_reads_a_file_as_train_config_does(tmp_path: Path) -> None:
    """yaml.safe_load of lmtune's own examples then TrainConfig(**...) refused their dashes and
    read ``lr: 1e-3`` as text; from_file reads a file as --config does, settings over it."""
    for example in ("tiny-demo.yaml", "chat-sft.yaml", "dpo.yaml"):
        path = REPO / "examples" / example
        assert TrainConfig.from_file(path) == build_config(load_yaml(str(path)))
    demo = REPO / "examples" / "tiny-demo.yaml"
    assert TrainConfig.from_file(demo).schedule.epochs == SAMPLE_EPOCHS  # the built-in demo's (it said 6)
    cfg = TrainConfig.from_file(demo, lr=2e-3, max_steps=3)
    assert (cfg.optim.lr, cfg.schedule.max_steps, cfg.batch.global_batch_size) == (2e-3, 3, 32)
    written = tmp_path / "r.yaml"
    written.write_text("lr: 1e-3\nlearning_rate: 1e-3\nlora_rank: 8\n")  # YAML 1.1 reads 1e-3 as text
    with pytest.raises(UserError, match=r"^--lora-rank: applies with --lora only"):  # given by the file
        validate(TrainConfig.from_file(written), 1)
    assert TrainConfig.from_file(written, lora=True).optim.lr == 1e-3
    with pytest.raises(UserError, match=r"^TrainConfig.from_file: no such file: "):  # it said --config
        TrainConfig.from_file(tmp_path / "nosuch.yaml")


def test_a_python_callers_messages_name_settings_as_a_call_does() -> None:
    """A switch followed by its value read ``load_best_at_end=True False, was True``, and ``use the
    same lora=True and strategy`` told a caller to keep the setting that differed."""
    from lmtune.config.python_values import python_spelling

    assert (
        python_spelling("--global-batch-size 8 -> 4 (or --overwrite)")
        == "global_batch_size 8 -> 4 (or overwrite=True)"
    )
    assert python_spelling("--load-best-at-end False, was True") == "load_best_at_end False, was True"
    assert python_spelling("use the same --lora and strategy") == "use the same lora and strategy"
    assert (
        python_spelling("--no-progress and --data x; or --no-lora.")
        == "progress=False and data x; or lora=False."
    )
    assert python_spelling("--not-a-setting x") == "--not-a-setting x"
    kept = "run lmtune export CKPT DIR --merge-lora"  # a command to run keeps its flags
    assert python_spelling(kept) == kept
