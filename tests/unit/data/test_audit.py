from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lmtune.cli import main
from lmtune.config.groups import ExampleSettings
from lmtune.data.audit import rank_imbalance, stops_lost_warning


def test_audit_reports_everything_and_fails_on_bad_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "mixed.jsonl"
    rows = [
        {"text": "hello world"},
        {"prompt": "Q: 1+1?\nA: ", "completion": "2"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"}]},
        {"messages": [{"role": "user", "content": "no reply"}]},
        {"text": "x" * 100},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{broken\n")
    png = tmp_path / "h.png"
    code = main(
        [
            "data",
            "audit",
            str(f),
            "--max-length",
            "64",
            "--nproc-per-node",
            "2",
            "--global-batch-size",
            "2",
            "--plot",
            str(png),
        ]
    )
    out = capsys.readouterr().out
    assert code == 2
    assert "messages 2, prompt_completion 1, text 2" in out
    # Under its row (it sat under the "per epoch" row that came between).
    assert f"  bad lines           1\n    {f}:6: not valid JSON" in out
    assert "1 truncated, 0 dropped" in out
    assert "no trainable tokens 1" in out
    assert "EOS keeps its label NO: 3 of 4 kept examples" in out  # the long text lost its EOS
    assert "1 lost their end to --max-length 64" in out
    assert "(exit code 2): 1 bad line would stop training (--skip-bad-lines skips them)" in out
    assert "rank imbalance      2 ranks" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_data_of_no_record_lmtune_reads_says_where_the_records_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """HF's {"data": [...]} layout was told to use --field-map, which cannot read it; lines that are
    all bad were told to skip them, which leaves nothing."""
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps({"data": [{"prompt": "1+1=", "completion": "2"}] * 4}))
    assert main(["data", "audit", str(nested)]) == 2
    out = capsys.readouterr().out
    assert f"{nested}:1: the records sit in the list under 'data' (the layout load_dataset reads" in out
    assert "--field-map" not in out
    nested.write_text(json.dumps({"rows": [{"text": "a"}] * 4, "version": 1}))  # beside metadata
    assert main(["data", "audit", str(nested)]) == 2
    assert "the records sit in the list under 'rows'" in capsys.readouterr().out
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    assert main(["data", "audit", str(wrong)]) == 2
    out = capsys.readouterr().out
    assert "such as prompt=question,completion=answer" in out
    assert "1 bad line would stop training (above: what they need)" in out and "--skip-bad-lines" not in out


def test_clean_data_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "ok.jsonl"
    f.write_text('{"text": "a"}\n{"text": "bb"}\n')
    assert main(["data", "audit", str(f), "--global-batch-size", "2"]) == 0
    assert "result              clean" in capsys.readouterr().out


def test_audit_reads_the_data_of_a_train_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`data audit --config run.yaml` audits what `train --config run.yaml` would train on; DATA
    given beside it wins, as a flag does."""
    f, other = tmp_path / "ok.jsonl", tmp_path / "other.jsonl"
    f.write_text('{"text": "a"}\n{"text": "bb"}\n')
    other.write_text('{"text": "a"}\n{"text": "bb"}\n{"text": "ccc"}\n')
    config = tmp_path / "run.yaml"
    config.write_text(f"data: {f}\nglobal_batch_size: 2\n")
    assert main(["data", "audit", "--config", str(config)]) == 0
    assert f"audit of {f}\n  records             2 read, 2 kept" in capsys.readouterr().out
    assert main(["data", "audit", str(other), "--config", str(config)]) == 0
    assert f"audit of {other}\n  records             3 read, 3 kept" in capsys.readouterr().out
    assert main(["data", "audit"]) == 2
    assert "name the DATA to audit, or a --config file whose data it reads" in capsys.readouterr().err
    config.write_text("seed: 1\ndata: missing.jsonl\n")  # named by the file's line, as train names it
    assert main(["data", "audit", "--config", str(config)]) == 2
    assert (
        f"--config {config}:2: data: no such file or folder: missing.jsonl (in the working"
        in capsys.readouterr().err
    )
    # Axolotl's val_set_size is --eval-split: what it holds out is not trained, nor is what is left
    # past an epoch's last whole global batch.
    config.write_text(f"data: {other}\nglobal_batch_size: 2\nval_set_size: 0.34\n")
    assert main(["data", "audit", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "held out            1 (--eval-split): 2 left to train on" in out
    assert "per epoch" not in out
    config.write_text(f"data: {other}\nglobal_batch_size: 2\n")
    assert main(["data", "audit", "--config", str(config)]) == 0
    assert (
        "per epoch           2 of 3 in 1 step of --global-batch-size 2; the 1 left over"
        in capsys.readouterr().out
    )


def _chat(i: int, words: int, question: str = "") -> dict[str, object]:
    reply = " ".join(["word"] * words)
    return {
        "messages": [{"role": "user", "content": f"{question}q{i}"}, {"role": "assistant", "content": reply}]
    }


@pytest.mark.parametrize(
    ("rows", "extra", "code", "needle"),
    [
        # 3 of 10 chat examples lose their end of turn to --max-length: trains, but never learns to stop.
        (
            [_chat(i, 40 if i < 3 else 2) for i in range(10)],
            ["--max-length", "64"],
            1,
            "3 of 10 examples lose",
        ),
        ([], [], 2, "it holds no records (empty)"),  # train stops on it too
        ([{"text": "ok"}] * 3, ["--global-batch-size", "4"], 2, "3 examples, fewer than one global batch"),
        # What train would take: a multiple of the micro-batch (train says the same, test_cli).
        (
            [{"text": "ok"}] * 7,
            ["--global-batch-size", "8", "--micro-batch-size", "2"],
            2,
            "(--global-batch-size 8); give --global-batch-size 6 or less, or more data",
        ),
        # What --eval-split holds out does not train: the audit counts what is left, as train does.
        (
            [{"text": "ok"}] * 6,
            ["--global-batch-size", "4", "--eval-split", "0.5"],
            2,
            "3 examples left after --eval-split holds out 3, fewer than one global batch",
        ),
        (
            [{"messages": [{"role": "user", "content": "only a question"}]}, {"text": "t"}],
            [],
            1,
            "nothing to train",
        ),
        ([{"text": "ok"}, "{broken"], ["--skip-bad-lines"], 1, "1 bad line skipped"),
        ([{"text": "ok"}, "{broken"], [], 2, "1 bad line would stop training"),
        (
            [{"text": "ok"}, {"text": "x" * 80}],
            ["--max-length", "64", "--truncation", "error"],
            2,
            "would stop",
        ),
        # Left truncation keeps the end of turn, and here some of the question (all of it cut away: 1).
        (
            [_chat(i, 8, "question " * 10) for i in range(4)],
            ["--max-length", "64", "--truncation", "left"],
            0,
            "clean",
        ),
        (
            [_chat(i, 40) for i in range(4)],
            ["--max-length", "64", "--truncation", "left"],
            1,
            "cut away whole",
        ),
    ],
)
def test_exit_code_says_clean_trains_badly_or_unusable(
    rows: list[object],
    extra: list[str],
    code: int,
    needle: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    batch = [] if "--global-batch-size" in extra else ["--global-batch-size", "1"]
    assert main(["data", "audit", str(f), *extra, *batch]) == code
    out = capsys.readouterr().out
    result = next(line for line in out.splitlines() if line.startswith("  result"))
    assert needle in result and (code == 0 or f"(exit code {code})" in result)
    if not rows:
        assert "no example to check" in out and "0 of 0" not in out


def test_over_long_examples_under_truncation_error_are_counted_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """They were also bad lines: 3 records read as 5, "2 bad lines would stop training"."""
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in [{"text": "ok"}, *[{"text": "x" * 80}] * 2]))
    assert main(["data", "audit", str(f), "--max-length", "64", "--truncation", "error"]) == 2
    out = capsys.readouterr().out
    assert "3 read, 1 kept" in out and "bad lines           0" in out
    assert "0 truncated, 2 would stop training (--max-length 64, --truncation error; at " in out
    assert "(exit code 2): 2 examples longer than --max-length 64 would stop training" in out


def test_rank_imbalance_of_equal_lengths_is_one() -> None:
    even = rank_imbalance(np.full(64, 10), world_size=4, global_batch_size=16, micro_batch_size=2, seed=0)
    assert even is not None and even.mean == pytest.approx(1.0) and even.padding == pytest.approx(1.0)
    # The sampler deals tokens evenly (a steady ramp of lengths stays within a few percent); one
    # example far longer than the rest is what no dealing can even out.
    ramp = rank_imbalance(np.arange(1, 65), 4, 16, 2, seed=0)
    assert ramp is not None and ramp.worst < 1.1 and ramp.padding > 1.0
    outlier = np.full(64, 10)
    outlier[5] = 400
    skewed = rank_imbalance(outlier, 4, 16, 2, seed=0)
    assert skewed is not None and skewed.worst > 2.0


def test_length_bins_are_whole_token_counts_each_length_in_one() -> None:
    import itertools

    import numpy as np

    from lmtune.data.audit import _histogram

    assert _histogram(np.array([16, 16, 17, 17, 17]), 512) == [(16, 16, 2), (17, 17, 3)]
    bins = _histogram(np.arange(1, 1000), 512)
    assert len(bins) <= 12 and bins[0][0] == 1 and bins[-1][1] == 512
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(bins))  # no gap, no overlap
    assert sum(c for *_, c in bins) == 999  # longer ones counted in the last bin


def test_the_same_problem_on_many_lines_is_one_line_of_the_report() -> None:
    from lmtune.data.audit import _grouped

    messages = [f"qa.jsonl:{i}: cannot tell the format" for i in range(1, 8)] + ["qa.jsonl:9: not JSON"]
    assert _grouped(messages) == [
        "qa.jsonl:1, 2, 3, 4, 5 and 2 more: cannot tell the format",
        "qa.jsonl:9: not JSON",
    ]
    assert _grouped(["no place given"]) == ["no place given"]
    # Problems found at different stages arrive out of order; each file's are shown by line.
    late = ["d.jsonl:8: not JSON", "d.jsonl:3: no field", "d.jsonl:2: not JSON", "d.jsonl:6: no field"]
    assert _grouped(late) == ["d.jsonl:2, 8: not JSON", "d.jsonl:3, 6: no field"]


def test_an_empty_or_blank_answer_is_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only the stop token trains on them: the model learns to answer nothing."""
    rows = [
        {"prompt": "1+1=", "completion": ""},
        {"prompt": "1+2=", "completion": "  "},
        {"prompt": "1+3=", "completion": "4"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]},
        {"text": "plain"},
        # A blank reply between others (it was "clean"); a full one of a few tokens is not blank.
        {"messages": [{"role": r, "content": c} for r, c in (("user", "a"), ("assistant", "b"))] * 2},
        {
            "messages": [
                {"role": r, "content": c} for r, c in (("user", "a"), ("assistant", " "), ("user", "c"))
            ]
        },
    ]
    rows[-1]["messages"].append({"role": "assistant", "content": "a full reply"})
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["data", "audit", str(f), "--global-batch-size", "1"]) == 1
    said = capsys.readouterr().out
    assert f"4 examples with an empty or blank answer (at {f}:1, {f}:2, {f}:4 and 1 more): only the" in said


def test_the_examples_training_drops_or_leaves_without_a_stop_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Their lines, the first few of each kind and how many more: a count alone leaves the user to
    search the file for them."""
    rows = [
        {"prompt": "1+3=", "completion": "4"},
        {"messages": [{"role": "user", "content": "no reply"}]},  # nothing to train
        {"prompt": "p" * 40, "completion": "long"},  # the prompt alone fills --max-length
        {"prompt": "1+4=", "completion": "5" * 30},  # cut: its stop is lost
        *[{"messages": [{"role": "user", "content": f"{i}"}]} for i in range(4)],
    ]
    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["data", "audit", str(f), "--global-batch-size", "1", "--max-length", "20"]) == 1
    said = capsys.readouterr().out
    assert (
        f"no trainable tokens 5 (dropped: they would train on nothing; at {f}:2, {f}:5, {f}:6 and 2 more)"
        in said
    )
    assert f"dropped: too long, or left with nothing to train, as a prompt that fills it; at {f}:3)" in said
    assert f"1 of 2 examples lose their stop token's label (at {f}:4)" in said


def test_the_stop_token_warning_names_the_likely_cause() -> None:
    """A pair's answers are cut from the right whatever --truncation says; left truncation keeps an
    example's end, so the length is not offered as the cause then."""
    right, left = ExampleSettings(max_length=40), ExampleSettings(max_length=40, truncation="left")
    assert "after the reply" in stops_lost_warning(3, 4, True, "examples", right, cut_any=True)
    said = stops_lost_warning(64, 64, False, "pairs", left, cut_any=True)
    assert said.startswith("warning: 64 of 64 training pairs train no stop token (--max-length 40 cut")
    assert "--truncation" not in said and "--max-prompt-length" in said
    assert "--truncation left keeps" in stops_lost_warning(8, 8, False, "examples", right, cut_any=True)
    assert "token, so" in stops_lost_warning(8, 8, False, "examples", left, cut_any=True)
    # Nothing cut: the length is not blamed (a tokenizer's own EOS left untrained was blamed on it).
    assert "token, so" in stops_lost_warning(8, 8, False, "examples", right, cut_any=False)


def test_a_chat_template_for_data_without_conversations_is_what_training_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The audit said "clean" (exit 0) where `lmtune train` stops on the same settings."""
    f = tmp_path / "d.jsonl"
    f.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(4))
    )
    assert main(["data", "audit", str(f), "--global-batch-size", "1", "--chat-template", "chatml"]) == 2
    said = capsys.readouterr().out
    assert "--chat-template chatml applies to conversations (messages records), and the data holds" in said
    assert main(["data", "audit", str(f), "--global-batch-size", "1"]) == 0


def test_a_system_prompt_that_a_prompt_completion_record_never_renders_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Axolotl's alpaca_w_system records: their system prompt was dropped without a word."""
    f = tmp_path / "d.jsonl"
    rows = [
        {"instruction": "Say hi", "output": "hi", "system": "Be nice"},
        {"prompt": "a", "completion": "b"},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["data", "audit", str(f), "--global-batch-size", "1"]) == 1
    said = capsys.readouterr().out
    assert f"1 prompt/completion or instruction record with a 'system' field (at {f}:1), which" in said
    # Intel/orca_dpo_pairs' records (system, question, chosen, rejected): the same, said of pairs.
    pairs = [
        {"system": "Be brief." if i % 2 else "", "question": f"{i}+1=", "chosen": str(i + 1), "rejected": "0"}
        for i in range(4)
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in pairs))
    argv = ["data", "audit", str(f), "--field-map", "prompt=question", "--global-batch-size", "2"]
    assert main(argv) == 1
    said = capsys.readouterr().out
    assert (
        f"2 preference records with a 'system' field (at {f}:2, {f}:4), which that format does not "
        "render: they train without it (write them as a prompt of messages, a system turn then the user's)"
    ) in said


def test_a_system_column_beside_a_conversation_and_dollys_context_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ShareGPT or messages export with the system prompt in a column of its own, and Dolly's
    'context' once its response was mapped as lmtune's hint said (the hint named output=response
    alone), trained without them while the audit said "clean"."""
    f = tmp_path / "d.jsonl"
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Arr"}]
    rows = [
        {
            "system": "You are a pirate.",
            "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Arr"}],
        },
        {"system": "You are a pirate.", "messages": turns},
        {
            "system": "Be nice.",
            "messages": [{"role": "system", "content": "Be nice."}, *turns],
        },  # its own turn
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["data", "audit", str(f), "--global-batch-size", "1"]) == 1
    said = capsys.readouterr().out
    assert (
        f"2 conversation records with a 'system' field (at {f}:1, {f}:2), which that format does not render: "
        "they train without it (put it in the conversation as its first turn, of role system)"
    ) in said
    dolly = {"instruction": "Summarize", "context": "Long text here.", "response": "Short.", "category": "qa"}
    f.write_text(json.dumps(dolly) + "\n")
    assert main(["data", "audit", str(f), "--global-batch-size", "1"]) == 2
    assert "such as output=response,input=context)" in capsys.readouterr().out
    assert main(["data", "audit", str(f), "--global-batch-size", "1", "--field-map", "output=response"]) == 1
    assert f"1 record with a context (or an input) its format does not read (at {f}:1): it trains" in (
        capsys.readouterr().out
    )
    # Mapped as a prompt/completion record, the input is read by no format either (it was unsaid).
    mapped = ["data", "audit", str(f), "--global-batch-size", "1", "--field-map"]
    assert main([*mapped, "prompt=instruction,completion=response,input=context"]) == 1
    assert "with a context (or an input) its format does not read" in capsys.readouterr().out
    argv = [
        "data",
        "audit",
        str(f),
        "--global-batch-size",
        "1",
        "--field-map",
        "output=response,input=context",
    ]
    assert main(argv) == 0


def test_records_that_repeat_an_earlier_one_are_counted_and_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file given twice, or a record pasted over and over, trains each copy; the audit said
    nothing. By what trains, across files, with the first places of the repeats: copies that
    differ only in a field no format reads (an id) count, copies that train otherwise do not (a
    turn flagged not to train); the verdict is unchanged (repeating may be meant)."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"text": "one"}\n{"prompt": "p", "completion": "c"}\n{"text": "two"}\n{"text": "one"}\n')
    b.write_text('{"completion": "c", "prompt": "p"}\n{"text": "three"}\n{"text": "One"}\n')
    assert main(["data", "audit", f"{a},{b}", "--global-batch-size", "2"]) == 0  # clean all the same
    out = capsys.readouterr().out
    said = (
        f"repeated records    2 records repeat what an earlier one trains on ({a}:4 = {a}:1, {b}:1 = {a}:2;"
    )
    assert said in out
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    flagged = [chat[0], {**chat[1], "weight": 0}]
    rows = [
        {"id": 1, "messages": chat},
        {"id": 2, "messages": chat, "source": "web"},  # the same turns: a repeat
        {"id": 3, "messages": flagged},  # the reply does not train: not a repeat
        {"id": 4, "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
        {"id": 5, "question": "p", "answer": "c"},  # mapped: p/c as in a.jsonl, but this file's first
        {"id": 6.0, "question": "p", "answer": "c"},
    ]
    d = tmp_path / "d.jsonl"
    d.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(
        [
            "data",
            "audit",
            str(d),
            "--global-batch-size",
            "2",
            "--field-map",
            "prompt=question,completion=answer",
        ]
    )
    assert (
        f"3 records repeat what an earlier one trains on ({d}:2 = {d}:1, {d}:4 = {d}:1, {d}:6 = {d}:5;"
        in (capsys.readouterr().out)
    )
    listed = tmp_path / "one_line.json"  # records sharing a line are named by their number
    listed.write_text('[{"text": "same"}, {"text": "other"}, {"text": "same"}]')
    main(["data", "audit", str(listed), "--global-batch-size", "2"])
    assert f"({listed}:1 (record 3) = {listed}:1 (record 1);" in capsys.readouterr().out
    c = tmp_path / "c.jsonl"
    c.write_text('{"text": "one"}\n{"text": "two"}\n')
    main(["data", "audit", str(c), "--global-batch-size", "2"])
    assert "repeated records    0" in capsys.readouterr().out
    # Bad lines train nothing: the same bad line twice is no copy that trains twice.
    c.write_text('{"question": "1+1"}\n{"question": "1+1"}\n{"text": "one"}\n')
    main(["data", "audit", str(c), "--global-batch-size", "1", "--skip-bad-lines"])
    assert "repeated records    0" in capsys.readouterr().out


def test_an_empty_file_and_a_json_array_named_jsonl_are_said_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty file is said to be empty (as training says it), not "no example to train on"; a
    JSON array of records in a .jsonl file (one line, or pretty-printed) gets the way to read it."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["data", "audit", str(empty)]) == 2
    assert "unusable as it is (exit code 2): it holds no records (empty)" in capsys.readouterr().out
    one, pretty = tmp_path / "one.jsonl", tmp_path / "pretty.jsonl"
    one.write_text(json.dumps([{"text": "a"}, {"text": "b"}]) + "\n")
    pretty.write_text('[\n  {"text": "a"},\n  {"text": "b"}\n]\n')
    assert main(["data", "audit", str(one)]) == 2
    said = f"{one}:1: expected a JSON object, got a list (a JSON array of records? name the file .json)"
    assert said in capsys.readouterr().out
    assert main(["data", "audit", str(pretty)]) == 2
    out = capsys.readouterr().out
    assert f"{pretty}:1: not valid JSON" in out and out.count("name the file .json") == 1


def test_the_evaluation_data_is_audited_with_what_training_trains_of_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--config` with eval_data: the audit read the training data alone and said "clean" where
    training stopped on a bad evaluation line; --eval-data was refused; eval records that are
    training's too were said only when the two specs were the same."""
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"text": f"example {i}"}) + "\n" for i in range(4)))
    held.write_text(json.dumps({"text": "example 2"}) + "\n" + json.dumps({"text": "new"}) + "\n")
    argv = ["data", "audit", str(train), "--global-batch-size", "2", "--eval-data", str(held)]
    assert main(argv) == 1
    said = capsys.readouterr().out
    assert f"audit of --eval-data {held}" in said
    assert f"  also in --data      1 ({held}:1 = {train}:3)" in said
    assert "1 evaluation record also in --data: their loss says how well the model remembers" in said
    held.write_text(json.dumps({"text": "new"}) + "\n" + '"a string"\n')
    config = tmp_path / "run.yaml"
    config.write_text(f"data: {train}\neval_data: {held}\nglobal_batch_size: 2\n")
    assert main(["data", "audit", "--config", str(config)]) == 2  # as training stops on it
    assert f"{held}:2: expected a JSON object, got a string" in capsys.readouterr().out


def test_a_prompt_left_truncation_cut_away_is_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--truncation left kept the answer of an over-long example and none of its question: the
    audit said "clean". A prompt of which words are left is cut as asked, unsaid."""
    f = tmp_path / "d.jsonl"
    rows = [
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},  # keeps "nd 3"
        {"instruction": "Say hello.", "input": "", "output": "Hello!"},  # keeps "\n" alone
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["data", "audit", str(f), "--global-batch-size", "1", "--max-length", "8", "--truncation", "left"]
    assert main(argv) == 1
    assert (
        f"1 example whose prompt --truncation left cut away whole (at {f}:2): it trains an answer to no "
        "question"
    ) in capsys.readouterr().out
    assert main([*argv[:-4], "--max-length", "40"]) == 0
    # A text cut either way has no prompt to lose (its untrained BOS read as one cut away, exit 1).
    f.write_text(json.dumps({"text": "word " * 40}) + "\n")
    for mode in ("right", "left"):
        assert main([*argv[:-1], mode]) in (0, 1)
        assert "cut away whole" not in capsys.readouterr().out


def test_documents_cut_at_max_length_are_told_to_be_split_not_cut_otherwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """For text records the advice was --truncation left or drop: each loses the rest of a document
    as well."""
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "word " * 200}) + "\n" + json.dumps({"text": "short"}) + "\n")
    assert main(["data", "audit", str(f), "--max-length", "64", "--global-batch-size", "1"]) == 1
    said = capsys.readouterr().out
    assert "1 lost their end to --max-length 64 (raise it, or --truncation split trains each document" in said


def test_the_objective_a_config_gives_takes_the_datas_kind_as_training_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`data audit --config sft.yaml` said pairs were clean (exit 0) where `train --config sft.yaml`
    refused them; the objective is read where a config file or --objective gives it."""
    pairs, texts = tmp_path / "pairs.jsonl", tmp_path / "texts.jsonl"
    pairs.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "chosen": "a", "rejected": "b"}) + "\n" for i in range(4))
    )
    texts.write_text("".join(json.dumps({"text": f"t {i}"}) + "\n" for i in range(4)))
    config = tmp_path / "sft.yaml"
    config.write_text(f"data: {pairs}\nglobal_batch_size: 2\n")
    assert main(["data", "audit", "--config", str(config)]) == 2
    assert (
        "result              unusable as it is (exit code 2): --objective sft trains on single examples"
        in (capsys.readouterr().out)
    )
    assert main(["data", "audit", str(pairs), "--global-batch-size", "2"]) == 0  # no objective given
    assert main(["data", "audit", str(pairs), "--global-batch-size", "2", "--objective", "dpo"]) == 0
    assert main(["data", "audit", str(texts), "--global-batch-size", "2", "--objective", "dpo"]) == 2
    assert "--objective dpo tunes on preference pairs, and the data holds single examples" in (
        capsys.readouterr().out
    )
