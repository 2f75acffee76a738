from __future__ import annotations

from pathlib import Path

import pytest

from lmtune.data.collate import Collator
from lmtune.data.reading import read_jsonl_texts
from lmtune.data.sample import addition_examples, split_prompt
from lmtune.data.tokenize import IGNORE_INDEX, tokenize_texts
from lmtune.errors import UserError
from lmtune.modeling import byte_tokenizer


def test_reads_texts_and_skips_blank_lines(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "a"}\n\n   \n{"text": "b", "other": 1}\n')
    assert read_jsonl_texts(str(f), "text") == ["a", "b"]


def test_custom_field(tmp_path: Path) -> None:
    f = tmp_path / "d.ndjson"
    f.write_text('{"content": "x"}\n')
    assert read_jsonl_texts(str(f), "content") == ["x"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"text": "ok"}\n{"text": "broken\n', r"d.jsonl:2: not valid JSON \(Unterminated string"),
        (
            b'{"text": "ok"}\n{"body": "x", "id": 3}\n',
            r"d.jsonl:2: record has no 'text' field \(fields found: 'body', 'id'; expected: 'text'",
        ),
        (b'{"text": 5}\n', r"d.jsonl:1: record has a non-string \(int\) 'text' field"),
        (b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', r"d.jsonl:2: not valid UTF-8"),
        (b"[1, 2]\n", r"d.jsonl:1: expected a JSON object"),
        (b"", r"d.jsonl: no records"),
        (b"\n\n", r"d.jsonl: no records"),
    ],
)
def test_bad_data_names_file_and_line(tmp_path: Path, content: bytes, message: str) -> None:
    f = tmp_path / "d.jsonl"
    f.write_bytes(content)
    with pytest.raises(UserError, match=message):
        read_jsonl_texts(str(f), "text")


def test_tokenize_appends_eos_and_counts_truncation() -> None:
    tok = byte_tokenizer()
    data = tokenize_texts(["ab", "abcdefghij"], tok, max_length=6)
    assert len(data) == 2 and data.truncated == 1
    short, _ = data[0]
    assert list(short) == [tok.bos_token_id, ord("a"), ord("b"), tok.eos_token_id]
    long_ids, _ = data[1]
    # Cut on the right, and without EOS: the text did not end there.
    assert len(long_ids) == 6 and tok.eos_token_id not in list(long_ids)


def test_padding_is_masked_from_the_attention_mask_not_by_id() -> None:
    tok = byte_tokenizer()
    tok.pad_token = tok.eos_token  # the common pad == eos setup
    data = tokenize_texts(["a", "abcd"], tok, max_length=64)
    batch = Collator(tok.pad_token_id)([data[0], data[1]])
    assert batch.input_ids.shape == (2, 6)
    # Row 0 is bos a eos pad pad pad: the real EOS keeps its label, the padding (same id) does not.
    assert batch.labels[0].tolist() == [
        tok.bos_token_id,
        ord("a"),
        tok.eos_token_id,
        IGNORE_INDEX,
        IGNORE_INDEX,
        IGNORE_INDEX,
    ]
    assert batch.attention_mask[0].tolist() == [1, 1, 1, 0, 0, 0]
    # Plain text with no prompt: every real position is a target.
    assert (batch.labels[1] == batch.input_ids[1]).all()
    assert batch.target_tokens() == 2 + 5


def test_sample_task_is_deterministic_and_splits_are_disjoint() -> None:
    train, held = addition_examples()
    assert (train, held) == addition_examples()
    assert not set(train) & set(held)
    for text in train[:50]:
        prompt, answer = split_prompt(text)
        a, b = prompt[:-1].split("+")
        assert int(answer) == int(a) + int(b)
