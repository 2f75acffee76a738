"""Small hostile files cost little: YAML bombs, FIFOs, /dev/zero behind a link, huge files, chat
templates that multiply strings or loop without end, model folders whose configs describe absurd
models, bad LMTUNE_* variables. Each is one line on stderr with exit code 2 (or one UserError), in
bounded time, and nothing is read past its cap."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from lmtune.checkpoint.layout import LOCK_FILE
from lmtune.checkpoint.rundir import acquire
from lmtune.cli import main
from lmtune.data.chat import read_template
from lmtune.errors import UserError
from lmtune.model.modeling import byte_tokenizer, load_model
from tests.conftest import deadline, one_line_error


def _error(argv: list[str], capsys: pytest.CaptureFixture[str], seconds: float = 30.0) -> str:
    started = time.perf_counter()
    err = one_line_error(argv, capsys)
    assert len(err) < 400 and time.perf_counter() - started < seconds, err[:1000]
    return err


def _aliases(levels: int) -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\ndata: *a{levels - 1}\n"


def _merges(levels: int) -> str:
    lines = ["m0: &m0 {x: 1, y: 2}"]
    lines += [f"m{i}: &m{i} {{<<: [*m{i - 1}, *m{i - 1}], k{i}: 1}}" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (_aliases(10), "expands to over 100,000 values"),  # 0.5 KB; 9**10 values expanded
        (_merges(40), "expands to over 100,000 values"),  # merge keys double at every level
        ("data: " + "[" * 100_000 + "\n", "nested too deeply"),
        ("max_steps: 1" + "0" * 5_000 + "\n", "not valid YAML here (Exceeds the limit (4300 digits)"),
        # Hex, binary and base 60 are read at any length, and failed where the number was printed.
        ("max_steps: 0x" + "f" * 5_000 + "\n", "not valid YAML here (a number of over 4,000 digits)"),
        ("foo_bar: 0b" + "1" * 20_000 + "\n", "not valid YAML here (a number of over 4,000 digits)"),
        ("lr: " + "x" * 900_000 + "\n", "run.yaml:1: lr: expected float, got 'xxxx"),  # a value is cut short
        ("# padding\n" * 120_000, "over the 1,048,576 such a file may have"),
        (
            "data: !!python/object/apply:os.system ['touch /tmp/lmtune-ran']\n",
            "could not determine a constructor",
        ),
    ],
)
def test_yaml_bombs_are_refused_quickly(
    content: str, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(content)
    assert needle in _error(["train", "--config", str(config)], capsys, seconds=10)


def test_special_files_are_never_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.yaml"
    zero.symlink_to("/dev/zero")
    for config in (fifo, zero):
        with deadline(60):
            assert "not a regular file" in _error(["train", "--config", str(config)], capsys, seconds=10)
    assert f"{tmp_path}: a folder, not a file" in _error(["train", "--config", str(tmp_path)], capsys)
    # As data, they were "no such file or folder: fifo.jsonl (did you mean fifo.jsonl?)".
    (tmp_path / "fifo.jsonl").symlink_to(fifo)
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")
    for data in ("fifo.jsonl", "zero.jsonl"):
        said = f"{tmp_path / data}: not a regular file (a FIFO, device or socket is not read)"
        with deadline(60):
            assert said in _error(["train", "--data", str(tmp_path / data)], capsys, seconds=10)
            assert said in _error(["data", "audit", str(tmp_path / data)], capsys, seconds=10)
    # Inside a folder or a glob of data they were passed over without a word, their records left out.
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text('{"text": "hello"}\n')
    (folder / "b.jsonl").symlink_to(fifo)
    for data in (str(folder), f"{folder}/*.jsonl"):
        said = f"{folder / 'b.jsonl'}: not a regular file"
        with deadline(60):
            assert said in _error(["train", "--data", data], capsys, seconds=10)
    (folder / "b.jsonl").unlink()
    (folder / "b.jsonl").symlink_to(tmp_path / "gone.jsonl")
    assert f"{folder / 'b.jsonl'}: a link to {tmp_path / 'gone.jsonl'}, which is not there" in _error(
        ["train", "--data", str(folder)], capsys
    )


@pytest.mark.parametrize("kind", ["zero", "fifo", "huge", "garbage", "far future"])
def test_a_hostile_lock_file_is_one_line(kind: str, tmp_path: Path) -> None:
    lock = tmp_path / LOCK_FILE
    holder = {"host": 1, "pid": -5, "pid_started": None, "started": 0, "run_id": "", "token": ""}
    if kind == "zero":
        lock.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(lock)
    elif kind == "huge":
        lock.write_text(json.dumps({"host": "h" * (1 << 20)}))
    elif kind == "garbage":
        lock.write_text(json.dumps(holder))
    else:  # a start time no clock can show
        lock.write_text(json.dumps({**holder, "host": "h", "pid": 1, "started": 1e300}))
    started = time.perf_counter()
    refused = (
        r"\.lmtune\.lock(: an unreadable lock file .*delete it| is a symbolic link| is not a regular file)"
    )
    with deadline(60), pytest.raises(UserError, match=refused):
        acquire(tmp_path, "", print)
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("LMTUNE_CACHE_WAIT_TIMEOUT", "soon"),
        ("LMTUNE_CACHE_WAIT_TIMEOUT", "-1"),
        ("LMTUNE_JOIN_TIMEOUT", "inf"),
        ("LMTUNE_JOIN_TIMEOUT", "0"),
        ("LMTUNE_LOCK_TOKEN", "xyz"),
        ("LMTUNE_ERROR_DIR", "/nonexistent/errors"),
        ("LMTUNE_HEALTH_DIR", "/dev/null"),
        ("LMTUNE_CACHE_DIR", "/dev/null"),
        ("LMTUNE_CACHE_DIR", "/dev/null/cache"),  # under a file: it could never be created
        ("LMTUNE_VERBOSE", "loud"),
        # Read by a CPU bf16 run only: a typo in an fp32 run's environment was ignored.
        ("LMTUNE_CPU_PRODUCTS", "bogus"),
        ("LMTUNE_CPU_ATTENTION", "fast"),
    ],
)
def test_every_lmtune_variable_is_strict(
    name: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(name, value)
    err = _error(["train", "--output-dir", str(tmp_path / "o"), "--max-steps", "1"], capsys)
    assert f"environment variable {name}=" in err
    assert not (tmp_path / "o").exists()


def test_the_python_api_checks_lmtunes_variables_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fp32 run from Python never read LMTUNE_CPU_PRODUCTS, so a typo in it went unseen."""
    import lmtune

    monkeypatch.setenv("LMTUNE_CPU_PRODUCTS", "bogus")
    with pytest.raises(UserError, match=r"^environment variable LMTUNE_CPU_PRODUCTS='bogus': expected "):
        lmtune.train(lmtune.TrainConfig(max_steps=1, output_dir=str(tmp_path / "o")))
    assert not (tmp_path / "o").exists()


def test_a_cache_folder_that_cannot_be_created_is_named_by_what_chose_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The option, the variable or lmtune's default: an OSError's path alone leaves the user to
    guess which setting put it there."""
    from lmtune.config.groups import DataSettings
    from lmtune.data.prepare import data_cache_dir
    from lmtune.errors import SettingError

    def refuse(path: Path, *_: object, **__: object) -> None:
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(
        SettingError, match=r"--cache-dir: /x/cache: cannot create it \(Operation not permitted\)"
    ):
        data_cache_dir(DataSettings(cache_dir="/x/cache"))
    monkeypatch.setenv("LMTUNE_CACHE_DIR", str(tmp_path / "mine"))
    with pytest.raises(UserError, match=rf"LMTUNE_CACHE_DIR: {tmp_path}/mine/data: cannot create it"):
        data_cache_dir(DataSettings())
    monkeypatch.delenv("LMTUNE_CACHE_DIR")
    with pytest.raises(
        UserError, match=r"lmtune's cache \(LMTUNE_CACHE_DIR chooses another\): .*/data: cannot"
    ):
        data_cache_dir(DataSettings())


@pytest.fixture
def quick_trials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("lmtune.data.chat.TRIAL_SECONDS", 1)
    monkeypatch.setattr("lmtune.data.chat.TRIAL_MEMORY_BYTES", 512 << 20)


@pytest.mark.parametrize(
    ("template", "needle"),
    [
        ("{{ 'x' * 4000000000 }}{{ messages }}", "MiB of memory"),
        (
            "{% set n = namespace(s='xxxxxxxx') %}{% for i in range(40) %}"
            "{% set n.s = n.s ~ n.s %}{% endfor %}{{ messages }}",
            # Copying its doubled strings spends CPU too: on a busy machine the 1 s of CPU can run
            # out before the memory does (the case above checks the memory limit alone).
            "(MiB of memory|did not finish within 1 s of CPU)",
        ),
        (
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{{ messages }}",
            "did not finish within 1 s of CPU",
        ),
        ("{% for i in range(100000) %}{{ messages }}{% endfor %}", "characters for five short messages"),
    ],
)
def test_template_bombs_are_refused(template: str, needle: str, tmp_path: Path, quick_trials: None) -> None:
    path = tmp_path / "bomb.jinja"
    path.write_text(template)
    started = time.perf_counter()
    with pytest.raises(
        UserError, match=f"--chat-template {path}: rendering a sample conversation: .*{needle}"
    ):
        read_template(str(path))
    assert time.perf_counter() - started < 30
    # The same template in a model folder's tokenizer is bounded the same way.
    from lmtune.data.formats import ensure_chat_template

    tok = byte_tokenizer()
    tok.chat_template = template
    with pytest.raises(
        UserError, match=f"the chat template of .*: rendering a sample conversation: .*{needle}"
    ):
        ensure_chat_template(tok)


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ("{% for m in messages %}{{ m.content }}{{ messages.append(m) }}{% endfor %}", "SecurityError"),
        ("{% for m in messages %}{{ m.content }}{{ undefined_thing.field }}{% endfor %}", "UndefinedError"),
        ("{% for m in messages %}{{ raise_exception('roles must alternate') }}{% endfor %}", "TemplateError"),
    ],
)
def test_template_errors_are_one_line_naming_the_record_and_template(template: str, error: str) -> None:
    from lmtune.data.formats import PLAIN_FIELDS, render
    from lmtune.data.sources import Record

    tok = byte_tokenizer()
    tok.chat_template = template
    record = Record("chat.jsonl", 7, {"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(
        UserError, match=f"chat.jsonl:7: the chat template of .* failed.*: {error}: "
    ) as caught:
        render(record, "messages", PLAIN_FIELDS, tok)
    assert "\n" not in str(caught.value)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("model") / "base"
    loaded = load_model("tiny", 0)
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder


def _edited(source: Path, target: Path, name: str, **changes: object) -> Path:
    target.mkdir()
    for f in source.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    raw = json.loads((source / name).read_text())
    (target / name).write_text(json.dumps({**raw, **changes}))
    return target


@pytest.mark.parametrize(
    ("name", "changes", "needle"),
    [
        ("config.json", {"num_hidden_layers": 10**9}, "num_hidden_layers must be a whole number in"),
        ("config.json", {"num_hidden_layers": 1000, "hidden_size": 16384}, "more than this machine's"),
        ("config.json", {"hidden_size": "wide"}, "hidden_size must be a whole number"),
        ("config.json", {"num_attention_heads": [4]}, "num_attention_heads must be a whole number"),
        ("config.json", {"rope_scaling": "x"}, "could not load the local folder"),
        ("generation_config.json", {"eos_token_id": [[1]]}, "eos_token_id must be a token id"),
        ("generation_config.json", {"max_length": "long"}, "max_length must be a whole number"),
    ],
)
def test_a_model_folders_configs_are_checked_before_allocating(
    name: str, changes: dict[str, object], needle: str, model_folder: Path, tmp_path: Path
) -> None:
    folder = _edited(model_folder, tmp_path / "edited", name, **changes)
    started = time.perf_counter()
    with pytest.raises(UserError, match=needle) as caught:
        load_model(str(folder), 0)
    assert "\n" not in str(caught.value) and time.perf_counter() - started < 20


def test_special_files_in_a_model_folder(model_folder: Path, tmp_path: Path) -> None:
    folder = _edited(model_folder, tmp_path / "m", "config.json")
    os.mkfifo(folder / "tokenizer_config.json.fifo")
    with pytest.raises(UserError, match="is not a regular file"):
        load_model(str(folder), 0)
    os.unlink(folder / "tokenizer_config.json.fifo")
    (folder / "generation_config.json").unlink()
    (folder / "generation_config.json").symlink_to("/dev/zero")
    with pytest.raises(UserError, match="is not a regular file"):
        load_model(str(folder), 0)


def test_an_adapter_names_a_base_that_loads_and_is_not_itself(model_folder: Path, tmp_path: Path) -> None:
    own = tmp_path / "own"
    own.mkdir()
    (own / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(own)}))
    with pytest.raises(UserError, match="is an adapter folder itself"):
        load_model(str(own), 0)
    (own / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "../moved/base"}))
    with pytest.raises(UserError, match=r"the adapter's base model \.\./moved/base .* is not there"):
        load_model(str(own), 0)
    (own / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": ["x"]}))
    with pytest.raises(UserError, match="base_model_name_or_path is"):
        load_model(str(own), 0)


def test_a_lora_adapter_records_an_absolute_base_and_loads_from_anywhere(
    model_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("peft")
    work = tmp_path / "work"
    work.mkdir()
    (work / "base").symlink_to(model_folder)
    (work / "d.jsonl").write_text("".join(json.dumps({"text": f"sum {i}"}) + "\n" for i in range(8)))
    monkeypatch.chdir(work)
    argv = ["train", "--model", "./base", "--data", "d.jsonl", "--output-dir", "out", "--lora"]
    assert main([*argv, "--max-steps", "1", "--global-batch-size", "8", "--no-progress"]) == 0
    base = json.loads((work / "out" / "final" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert Path(base).is_absolute() and Path(base).resolve() == model_folder.resolve()
    monkeypatch.chdir(tmp_path)
    assert load_model(str(work / "out" / "final"), 0).model is not None
