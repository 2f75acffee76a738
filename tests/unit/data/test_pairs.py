"""Preference pairs: detection, rendering (strings and messages), the shared prompt, what trains,
truncation, bad records, collation, and the data audit."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lmtune.config.groups import ExampleSettings
from lmtune.data.audit import audit, format_report
from lmtune.data.dataset import PairExample
from lmtune.data.pair_collate import PairCollator, PairStepCollator, sequences
from lmtune.data.prepare import encode_in_memory
from lmtune.data.sources import BadLines, Record
from lmtune.data.tokenize import IGNORE_INDEX
from lmtune.errors import UserError
from lmtune.model.modeling import byte_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def encode(rows: list[dict[str, Any]], tok: Any = None, **kw: Any) -> tuple[Any, Any, Any]:
    tok = tok or byte_tokenizer()
    recs = [Record("pairs.jsonl", i + 1, r) for i, r in enumerate(rows)]
    data, stats = encode_in_memory(recs, tok, ExampleSettings(**kw))
    return data, stats, tok


def parts(pair: PairExample, tok: Any) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) as text, special tokens shown."""
    p, c = pair.parts
    ids = [int(t) for t in pair.input_ids]
    return tuple(tok.decode(x) for x in (ids[:p], ids[p : p + c], ids[p + c :]))  # type: ignore[return-value]


def trained(seq: Any, tok: Any) -> str:
    ids, labels, _ = seq
    return str(tok.decode([int(t) for t in ids[1:][labels[1:] != IGNORE_INDEX]]))


def test_string_pairs_share_the_prompt_and_train_only_the_answers_with_eos() -> None:
    data, stats, tok = encode([{"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5, I think"}])
    assert stats.formats == {"preference": 1} and stats.eos_trained == 1
    pair = data[0]
    assert isinstance(pair, PairExample)
    assert parts(pair, tok) == ("<|bos|>2 + 2 =", " 4<|eos|>", " 5, I think<|eos|>")
    chosen, rejected = sequences(pair)
    assert trained(chosen, tok) == " 4<|eos|>" and trained(rejected, tok) == " 5, I think<|eos|>"
    assert stats.target_tokens == 3 + 12
    assert stats.tokens == 8 + 3 + 12 == data.lengths()[0]  # the prompt runs once for both answers


def test_a_conversational_pair_renders_with_the_template_and_trains_only_the_answer() -> None:
    tok = byte_tokenizer()
    tok.chat_template = CHATML
    row = {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    data, stats, _ = encode([row], tok)
    assert stats.formats == {"preference_messages": 1}
    prompt, chosen, rejected = parts(data[0], tok)
    system, user = "<|im_start|>system\nBe brief.<|im_end|>\n", "<|im_start|>user\n2 + 2?<|im_end|>\n"
    assert prompt == system + user + "<|im_start|>assistant\n"
    assert (chosen, rejected) == ("4<|im_end|>\n", "5<|im_end|>\n")  # the template ends the turn
    seq_c, seq_r = sequences(data[0])
    assert trained(seq_c, tok) == "4<|im_end|>\n" and trained(seq_r, tok) == "5<|im_end|>\n"
    assert tok.decode(seq_c.input_ids) == tok.apply_chat_template(
        row["prompt"] + row["chosen"], tokenize=False
    )


def test_a_prompt_of_messages_with_string_answers_and_an_implicit_prompt() -> None:
    tok = byte_tokenizer()
    tok.chat_template = CHATML
    user = {"role": "user", "content": "hi"}
    explicit = {"prompt": [user], "chosen": "hello", "rejected": "go away"}
    implicit = {
        "chosen": [user, {"role": "assistant", "content": "hello"}],
        "rejected": [user, {"role": "assistant", "content": "go away"}],
    }
    data, _, _ = encode([explicit, implicit], tok)
    assert parts(data[0], tok) == parts(data[1], tok)
    assert parts(data[0], tok)[1] == "hello<|im_end|>\n"


def test_a_text_prompt_beside_whole_conversations_is_their_shared_turns_as_trl_takes_it() -> None:
    """HuggingFaceH4/ultrafeedback_binarized's form: the prompt as text, and each answer the whole
    conversation. TRL's maybe_extract_prompt takes the shared turns as the prompt; so does lmtune.
    A text prompt before answers that share no turn is one user turn."""
    from trl.data_utils import maybe_extract_prompt

    tok = byte_tokenizer()
    tok.chat_template = CHATML
    user = {"role": "user", "content": "hi"}
    explicit = {"prompt": [user], "chosen": "hello", "rejected": "go away"}
    ultrafeedback = {
        "prompt": "hi",
        "chosen": [user, {"role": "assistant", "content": "hello"}],
        "rejected": [user, {"role": "assistant", "content": "go away"}],
    }
    answers_only = {
        "prompt": "hi",
        "chosen": [{"role": "assistant", "content": "hello"}],
        "rejected": "go away",
    }
    data, _, _ = encode([explicit, ultrafeedback, answers_only], tok)
    assert parts(data[0], tok) == parts(data[1], tok) == parts(data[2], tok)
    trl = maybe_extract_prompt(ultrafeedback)
    assert trl["prompt"] == [user] and trl["chosen"] == [{"role": "assistant", "content": "hello"}]


def test_field_map_renames_pair_fields_and_their_messages_roles() -> None:
    """A ShareGPT-style pair ({from, value}, human/bot) under --field-map trains as lmtune's own
    names would, and the audit reads it the same way."""
    tok = byte_tokenizer()
    tok.chat_template = CHATML
    ours = {
        "prompt": [{"role": "user", "content": "2 + 2?"}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    theirs = {
        "question": [{"from": "human", "value": "2 + 2?"}],
        "good": [{"from": "bot", "value": "4"}],
        "bad": [{"from": "bot", "value": "5"}],
    }
    mapping = "prompt=question,chosen=good,rejected=bad,role=from,content=value,assistant=bot"
    mapped, stats, _ = encode([theirs], tok, field_map=mapping)
    assert stats.formats == {"preference_messages": 1}
    assert parts(mapped[0], tok) == parts(encode([ours], tok)[0][0], tok)
    with pytest.raises(
        UserError, match=r"a non-string \(int\) 'bad' field \(fields found: 'question', 'good', 'bad'\)"
    ):
        encode([{"question": "q", "good": "a", "bad": 5}], field_map=mapping)
    sharegpt = r"'good' message 1 must be .*; ShareGPT turns name them with --field-map role=from"
    with pytest.raises(UserError, match=sharegpt):
        encode([theirs], tok, field_map="prompt=question,chosen=good,rejected=bad")


def test_truncation_cuts_the_prompt_left_and_the_answers_right() -> None:
    row = {"prompt": "p" * 40, "chosen": "c" * 10, "rejected": "r" * 30}  # + BOS and EOS
    data, stats, tok = encode([row], max_length=32)
    prompt, chosen, rejected = parts(data[0], tok)
    assert prompt == "p" * 16  # half of --max-length kept for a prompt longer than that: its end
    assert chosen == "c" * 10 + "<|eos|>" and rejected == "r" * 16
    assert (stats.truncated, stats.prompts_truncated, stats.answers_truncated) == (1, 1, 1)
    short_answers = {"prompt": "p" * 40, "chosen": "c", "rejected": "r"}
    data, stats, tok = encode([short_answers], max_length=32)
    assert parts(data[0], tok) == ("p" * 30, "c<|eos|>", "r<|eos|>")  # the answers keep their room
    assert (stats.prompts_truncated, stats.answers_truncated) == (1, 0)
    for mode in ("left", "right"):
        assert encode([row], max_length=32, truncation=mode)[1].truncated == 1
    assert encode([row], max_length=32, truncation="drop")[1].dropped_too_long == 1
    with pytest.raises(UserError, match=r"pairs.jsonl:1: prompt and answer of 41 \+ 31 tokens"):
        encode([row], max_length=32, truncation="error")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (
            {"chosen": "a", "rejected": "b"},
            "pairs.jsonl:1: preference record has no 'prompt' field, and its chosen and rejected texts share",
        ),
        ({"prompt": "q", "chosen": 3, "rejected": "b"}, "a non-string \\(int\\) 'chosen'"),
        (
            {"prompt": "q", "chosen": ["y"], "rejected": "b"},
            "'chosen' field \\(fields found: .*\\); it takes text, or a list of messages",
        ),
        ({"prompt": "q", "chosen": "a", "rejected": None}, "has a null 'rejected' field"),
        (
            {"prompt": [{"role": "user"}], "chosen": "a", "rejected": "b"},
            "'prompt' message 1 must be an object",
        ),
        (
            {
                "prompt": [{"role": "user", "content": "q"}],
                "chosen": [{"role": "user", "content": "a"}],
                "rejected": [{"role": "assistant", "content": "b"}],
            },
            "pairs.jsonl:1: the 'chosen' answer starts with a user turn",
        ),
        (  # answers as whole conversations beside the prompt: the role-mapping hint trained the prompt
            {
                "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}],
                "chosen": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "a"},
                ],
                "rejected": [{"role": "assistant", "content": "b"}],
            },
            "pairs.jsonl:1: the 'chosen' answer repeats the prompt's 2 turns; an answer holds only the reply "
            "after the prompt: remove them from both answers, or drop the prompt field",
        ),
        (
            {
                "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "rejected": [
                    {"role": "user", "content": "q"},
                    {"role": "assistant", "content": "b"},
                    {"role": "user", "content": "again?"},
                ],
            },
            "pairs.jsonl:1: the 'rejected' answer ends with a user turn",
        ),
        (  # whole conversations whose chosen one stops before the answer: no prompt and answers to split
            {
                "chosen": [{"role": "user", "content": "q"}],
                "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}],
            },
            "pairs.jsonl:1: .*chosen messages are turns the other answer starts with: chosen has no answer",
        ),
        (
            {"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "x"}]},
            "pairs.jsonl:1: .*chosen and rejected messages share no leading turn",
        ),
        (
            {"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "q"}]},
            "pairs.jsonl:1: .*chosen and rejected messages are the same",
        ),
        # The answers' shared start ("The answer is") trained as the prompt, the question unread.
        (
            {"question": "2+2?", "chosen": "The answer is 4", "rejected": "The answer is 5"},
            "pairs.jsonl:1: .*no 'prompt' field but a 'question' one, which would not be read.*"
            "--field-map prompt=question",
        ),
        ({"Prompt": "q", "chosen": "The a", "rejected": "The b"}, "--field-map prompt=Prompt"),
        ({"prompt": "q", "chosen": "a", "rejectd": "b"}, r"no 'rejected' field .*map rejected=rejectd\)"),
    ],
)
def test_bad_pairs_name_file_and_line(row: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message):
        encode([row])


def test_max_prompt_length_cuts_the_prompt_from_the_left_first() -> None:
    """TRL's max_prompt_length: the prompt's end is kept; the answers keep their room."""
    row = {"prompt": "a" * 20 + "p" * 20, "chosen": "c" * 10, "rejected": "r" * 12}  # + BOS and EOS
    data, stats, tok = encode([row], max_length=64, max_prompt_length=8)
    assert parts(data[0], tok) == ("p" * 8, "c" * 10 + "<|eos|>", "r" * 12 + "<|eos|>")
    assert (stats.truncated, stats.prompts_truncated, stats.answers_truncated) == (1, 1, 0)
    # A prompt within it is left alone; --max-length still rules the whole pair after the cut.
    assert (
        parts(encode([row], max_length=64, max_prompt_length=60)[0][0], tok)[0] == "<|bos|>" + row["prompt"]
    )
    data, stats, _ = encode([row], max_length=16, max_prompt_length=12, truncation="drop")
    assert stats.dropped_too_long == 1  # 12 + 13 tokens, more than 16


def test_a_data_set_holds_one_kind_of_record() -> None:
    rows = [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"text": "plain"}]
    with pytest.raises(UserError, match=r"pairs\.jsonl:2: a single example among preference pairs"):
        encode(rows)
    data, _, _ = encode(rows, skip_bad_lines=True)
    assert len(data) == 1 and data.is_pairs
    with pytest.raises(UserError, match=r"pairs\.jsonl:1: record has no 'completion' field"):
        encode([rows[0]], format="prompt_completion")


def test_a_pair_runs_as_one_sequence_that_shares_its_prompt() -> None:
    rows = [
        {"prompt": "q" * (i + 1), "chosen": "a" * (2 * i + 1), "rejected": "b" * (5 - i)} for i in range(5)
    ]
    data, _, tok = encode(rows)
    data.set_reference(np.arange(10, dtype=np.float64).reshape(5, 2))
    batch = PairCollator(tok.pad_token_id)([data[i] for i in (3, 1)])
    assert batch.example_ids == [3, 1] and batch.pairs == 2
    assert batch.reference.tolist() == [[6.0, 7.0], [2.0, 3.0]]
    row = batch.attention_mask[0].bool()
    assert tok.decode(batch.input_ids[0][row]) == "<|bos|>qqqq" + "a" * 7 + "<|eos|>" + "bb<|eos|>"
    # positions restart after the prompt for the rejected answer; segments tell the parts apart
    assert batch.position_ids[0][row].tolist() == [*range(5 + 8), *range(5, 5 + 3)]
    assert batch.segment_ids[0][row].tolist() == [0] * 5 + [1] * 8 + [2] * 3
    assert (batch.segment_ids[1][batch.attention_mask[1] == 0] == -1).all()
    for mode in ("pad", "group", "pack", "auto"):
        micro = PairStepCollator(tok.pad_token_id, 2, mode, 32)([data[i] for i in range(5)])
        assert sorted(i for b in micro for i in b.example_ids) == list(range(5)), mode
        answers = sum(len(data[i].input_ids) - data[i].parts[0] for i in range(5))
        assert sum(b.target_tokens() for b in micro) == answers, mode  # every answer token trains
        for b in micro:
            assert b.reference.tolist() == [[2.0 * i, 2.0 * i + 1] for i in b.example_ids], mode


def test_the_pair_mask_keeps_the_answers_apart() -> None:
    from lmtune.model.masks import pair_causal_mask

    segments = torch.tensor([[0, 0, 1, 1, 2, 2, 3, 4, 5, -1]])
    positions = torch.tensor([[0, 1, 2, 3, 2, 3, 0, 1, 1, 0]])
    mask = pair_causal_mask(segments, positions)[0, 0]
    assert mask[4].tolist() == [True, True, False, False, True, False, False, False, False, False]
    assert mask[3].tolist() == [True, True, True, True, False, False, False, False, False, False]
    assert mask[8].tolist() == [False] * 6 + [True, False, True, False]  # the second pair's rejected
    windowed = pair_causal_mask(segments, positions, window=2)[0, 0]
    assert windowed[5].tolist() == [False] * 4 + [True, True] + [False] * 4  # positions 2 and 3


def test_audit_reports_pair_problems(tmp_path: Path) -> None:
    rows = [
        {"prompt": "q1", "chosen": "same", "rejected": "same"},
        {"prompt": "q2", "chosen": "", "rejected": "no"},
        {"prompt": "q5", "chosen": "", "rejected": ""},  # both: one pair that teaches nothing
        {"prompt": "q3" * 40, "chosen": "a long answer", "rejected": "b"},
        {"prompt": "q4", "chosen": "longer chosen answer", "rejected": "short"},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = audit(str(path), byte_tokenizer(), ExampleSettings(max_length=64))
    assert report.pairs is not None
    assert report.pairs.identical == 2 and report.pairs.empty == 2 and report.pairs.prompt_fills == 1
    assert report.pairs.useless == 3 and report.pairs.chosen_longer == 2  # of 5 pairs
    text = format_report(report)
    assert "identical chosen and rejected  2" in text and "chosen longer than rejected" in text
    assert "3 pairs with identical or empty answers" in text
    assert (
        "prompt alone over --max-length  1 (train on them with --objective dpo, ipo, simpo or orpo)" in text
    )
    # Audited for a preference objective, the pairs are not told to take one.
    assert "(train on them" not in format_report(replace(report, objective="dpo"))
    assert BadLines(skip=True).count == 0
    # Training cuts a prompt to --max-prompt-length first: the audit measures what remains.
    cut = audit(str(path), byte_tokenizer(), ExampleSettings(max_length=64, max_prompt_length=16))
    assert cut.pairs is not None and cut.pairs.prompt_fills == 0
    text = format_report(cut)
    assert "lost their end" not in text  # a cut prompt keeps its answers' ends
    bins = [line for line in text.splitlines() if line.startswith("    ") and line.strip()[0].isdigit()]
    assert len(bins) > 1  # pairs run longer than --max-length: not all in its last bin


def test_the_length_share_leaves_ties_out() -> None:
    from lmtune.data.pair_audit import PairAudit, pair_lines

    tied = "\n".join(pair_lines(PairAudit(pairs=4, same_length=4)))
    assert "every pair's answers have the same length" in tied and "%" not in tied
    mixed = "\n".join(pair_lines(PairAudit(pairs=4, same_length=2, chosen_longer=1)))
    assert "chosen longer than rejected in 50% of the pairs whose answers differ" in mixed
    assert "near 50%: length does not tell them apart" in mixed and "far from 50%" not in mixed
    skewed = "\n".join(pair_lines(PairAudit(pairs=4, chosen_longer=4)))
    assert "in 100% of the pairs" in skewed and "far from 50%: DPO learns that length too" in skewed


def test_a_chat_answer_trains_its_end_of_turn_though_a_newline_follows() -> None:
    """ChatML and Qwen write a newline after the end of turn: the pair still trains a stop."""
    from lmtune.data.chat import use_chat_template

    tok = byte_tokenizer()
    use_chat_template(tok, "chatml")
    row = {
        "prompt": [{"role": "user", "content": "2 + 2?"}],
        "chosen": [{"role": "assistant", "content": "4"}],
        "rejected": [{"role": "assistant", "content": "5"}],
    }
    data, stats, _ = encode([row], tok)
    _, chosen, rejected = parts(data[0], tok)
    assert chosen.endswith("<|im_end|>\n") and rejected.endswith("<|im_end|>\n")
    assert stats.eos_trained == 1


def test_two_whole_texts_share_their_beginning_as_the_prompt() -> None:
    """Anthropic HH's form: TRL's extract_prompt takes the shared text, less a space it ends with."""
    row = {"chosen": "Human: 2 + 2?\n\nAssistant: 4", "rejected": "Human: 2 + 2?\n\nAssistant: 5, I think"}
    data, stats, tok = encode([row])
    assert stats.formats == {"preference": 1}
    assert parts(data[0], tok) == ("<|bos|>Human: 2 + 2?\n\nAssistant:", " 4<|eos|>", " 5, I think<|eos|>")

    # One text the other's beginning: the prompt would swallow an answer.
    with pytest.raises(UserError, match="one of its chosen and rejected texts is the other's beginning"):
        encode([{"chosen": "Human: hi Assistant: hello there", "rejected": "Human: hi Assistant: hello"}])
    # HH's answers start after its last assistant marker: not inside a shared first letter or word,
    # and one that begins the other is no longer refused.
    hh = "\n\nHuman: hi\n\nAssistant: yes\n\nHuman: colour?\n\nAssistant:"
    for chosen, rejected in ((" blue sky", " big dog"), (" dog blue", " dog blue red slow dog")):
        data, _, tok = encode([{"chosen": hh + chosen, "rejected": hh + rejected}])
        assert parts(data[0], tok) == (f"<|bos|>{hh}", f"{chosen}<|eos|>", f"{rejected}<|eos|>")
    # Elsewhere not inside a word either (TRL's extract_prompt cut "b" off "blue" and "big").
    data, _, tok = encode([{"chosen": "Q: colour? A: blue sky", "rejected": "Q: colour? A: big dog"}])
    assert parts(data[0], tok) == ("<|bos|>Q: colour? A:", " blue sky<|eos|>", " big dog<|eos|>")


def test_training_counts_pairs_with_the_same_or_an_empty_answer() -> None:
    """As the audit does: the data line of a run names them (they trained in silence)."""
    from lmtune.data.pairs import pair_counts

    rows = [
        {"prompt": "q", "chosen": "a", "rejected": "a"},
        {"prompt": "q", "chosen": "  ", "rejected": "b"},
        {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": ""}]}
        | {"rejected": [{"role": "assistant", "content": "c"}]},
        {"prompt": "q", "chosen": "a", "rejected": "b"},
    ]
    tok = byte_tokenizer()
    tok.chat_template = CHATML
    _, stats, _ = encode(rows, tok)
    assert stats.examples == 4 and (stats.identical_pairs, stats.empty_answer_pairs) == (1, 2)
    meta = {"formats": stats.formats, "identical_pairs": 1, "empty_answer_pairs": 2}
    assert pair_counts(meta) == (
        "; 1 with the same answer as chosen and rejected (no preference to learn); 2 with an empty "
        "answer (most often a data error); lmtune data audit lists them"
    )


def test_training_counts_single_examples_with_an_empty_answer() -> None:
    """As the audit does for supervised data: a blank completion trains the stop alone, and the data
    line says how many (they trained in silence)."""
    from lmtune.data.pairs import pair_counts

    rows = [
        {"prompt": "q", "completion": ""},
        {"prompt": "q", "completion": " \n"},
        {"prompt": "q", "completion": " an answer"},
        {"text": "plain text trains whole"},
    ]
    _, stats, _ = encode(rows, byte_tokenizer())
    assert (stats.examples, stats.empty_answers) == (4, 2)
    said = pair_counts({"formats": stats.formats, "empty_answers": stats.empty_answers, "where": stats.where})
    assert said.startswith(
        "; 2 with an empty or blank answer (at pairs.jsonl:1, pairs.jsonl:2): only the stop ("
    )
    assert pair_counts({"formats": {"text": 1}}) == ""


def test_the_data_line_names_the_files_a_folder_or_glob_read() -> None:
    """A folder's files were trained unnamed: the log (and run.json) did not say which."""
    from lmtune.data.pairs import data_line

    meta = {"examples": 6, "tokens": 90, "truncated": 0, "dropped_too_long": 0, "dropped_no_targets": 0}
    meta |= {"bad_lines": 0, "formats": {"text": 6}}
    files = [f"d/{i}.jsonl" for i in range(6)]
    line = data_line("train data d", meta, "from the cache", files)
    assert line.startswith(
        "train data d (6 files: d/0.jsonl, d/1.jsonl, d/2.jsonl, d/3.jsonl and 2 more): 6 examples, 90 tokens"
    )
    assert data_line("train data a.jsonl", meta, "from the cache").startswith(
        "train data a.jsonl: 6 examples"
    )
