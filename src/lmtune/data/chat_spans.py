"""Finding the assistant replies in a conversation whose chat template does not render it turn by
turn: a turn that renders otherwise once later turns follow it (Qwen3's drops the empty thinking
block of every reply but the last, Phi-3's ends the text with EOS, Mistral's folds the system
prompt into the last user turn). Each reply is found as it was written, in order, in the whole
rendering, and trains from the generation prompt's end to its end-of-turn marker."""

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
        start, end = _reply_bounds(tokenizer, messages[:i], text, content, at, stops)
        spans += [(start, len(text) if i == len(messages) - 1 else end)] if i in replies else []
        at = end
    return spans


def _passed(text: str, system: str, at: int, after: list[dict[str, str]]) -> int:
    """Where the rendering is past a system prompt that stands before the next turn's text (a user
    turn's words inside it are not that turn), else ``at``: Mistral's moves it, or drops it."""
    found = text.find(system, at) if system else -1
    following = next((m["content"].strip() for m in after if m["role"] != "system"), "")
    ahead = text.find(following, at) if following else -1
    return found + len(system) if found >= 0 and (ahead < 0 or found <= ahead) else at


def _reply_bounds(
    tokenizer: Any, before: list[dict[str, str]], text: str, content: str, at: int, stops: list[str]
) -> tuple[int, int]:
    """Where a reply of text ``content`` after the turns ``before`` (found up to ``at``) trains: from
    the end of the generation prompt (without one, Mistral's, from the separator before it, " ",
    which a token of its first word holds) through the marker that closes it."""
    header = generation_header(tokenizer, before)
    opened = text.find(header, at) if header else -1
    after = opened + len(header) if opened >= 0 else at
    # An empty reply is its end of turn alone: the first marker after the generation prompt.
    found = text.find(content, after) if content else min(_places(text, stops, after), default=-1)
    while found >= 0:  # the first place it is followed by an end of turn, not a word in the template
        end = found + len(content)
        rest = text[end:].lstrip(" \n")
        stop = next((s for s in stops if rest.startswith(s)), None)
        if stop is not None:
            close = len(text) - len(rest) + len(stop)
            while close < len(text) and text[close] in " \n":  # ChatML's newline after <|im_end|>
                close += 1
            start = after if opened >= 0 else at + len(text[at:found].rstrip(" "))
            return start, close
        found = text.find(content, found + 1) if content else -1
    raise UserError(NOT_LOCATED)


def _places(text: str, stops: list[str], start: int) -> list[int]:
    return [at for at in (text.find(stop, start) for stop in stops) if at >= 0]


def generation_header(tokenizer: Any, before: list[dict[str, str]]) -> str:
    """What the generation prompt adds after the turns ``before`` a reply ("" where it does not
    add to their rendering, as Phi-3's, which ends it with EOS otherwise). Raises the template's
    UserError where it cannot render them."""
    if not before:
        return ""
    asked, said = (render_chat(tokenizer, before, generation_prompt=g) for g in (True, False))
    return asked[len(said) :] if asked.startswith(said) else ""


def _stop_texts(tokenizer: Any) -> list[str]:
    """The texts of the tokens that end a reply: the template's end of turn, and EOS."""
    ids = [*end_of_turn_ids(tokenizer), tokenizer.eos_token_id]
    tokens = tokenizer.convert_ids_to_tokens([i for i in ids if i is not None])
    return sorted({t for t in tokens if isinstance(t, str) and t}, key=len, reverse=True)
