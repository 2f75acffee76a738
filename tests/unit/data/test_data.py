"""Reading inputs, formats and their labels, truncation, and batching."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmtune.config.groups import ExampleSettings
from lmtune.data.addition import addition_examples, split_prompt
from lmtune.data.collate import Collator
from lmtune.data.formats import PLAIN_FIELDS, ensure_chat_template, render
from lmtune.data.prepare import encode_in_memory
from lmtune.data.readers import records
from lmtune.data.sources import BadLines, Record, resolve_sources
from lmtune.data.tokenize import IGNORE_INDEX
from lmtune.errors import UserError
from lmtune.model.modeling import byte_tokenizer

# A ChatML template like the ones Qwen models ship, to check masking under a real template.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def read(spec: str, **kw: Any) -> list[dict[str, Any]]:
    settings = ExampleSettings(**kw)
    return [r.fields for r in records(resolve_sources(spec), settings, BadLines(skip=False))]


def encode(rows: list[dict[str, Any]], tokenizer: Any = None, **kw: Any) -> tuple[Any, Any, Any]:
    tok = tokenizer or byte_tokenizer()
    recs = [Record("mem", i + 1, r) for i, r in enumerate(rows)]
    data, stats = encode_in_memory(recs, tok, ExampleSettings(**kw))
    return data, stats, tok


def trained_text(data: Any, i: int, tok: Any) -> str:
    """The text of the positions that train (as targets after the shift: position 0 never does)."""
    ids, labels, _ = data[i]
    return str(tok.decode([int(t) for t in ids[1:][labels[1:] != IGNORE_INDEX]]))


# --- inputs ---------------------------------------------------------------------------------------


def test_every_input_kind_reads_the_same_records(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    rows = [{"text": "first"}, {"text": "second, with a comma"}]
    (tmp_path / "a.jsonl").write_text('{"text": "first"}\n\n  \n{"text": "second, with a comma"}\n')
    (tmp_path / "b.ndjson").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "c.json").write_text(json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    (tmp_path / "e.csv").write_text('text\nfirst\n"second, with a comma"\n')
    (tmp_path / "f.txt").write_text("first\n\nsecond, with a comma\n")
    Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for name in ("a.jsonl", "b.ndjson", "c.json", "d.parquet", "e.csv", "f.txt", "saved"):
        assert read(str(tmp_path / name)) == rows, name
    assert len(read(str(tmp_path / "*.jsonl") + "," + str(tmp_path / "c.json"))) == 4
    assert len(read(str(tmp_path / "a.jsonl"))) == 2


def test_json_files_name_each_records_line_and_read_json_lines(tmp_path: Path) -> None:
    """An indented JSON list named record numbers as lines (record 5 is on line 18); JSON Lines
    saved as .json (as HF's json loader reads them) was "not valid JSON" at line 2."""
    rows = [{"text": f"t{i}"} for i in range(6)]
    (tmp_path / "a.json").write_text(json.dumps(rows, indent=2))
    found = list(records(resolve_sources(str(tmp_path / "a.json")), ExampleSettings(), BadLines(False)))
    lines = (tmp_path / "a.json").read_text().splitlines()
    assert [lines[r.line - 1].strip() for r in found] == ["{"] * 6
    assert [lines[r.line].strip() for r in found] == [f'"text": "t{i}"' for i in range(6)]
    (tmp_path / "b.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read(str(tmp_path / "b.json")) == rows
    (tmp_path / "c.json").write_text('[{"text": "a"},\n\n  5]')
    with pytest.raises(UserError, match=r"c\.json:3: record 2 is not a JSON object"):
        read(str(tmp_path / "c.json"))
    skipped = BadLines(skip=True)  # a bad line, as in JSONL (the whole file was refused)
    kept = records(resolve_sources(str(tmp_path / "c.json")), ExampleSettings(skip_bad_lines=True), skipped)
    assert [r.fields for r in kept] == [{"text": "a"}] and skipped.count == 1
    # Records sharing a line (json.dumps without indent) are told apart by their number there.
    (tmp_path / "d.json").write_text(json.dumps(rows[:2])[:-1] + ",\n" + json.dumps(rows[2]) + "]")
    found = list(records(resolve_sources(str(tmp_path / "d.json")), ExampleSettings(), BadLines(False)))
    named = ["d.json:1 (record 1)", "d.json:1 (record 2)", "d.json:2"]
    assert [r.where.split("/")[-1] for r in found] == named


def test_saved_splits_without_train_are_named_not_guessed(tmp_path: Path) -> None:
    from datasets import Dataset, DatasetDict

    DatasetDict({"test": Dataset.from_list([{"text": "x"}])}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(UserError, match=r"no 'train' split \(splits: test\); name the split .*/dd/test"):
        read(str(tmp_path / "dd"))
    assert read(str(tmp_path / "dd" / "test")) == [{"text": "x"}]


def test_folder_reads_every_supported_file(tmp_path: Path) -> None:
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "1.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "x" / "2.json").write_text('[{"text": "b"}]')
    (tmp_path / "x" / "notes.md").write_text("ignored\n")
    assert [r["text"] for r in read(str(tmp_path / "x"))] == ["a", "b"]
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "1.txt").write_text("b\nc\n")
    (tmp_path / "t" / "2.txt.gz").write_bytes(gzip.compress(b"d\n"))
    assert [r["text"] for r in read(str(tmp_path / "t"))] == ["b", "c", "d"]


def test_a_folder_of_records_with_plain_text_beside_them_is_refused(tmp_path: Path) -> None:
    """A notes.txt among a folder's .jsonl files trained each of its lines as an example."""
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "a.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n')
    (tmp_path / "x" / "notes.txt").write_text("tune the lr\n")
    with pytest.raises(UserError, match=r"holds plain text \(notes.txt\) beside records \(a.jsonl\)"):
        resolve_sources(str(tmp_path / "x"))
    # A glob that matches both, as the folder holds them (it trained the notes).
    with pytest.raises(UserError, match=r"x/\*: matches plain text \(notes.txt\) beside records \(a.jsonl\)"):
        resolve_sources(str(tmp_path / "x" / "*"))
    given = f"{tmp_path / 'x' / 'a.jsonl'},{tmp_path / 'x' / 'notes.txt'}"
    assert len(resolve_sources(given)) == 2  # named, both are read


def test_a_folder_leaves_out_hidden_files_and_papers_and_refuses_split_files(tmp_path: Path) -> None:
    """A folder trained a notebook's .ipynb_checkpoints copy, macOS's ._ file, a LICENSE.txt as
    text, and a hub data set's test.jsonl with its train.jsonl."""
    x = tmp_path / "x"
    (x / ".ipynb_checkpoints").mkdir(parents=True)
    (x / "a.jsonl").write_text('{"text": "a"}\n')
    (x / ".ipynb_checkpoints" / "a-checkpoint.jsonl").write_text('{"text": "a"}\n')
    (x / "._a.jsonl").write_bytes(b"\x00\x05\x16\x07")
    (x / "LICENSE.txt").write_text("MIT\n")
    (x / "README.txt").write_text("about\n")
    assert [s.name for s in resolve_sources(str(x))] == [str(x / "a.jsonl")]
    (x / "split" / "validation").mkdir(parents=True)
    (x / "split" / "train-00000.jsonl").write_text('{"text": "t"}\n')
    (x / "split" / "validation" / "part.jsonl").write_text('{"text": "v"}\n')
    held = f"--eval-data {x / 'split' / 'validation' / 'part.jsonl'}"
    for given in (x, x / "split"):
        with pytest.raises(
            UserError, match=rf"holds a train split and a held-out one by their file names .*{held}$"
        ):
            resolve_sources(str(given))
    assert len(resolve_sources(str(x / "split" / "validation"))) == 1  # one split's folder: read
    with pytest.raises(UserError, match="holds a train split and a held-out one"):  # a glob over both
        resolve_sources(f"{x / 'split'}/**/*.jsonl")


def test_compressed_files_read_as_their_format(tmp_path: Path) -> None:
    """HF's loaders and Axolotl read train.jsonl.gz; it was an unsupported file type."""
    import bz2
    import gzip
    import lzma

    rows = [{"text": f"line {i}, with a comma"} for i in range(5)]
    jsonl = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(jsonl))
    (tmp_path / "b.json.bz2").write_bytes(bz2.compress(json.dumps(rows).encode()))
    csv_text = "text\n" + "".join(f'"{r["text"]}"\n' for r in rows)
    (tmp_path / "c.csv.xz").write_bytes(lzma.compress(csv_text.encode()))
    (tmp_path / "d.txt.gz").write_bytes(gzip.compress("".join(r["text"] + "\n" for r in rows).encode()))
    for name in ("a.jsonl.gz", "b.json.bz2", "c.csv.xz", "d.txt.gz"):
        assert read(str(tmp_path / name)) == rows, name
    (tmp_path / "d.txt.gz").unlink()  # plain text beside records is refused in a folder
    assert read(str(tmp_path)) == rows * 3  # a folder's compressed files too
    (tmp_path / "e.jsonl.gz").write_bytes(gzip.compress(jsonl)[:40])
    with pytest.raises(UserError, match=r"e\.jsonl\.gz: cannot be decompressed \(Compressed file ended"):
        read(str(tmp_path / "e.jsonl.gz"))
    for name in ("f.gz", "g.parquet.gz"):
        (tmp_path / name).write_bytes(gzip.compress(b"x"))
        with pytest.raises(UserError, match=r"type '(\.gz|\.parquet\.gz)'.*compressed: \.gz"):
            read(str(tmp_path / name))


def test_a_damaged_archive_is_named_not_its_first_bad_line(tmp_path: Path) -> None:
    """gzip checks its CRC only at the end: a flipped byte inside read as a bad JSON line, and the
    archive's damage went unsaid. A bad line of an intact archive is still that line."""
    import gzip

    lines = "".join(json.dumps({"text": f"record number {i} " * 5}) + "\n" for i in range(300)).encode()
    stored = bytearray(gzip.compress(lines, compresslevel=0))  # stored blocks: the byte reads as it is
    stored[stored.find(b'{"text": "record number 150 ')] = ord("x")
    (tmp_path / "flipped.jsonl.gz").write_bytes(bytes(stored))
    with pytest.raises(
        UserError,
        match=r"flipped\.jsonl\.gz: cannot be decompressed \(CRC check failed [^()]*\): the "
        r"archive is damaged, which is why line 151 read as not valid JSON \(Expecting value, column 1\)$",
    ):
        read(str(tmp_path / "flipped.jsonl.gz"))
    # Read past its bad line (--skip-bad-lines, the audit), the same, once; cut short, its own error.
    for name, content in (("flipped.jsonl.gz", bytes(stored)), ("cut.jsonl.gz", gzip.compress(lines)[:900])):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UserError) as caught:
            list(records(resolve_sources(str(tmp_path / name)), ExampleSettings(), BadLines(skip=True)))
        spoilt = r": the archive is damaged, which is why line 151 read as not valid JSON \(.*\)"
        said = rf".*{name}: cannot be decompressed \([^()]*\)" + (spoilt if "flipped" in name else "")
        assert re.fullmatch(said, str(caught.value)), caught.value
    (tmp_path / "bad.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a"}\nnot json\n'))
    with pytest.raises(UserError, match=r"bad\.jsonl\.gz:2: not valid JSON"):
        read(str(tmp_path / "bad.jsonl.gz"))


def test_txt_blocks(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("one\ntwo\n\n\nthree\n")
    assert read(str(tmp_path / "t.txt"), txt_mode="block") == [{"text": "one\ntwo"}, {"text": "three"}]


def test_json_lines_in_a_txt_file_are_refused_unless_text_is_asked(tmp_path: Path) -> None:
    """Each line would train as its JSON text, braces and field names included, without a word."""
    lines = '\n{"prompt": "a", "completion": "b"}\n{"prompt": "c", "completion": "d"}\n'
    (tmp_path / "d.txt").write_text(lines)
    for mode in ("line", "block"):
        with pytest.raises(UserError, match=r"d\.txt:2: a JSON object in a \.txt file.*--data-format text"):
            read(str(tmp_path / "d.txt"), txt_mode=mode)
    texts = [r["text"] for r in read(str(tmp_path / "d.txt"), format="text")]
    assert texts == [line for line in lines.splitlines() if line]
    (tmp_path / "e.txt").write_text('plain first\n{"a": 1}\n')  # only a first line that is JSON
    assert len(read(str(tmp_path / "e.txt"))) == 2


def test_a_datasets_loader_name_is_no_data_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--data json (Axolotl's path: json) went to load_dataset("json"), which read every JSON file
    under the working folder and trained on them."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "other.jsonl").write_text('{"text": "x"}\n')
    for name in ("json", "csv:train", "Parquet"):
        with pytest.raises(UserError, match=r"the datasets library's .* loader .*give the files themselves"):
            resolve_sources(name)
    assert resolve_sources("org/json")[0].kind == "hf_hub"  # a hub data set named so is one


def test_a_typo_of_a_local_file_is_no_hub_data_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Said at once, with the file meant, not after a minute of the hub's retries."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(UserError, match=r"no such file or folder: trian \(did you mean train\.jsonl\?\)"):
        resolve_sources("trian")
    with pytest.raises(
        UserError, match=r"no such file or folder: train\.jsnl \(did you mean train\.jsonl\?\)"
    ):
        resolve_sources("train.jsnl")
    with pytest.raises(UserError, match=r"no such file or folder: shards/ \(in the working folder"):
        resolve_sources("shards/")  # a folder by its form: no hub id ends in a slash
    # A name with a comma is meant as the value must be written: commas list sources.
    (tmp_path / "a,b.jsonl").write_text('{"text": "x"}\n')
    written = r"did you mean a\\,b\.jsonl\? A comma inside a name is written \\,\.\)"
    with pytest.raises(UserError, match=written):
        resolve_sources("a.jsonl,b.jsonl")
    assert resolve_sources("a\\,b.jsonl")[0].name.endswith("a,b.jsonl")
    # A file's name, not a hub id; a relative path is looked for in the working folder (a --config
    # file's too, not beside that file), and the message says which.
    with pytest.raises(
        UserError, match=rf"no such file or folder: notes\.md \(in the working folder {tmp_path}\)$"
    ):
        resolve_sources("notes.md")
    assert [s.kind for s in resolve_sources("org/dataset,squad")] == ["hf_hub", "hf_hub"]


def test_a_source_reached_twice_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every example of it would count twice, unasked: named twice, or by a file and a glob (or a
    folder) that holds it; --data-weights is how a source is drawn more often."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    for name in ("a.jsonl", "d/b.jsonl"):
        (tmp_path / name).write_text('{"text": "x"}\n')
    twice = r"is named twice \(each of its examples would be trained twice an epoch\); give it once, and "
    for spec in (
        "a.jsonl,a.jsonl",
        f"a.jsonl,{tmp_path}/a.jsonl",
        "d/b.jsonl,d",
        "*.jsonl,./a.jsonl",
        "x=a.jsonl,y=a.jsonl",
    ):
        with pytest.raises(UserError, match=twice):
            resolve_sources(spec)
    with pytest.raises(UserError, match=r"--eval-data: .* would be evaluated twice\); give it once$"):
        resolve_sources("a.jsonl,a.jsonl", "--eval-data")
    with pytest.raises(UserError, match="org/set is named twice"):
        resolve_sources("org/set,org/set")
    assert len(resolve_sources("a.jsonl,d,org/set,org/set:test")) == 4  # a split is another source


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("missing.jsonl", "no such file or folder: missing.jsonl"),
        ("nothing-*.jsonl", "no file matches"),
        ("data.xml", "unsupported file type '.xml'"),
    ],
)
def test_missing_inputs(tmp_path: Path, spec: str, message: str) -> None:
    if spec.endswith(".xml"):
        (tmp_path / spec).write_text("<x/>")
    with pytest.raises(UserError, match=message.replace("*", r"\*").replace(".", r"\.")):
        resolve_sources(str(tmp_path / spec) if "xml" in spec or "*" in spec else spec)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="folder has no"):
        resolve_sources(str(tmp_path / "empty"))


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin", "adapter_model.safetensors"])
def test_a_model_folder_given_as_data_is_named_as_such(tmp_path: Path, weights: str) -> None:
    """Its JSON files (config.json, tokenizer.json) are not records: said, not read as data."""
    model = tmp_path / "final"
    model.mkdir()
    config = "adapter_config.json" if weights.startswith("adapter") else "config.json"
    (model / config).write_text("{}")
    (model / "tokenizer.json").write_text("{}")
    (model / weights).write_bytes(b"")
    said = rf"--data: {model}: a model folder \(it holds {weights}\), not data; a model is given with --model"
    with pytest.raises(UserError, match=said):
        resolve_sources(str(model))
    run = tmp_path  # a run's output folder, its model in final/
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    said = rf"--data: {run}: holds a model \({model}\), not only data; a model is given with --model"
    with pytest.raises(UserError, match=said):
        resolve_sources(str(run))
    if config == "config.json":  # a folder of JSON records that happens to hold a config.json stays data
        (model / weights).unlink()
        read = [s.name for s in resolve_sources(str(model))]
        assert read == [str(model / config), str(model / "tokenizer.json")]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"text": "ok"}\n{"text": "broken\n', r"d\.jsonl:2: not valid JSON \(Unterminated string"),
        (
            b'{"text": "ok"}\n{"body": "x", "id": 3}\n',
            r"d\.jsonl:2: cannot tell the format \(fields found: 'body', 'id'",
        ),
        (b'{"text": 5}\n', r"d\.jsonl:1: record has a non-string \(int\) 'text' field"),
        (b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', r"d\.jsonl:2: not valid UTF-8 \(byte 11 of the line\)$"),
        (  # gzip's bytes under a plain name
            gzip.compress(b'{"text": "ok"}\n'),
            r"d\.jsonl:1: not valid UTF-8 \(byte 2 of the line\): it is compressed; name it by its",
        ),
        (b"[1, 2]\n", r"d\.jsonl:1: expected a JSON object"),
        (
            b'{"messages": [{"role": "bot", "content": "x"}]}\n',
            r"d\.jsonl:1: message 1 has unknown role 'bot'",
        ),
        (b'{"prompt": "p", "completion": null}\n', r"d\.jsonl:1: record has a null 'completion' field"),
    ],
)
def test_bad_records_name_file_and_line(tmp_path: Path, content: bytes, message: str) -> None:
    f = tmp_path / "d.jsonl"
    f.write_bytes(content)
    with pytest.raises(UserError, match=message):
        recs = list(records(resolve_sources(str(f)), ExampleSettings(), BadLines(skip=False)))
        encode_in_memory(recs, byte_tokenizer(), ExampleSettings())


def test_a_compressed_json_file_under_a_plain_name_says_so(tmp_path: Path) -> None:
    f = tmp_path / "d.json"
    f.write_bytes(gzip.compress(b'[{"text": "ok"}]'))
    with pytest.raises(UserError, match=r"d\.json: not valid UTF-8: it is compressed; name it by its"):
        list(records(resolve_sources(str(f)), ExampleSettings(), BadLines(skip=False)))


def test_a_csv_row_with_more_or_fewer_fields_than_its_header_is_a_bad_line(tmp_path: Path) -> None:
    """An unquoted comma would otherwise cut the completion at it, silently."""
    f = tmp_path / "d.csv"
    f.write_text('prompt,completion\nQ,"It is 4, of course"\nQ,It is 4, of course\nQ\nQ,fine\n')
    with pytest.raises(UserError, match=r"d\.csv:3: 3 fields where the header has 2 \(quote a field that"):
        list(records(resolve_sources(str(f)), ExampleSettings(), BadLines(skip=False)))
    bad = BadLines(skip=True)
    kept = list(records(resolve_sources(str(f)), ExampleSettings(skip_bad_lines=True), bad))
    assert [r.fields["completion"] for r in kept] == ["It is 4, of course", "fine"]
    assert [m.split(": ", 1)[1] for m in bad.messages] == [
        "3 fields where the header has 2 (quote a field that holds a comma)",
        "1 field where the header has 2",
    ]


def test_a_tsv_file_is_read_with_tabs_compressed_too(tmp_path: Path) -> None:
    """A .tsv was refused as an unsupported file type; its fields are split at tabs, commas kept,
    and a row with a tab too many is a bad line that says so."""
    import gzip

    f = tmp_path / "d.tsv"
    f.write_text('prompt\tcompletion\nWhat is 2+2?\tIt is 4, of course\nQ\t"a\ttab, quoted"\nQ\tx\ty\n')
    bad = BadLines(skip=True)
    kept = list(records(resolve_sources(str(f)), ExampleSettings(skip_bad_lines=True), bad))
    assert [r.fields for r in kept] == [
        {"prompt": "What is 2+2?", "completion": "It is 4, of course"},
        {"prompt": "Q", "completion": "a\ttab, quoted"},
    ]
    assert bad.messages == [f"{f}:4: 3 fields where the header has 2 (quote a field that holds a tab)"]
    # A quote never closed swallowed the rest of the file as one field, without a word (pandas and
    # HF's loader refuse it); one closed by a later field's quote the lines between (pandas reads
    # that). Each is a bad line where it opens, and reading goes on from the next line; a closed
    # field over lines reads as before.
    f.write_text(
        'text\tn\nthe cat\t1\n"two\nlines"\t2\n"left open\t3\nrow a\t4\n"quoted" b\t5\nrow c\t6\n'
        '"never closed\t7\nrow d\t8\n"last one\t9'
    )  # line 9's quote is closed by line 11's, which then opens none
    bad = BadLines(skip=True)
    kept = list(records(resolve_sources(str(f)), ExampleSettings(skip_bad_lines=True), bad))
    assert [(r.line, r.fields["text"]) for r in kept] == [
        (2, "the cat"), (3, "two\nlines"), (6, "row a"), (7, "quoted b"), (8, "row c"), (10, "row d")
    ]  # fmt: skip
    fix = 'close it, or double a quote inside a quoted field: ""'
    assert bad.messages == [
        f"{f}:5: a quoted field opens here, runs over 3 lines and its closing quote is followed by more "
        f"text: a quote is left open here ({fix})",
        f"{f}:9: a quoted field opens here, runs over 3 lines and its closing quote is followed by more "
        f"text: a quote is left open here ({fix})",
        f"{f}:11: a quoted field opens here and the file ends before it closes ({fix})",
    ]
    f.write_text('text\tn\nthe cat\t1\n"two\nlines"\t2\nlast\t3\n')
    packed = tmp_path / "e.tsv.gz"
    packed.write_bytes(gzip.compress(f.read_bytes()))
    (source,) = resolve_sources(str(packed))
    assert source.kind == "tsv"
    assert len(list(records([source], ExampleSettings(skip_bad_lines=True), BadLines(skip=True)))) == 3


def test_a_long_csv_field_is_read_and_bad_bytes_name_their_line(tmp_path: Path) -> None:
    """Python's csv refuses fields over 128 KiB by default (a long document); invalid UTF-8 in a CSV
    was named without its line."""
    long = tmp_path / "long.csv"
    long.write_text('text\n"' + "word " * 40_000 + '"\nshort\n')
    kept = list(records(resolve_sources(str(long)), ExampleSettings(), BadLines(skip=False)))
    assert [len(r.fields["text"]) for r in kept] == [200_000, 5]
    bad = tmp_path / "bad.csv"
    bad.write_bytes(b"text\nfine\nalso fine\nbad \xff byte\n")
    with pytest.raises(UserError, match=r"bad\.csv:4: not valid UTF-8"):
        list(records(resolve_sources(str(bad)), ExampleSettings(), BadLines(skip=False)))
    # With --skip-bad-lines the row is skipped, as a JSONL line is (the whole file was refused);
    # a row with a line break inside quotes is named by the line it starts on.
    bad.write_bytes(b'text\nfine\n"two\nlines \xff"\nlast\n')
    skipped = BadLines(skip=True)
    kept = list(records(resolve_sources(str(bad)), ExampleSettings(skip_bad_lines=True), skipped))
    assert [(r.line, r.fields["text"]) for r in kept] == [(2, "fine"), (5, "last")]
    assert skipped.messages == [f"{bad}:3: not valid UTF-8"]


def test_a_control_character_in_json_is_named_plainly(tmp_path: Path) -> None:
    f = tmp_path / "nul.jsonl"
    f.write_bytes(b'{"text": "a\x00b"}\n')
    with pytest.raises(
        UserError, match=r"nul\.jsonl:1: not valid JSON \(Invalid control character, column 12\)$"
    ):
        list(records(resolve_sources(str(f)), ExampleSettings(), BadLines(skip=False)))


def test_skip_bad_lines_counts_them(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'{"text": "a"}\n{oops\n{"x": 1}\n{"text": "\xff"}\n{"text": "b"}\n')
    bad = BadLines(skip=True)
    settings = ExampleSettings(skip_bad_lines=True)
    data, _stats = encode_in_memory(
        records(resolve_sources(str(f)), settings, bad), byte_tokenizer(), settings, bad
    )
    assert len(data) == 2 and bad.count == 3
    assert [m.split(": ")[0] for m in bad.messages] == [f"{f}:2", f"{f}:4", f"{f}:3"]


# --- formats and labels ---------------------------------------------------------------------------


def test_text_trains_everything_and_appends_eos() -> None:
    data, stats, tok = encode([{"text": "abc"}])
    ids, labels, _ = data[0]
    assert list(ids) == [tok.bos_token_id, ord("a"), ord("b"), ord("c"), tok.eos_token_id]
    assert (labels[1:] == ids[1:]).all()
    assert stats.formats == {"text": 1} and stats.eos_trained == 1


def test_prompt_completion_trains_only_the_completion_and_eos() -> None:
    data, _, tok = encode([{"prompt": "Q: 2+2?\nA: ", "completion": "4"}])
    assert trained_text(data, 0, tok) == "4" + tok.eos_token
    labels = data[0].labels
    assert labels[-1] == tok.eos_token_id


def test_an_eos_the_tokenizer_appends_itself_trains_as_the_one_lmtune_appends() -> None:
    """A tokenizer whose post-processor adds EOS (add_eos_token=True, as some Llama ones are saved)
    had that EOS kept untrained, a special token: no example trained a stop, and the run blamed
    --max-length."""
    from tokenizers import processors

    tok = byte_tokenizer()
    bos, eos = (tok.bos_token, tok.bos_token_id), (tok.eos_token, tok.eos_token_id)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos[0]} $A {eos[0]}", special_tokens=[bos, eos]
    )
    rows = [{"text": "abc"}, {"prompt": "Q: 2+2?\nA: ", "completion": "4"}]
    theirs, stats, _ = encode(rows, tok)
    ours, _, _ = encode(rows)
    for a, b in zip(theirs, ours, strict=True):
        assert a.input_ids.tolist() == b.input_ids.tolist() and a.labels.tolist() == b.labels.tolist()
    assert stats.eos_trained == 2
    # A prompt to continue ends before that EOS (generate, --sample-prompts, the demo's answers):
    # it asked the model to go on past its own end.
    from lmtune.model.tokens import appends_eos, prompt_ids

    assert appends_eos(tok) and not appends_eos(byte_tokenizer())
    assert prompt_ids(tok, "ab") == [bos[1], ord("a"), ord("b")] == prompt_ids(byte_tokenizer(), "ab")


def test_instruction_alias() -> None:
    data, stats, tok = encode([{"instruction": "Add.", "input": "2 2", "output": "4"}])
    assert stats.formats == {"prompt_completion": 1}
    assert trained_text(data, 0, tok) == "4" + tok.eos_token
    assert tok.decode(data[0][0][1:]).startswith("Add.\n\n2 2\n\n4")


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def test_messages_train_only_assistant_turns_with_the_builtin_template() -> None:
    data, stats, tok = encode([{"messages": CONVERSATION}])
    assert trained_text(data, 0, tok) == f"hello{tok.eos_token}4{tok.eos_token}"
    assert stats.eos_trained == 1


def test_the_builtin_template_puts_each_turn_on_its_own_line() -> None:
    tok = byte_tokenizer()
    ensure_chat_template(tok)
    rendered = render(Record("m", 1, {"messages": CONVERSATION[:4]}), "auto", PLAIN_FIELDS, tok)
    eos = tok.eos_token
    assert rendered.text == f"<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\nhello{eos}\n<|user|>\n2+2?"


def test_messages_under_a_real_chat_template() -> None:
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    data, _, _ = encode([{"messages": conv}], tokenizer=tok)
    assert trained_text(data, 0, tok) == "hello<|im_end|>\n"
    rendered = render(Record("m", 1, {"messages": conv}), "auto", PLAIN_FIELDS, tok)
    assert rendered.text.startswith("<|im_start|>user\nhi<|im_end|>")


def test_forced_format_requires_its_fields() -> None:
    with pytest.raises(UserError, match="mem:1: record has no 'prompt' field"):
        encode([{"text": "x"}], format="prompt_completion")


# --- truncation -----------------------------------------------------------------------------------


def test_truncation_modes_and_counts() -> None:
    rows = [{"text": "short"}, {"prompt": "p", "completion": "a long answer here"}]
    right, s_right, _ = encode(rows, max_length=8, truncation="right")
    left, s_left, tok = encode(rows, max_length=8, truncation="left")
    assert (s_right.truncated, s_left.truncated) == (1, 1)
    assert len(right[1][0]) == len(left[1][0]) == 8
    assert left[1][0][-1] == tok.eos_token_id and right[1][0][-1] != tok.eos_token_id
    _, s_drop, _ = encode(rows, max_length=8, truncation="drop")
    assert (s_drop.examples, s_drop.dropped_too_long) == (1, 1)
    with pytest.raises(UserError, match=r"mem:2: 21 tokens, more than --max-length 8"):
        encode(rows, max_length=8, truncation="error")


def test_an_example_left_with_no_targets_is_dropped_and_counted() -> None:
    rows = [{"prompt": "a very long prompt", "completion": "x"}, {"text": "ok"}]
    data, stats, _ = encode(rows, max_length=6, truncation="right")
    # The prompt alone fills --max-length: dropped for being too long, not as "nothing to train".
    assert len(data) == 1 and stats.dropped_too_long == 1 and stats.dropped_no_targets == 0
    assert stats.truncated == 0


# --- batching -------------------------------------------------------------------------------------


def test_padding_is_masked_from_the_attention_mask_not_by_id() -> None:
    tok = byte_tokenizer()
    tok.pad_token = tok.eos_token  # the common pad == eos setup
    data, _, _ = encode([{"text": "a"}, {"text": "abcd"}], tokenizer=tok)
    batch = Collator(tok.pad_token_id)([data[0], data[1]])
    assert batch.input_ids.shape == (2, 6)
    # Row 0 is bos a eos pad pad pad: the real EOS keeps its label, the padding (same id) does not.
    # (BOS is never a target: nothing precedes it.)
    assert batch.labels[0].tolist() == [
        IGNORE_INDEX,
        ord("a"),
        tok.eos_token_id,
        IGNORE_INDEX,
        IGNORE_INDEX,
        IGNORE_INDEX,
    ]
    assert batch.attention_mask[0].tolist() == [1, 1, 1, 0, 0, 0]
    assert (batch.labels[1, 1:] == batch.input_ids[1, 1:]).all()
    assert batch.target_tokens() == 2 + 5


def test_sample_task_is_deterministic_and_splits_are_disjoint() -> None:
    train, held = addition_examples()
    assert (train, held) == addition_examples()
    assert not set(train) & set(held)
    for text in train[:50]:
        prompt, answer = split_prompt(text)
        a, b = prompt[:-1].split("+")
        assert int(answer) == int(a) + int(b)
    assert np.all(np.array([len(t) for t in train]) > 4)


def test_a_utf16_file_is_named_as_such_with_how_to_convert_it(tmp_path: Path) -> None:
    """Excel's and PowerShell's "Unicode" text read as bad UTF-8 lines and a CSV field named
    '\\udcff\\udcfep\\x00r\\x00...'."""
    for name, text in (("d.jsonl", '{"text": "a"}\n'), ("d.csv", "prompt,completion\nq,a\n")):
        (tmp_path / name).write_bytes(text.encode("utf-16"))  # with its byte-order mark
        with pytest.raises(UserError, match=r"d\.\w+: UTF-16 text .*iconv -f UTF-16 -t UTF-8 FILE > NEW$"):
            read(str(tmp_path / name))
    # Without a mark (Python's encoding="utf-16-le", some exports): by its zero bytes.
    for encoding, said in (("utf-16-le", "UTF-16LE"), ("utf-16-be", "UTF-16BE"), ("utf-32-le", "UTF-32LE")):
        (tmp_path / "d.jsonl").write_bytes('{"text": "a"}\n'.encode(encoding))
        with pytest.raises(UserError, match=rf"{said} text \(its first characters are ASCII .*-f {said} "):
            read(str(tmp_path / "d.jsonl"))
    (tmp_path / "d.jsonl").write_bytes(b"\xef\xbb\xbf" + b'{"text": "a"}\n')  # UTF-8's own mark: read
    assert read(str(tmp_path / "d.jsonl")) == [{"text": "a"}]


def test_examples_two_data_sets_share_are_counted_by_their_tokens() -> None:
    """--eval-data that repeats some training examples (a copy of part of the data) was warned of
    only when it was the very same data."""
    from lmtune.data.dataset import SplitView, shared_examples

    def encoded(texts: list[str]) -> Any:
        recs = [Record("d.jsonl", i + 1, {"text": t}) for i, t in enumerate(texts)]
        return encode_in_memory(recs, byte_tokenizer(), ExampleSettings())[0]

    train = encoded([f"example {i}" for i in range(6)])
    held = encoded(["example 2", "example 5", "something new", "example 2 "])
    assert shared_examples(train, held) == 2
    assert shared_examples(SplitView(train, np.array([0, 1, 2])), held) == 1  # of the view's examples
    assert shared_examples(train, SplitView(held, np.array([2, 3]))) == 0
    assert shared_examples(train, held, most_tokens=10) is None  # not worth its cost past that


def test_truncation_split_trains_a_document_as_consecutive_pieces() -> None:
    """A document past --max-length lost all but its first --max-length tokens whichever way it was
    cut (HF's run_clm and Axolotl's completion data chunk it). Under --truncation split its tokens
    train as pieces of --max-length, in order, the EOS in the last; other formats are cut as right."""
    text = "".join(f"w{i:03d} " for i in range(60))  # 300 byte tokens, +BOS +EOS
    recs = [
        Record("d.jsonl", 1, {"text": text}),
        Record("d.jsonl", 2, {"prompt": "q" * 10, "completion": "a" * 100}),
        Record("d.jsonl", 3, {"text": "short"}),
    ]
    settings = ExampleSettings(max_length=64, truncation="split")
    data, stats = encode_in_memory(recs, byte_tokenizer(), settings)
    whole, _ = encode_in_memory(recs[:1], byte_tokenizer(), ExampleSettings(max_length=1024))
    pieces = [data[i] for i in range(5)]
    assert [len(p.input_ids) for p in pieces] == [64, 64, 64, 64, 46]  # 302 tokens
    assert np.concatenate([p.input_ids for p in pieces]).tolist() == whole[0].input_ids.tolist()
    assert all((p.labels != IGNORE_INDEX)[1:].all() for p in pieces)  # every token trains
    assert (stats.documents_split, stats.pieces_added, stats.truncated, stats.examples) == (1, 4, 1, 7)
    assert len(data[5].input_ids) == 64  # the prompt/completion record, cut as right
    assert (
        stats.eos_trained - stats.pieces_added == 2
    )  # the document's end and "short"'s; the cut one lost it


def test_a_hub_data_sets_metadata_is_not_data_and_a_folder_names_its_files(tmp_path: Path) -> None:
    """A cloned hub data set's dataset_infos.json read as a record ("cannot tell the format"); a
    dataset_dict.json that datasets did not write was a KeyError traceback; a folder of one file and
    a cache entry built from other names listed no file, or the other names."""
    from lmtune.data.sources import files_read, resolve_components

    hub = tmp_path / "hub"
    hub.mkdir()
    (hub / "data.jsonl").write_text('{"text": "a"}\n')
    (hub / "dataset_infos.json").write_text('{"default": {"features": {}}}')
    assert [Path(s.name).name for s in resolve_sources(str(hub))] == ["data.jsonl"]
    for spec, files in ((str(hub), (str(hub / "data.jsonl"),)), (str(hub / "data.jsonl"), ())):
        # One file of a folder is named all the same; a file given by its name adds nothing.
        assert files_read(spec, resolve_components(spec)) == files
    (hub / "dataset_dict.json").write_text('{"other": 1}')  # not save_to_disk's
    with pytest.raises(UserError, match=r"holds dataset_dict\.json but is no folder datasets' save_to_disk"):
        read(str(hub))


def test_a_cache_entry_read_for_files_of_other_names_says_their_places() -> None:
    """A folder Z with the content of a folder X read X's cache entry, whose places (data line,
    run.json) named X's files."""
    from lmtune.data.dataset import named_here

    recs = [Record("X/a.jsonl", 1, {"text": "x" * 900}), Record("X/b.jsonl", 2, {"text": "ok"})]
    data, _ = encode_in_memory(recs, byte_tokenizer(), ExampleSettings(max_length=64))
    data.meta = {"sources": ["X/a.jsonl", "X/b.jsonl"], "where": {"no_stop": ["X/a.jsonl:1"]}}
    data.meta["bad_line_examples"] = ["X/b.jsonl:2: not valid JSON"]
    named_here(data, ["Z/a1.jsonl", "Z/b1.jsonl"])
    assert data.meta["where"] == {"no_stop": ["Z/a1.jsonl:1"]} and data.meta["sources"] == [
        "Z/a1.jsonl",
        "Z/b1.jsonl",
    ]
    assert data.meta["bad_line_examples"] == ["Z/b1.jsonl:2: not valid JSON"]
