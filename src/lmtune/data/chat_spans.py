"""What of a rendered conversation trains: each assistant reply, as rendering the conversation
turn by turn adds it. Where the chat template does not render it turn by turn (a turn renders
otherwise once later turns follow it: Qwen3's drops the empty thinking block of every reply but
the last, Phi-3's ends the text with EOS, Mistral's folds the system prompt into the last user
turn), each reply is found as it was written, in order, in the whole rendering, and trains from
the generation prompt's end to its end-of-turn marker."""

from __future__ import annotations

from typing import Any

from lmtune.data.chat import end_of_turn_ids, render_chat
from lmtune.errors import UserError

NOT_LOCATED = (
    "the chat template does not render the conversation turn by turn (a turn renders otherwise once "
    "later turns follow it), and a turn's text is not found in the rendering as it was written, so "
    "the assistant replies cannot be located; --chat-template chatml|llama3|gemma|FILE.jinja renders "
    "turn by turn"
)


def conversation_spans(
    tokenizer: Any, messages: list[dict[str, str]], text: str, untrained: frozenset[int], every_turn: bool
) -> list[tuple[int, int]]:
    """The character spans of ``text`` (``messages`` rendered whole) that train: each assistant
    turn's own text (``every_turn``: all of the text), less the turns in ``untrained``.

    A turn's span is what rendering up to and including it adds to the rendering of the
    conversation before it with the generation prompt: the reply and its end-of-turn marker;
    where a template renders a turn otherwise once later turns follow it, the replies are found in
    the whole rendering (:func:`found_replies`).

    Raises:
        UserError: where the replies cannot be located.
    """
    if every_turn:  # all of it, less the turns kept out
        spans, at = [], 0
        try:
            out = [_turn_span(tokenizer, messages, i, text) for i in sorted(untrained)]
        except UserError:  # a template whose turns render otherwise once later ones follow
            if any(messages[i]["role"] != "assistant" for i in untrained):
                raise
            out = found_replies(tokenizer, messages, sorted(untrained), text)
        for start, end in out:
            spans += [(at, start)] if start > at else []
            at = max(at, end)
        spans += [(at, len(text))] if at < len(text) else []
    else:
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i not in untrained]
        try:
            spans = [_reply_span(tokenizer, messages, i, text) for i in replies]
        except UserError:  # a template whose turns render otherwise once later ones follow
            spans = found_replies(tokenizer, messages, replies, text)
    return spans


def _turn_span(tokenizer: Any, messages: list[dict[str, str]], i: int, text: str) -> tuple[int, int]:
    """What turn ``i`` adds to the rendering: a reply as :func:`_reply_span`, another turn whole."""
    if messages[i]["role"] == "assistant":
        return _reply_span(tokenizer, messages, i, text)
    before = render_chat(tokenizer, messages[:i], generation_prompt=False) if i else ""
    upto = render_chat(tokenizer, messages[: i + 1], generation_prompt=False)
    if not text.startswith(upto) or not upto.startswith(before):
        raise UserError("the chat template does not render the conversation turn by turn")
    return len(before), len(upto)


def _reply_span(tokenizer: Any, messages: list[dict[str, str]], i: int, text: str) -> tuple[int, int]:
    upto = render_chat(tokenizer, messages[: i + 1], generation_prompt=False)
    before = render_chat(tokenizer, messages[:i], generation_prompt=True) if i else _opening(tokenizer, upto)
    if not (upto.startswith(before) and text.startswith(upto)):
        raise UserError(NOT_LOCATED)
    return len(before), len(upto)


def _opening(tokenizer: Any, upto: str) -> str:
    """What precedes a reply that opens the conversation (``upto``: it rendered alone): the
    template's start and the assistant's role header, which a reply after another turn does not
    train either."""
    empty = _empty_prompt(tokenizer)
    try:  # the header the generation prompt adds after a turn, without the separator before it
        header = generation_header(tokenizer, [{"role": "user", "content": "x"}]).lstrip()
    except UserError:
        header = ""
    if not header or (empty and upto.startswith(empty) and empty.endswith(header)):
        return empty
    at = upto.find(header)
    return upto[: at + len(header)] if at >= 0 else empty


def _empty_prompt(tokenizer: Any) -> str:
    """What precedes a reply that opens the conversation."""
    try:
        return render_chat(tokenizer, [], generation_prompt=True)
    except Exception:  # many templates index messages[0]; then nothing precedes it
        return ""


def found_replies(
    tokenizer: Any, messages: list[dict[str, str]], replies: list[int], text: str
) -> list[tuple[int, int]]:
    """The character spans of the replies ``replies`` (indices of assistant turns) in ``text``, the
    whole conversation rendered: each turn's text is sought after the one before it (a system
    prompt anywhere, as templates move it), a reply's after the generation prompt and followed by
    an end-of-turn marker. A reply trains what the template writes after the generation prompt
    (Qwen3's thinking block) up to that marker, as a reply found turn by turn does; the last
    turn's span runs to the end of the text (Phi-3's closing EOS).

    Raises:
        UserError: a turn's text is not in the rendering as written, or a reply has no marker after it.
    """
    stops = _stop_texts(tokenizer)
    spans, at = [], 0
    for i, message in enumerate(messages):
        content = message["content"].strip()
        if message["role"] == "system":  # passed where it stands; a template may move or drop it
            at = _passed(text, content, at, messages[i + 1 :])
            continue
        if message["role"] != "assistant":
            if not content:  # an empty turn: nothing of it to find (an empty reply is its marker)
                continue
            found = text.find(content, at)
            if found < 0:
                raise UserError(NOT_LOCATED)
            at = found + len(content)
            continue
        start, end = _reply_bounds(tokenizer, messages[:i], text, content, at, stops, i == len(messages) - 1)
        spans += [(start, end)] if i in replies else []
        at = end
    return spans


def _passed(text: str, system: str, at: int, after: list[dict[str, str]]) -> int:
    """Where the rendering is past a system prompt that stands before the next turn's text (a user
    turn's words inside it are not that turn), else ``at``: Mistral's moves it, or drops it."""
    found = text.find(system, at) if system else -1
    following = next((m["content"].strip() for m in after if m["role"] != "system"), "")
    ahead = text.find(following, at) if following else -1
    ends_before = found >= 0 and (ahead < 0 or found + len(system) <= ahead)  # not the turn's own start
    return found + len(system) if ends_before else at


def _reply_bounds(
    tokenizer: Any,
    before: list[dict[str, str]],
    text: str,
    content: str,
    at: int,
    stops: list[str],
    last: bool,
) -> tuple[int, int]:
    """Where a reply of text ``content`` after the turns ``before`` (found up to ``at``) trains: from
    the end of the generation prompt (without one, Mistral's, from the separator before it, " ",
    which a token of its first word holds) through the marker that closes it; the ``last`` turn's
    through the end of the text (Phi-3's closing EOS), whatever the template made of its words, as
    rendering it turn by turn trains it."""
    opened, header = _opened(text, generation_header(tokenizer, before), at)
    after = opened + len(header) if opened >= 0 else at
    if last and opened >= 0:
        return after, len(text)
    # An empty reply is its end of turn alone: the first marker after the generation prompt.
    found = text.find(content, after) if content else min(_places(text, stops, after), default=-1)
    while found >= 0:  # the first place it is followed by an end of turn, not a word in the template
        end = found + len(content)
        rest = text[end:].lstrip()  # a reply's own trailing whitespace (\r\n, a tab) stripped by some
        stop = next((s for s in stops if rest.startswith(s)), None)
        if stop is not None:
            close = len(text) - len(rest) + len(stop)
            while close < len(text) and text[close].isspace():  # ChatML's newline after <|im_end|>
                close += 1
            start = after if opened >= 0 else at + len(text[at:found].rstrip(" "))
            return start, len(text) if last else close
        found = text.find(content, found + 1) if content else -1
    raise UserError(NOT_LOCATED)


def _opened(text: str, header: str, at: int) -> tuple[int, str]:
    """Where the generation prompt's ``header`` opens the next reply after ``at``, and the header as
    written there. A generation prompt that adds more than earlier replies show (Qwen3-Thinking's
    opens the thinking block) is found by its first line where the whole would skip a reply."""
    opened = text.find(header, at) if header else -1
    # Its first line with words: a header that opens with a newline ("\nAssistant: ") has no
    # shorter first line to find (the newline alone is any turn's).
    line = header[: header.find("\n", len(header) - len(header.lstrip())) + 1]
    if line and line != header and (early := text.find(line, at)) >= 0 and (opened < 0 or early < opened):
        return early, line
    return opened, header


def _places(text: str, stops: list[str], start: int) -> list[int]:
    return [at for at in (text.find(stop, start) for stop in stops) if at >= 0]


def generation_header(tokenizer: Any, before: list[dict[str, str]]) -> str:
    """What the generation prompt adds after the turns ``before`` a reply: Phi-3's writes it in
    place of the EOS that closes a conversation, so it is found after the rendering less that EOS
    ("" where it is neither). Raises the template's UserError where it cannot render them."""
    if not before:
        return ""
    asked, said = (render_chat(tokenizer, before, generation_prompt=g) for g in (True, False))
    eos = tokenizer.eos_token if isinstance(tokenizer.eos_token, str) else ""
    for ending in (said, said.removesuffix(eos) if eos and said.endswith(eos) else None):
        if ending is not None and asked.startswith(ending):
            return asked[len(ending) :]
    return ""


def _stop_texts(tokenizer: Any) -> list[str]:
    """The texts of the tokens that end a reply: the template's end of turn (the last reply's, and
    an earlier one's where it is another), and EOS."""
    ids = [*end_of_turn_ids(tokenizer), *end_of_turn_ids(tokenizer, followed=True), tokenizer.eos_token_id]
    tokens = tokenizer.convert_ids_to_tokens([i for i in ids if i is not None])
    return sorted({t for t in tokens if isinstance(t, str) and t}, key=len, reverse=True)
