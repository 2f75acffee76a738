"""`lmtune data show`: records as training sees them, the trained tokens marked as the examples
training builds from them have them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmtune.cli import main
from lmtune.config.groups import ExampleSettings
from lmtune.data.prepare import encode_in_memory
from lmtune.data.sources import Record
from lmtune.data.tokenize import IGNORE_INDEX
from lmtune.model.modeling import byte_tokenizer

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "6."},
    ]
}
ROWS = [CHAT, {"prompt": "Q: capital of France?\nA:", "completion": " Paris"}, {"text": "all of it"}]


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_show_marks_exactly_the_tokens_training_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _write(tmp_path / "d.jsonl", ROWS)
    assert main(["data", "show", str(data)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("(trained tokens are between [[ and ]])\n")
    assert f"== {data}:1 (messages, " in out and f"== {data}:3 (text, " in out
    # Each turn on its own line; only the replies and their end of turn train.
    assert "<|user|>\nWhat is 2+2?\n<|assistant|>\n[[4.<|eos|>]]\n<|user|>\nAnd 3+3?" in out
    assert "A:[[ Paris<|eos|>]]" in out and "<|bos|>[[all of it<|eos|>]]" in out
    # Token by token, the same positions as the examples training builds.
    tok = byte_tokenizer()
    data_set, _ = encode_in_memory([Record(str(data), 2, ROWS[1])], tok, ExampleSettings())
    ids, trainable = data_set[0].input_ids, data_set[0].labels != IGNORE_INDEX
    assert main(["data", "show", str(data), "--start", "2", "-n", "1", "--tokens"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[0] == f"== {data}:2 (prompt_completion, {len(ids)} tokens, {int(trainable.sum())} trained)"
    assert [int(r.split()[1]) for r in rows[1:]] == ids.tolist()
    assert [" train " in r for r in rows[1:]] == trainable.astype(bool).tolist()


def test_show_pairs_and_what_training_drops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pairs = _write(tmp_path / "p.jsonl", [{"prompt": "Q?", "chosen": "good", "rejected": "bad"}])
    assert main(["data", "show", str(pairs)]) == 0
    out = capsys.readouterr().out
    assert "(preference, prompt 3 + chosen 5 + rejected 4 tokens, 9 trained)" in out
    assert "-- prompt:\n<|bos|>Q?\n-- chosen:\n[[good<|eos|>]]\n-- rejected:\n[[bad<|eos|>]]" in out
    long = _write(tmp_path / "long.jsonl", [{"text": "x" * 50}])
    assert main(["data", "show", str(long), "--max-length", "8", "--truncation", "drop"]) == 0
    assert f"== {long}:1 (text): not trained: longer than --max-length" in capsys.readouterr().out
    assert main(["data", "show", str(long), "--max-length", "8"]) == 0  # cut on the right, as training does
    assert "(text, 8 tokens, 7 trained, truncated)" in capsys.readouterr().out
    # Shown as text, where training refuses a chat template for data of no conversation.
    assert main(["data", "show", str(long), "--chat-template", "chatml"]) == 0
    assert "note: --chat-template chatml applies to conversations (messages records), and these records " in (
        capsys.readouterr().out
    )
    data = _write(tmp_path / "d.jsonl", ROWS)
    assert main(["data", "show", str(data), "--chat-template", "chatml", "-n", "2"]) == 0
    assert "note:" not in capsys.readouterr().out  # a conversation among them: the template shapes it
    prompt = _write(tmp_path / "prompt.jsonl", [{"prompt": "x" * 50, "completion": "y"}])
    assert main(["data", "show", str(prompt), "--max-length", "8"]) == 0  # the cut leaves only prompt
    said = "(prompt_completion): not trained: cut to --max-length 8 (--truncation right), nothing to train"
    assert said in capsys.readouterr().out


def test_show_refuses_what_it_cannot_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _write(tmp_path / "d.jsonl", ROWS)
    assert main(["data", "show", str(data), "--start", "4"]) == 2
    assert f"--start 4: {data} holds 3 records" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_text("")
    assert main(["data", "show", str(tmp_path / "empty.jsonl")]) == 2
    assert "empty.jsonl holds no records" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(ROWS[2]) + '\n{broken\n{"nottext": 5}\n' + json.dumps(ROWS[1]) + "\n")
    # Shown where they are, with what training does there: it stops at the first...
    assert main(["data", "show", str(broken), "-n", "5"]) == 0
    out = capsys.readouterr().out
    stops = "a bad line: training stops here (--skip-bad-lines passes over it)"
    assert f"== {stops}: {broken}:2: not valid JSON" in out
    assert f"== {stops}: {broken}:3: cannot tell the format (fields found: 'nottext'" in out
    assert f"== {broken}:4 (prompt_completion, " in out
    # ... or passes over them with --skip-bad-lines.
    assert main(["data", "show", str(broken), "--skip-bad-lines"]) == 0
    out = capsys.readouterr().out
    assert f"== skipped (--skip-bad-lines): {broken}:2: not valid JSON" in out
    assert f"== skipped (--skip-bad-lines): {broken}:3: cannot tell the format" in out
    # Bad lines before the records asked for are not in the way.
    assert main(["data", "show", str(broken), "--start", "3"]) == 0
    out = capsys.readouterr().out
    assert f"== {broken}:4 (prompt_completion, " in out and "not valid JSON" not in out
    assert main(["data", "show", str(broken), "--start", "9"]) == 2
    assert f"--start 9: {broken} holds 3 records" in capsys.readouterr().err
    # A bad line after the last record was shown before the refusal that nothing is there.
    with broken.open("a") as f:
        f.write("{broken\n")
    assert main(["data", "show", str(broken), "--start", "9"]) == 2
    said = capsys.readouterr()
    assert said.out == "" and "holds 3 records and 1 bad line after them (lmtune data audit" in said.err
    # A file of nothing but bad lines (a pretty-printed JSON saved as .jsonl) is not called empty.
    unreadable = tmp_path / "pretty.jsonl"
    unreadable.write_text(json.dumps(ROWS[0], indent=2) + "\n")
    assert main(["data", "show", str(unreadable)]) == 2
    said = capsys.readouterr()
    assert f"{unreadable} holds no record that can be read: {unreadable}:1: not valid JSON" in said.err
    assert "more bad lines (lmtune data audit lists them)" in said.err and "(empty)" not in said.err
    assert main(["data", "show"]) == 2
    assert "name the DATA to show, or a --config file" in capsys.readouterr().err


def test_show_counts_a_text_without_a_bos_from_its_second_token(tmp_path: Path) -> None:
    """GPT-2's tokenizer adds no BOS: the first token was marked trained and counted, where it is
    never predicted."""
    from tokenizers import processors

    from lmtune.data.show import Marks, shown_records

    tok = byte_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
    data = _write(tmp_path / "d.jsonl", [{"text": "abc"}])
    [block] = shown_records(str(data), tok, ExampleSettings(), 1, 1, Marks("[[", "]]"), False)
    assert block.splitlines()[1:] == ["a[[bc<|eos|>]]"] and "(text, 4 tokens, 3 trained)" in block
