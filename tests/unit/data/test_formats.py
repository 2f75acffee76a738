"""ShareGPT records and --field-map: a data set with other names trains exactly as lmtune's own
format would, with no conversion script."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lmtune.cli import main
from lmtune.config.groups import ExampleSettings
from lmtune.data.formats import FieldMap, render, unused_names
from lmtune.data.prepare import encode_in_memory
from lmtune.data.sources import Record
from lmtune.errors import UserError
from lmtune.model.modeling import byte_tokenizer

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6."},
]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}


def _sharegpt(turns: list[dict[str, str]]) -> dict[str, Any]:
    return {"conversations": [{"from": SHAREGPT_ROLE[t["role"]], "value": t["content"]} for t in turns]}


def _encoded(rows: list[dict[str, Any]], **settings: Any) -> tuple[list[Any], dict[str, int]]:
    recs = [Record("d.jsonl", i + 1, r) for i, r in enumerate(rows)]
    data, stats = encode_in_memory(recs, byte_tokenizer(), ExampleSettings(**settings))
    return [tuple(np.asarray(x).tolist() for x in data[i][:2]) for i in range(len(data))], stats.formats


def test_sharegpt_trains_exactly_as_the_same_messages() -> None:
    ours, ours_formats = _encoded([{"messages": CHAT}])
    theirs, formats = _encoded([_sharegpt(CHAT)])
    assert theirs == ours  # the same token ids and the same trained positions
    assert formats == {"sharegpt": 1} and ours_formats == {"messages": 1}
    forced, _ = _encoded([_sharegpt(CHAT)], format="sharegpt")
    assert forced == ours


def test_trls_conversational_prompt_completion_trains_its_completion() -> None:
    """TRL's conversational prompt-completion records ("prompt" and "completion" lists of messages)
    were refused ("a non-string (list) 'prompt' field"). They train as the conversation they make,
    the completion's turns alone: the same tokens as its messages with the prompt's assistant turn
    kept out of training."""
    record = {"prompt": CHAT[:4], "completion": CHAT[4:]}
    ids, trained = _encoded([record])[0][0]
    whole_ids, whole_trained = _encoded([{"messages": CHAT}])[0][0]
    assert ids == whole_ids and sum(trained) < sum(whole_trained)
    only_last = [{**t, "weight": 0} if i == 2 else t for i, t in enumerate(CHAT)]
    assert _encoded([record]) == _encoded([{"messages": only_last}])
    assert _encoded([record], train_on_prompt=True) == _encoded([{"messages": CHAT}], train_on_prompt=True)


def test_content_as_text_parts_trains_as_the_same_strings() -> None:
    """Multimodal-style and TRL conversational data write a message's content as a list of parts."""
    parts = [
        {
            **t,
            "content": [
                {"type": "text", "text": t["content"][:2]},
                {"type": "text", "text": t["content"][2:]},
            ],
        }
        for t in CHAT
    ]
    assert _encoded([{"messages": parts}]) == _encoded([{"messages": CHAT}])
    image = [
        CHAT[0],
        {"role": "user", "content": [{"type": "image", "url": "x.png"}, {"type": "text", "text": "?"}]},
    ]
    for content, kind in ((image, "type 'image'"), ([CHAT[0], {"role": "user", "content": 3}], None)):
        with pytest.raises(UserError, match=r"d\.jsonl:1: message 2 ") as e:
            render(
                Record("d.jsonl", 1, {"messages": content}),
                "auto",
                FieldMap.of(ExampleSettings()),
                byte_tokenizer(),
            )
        assert (kind or "a string or a list of text parts") in str(e.value)


def _render_messages(turns: list[dict[str, str]]) -> None:
    names = FieldMap.of(ExampleSettings())
    render(Record("d.jsonl", 1, {"messages": turns}), "auto", names, byte_tokenizer())


def test_sharegpt_unknown_role_names_file_line_and_the_way_out() -> None:
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "x"}]}
    with pytest.raises(
        UserError,
        match=r"d\.jsonl:1: message 2 has unknown role 'function_call'.*"
        r"--field-map ROLE=VALUE, such as ROLE=function_call\)",  # no guess: it could be either side
    ):
        render(Record("d.jsonl", 1, row), "auto", FieldMap.of(ExampleSettings()), byte_tokenizer())
    # A role lmtune knows by another case or another tool's name is mapped to that role (the advice
    # was assistant=User: the user's turns would have trained as the assistant's).
    for theirs, advice in [
        ("User", "user=User"),
        ("Assistant", "assistant=Assistant"),
        ("bot", "assistant=bot"),
    ]:
        turns = [{"role": theirs, "content": "hi"}, {"role": "assistant", "content": "x"}]
        with pytest.raises(UserError, match=rf"such as {advice}\)"):
            _render_messages(turns)
    # Every unknown role of the record at once (one per run took three runs for System/Human/Bot).
    turns = [{"role": r, "content": "x"} for r in ("System", "Human", "Bot", "Human", "narrator")]
    with pytest.raises(UserError, match=r"such as system=System,user=Human,assistant=Bot,ROLE=narrator\)"):
        _render_messages(turns)
    mapped, _ = _encoded([row], field_map="tool=function_call")
    assert len(mapped) == 0  # readable now; a conversation whose only reply is a tool turn trains nothing


@pytest.mark.parametrize(
    ("theirs", "field_map", "ours"),
    [
        (
            {"dialog": [{"speaker": "user", "text": "hi"}, {"speaker": "bot", "text": "hello"}]},
            "messages=dialog,role=speaker,content=text,assistant=bot",
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        ),
        (
            {"question": "2+2=", "answer": "4"},
            "prompt=question,completion=answer",
            {"prompt": "2+2=", "completion": "4"},
        ),
        ({"body": "plain text", "id": 3}, "text=body", {"text": "plain text"}),
        # The mapped field wins over a field of the data set that happens to carry lmtune's name.
        ({"text": "not me", "prompt": "Q", "completion": "A"}, "text=prompt", {"text": "Q"}),
    ],
)
def test_field_map_trains_as_lmtunes_own_names(
    theirs: dict[str, Any], field_map: str, ours: dict[str, Any]
) -> None:
    assert _encoded([theirs], field_map=field_map) == _encoded([ours])


def test_text_field_is_the_field_map_of_text() -> None:
    assert _encoded([{"body": "x y"}], text_field="body") == _encoded(
        [{"body": "x y"}], field_map="text=body"
    )
    with pytest.raises(UserError, match="--field-map text=other and --text-field body differ"):
        FieldMap.of(ExampleSettings(text_field="body", field_map="text=other"))


@pytest.mark.parametrize(
    ("field_map", "message"),
    [
        ("prompt", "expected OURS=THEIRS pairs, got 'prompt'"),
        ("answer=completion", "'answer' is none of lmtune's fields"),
        ("prompt=", "expected OURS=THEIRS"),
        (
            "conversations=dialog",
            "lmtune's names go on the left; 'conversations' is ShareGPT's name for "
            "lmtune's 'messages': give messages=dialog",
        ),
        (
            "value=said",
            "lmtune's names go on the left; 'value' is ShareGPT's name for lmtune's 'content': "
            "give content=said",
        ),
    ],
)
def test_bad_field_maps_name_the_option(field_map: str, message: str) -> None:
    with pytest.raises(UserError, match=f"--field-map: {message}"):
        FieldMap.of(ExampleSettings(field_map=field_map))


def test_a_missing_mapped_field_names_both_names() -> None:
    with pytest.raises(UserError, match=r"no 'answer' field \(--field-map completion=answer\)"):
        render(
            Record("d.jsonl", 4, {"prompt": "q", "other": 1}),
            "prompt_completion",
            FieldMap.of(ExampleSettings(field_map="completion=answer")),
            byte_tokenizer(),
        )


@pytest.mark.parametrize(
    ("row", "suggestion"),
    [
        ({"question": "q", "answer": "a"}, "such as prompt=question,completion=answer"),
        ({"instruction": "i", "context": "c", "response": "r"}, "such as output=response"),
        ({"foo": "q", "bar": "a"}, None),
        ({"prompt": "q", "response": "a"}, "such as completion=response)"),
        ({"promt": "q", "completion": "a"}, "such as prompt=promt)"),
        ({"Prompt": "q", "Completion": "a"}, "such as prompt=Prompt,completion=Completion)"),
        ({"txt": "hello"}, "such as text=txt)"),
        ({"dialog": [{"role": "user", "content": "a"}]}, "such as messages=dialog)"),
        ({"data": [{"prompt": "a"}], "more": [{"completion": "b"}]}, None),  # records under keys, not turns
    ],
)
def test_unknown_fields_get_a_field_map_suggestion(row: dict[str, Any], suggestion: str | None) -> None:
    with pytest.raises(UserError, match="cannot tell the format") as refused:
        render(Record("d.jsonl", 1, row), "auto", FieldMap.of(ExampleSettings()), byte_tokenizer())
    assert (suggestion in str(refused.value)) if suggestion else ("such as" not in str(refused.value))


def test_a_runs_metrics_read_as_data_are_named_so(tmp_path: Path) -> None:
    """A glob over a folder that held a run (``DIR/*.jsonl``) read its metrics.jsonl: "cannot tell
    the format (fields found: 'kind', 'step', ...)"."""
    row = {"kind": "train", "step": 1, "loss": 2.5}
    metrics = tmp_path / "metrics.jsonl"
    with pytest.raises(UserError, match="cannot tell the format"):  # no run.json beside it: data
        render(Record(str(metrics), 1, row), "auto", FieldMap.of(ExampleSettings()), byte_tokenizer())
    (tmp_path / "run.json").write_text("{}")
    said = r"metrics.jsonl:1: the metrics an lmtune run wrote .* leave it out of the data given"
    with pytest.raises(UserError, match=said):
        render(Record(str(metrics), 1, row), "auto", FieldMap.of(ExampleSettings()), byte_tokenizer())


@pytest.mark.parametrize(
    ("row", "fmt", "message"),
    [
        ({"question": "q"}, "auto", r"cannot tell the format \(fields found: 'question';"),
        (
            {"question": "q", "answer": 5},
            "auto",
            r"a non-string \(int\) 'answer' field \(--field-map completion=answer\) "
            r"\(fields found: 'question', 'answer'\)",
        ),
    ],
)
def test_errors_name_fields_as_the_data_set_does(row: dict[str, Any], fmt: str, message: str) -> None:
    """A user who mapped question -> prompt reads their own field names in the message, not ours."""
    names = FieldMap.of(ExampleSettings(field_map="prompt=question,completion=answer"))
    with pytest.raises(UserError, match=message):
        render(Record("d.jsonl", 2, row), fmt, names, byte_tokenizer())


def test_audit_reads_with_the_field_map(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "qa.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(5))
    )
    assert main(["data", "audit", str(data)]) == 2  # unreadable as it is
    capsys.readouterr()
    fields = ["--field-map", "prompt=question,completion=answer"]
    assert main(["data", "audit", str(data), *fields, "--global-batch-size", "1"]) == 0
    assert "prompt_completion 5" in capsys.readouterr().out


def test_training_on_sharegpt_records(tmp_path: Path) -> None:
    """The CLI trains on ShareGPT records as chat: the end of turn trains and saved models stop there."""
    rows = [_sharegpt(CHAT[:3]) for _ in range(8)]
    data = tmp_path / "sharegpt.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    argv = ["train", "--data", str(data), "--output-dir", str(out), "--max-steps", "2"]
    assert main([*argv, "--global-batch-size", "4", "--no-progress"]) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["data"]["train"]["formats"] == {"sharegpt": 8}
    assert run["data"]["train"]["eos_trained"] == 8
    assert (out / "final" / "config.json").is_file()


@pytest.mark.parametrize(
    ("settings", "formats", "unused"),
    [
        ({"text_field": "body"}, {"text"}, []),
        ({"text_field": "body"}, {"prompt_completion"}, ["--text-field body"]),
        ({"field_map": "prompt=question,completion=answer"}, {"prompt_completion", "text"}, []),
        (
            {"field_map": "prompt=question,completion=answer"},
            {"text"},
            ["--field-map prompt=question", "--field-map completion=answer"],
        ),
        ({"field_map": "prompt=q"}, {"preference"}, []),  # a pair's prompt
        ({"field_map": "messages=dialog,assistant=bot"}, {"messages"}, []),
        ({"field_map": "assistant=gpt"}, {"sharegpt"}, []),
        (
            {"field_map": "messages=dialog,assistant=bot"},
            {"text"},
            ["--field-map messages=dialog", "--field-map assistant=bot"],
        ),
        ({"field_map": "text=body"}, {"messages"}, ["--field-map text=body"]),
    ],
)
def test_names_no_record_was_read_through_are_found(
    settings: dict[str, str], formats: set[str], unused: list[str]
) -> None:
    assert unused_names(ExampleSettings(**settings), formats) == unused


def test_train_warns_of_data_settings_that_changed_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i}"}) + "\n" for i in range(8)))
    args = ["train", "--data", str(data), "--max-steps", "1", "--global-batch-size", "8", "--no-progress"]
    args += ["--text-field", "body", "--txt-mode", "block", "--output-dir", str(tmp_path / "out")]
    assert main([*args, "--eval-data", str(data)]) == 0
    out = capsys.readouterr().out
    assert (
        "warning: --text-field body changed nothing: no record of the data was read through it (formats "
        "found: prompt_completion)" in out
    )
    assert "warning: --txt-mode block changed nothing: the data has no .txt file" in out
    assert "warning: --eval-data is the training data: its loss says how well the model fits" in out


def test_train_warns_when_a_mapped_name_is_absent_and_lmtunes_own_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--field-map prompt=question` on records with `prompt`: they still have a format (read as
    they are), so only their fields tell that the mapping matched nothing (a misspelled name?)."""
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i}"}) + "\n" for i in range(8)))
    args = ["train", "--data", str(data), "--max-steps", "1", "--global-batch-size", "8", "--no-progress"]
    args += ["--field-map", "prompt=question,completion=completion", "--output-dir", str(tmp_path / "out")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"warning: --field-map prompt=question: the first record of {data} has no 'question' field" in out
    assert "completion=completion" not in out  # a name mapped to itself is no mistake
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"t{i}"}) + "\n" for i in range(8)))
    for given in (["--field-map", "text=body"], ["--text-field", "body"]):  # named as it was given
        args = ["train", "--data", str(texts), "--max-steps", "1", "--global-batch-size", "8", *given]
        assert main([*args, "--no-progress", "--output-dir", str(tmp_path / given[0])]) == 0
        said = f"warning: {' '.join(given)}: the first record of {texts} has no 'body' field"
        assert said in capsys.readouterr().out


def test_tool_calls_are_refused_not_trained_as_an_empty_reply() -> None:
    """OpenAI-style tool calls: the template saw only the turn's text, so the call turn trained
    as an empty reply (content "") or was called malformed (content null)."""
    call = [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]
    for content in ("", None):
        turns = [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": content}]
        turns[1]["tool_calls"] = call
        with pytest.raises(UserError, match=r"d.jsonl:1: message 2 holds tool_calls; .* empty reply"):
            _render_messages(turns)
    turns[1]["content"] = "Let me look."  # text beside the call: the call alone is lost
    with pytest.raises(UserError, match=r"would train as its text alone, without the call\)"):
        _render_messages(turns)


def test_turns_of_role_and_content_under_conversations_get_the_field_map() -> None:
    row = {"conversations": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    with pytest.raises(UserError, match="read with --field-map messages=conversations"):
        render(Record("d.jsonl", 1, row), "auto", FieldMap.of(ExampleSettings()), byte_tokenizer())


@pytest.mark.parametrize("template", [None, "chatml", "llama3"])
def test_a_conversation_opened_by_the_assistant_trains_its_reply_not_its_header(template: str | None) -> None:
    """The role header (and Llama 3's BOS) of an assistant turn that opens the conversation trained;
    after another turn it does not. The reply and its end of turn train as after a user turn."""
    from lmtune.data.chat import use_chat_template
    from lmtune.data.formats import ensure_chat_template

    tokenizer = byte_tokenizer()
    if template is not None:
        use_chat_template(tokenizer, template)
    ensure_chat_template(tokenizer)  # the built-in one, without a choice
    names, reply = FieldMap.of(ExampleSettings()), "Hello there"
    opened = render(
        Record("d.jsonl", 1, {"messages": [{"role": "assistant", "content": reply}]}),
        "auto",
        names,
        tokenizer,
    )
    asked = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": reply}]
    after = render(Record("d.jsonl", 1, {"messages": asked}), "auto", names, tokenizer)
    (start, end), (start2, end2) = opened.spans[0], after.spans[-1]
    assert opened.text[start:end] == after.text[start2:end2]
    assert opened.text[start:end].startswith(reply)


def test_a_turns_own_weight_or_training_flag_keeps_it_from_training() -> None:
    """Axolotl's ShareGPT turns carry weight 0 | 1 (and its chat data training: false | true): a
    reply marked 0 trained as any other; a flag asking to train a user turn, or another value,
    is refused rather than ignored."""
    from lmtune.data.formats import ensure_chat_template

    names, tokenizer = FieldMap.of(ExampleSettings()), byte_tokenizer()
    ensure_chat_template(tokenizer)
    turns = [
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "BAD ANSWER", "weight": 0},
        {"from": "human", "value": "again", "weight": 0},
        {"from": "gpt", "value": "good", "weight": 1},
    ]
    rendered = render(Record("d.jsonl", 1, {"conversations": turns}), "auto", names, tokenizer)
    assert [rendered.text[a:b] for a, b in rendered.spans] == ["good<|eos|>"]
    flagged = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "training": False}]
    assert render(Record("d.jsonl", 1, {"messages": flagged}), "auto", names, tokenizer).spans == ()
    for turn, message in (
        (
            {"role": "user", "content": "x", "training": True},
            r"message 1 \(user\) asks to train \(training true\)",
        ),
        (
            {"role": "assistant", "content": "x", "weight": 0.5},
            "message 1 has weight 0.5; a turn's weight is 0 or 1",
        ),
        ({"role": "assistant", "content": "x", "training": 1}, "message 1 has training 1; .* true or false"),
    ):
        with pytest.raises(UserError, match=message):
            render(Record("d.jsonl", 1, {"messages": [turn]}), "auto", names, tokenizer)
    # --train-on-prompt trains every turn but those a flag keeps out (it trained them all), and a
    # user turn may ask to train there.
    every = render(
        Record("d.jsonl", 1, {"conversations": turns}), "auto", names, tokenizer, train_on_prompt=True
    )
    kept = "".join(every.text[a:b] for a, b in every.spans)
    assert "BAD ANSWER" not in kept and "again" not in kept and "hi" in kept and kept.endswith("good<|eos|>")
    asked = [{"role": "user", "content": "x", "weight": 1}, {"role": "assistant", "content": "y"}]
    whole = render(Record("d.jsonl", 1, {"messages": asked}), "auto", names, tokenizer, train_on_prompt=True)
    assert whole.spans == ((0, len(whole.text)),)


def test_a_forced_chat_format_names_the_missing_field_and_a_template_typo_is_suggested() -> None:
    from lmtune.data.chat import read_template

    names = FieldMap.of(ExampleSettings(format="messages"))
    with pytest.raises(
        UserError, match=r"d.jsonl:1: record has no 'messages' field \(fields found: 'prompt'"
    ):
        render(Record("d.jsonl", 1, {"prompt": "a", "completion": "b"}), "messages", names, byte_tokenizer())
    with pytest.raises(UserError, match=r"--chat-template chatmll: must be one of .*; did you mean chatml\?"):
        read_template("chatmll")


def test_a_text_part_without_text_and_a_null_content_are_said_as_they_are() -> None:
    """{"type": "text", "content": ...} was "a content part that is not text (type 'text')", and a
    null content "must be an object with a 'role' and a 'content'", which the message has."""
    names = FieldMap.of(ExampleSettings())
    for turn, said in (
        (
            {"role": "user", "content": [{"type": "text", "content": "hi"}]},
            "a text part without a 'text' string",
        ),
        (
            {"role": "user", "content": None},
            "message 1 has a null 'content'; lmtune trains on each turn's text",
        ),
    ):
        with pytest.raises(UserError, match=said):
            render(Record("d.jsonl", 1, {"messages": [turn, CHAT[2]]}), "auto", names, byte_tokenizer())


def test_a_forced_format_a_misspelt_field_map_and_a_comma_in_a_name_say_what_was_meant(
    tmp_path: Path,
) -> None:
    """--data-format text on Alpaca records said to skip every line; --field-map promt=... listed
    lmtune's fields without the one meant; a,b.jsonl given as it is was "no such file: a" with another
    file's near name."""
    alpaca = Record("d.jsonl", 1, {"instruction": "Say hi.", "input": "", "output": "hi"})
    with pytest.raises(
        UserError, match=r"; it is a prompt_completion record, which --data-format auto reads as one$"
    ):
        render(alpaca, "text", FieldMap.of(ExampleSettings()), byte_tokenizer())
    with pytest.raises(UserError, match=r"; did you mean prompt=question\?$"):
        FieldMap.of(ExampleSettings(field_map="promt=question"))
    from lmtune.data.sources import resolve_sources

    (tmp_path / "a,b.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "a.parquet").write_text("")
    with pytest.raises(
        UserError, match=r"no such file or folder: .*a \(did you mean .*a\\,b\.jsonl\? A comma"
    ):
        resolve_sources(f"{tmp_path / 'a'},b.jsonl")
    assert len(resolve_sources(str(tmp_path / "a\\,b.jsonl"))) == 1  # as the hint writes it


def test_a_completion_labelled_false_does_not_train_as_one_to_give() -> None:
    """TRL's KTO records (prompt, completion, label): label false trained as a target, the audit
    "clean"."""
    names = FieldMap.of(ExampleSettings())
    kept = render(
        Record("d.jsonl", 1, {"prompt": "2+2=", "completion": "4", "label": True}), "auto", names, None
    )
    assert kept.text == "2+2=4"
    with pytest.raises(UserError, match=r"d\.jsonl:2: a completion labelled false .*lmtune has no KTO"):
        render(
            Record("d.jsonl", 2, {"prompt": "2+2=", "completion": "5", "label": False}), "auto", names, None
        )


def test_kto_labels_in_other_spellings_are_refused() -> None:
    """label 0 and "false" trained as targets (only JSON false was caught)."""
    names = FieldMap.of(ExampleSettings())
    for label in (0, "false", "False"):
        with pytest.raises(UserError, match="a completion labelled false"):
            render(
                Record("d.jsonl", 1, {"prompt": "a", "completion": "b", "label": label}), "auto", names, None
            )


# The features of real templates that render a turn otherwise once later turns follow it.
QWEN3 = (  # the empty thinking block only on replies after the last user turn, the last one's always
    "{%- set ns = namespace(last=messages|length - 1) %}"
    "{%- for m in messages[::-1] %}{%- if m.role == 'user' and ns.last == messages|length - 1 %}"
    "{%- set ns.last = messages|length - 1 - loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role != 'assistant' %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{%- set c = m.content %}{%- if '</think>' in c %}{%- set c = c.split('</think>')[-1] %}"
    "{%- endif %}{%- if loop.index0 > ns.last and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + c.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + c }}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
PHI3 = (  # EOS closes the text where no generation prompt follows
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
)
MISTRAL = (  # the system prompt folded into the last user turn
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set rest = messages[1:] %}{%- else %}{%- set rest = messages %}{%- endif %}{{- bos_token }}"
    "{%- for m in rest %}{%- if m['role'] == 'user' %}{%- if loop.last and system is defined %}"
    "{{- '[INST] ' + system + '\\n\\n' + m['content'] + '[/INST]' }}{%- else %}"
    "{{- '[INST] ' + m['content'] + '[/INST]' }}{%- endif %}"
    "{%- else %}{{- ' ' + m['content'] + eos_token }}{%- endif %}{%- endfor %}"
)


@pytest.mark.parametrize(
    ("template", "replies"),
    [
        (QWEN3, ["4.<|im_end|>\n", "<think>\n\n</think>\n\n6.<|im_end|>\n"]),
        (PHI3, ["4.<|end|>\n", "6.<|end|>\n<|eos|>"]),
        (MISTRAL, [" 4.<|eos|>", " 6.<|eos|>"]),
    ],
)
def test_replies_of_a_template_that_renders_a_turn_otherwise_later_are_found_as_written(
    template: str, replies: list[str]
) -> None:
    """Qwen3's, Phi-3's and Mistral's own templates made every conversation of more than one
    exchange (Mistral's: with a system prompt) a bad line that stopped training: "the chat template
    does not render the conversation turn by turn". Each reply trains what it would as the last
    turn of a conversation found turn by turn: the same text, up to its end of turn."""
    from lmtune.data.chat import use_chat_template

    tokenizer = byte_tokenizer()
    use_chat_template(tokenizer, "chatml")  # its markers special tokens
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end|>", "<|user|>", "<|assistant|>"]})
    tokenizer.chat_template = template
    names = FieldMap.of(ExampleSettings())
    whole = render(Record("d.jsonl", 1, {"messages": CHAT}), "auto", names, tokenizer)
    assert [whole.text[a:b] for a, b in whole.spans] == replies
    for i in (2, 4):  # each exchange alone, found turn by turn, trains the same reply
        alone = render(Record("d.jsonl", 1, {"messages": CHAT[i - 1 : i + 1]}), "auto", names, tokenizer)
        assert [alone.text[a:b] for a, b in alone.spans] == [replies[-1].replace("6.", CHAT[i]["content"])]
    _, stats = encode_in_memory([Record("d.jsonl", 1, {"messages": CHAT})], tokenizer, ExampleSettings())
    assert stats.examples == 1 and stats.eos_trained == 1
    # An empty reply (or user turn) trains its end of turn, as turn by turn: it was a bad line.
    empty = [*CHAT[:2], {"role": "assistant", "content": ""}, {"role": "user", "content": ""}, *CHAT[4:]]
    blank = render(Record("d.jsonl", 1, {"messages": empty}), "auto", names, tokenizer)
    assert [blank.text[a:b] for a, b in blank.spans] == [replies[0].replace("4.", ""), replies[1]]
    # A user turn's words inside the system prompt before it are not that turn.
    inside = [{"role": "system", "content": "Answer What is 2+2? and more."}, *CHAT[1:]]
    passed = render(Record("d.jsonl", 1, {"messages": inside}), "auto", names, tokenizer)
    assert [passed.text[a:b] for a, b in passed.spans] == replies
    # A reply that is a word of the template's own (its role's name) is the reply's, not the header's.
    named = [*CHAT[:2], {"role": "assistant", "content": "INST"}, *CHAT[3:]]
    worded = render(Record("d.jsonl", 1, {"messages": named}), "auto", names, tokenizer)
    assert next(worded.text[a:b] for a, b in worded.spans) == replies[0].replace("4.", "INST")
    # A reply the template rewrites (Qwen3 drops an earlier turn's thinking) cannot be found: said.
    thought = [*CHAT[:2], {"role": "assistant", "content": "<think>add</think>4."}, *CHAT[3:]]
    if template is QWEN3:
        with pytest.raises(UserError, match=r"d.jsonl:1: the chat template does not render .*gemma\|FILE"):
            render(Record("d.jsonl", 1, {"messages": thought}), "auto", names, tokenizer)


def _templated(template: str) -> Any:
    from lmtune.data.chat import use_chat_template

    tokenizer = byte_tokenizer()
    use_chat_template(tokenizer, "chatml")  # its markers special tokens
    markers = ["<|end|>", "<|user|>", "<|assistant|>", "<|return|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": markers})
    tokenizer.chat_template = template
    return tokenizer


def _trained(tokenizer: Any, messages: list[dict[str, Any]], every_turn: bool = False) -> list[str]:
    names = FieldMap.of(ExampleSettings())
    r = render(
        Record("d.jsonl", 1, {"messages": messages}), "auto", names, tokenizer, train_on_prompt=every_turn
    )
    return [r.text[a:b] for a, b in r.spans]


@pytest.mark.parametrize(
    ("template", "header"),
    [(QWEN3, "<|im_start|>assistant\n"), (PHI3, "<|assistant|>\n"), (MISTRAL, "[/INST]")],
)
def test_a_reply_found_in_the_whole_rendering_is_found_after_its_own_header(
    template: str, header: str
) -> None:
    """Phi-3's generation prompt takes the place of its closing EOS, so none was found: an empty
    reply trained the user turn's end marker before it (and, last, the reply's header too), a
    blank one nothing of its own; a reply ending in a tab or \\r\\n was a bad line."""
    tokenizer = _templated(template)
    names = FieldMap.of(ExampleSettings())
    for reply in ("", "  ", "4.\t", "4.\r\n"):
        for last in (False, True):
            turns = [*CHAT[:2], {"role": "assistant", "content": reply}]
            turns += [] if last else CHAT[3:]
            r = render(Record("d.jsonl", 1, {"messages": turns}), "auto", names, tokenizer)
            start, end = r.spans[0]
            assert r.text[:start].endswith(header) or r.text[: start + 1].endswith(header + " "), (
                reply,
                last,
            )
            assert reply.strip() in r.text[start:end], (reply, last)


def test_templates_that_end_or_open_replies_otherwise_later_are_found() -> None:
    """gpt-oss ends the last reply with <|return|> and earlier ones with <|end|>; Qwen3-Thinking's
    generation prompt opens the thinking block, which earlier replies do not show; Qwen3 rewrites a
    last reply's thinking block. Each conversation of more than one exchange was a bad line."""
    ending = (
        "{% for m in messages %}{{ '<|' + m.role + '|>' + m.content }}{% if m.role == 'assistant' %}"
        "{{ '<|return|>' if loop.last else '<|end|>' }}{% else %}{{ '<|end|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    assert _trained(_templated(ending), CHAT) == ["4.<|end|>", "6.<|return|>"]
    thinking = QWEN3.replace(
        "{{- '<|im_start|>assistant\\n' }}{%- endif %}\"",
        "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}\"",
    )
    thinking = thinking[: thinking.rindex("'<|im_start|>assistant\\n'")] + (
        "'<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
    )
    assert _trained(_templated(thinking), CHAT) == ["4.<|im_end|>\n", "\n</think>\n\n6.<|im_end|>\n"]
    rewritten = [*CHAT[:4], {"role": "assistant", "content": "<think>add</think>6."}]
    assert _trained(_templated(QWEN3), rewritten) == [
        "4.<|im_end|>\n",
        "<think>\n\n</think>\n\n6.<|im_end|>\n",
    ]


def test_the_next_turns_header_is_not_a_replys_end_nor_a_newline_its_header() -> None:
    """A template that closes replies with nothing of its own trained the next user turn's header
    (``<|user|>``) as an earlier reply's end; a generation prompt opening with a newline
    ("\nAssistant: ") trained every reply's header, its first line being the newline alone."""
    closed_by_nothing = (
        "{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"
    )
    with pytest.raises(UserError, match="the assistant replies cannot be located"):
        _trained(_templated(closed_by_nothing), CHAT)
    newline_first = (
        "{% for m in messages %}{% if m.role == 'user' %}{{ 'User: ' + m.content + '\\n' }}"
        "{% elif m.role == 'assistant' %}{{ '\\nAssistant: ' + m.content + '<|end|>\\n' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '\\nAssistant: ' }}{% else %}{{ eos_token }}{% endif %}"
    )
    assert _trained(_templated(newline_first), CHAT) == ["4.<|end|>\n", "6.<|end|>\n<|eos|>"]


def test_train_on_prompt_keeps_a_weighted_out_reply_of_such_a_template_out() -> None:
    """--train-on-prompt with a reply of weight 0 was refused ("a turn's text is not found") where
    the replies are found in the whole rendering."""
    turns = [*CHAT[1:2], {"role": "assistant", "content": "5.", "weight": 0}, *CHAT[3:]]
    trained = "".join(_trained(_templated(QWEN3), turns, every_turn=True))
    assert "5." not in trained and "What is 2+2?" in trained and trained.endswith("6.<|im_end|>\n")


def test_a_system_prompt_the_template_leaves_out_is_counted_and_said() -> None:
    """Mistral v0.3's writes a system prompt only into a conversation that ends with a user turn:
    every training conversation trained without it, unsaid; and a first user turn that begins with
    the system prompt's words was a bad line."""
    from lmtune.data.pairs import unread_said

    tokenizer = _templated(MISTRAL)
    echoed = [CHAT[0], {"role": "user", "content": "Be brief. What is 2+2?"}, *CHAT[2:]]
    assert _trained(tokenizer, echoed) == [" 4.<|eos|>", " 6.<|eos|>"]
    records = [Record("d.jsonl", n, {"messages": m}) for n, m in ((1, CHAT), (2, CHAT[1:]), (3, echoed))]
    _, stats = encode_in_memory(records, tokenizer, ExampleSettings())
    assert stats.system_left_out == 2 and stats.where["system_left_out"] == ["d.jsonl:1", "d.jsonl:3"]
    assert unread_said(dataclasses.asdict(stats)).startswith(
        "2 conversations whose system turn the chat template does not write (at d.jsonl:1, d.jsonl:3): "
        "they train without it"
    )
    _, kept = encode_in_memory(records, _templated(QWEN3), ExampleSettings())
    assert kept.system_left_out == 0


def test_a_turns_reasoning_in_a_field_of_its_own_is_counted_and_said() -> None:
    """Qwen3's and DeepSeek's reasoning_content (gpt-oss's thinking) beside a reply's content was
    dropped silently: the reply trained an empty thinking block, the audit said "clean"."""
    from lmtune.data.pairs import unread_said

    reasoned = [*CHAT[:4], {"role": "assistant", "content": "6.", "reasoning_content": "3 and 3 make 6"}]
    # An earlier reply's reasoning is one the templates that render reasoning drop too: not counted
    # (its advice, to write it into the content, made Qwen3's conversation a bad line).
    earlier = [*CHAT[:2], {"role": "assistant", "content": "4.", "reasoning_content": "2 and 2"}, *CHAT[3:]]
    records = [Record("d.jsonl", n, {"messages": m}) for n, m in ((1, CHAT), (2, reasoned), (3, earlier))]
    _, stats = encode_in_memory(records, _templated(QWEN3), ExampleSettings())
    assert stats.unread_reasoning == 1 and stats.where["unread_reasoning"] == ["d.jsonl:2"]
    assert unread_said(dataclasses.asdict(stats)).startswith(
        "1 conversation whose last reply has its reasoning in a field of its own (reasoning_content, "
        "thinking) that lmtune does not render (at d.jsonl:2): it trains without it"
    )
