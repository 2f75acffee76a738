"""Tokenize rendered examples: token ids, which positions train, and truncation."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from lmtune.config.groups import ExampleSettings
from lmtune.data.chat import end_of_turn_ids
from lmtune.data.formats import CHAT_FORMATS, SHAREGPT_ROLES, FieldMap, Rendered, detect_format, render
from lmtune.data.pairs import (
    PairTokens,
    answer_targets,
    answer_texts,
    fit_pair,
    rendered_pairs,
    tokenize_pairs,
)
from lmtune.data.sources import BadLines, Record
from lmtune.errors import UserError

IGNORE_INDEX = -100
CHUNK = 2048  # records per tokenizer call: large enough for the Rust side to use every core
# A text far longer than --max-length can keep is cut before tokenizing, so one huge record costs
# what the kept tokens cost. The cut keeps this many characters per token that could be kept (with
# a margin of tokens, so the boundary of the cut never reaches the kept ones); a tokenizer whose
# tokens are longer still gets the whole text.
CHARS_PER_TOKEN = 16
CUT_MARGIN_TOKENS = 64


@dataclass
class EncodeStats:
    """What happened to the examples on their way to the token arrays."""

    examples: int = 0  # kept
    tokens: int = 0
    target_tokens: int = 0  # trained positions after the causal shift
    truncated: int = 0
    dropped_too_long: int = 0
    dropped_no_targets: int = 0
    eos_trained: int = 0  # kept examples that train a stop: EOS, or in chat data the end of turn
    formats: dict[str, int] = field(default_factory=dict)
    # Preference pairs: truncation cut their prompts from the left, their answers from the right.
    prompts_truncated: int = 0
    answers_truncated: int = 0
    identical_pairs: int = 0  # kept pairs whose answers are the same tokens: no preference in them
    empty_answer_pairs: int = 0  # kept pairs with an answer of no text (a data error, most often)
    empty_answers: int = 0  # kept single examples that train their stop alone (an empty answer)
    # Records with a system prompt beside fields whose format never renders one (Axolotl's
    # alpaca_w_system, a ShareGPT export's own column): the model trains without it.
    unread_system: int = 0
    # Conversations whose system turn their chat template does not render (Mistral v0.3's).
    system_left_out: int = 0
    # Conversations whose last reply has its reasoning in a field of its own (reasoning_content).
    unread_reasoning: int = 0
    # Instruction records with Dolly's 'context' (the passage the instruction is about) unread.
    unread_context: int = 0
    # Kept examples whose prompt --truncation left cut away whole: an answer to no question.
    prompt_cut_away: int = 0
    # Documents (text records) --truncation split made several examples of, and how many examples
    # that added (a record's pieces past its first): the records read are examples less these.
    documents_split: int = 0
    pieces_added: int = 0
    # Where the first examples of each kind of loss are (``file:line``), so a message can name them:
    # "no_targets", "too_long", "empty_answer", "no_stop".
    where: dict[str, list[str]] = field(default_factory=dict)

    def note(self, kind: str, where: str) -> None:
        kept = self.where.setdefault(kind, [])
        if len(kept) < WHERE_KEPT:
            kept.append(where)

    def merge(self, other: EncodeStats) -> None:
        for f in fields(self):
            if f.name not in ("formats", "where"):
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        for k, v in other.formats.items():
            self.formats[k] = self.formats.get(k, 0) + v
        for kind, places in other.where.items():
            for where in places:
                self.note(kind, where)


WHERE_KEPT = 3  # locations kept per kind of loss: enough to find the pattern, few enough for one line


@dataclass(frozen=True)
class Encoded:
    ids: np.ndarray  # int32
    trainable: np.ndarray  # bool, same length
    # A preference pair (lmtune.data.pairs): ids are its prompt, chosen and rejected tokens back to
    # back; these are the prompt's and the chosen answer's lengths.
    parts: tuple[int, int] | None = None


def _first_char_token(enc: Any, chars: range) -> int | None:
    for c in chars:
        t = enc.char_to_token(c)
        if t is not None:
            return int(t)
    return None


def trainable_mask(enc: Any, spans: tuple[tuple[int, int], ...], text_length: int) -> np.ndarray:
    """A token trains when it starts inside a trainable span (and is not a special token added
    around the text). A token that starts before a span and runs into it belongs to the part
    before: a prompt token that swallowed the answer's first character is not trained.

    Works from the span boundaries (a few lookups per example), not from every token's offsets.
    """
    n = len(enc.ids)
    if spans == ((0, text_length),):
        return ~np.asarray(enc.special_tokens_mask, dtype=bool)
    mask = np.zeros(n, dtype=bool)
    for lo, hi in spans:
        first = _first_char_token(enc, range(lo, hi))
        if first is None:
            continue  # nothing of the span survived as a token
        if enc.token_to_chars(first)[0] < lo:
            first += 1
        last = _first_char_token(enc, range(hi - 1, lo - 1, -1))
        assert last is not None
        mask[first : last + 1] = True
    return mask


def cut_long_text(r: Rendered, max_length: int, truncation: str) -> Rendered:
    """``r`` with the text that truncation would discard anyway cut off (spans moved along)."""
    limit = CHARS_PER_TOKEN * (max_length + CUT_MARGIN_TOKENS)
    if len(r.text) <= limit or (truncation == "split" and r.format == "text"):  # a document: all of it
        return r
    start = len(r.text) - limit if truncation == "left" else 0
    spans = tuple(
        (max(lo - start, 0), min(hi - start, limit))
        for lo, hi in r.spans
        if hi > start and lo < start + limit
    )
    return replace(r, text=r.text[start : start + limit], spans=spans)


def truncate(
    ids: np.ndarray, trainable: np.ndarray, max_length: int, mode: str, where: str, cut: bool = False
) -> tuple[np.ndarray, np.ndarray] | None:
    """Apply ``--truncation`` to one over-long example; None means drop it."""
    if mode == "right":
        return ids[:max_length], trainable[:max_length]
    if mode == "left":  # keeps the end, where a prompt-completion example has its answer
        return ids[-max_length:], trainable[-max_length:]
    if mode == "drop":
        return None
    raise UserError(
        f"{where}: {len(ids)}{'+' if cut else ''} tokens, more than --max-length {max_length} "
        "(--truncation error); raise --max-length or choose --truncation right, left or drop"
    )


def _prompt_cut_away(kept: tuple[np.ndarray, np.ndarray], worded: bool, tokenizer: Any) -> bool:
    """Whether --truncation left kept no word of a prompt that had words (``worded``, of the whole
    rendered text: a text cut before tokenizing may have lost it already): an answer to no
    question. Not of a text, whose untrained BOS is no prompt."""
    ids, trainable = kept
    left = tokenizer.decode(ids[~trainable].tolist(), skip_special_tokens=True)
    return worded and not any(ch.isalnum() for ch in left)


def _worded_prompt(r: Rendered) -> bool:
    """Whether ``r``'s text outside its trained spans has words (a prompt, a user turn)."""
    edges = [0, *(x for span in r.spans for x in span), len(r.text)]
    return any(ch.isalnum() for a, b in zip(edges[::2], edges[1::2], strict=True) for ch in r.text[a:b])


def _encode_batch(backend: Any, rendered: list[Rendered]) -> dict[int, Any]:
    """Every rendered text's Encoding, by position. The Rust tokenizer directly: it encodes a batch
    on every core, and its Encoding objects answer span lookups without converting every token's
    offsets to Python."""
    by_special: dict[bool, list[int]] = {}
    for i, r in enumerate(rendered):
        by_special.setdefault(r.add_special_tokens, []).append(i)
    encoded: dict[int, Any] = {}
    for special, idx in by_special.items():
        texts = [rendered[i].text for i in idx]
        encoded.update(zip(idx, backend.encode_batch(texts, add_special_tokens=special), strict=True))
    return encoded


def encode_chunk(
    chunk: list[Record], tokenizer: Any, settings: ExampleSettings, names: FieldMap, bad: BadLines
) -> tuple[list[Encoded], EncodeStats]:
    """Render and tokenize a list of records; returns the kept examples and the counts.

    A record that cannot be rendered (missing field, unknown role, ...) goes to ``bad``, which
    raises unless bad lines are being skipped. Preference pairs are encoded by
    :func:`encode_pairs`; a chunk is all pairs or all single examples, as its first record is.
    """
    fmt = settings.format
    chunk = _one_kind(chunk, fmt, names, bad)
    if chunk and _is_pair(chunk[0], fmt, names):
        pairs = [names.record(r) for r in chunk]
        lengths = (settings.max_length, settings.max_prompt_length)
        return encode_pairs(pairs, tokenizer, lengths, settings.truncation, bad, names)
    return _encode_examples(chunk, tokenizer, settings, names, bad)


def _encode_examples(
    chunk: list[Record], tokenizer: Any, settings: ExampleSettings, names: FieldMap, bad: BadLines
) -> tuple[list[Encoded], EncodeStats]:
    """:func:`encode_chunk` of single examples."""
    fmt, max_length, truncation = settings.format, settings.max_length, settings.truncation
    train_on_prompt = settings.train_on_prompt
    stats = EncodeStats()
    records: list[Record] = []
    rendered: list[Rendered] = []
    cut: list[bool] = []
    worded: list[bool] = []  # a prompt with words, before a long text was cut short
    for record in chunk:
        try:
            full = render(record, fmt, names, tokenizer, train_on_prompt=train_on_prompt)
        except UserError as e:
            bad.report(str(e))
            continue
        short = cut_long_text(full, max_length, truncation)
        rendered.append(short)
        records.append(record)
        cut.append(short is not full)
        worded.append(truncation == "left" and _worded_prompt(full))
    eos = tokenizer.eos_token_id
    # A trained stop: EOS, or in chat data the template's end-of-turn token (which may be EOS).
    chat = any(r.format in CHAT_FORMATS for r in rendered)
    stops = np.asarray([eos, *(end_of_turn_ids(tokenizer) if chat else [])], dtype=np.int32)
    out: list[Encoded] = []
    for r in rendered:
        stats.formats[r.format] = stats.formats.get(r.format, 0) + 1
    backend = tokenizer.backend_tokenizer
    encoded = _encode_batch(backend, rendered)
    for i, (rec, r) in enumerate(zip(records, rendered, strict=True)):
        enc = encoded[i]
        if cut[i] and len(enc.ids) <= max_length + CUT_MARGIN_TOKENS:  # tokens longer than assumed
            r = render(rec, fmt, names, tokenizer, train_on_prompt=train_on_prompt)
            enc = backend.encode(r.text, add_special_tokens=r.add_special_tokens)
        ids = np.asarray(enc.ids, dtype=np.int32)
        trainable = trainable_mask(enc, r.spans, len(r.text))
        if r.append_eos and len(ids) and ids[-1] == eos:
            trainable[-1] = True  # a tokenizer's own EOS (add_eos_token): it is the stop to learn
        elif r.append_eos:
            ids = np.append(ids, np.int32(eos))
            trainable = np.append(trainable, True)
        if len(ids) > max_length and truncation == "split" and r.format == "text":
            pieces = split_document(ids, trainable, max_length)
            stats.documents_split += 1
            stats.note("split", rec.where)
            kept_pieces = [
                _kept(piece, rec, stats, (tokenizer, stops), cut=None, ends=n == len(pieces) - 1)
                for n, piece in enumerate(pieces)  # each a document's part: only the last one ends it
            ]
            out += [k for k in kept_pieces if k is not None]
            stats.pieces_added += max(sum(k is not None for k in kept_pieces) - 1, 0)
            continue
        cut_here = False
        if len(ids) > max_length:
            mode = "right" if truncation == "split" else truncation  # split: documents (text records)
            try:
                shortened = truncate(ids, trainable, max_length, mode, rec.where, cut[i])
            except UserError as e:
                bad.report(str(e))
                continue
            if shortened is None:
                stats.dropped_too_long += 1
                stats.note("too_long", rec.where)
                continue
            if mode == "left" and _prompt_cut_away(shortened, worded[i], tokenizer):
                stats.prompt_cut_away += 1
                stats.note("prompt_cut_away", rec.where)
            (ids, trainable), cut_here = shortened, True
        kept = _kept((ids, trainable), rec, stats, (tokenizer, stops), cut=cut_here)
        if kept is not None:
            _count_unread(rec, stats, names if r.format == "prompt_completion" else None)
            if r.system_left_out:
                stats.system_left_out += 1
                stats.note("system_left_out", rec.where)
            out.append(kept)
    return out, stats


def split_document(
    ids: np.ndarray, trainable: np.ndarray, max_length: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """--truncation split: a document (a text record) as consecutive pieces of --max-length tokens,
    as HF's run_clm and Axolotl's completion data chunk long texts; the last has two tokens at least
    (one would predict nothing)."""
    starts = list(range(0, len(ids), max_length))
    if len(ids) - starts[-1] == 1 and len(starts) > 1:  # a last piece of one token would predict nothing:
        starts[-1] -= 1  # the one before gives it a token (every token trains once, the EOS too)
    ends = [*starts[1:], len(ids)]
    return [(ids[a:b], trainable[a:b]) for a, b in zip(starts, ends, strict=True)]


def _kept(
    example: tuple[np.ndarray, np.ndarray],
    rec: Record,
    stats: EncodeStats,
    stopping: tuple[Any, np.ndarray],
    cut: bool | None,
    ends: bool = True,
) -> Encoded | None:
    """One example counted into ``stats`` (None: dropped, with nothing to train); ``cut``: by
    truncation (None: a piece of a split document, which has no answer to be blank); ``ends``: the
    example is where its record ends (a document's earlier pieces do not, so they train no stop, as
    they should not)."""
    (ids, trainable), (tokenizer, stops) = example, stopping
    targets = int(trainable[1:].sum())  # position 0 is never predicted
    if targets == 0:  # would train as a loss of 0 on nothing
        if cut:  # the prompt alone fills --max-length: dropped for being too long
            stats.dropped_too_long += 1
            stats.note("too_long", rec.where)
        else:
            stats.dropped_no_targets += 1
            stats.note("no_targets", rec.where)
        return None
    stats.examples += 1
    stats.truncated += bool(cut)
    stats.tokens += len(ids)
    stats.target_tokens += targets
    stopped = not ends or bool((trainable & np.isin(ids, stops)).any())
    stats.eos_trained += stopped
    if not stopped:
        stats.note("no_stop", rec.where)
    if cut is not None and blank_answer(ids, trainable, tokenizer, stops):
        stats.empty_answers += 1
        stats.note("empty_answer", rec.where)
    return Encoded(ids, trainable)


def _count_unread(record: Record, stats: EncodeStats, instruction: FieldMap | None = None) -> None:
    """Text a record's format never reads, so it trains without it: counted, to be said. A 'system'
    field beside any fields but a text's (prompt/completion, instruction, preference records:
    Intel/orca_dpo_pairs; messages and ShareGPT with the system prompt in a column of its own);
    of a prompt/completion or instruction record (``instruction``: its field map), Dolly's
    'context' not mapped to an instruction's input, or an input beside a prompt (which reads none);
    the last reply's reasoning in a field of its own (``reasoning_content``), which no turn renders."""
    fields = record.fields
    passage = None
    if instruction is not None:  # prompt/completion records read no input; instruction records read it
        ours = instruction.apply(fields)
        passage = ours.get("input") if "prompt" in ours else None
        if "context" not in instruction.fields.values():
            passage = passage or fields.get("context")
    if any(_reasoning(v) for v in fields.values()):
        stats.unread_reasoning += 1
        stats.note("unread_reasoning", record.where)
    for name, value in (("system", fields.get("system")), ("context", passage)):
        if name == "system" and any(_system_turn(v) for v in fields.values()):
            continue  # a conversation that has its own system turn: the column repeats it, most often
        if isinstance(value, str) and value.strip() and not isinstance(fields.get("text"), str):
            setattr(stats, f"unread_{name}", getattr(stats, f"unread_{name}") + 1)
            stats.note(f"unread_{name}", record.where)


def blank_answer(ids: np.ndarray, trainable: np.ndarray, tokenizer: Any, stops: Collection[int]) -> bool:
    """Whether an answer the example trains (a run of trained tokens: the completion, or one reply
    of a conversation) is its stop alone, with an empty or blank text before it: the model learns
    to say nothing."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], trainable.astype(np.int8), [0]))))
    for start, end in zip(edges[::2], edges[1::2], strict=True):
        if end - start > 8:  # a blank answer is a few tokens at most: the rest is not decoded
            continue
        if not tokenizer.decode([int(t) for t in ids[start:end] if int(t) not in stops]).strip():
            return True
    return False


# A turn's reasoning in a field of its own (Qwen3's and DeepSeek's reasoning_content, gpt-oss's
# thinking): lmtune renders a turn's role and content only.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _reasoning(value: Any) -> bool:
    """Whether ``value`` is a list of turns whose last reply holds reasoning in a field of its own
    (the templates that render it, Qwen3's, DeepSeek's, gpt-oss's, drop an earlier reply's)."""
    turns = [t for t in value if isinstance(t, dict)] if isinstance(value, list) else []
    roles = [(t.get("role"), SHAREGPT_ROLES.get(str(t.get("from")))) for t in turns]
    last = next((t for t, r in zip(reversed(turns), reversed(roles), strict=True) if "assistant" in r), {})
    return any(isinstance(last.get(f), str) and last[f].strip() for f in REASONING_FIELDS)


def _system_turn(value: Any) -> bool:
    """Whether ``value`` is a list of turns with a system turn (lmtune's, or ShareGPT's names)."""
    turns = value if isinstance(value, list) else []
    return any(isinstance(t, dict) and "system" in (t.get("role"), t.get("from")) for t in turns)


def _is_pair(record: Record, fmt: str, names: FieldMap) -> bool:
    return fmt == "preference" or (
        fmt == "auto" and detect_format(names.apply(record.fields)) == "preference"
    )


def _one_kind(chunk: list[Record], fmt: str, names: FieldMap, bad: BadLines) -> list[Record]:
    """The records of the first one's kind (preference pair or single example); the others go to
    ``bad``: a data set trains one objective."""
    if not chunk or fmt != "auto":
        return chunk
    pair = _is_pair(chunk[0], fmt, names)
    kept = []
    for record in chunk:
        if _is_pair(record, fmt, names) == pair:
            kept.append(record)
            continue
        fields = ", ".join(repr(k) for k in record.fields)
        what = (
            "a single example among preference pairs" if pair else "a preference pair among single examples"
        )
        bad.report(f"{record.where}: {what} (fields found: {fields}); a data set holds one kind")
    return kept


def encode_pairs(
    chunk: list[Record],
    tokenizer: Any,
    lengths: tuple[int, int | None],
    truncation: str,
    bad: BadLines,
    names: FieldMap,
) -> tuple[list[Encoded], EncodeStats]:
    """Render and tokenize preference records (lmtune.data.pairs; fields renamed by ``names``,
    which also names their messages' fields and roles): the kept pairs and the counts.
    ``lengths``: --max-length, and --max-prompt-length (a longer prompt is cut from the left
    first, as TRL's max_prompt_length does) or None."""
    max_length, max_prompt = lengths
    stats = EncodeStats()
    records, texts = rendered_pairs(chunk, tokenizer, bad, names)
    chat = any(t.format == "preference_messages" for t in texts)
    stops = np.asarray(
        [tokenizer.eos_token_id, *(end_of_turn_ids(tokenizer) if chat else [])], dtype=np.int32
    )
    out: list[Encoded] = []
    for record, text, pair in zip(records, texts, tokenize_pairs(texts, tokenizer), strict=True):
        stats.formats[text.format] = stats.formats.get(text.format, 0) + 1
        prompt_cut = max_prompt is not None and len(pair.prompt) > max_prompt
        if prompt_cut:
            assert max_prompt is not None
            pair = PairTokens(pair.prompt[len(pair.prompt) - max_prompt :], pair.chosen, pair.rejected)
        p, longer = len(pair.prompt), max(len(pair.chosen), len(pair.rejected))
        cut = None
        if p + longer > max_length:
            if truncation == "drop":
                stats.dropped_too_long += 1
                stats.note("too_long", record.where)
                continue
            if truncation == "error":
                bad.report(
                    f"{record.where}: prompt and answer of {p} + {longer} tokens, more than --max-length "
                    f"{max_length} (--truncation error); raise --max-length or choose --truncation right, "
                    "left or drop"
                )
                continue
            cut = fit_pair(pair, max_length)
            pair = cut.pair
        targets = answer_targets(pair)
        if min(targets) == 0:  # an answer with nothing to train: no pair to compare
            stats.dropped_no_targets += 1
            stats.note("no_targets", record.where)
            continue
        stats.examples += 1
        stats.truncated += cut is not None or prompt_cut
        stats.prompts_truncated += bool(prompt_cut or (cut and cut.prompt_cut))
        stats.answers_truncated += bool(cut and cut.answers_cut)
        stats.identical_pairs += np.array_equal(pair.chosen, pair.rejected)
        stats.empty_answer_pairs += not all(a.strip() for a in answer_texts(record, names))
        _count_unread(record, stats)
        stats.tokens += len(pair.prompt) + len(pair.chosen) + len(pair.rejected)  # as the model runs it
        stats.target_tokens += sum(targets)
        # Anywhere in each answer, as for single examples: chat templates put a newline after the
        # end of turn (ChatML, Qwen), so it need not be the last token.
        stopped = bool(np.isin(pair.chosen, stops).any() and np.isin(pair.rejected, stops).any())
        stats.eos_trained += stopped
        if not stopped:
            stats.note("no_stop", record.where)
        out.append(_encoded_pair(pair))
    return out, stats


def _encoded_pair(pair: PairTokens) -> Encoded:
    ids = np.concatenate([pair.prompt, pair.chosen, pair.rejected]).astype(np.int32)
    trainable = np.arange(len(ids)) >= len(pair.prompt)
    return Encoded(ids, trainable, parts=(len(pair.prompt), len(pair.chosen)))


def chunks(records: Iterable[Record], size: int = CHUNK) -> Iterator[list[Record]]:
    batch: list[Record] = []
    for r in records:
        batch.append(r)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
