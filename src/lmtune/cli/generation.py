"""`lmtune generate`: complete a prompt, or chat, with a trained model folder."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from lmtune.errors import UserError, brief, visible


def _prompt_from_stdin() -> str:
    """The text piped in (``echo "1+2=" | lmtune generate ...``), less the newline echo ends it with."""
    text = sys.stdin.read()
    text = text[:-1] if text.endswith("\n") else text
    if not text:
        raise UserError("--prompt: nothing came on stdin; give the text with --prompt TEXT")
    return text


def _file_named(text: str) -> str | None:
    """The file a --prompt names, as itself or as curl's ``@FILE``; a prompt longer than a name can
    be names none (its check raised "File name too long", and the CLI refused the prompt as a path)."""
    for name in (text, text[1:]) if text.startswith("@") else (text,):
        try:
            if "\n" not in name and Path(name).expanduser().is_file():
                return name
        except (OSError, ValueError):
            continue
    return None


def _check_answer_length(
    model: Any, tokenizer: Any, prompt: str | None, new_tokens: int, chat: bool = False
) -> None:
    """A prompt and answer past the model's positions: refused for a learned position table (the
    answer would fail there), a warning otherwise (it never saw positions that far). ``chat``: the
    prompt is the conversation rendered, its special tokens written by the template."""
    from lmtune.model.tokens import position_limit, prompt_ids

    limit, learned = position_limit(model)
    prompt_tokens = len(prompt_ids(tokenizer, prompt, not chat)) if prompt is not None else 0
    if limit is None or prompt_tokens + new_tokens <= limit:
        return
    what = f"the {'conversation' if chat else 'prompt'}'s {prompt_tokens} tokens"
    said = f"--max-new-tokens {new_tokens}: with {what}, past the model's {limit} positions"
    if learned and prompt_tokens >= limit:  # no answer fits: the prompt is what to shorten
        raise UserError(
            f"{'the conversation' if chat else '--prompt'}: its {prompt_tokens} tokens fill the model's "
            f"{limit} positions (a learned table: it cannot run past it), leaving no room for an answer; "
            f"give a shorter {'one' if chat else 'prompt'}"
        )
    if learned:
        raise UserError(
            f"{said} (a learned table: it cannot run past it); give {limit - prompt_tokens} or fewer"
        )
    from lmtune.parallel.launch import warn

    warn(f"{said}: it never saw positions that far, so its answer may come apart there")


def generate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import torch

    from lmtune.config.groups import MAX_LENGTH
    from lmtune.model.modeling import load_model
    from lmtune.model.tokens import UNEMBEDDED, tokens_without_embeddings
    from lmtune.parallel.distributed import read_dist_env

    if not 1 <= args.max_new_tokens <= MAX_LENGTH:
        # Past 2**24 (as for --max-length) is a slip that would generate until stopped.
        raise UserError(f"--max-new-tokens must be in [1, 2**24] (got {brief(args.max_new_tokens)})")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0 (got {args.temperature})")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1] (got {args.top_p}; 1 is no cut)")
    if args.top_k is not None and args.top_k < 0:
        raise UserError(f"--top-k must be >= 0 (got {args.top_k})")
    if args.temperature == 0 and (args.top_k is not None or args.top_p is not None):
        cut = "--top-k" if args.top_k is not None else "--top-p"
        raise UserError(f"{cut} applies when sampling: give --temperature T > 0 (else decoding is greedy)")
    if args.device not in ("auto", "cpu", "cuda"):
        raise UserError(f"--device must be auto, cpu or cuda (got {args.device!r})")
    if args.prompt == "-" or (args.prompt is None and not args.chat and not sys.stdin.isatty()):
        args.prompt = _prompt_from_stdin()
    elif args.prompt is not None and (named := _file_named(args.prompt)) is not None:
        from lmtune.parallel.launch import warn

        # --prompt prompts.txt continued the text "prompts.txt": a file's text comes on stdin.
        warn(
            f"--prompt {args.prompt}: continuing the text {args.prompt!r}, which names a file; for the "
            f"file's text: lmtune generate ... < {shlex.quote(named)}"
        )
    if args.prompt is None and not args.chat:
        raise UserError("--prompt is needed (or piped input, or --chat, which reads turns from stdin)")
    if args.system is not None and not args.chat:
        raise UserError("--system needs --chat")
    device = read_dist_env(args.device).device
    loaded = load_model(args.model, seed=args.seed, trust_remote_code=args.trust_remote_code)
    if unembedded := tokens_without_embeddings(loaded.model, loaded.tokenizer, args.model):
        raise UserError(f"{unembedded}: {UNEMBEDDED}")
    _check_answer_length(
        loaded.model, loaded.tokenizer, None if args.chat else args.prompt, args.max_new_tokens
    )
    model = loaded.model.to(device)
    from lmtune.model.generate import Sampling

    options = {
        "max_new_tokens": args.max_new_tokens,
        "sampling": Sampling(args.temperature, args.top_p, args.top_k, args.seed),
    }
    with torch.inference_mode():
        if args.chat:
            problem = _untrained_template(args.model, loaded.tokenizer)
            if problem is not None:
                from lmtune.parallel.launch import warn

                # Its replies follow a format it never saw: likely text that rambles past the turn.
                warn(
                    f"{problem}; fine-tune it on conversations (messages records) first, or drop --chat to "
                    "complete plain text"
                )
            _chat(model, loaded.tokenizer, args.prompt, args.system, options)
        else:
            from lmtune.model.generate import complete

            text = complete(model, loaded.tokenizer, args.prompt, **options)
            print(args.prompt + visible(text))
            _note_if_empty(text)
    return 0


def _note_if_empty(reply: str) -> None:
    """An empty answer looks like a failure of the tool; say what the model did."""
    if not reply.strip():
        from lmtune.parallel.launch import warn

        # Whitespace alone is an answer too (10 spaces were called "the first token was a stop").
        said = (
            "empty: the first token it generated was a stop token"
            if not reply
            else f"only whitespace ({len(reply)} characters: {ascii(reply[:20])[1:-1]})"
        )
        warn(
            f"the model's answer is {said} (a model trained on empty answers, or not trained enough, "
            "does this; lmtune data audit finds empty answers)"
        )


def _chat(
    model: Any, tokenizer: Any, prompt: str | None, system: str | None, options: dict[str, Any]
) -> None:
    """One reply to --prompt, or a conversation over stdin's lines (interactive on a terminal)."""
    from lmtune.data.chat import render_chat
    from lmtune.data.formats import ensure_chat_template
    from lmtune.model.generate import chat_reply

    ensure_chat_template(tokenizer)
    messages = [{"role": "system", "content": system}] if system else []
    interactive = prompt is None and sys.stdin.isatty()
    turns = [prompt] if prompt is not None else _stdin_turns(interactive)
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        asked = render_chat(tokenizer, messages, generation_prompt=True)
        _check_answer_length(model, tokenizer, asked, options["max_new_tokens"], chat=True)
        generated = chat_reply(model, tokenizer, messages, **options)
        reply = generated.rstrip()
        messages.append({"role": "assistant", "content": reply})
        print(f"assistant> {visible(reply)}" if interactive else visible(reply), flush=True)
        _note_if_empty(generated)


def _untrained_template(model: str, tokenizer: Any) -> str | None:
    """Why --chat would render turns in a format ``model`` never learned, if it would: it has no
    chat template (the built-in one stands in), or lmtune gave it the built-in one (every model it
    saves has a template) and its run trained on no conversations."""
    from lmtune.checkpoint.card import run_record_near, trained_formats
    from lmtune.data.formats import BUILTIN_CHAT_TEMPLATE, CHAT_FORMATS

    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return "the model has no chat template, so --chat renders the turns with lmtune's built-in one"
    folder = Path(model).expanduser()
    run = run_record_near(folder) if template == BUILTIN_CHAT_TEMPLATE and folder.is_dir() else None
    formats = trained_formats(run)
    if formats and not set(CHAT_FORMATS) & formats:
        return (
            "the model's chat template is lmtune's built-in one, and the run that saved it trained on "
            f"{', '.join(sorted(formats))} records, not on conversations in it"
        )
    return None


def _stdin_turns(interactive: bool) -> Iterator[str]:
    while True:
        try:
            line = input("you> ") if interactive else sys.stdin.readline()
        except EOFError:  # Ctrl+D at the prompt
            print()
            return
        if not interactive and not line:
            return
        if line.strip():
            yield line.strip()
