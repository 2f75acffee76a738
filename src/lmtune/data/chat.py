"""Chat templates: the built-in ones, a template file read and checked, the template and its turn
markers given to a tokenizer, and the end-of-turn token a template trains after each reply."""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmtune.config.files import TooLarge, read_text
from lmtune.errors import SettingError, UserError, brief, one_line

_PROBE = "lmtune-end-of-turn-probe"
_USER_PROBE, _NEXT_PROBE = "lmtune-user-probe", "lmtune-next-user-probe"


def end_of_turn_ids(tokenizer: Any, followed: bool = False) -> list[int]:
    """The special token the chat template writes right after an assistant reply ([] when none);
    ``followed``: after a reply that another turn follows (gpt-oss ends the last reply with
    ``<|return|>``, earlier ones with ``<|end|>``).

    Found by rendering a one-exchange conversation and tokenizing what follows the reply's text,
    so it works for any template (ChatML's ``<|im_end|>``, Llama 3's ``<|eot_id|>``, Gemma's
    ``<end_of_turn>``, or EOS in lmtune's built-in template).
    """
    messages = [{"role": "user", "content": _USER_PROBE}, {"role": "assistant", "content": _PROBE}]
    messages += [{"role": "user", "content": _NEXT_PROBE}] if followed else []
    text = render_chat(tokenizer, messages, generation_prompt=False)
    after = text[text.rfind(_PROBE) + len(_PROBE) :]
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)
    }
    if followed and _NEXT_PROBE in after:
        texts = [t for t in tokenizer.convert_ids_to_tokens(sorted(special)) if isinstance(t, str) and t]
        after = _less_user_header(after[: after.find(_NEXT_PROBE)], text[: text.find(_USER_PROBE)], texts)
    for token in tokenizer(after, add_special_tokens=False)["input_ids"]:
        if token in special:
            return [int(token)]
    return []


def _less_user_header(between: str, first: str, special: list[str]) -> str:
    """What closes a reply, of the text ``between`` it and the next user turn's words: less that
    turn's header, as the first user turn's (``first``: the text before its words) ends from its
    last ``special`` token on. A template that closes replies with nothing of its own then gives no
    token, where the next turn's opening (``<|user|>``) was taken for the reply's end of turn."""
    opens = max((first.rfind(t) for t in special), default=-1)
    header = first[opens:] if opens >= 0 else ""
    return between.removesuffix(header) if header and between.endswith(header) else between


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # Jinja, as tokenizers store it in ``chat_template``
    markers: tuple[str, ...]  # the special tokens it writes (added to a vocabulary that lacks them)


# Turn by turn, with no trimming, so a reply's text is found unchanged in the rendering. Each writes
# the tokenizer's BOS where its model family does (Llama 3, Gemma); ChatML (Qwen) writes none.
TEMPLATES: dict[str, ChatTemplate] = {
    "chatml": ChatTemplate(
        "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor -%}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif -%}",
        ("<|im_start|>", "<|im_end|>"),
    ),
    "llama3": ChatTemplate(
        "{%- if bos_token %}{{ bos_token }}{% endif -%}"
        "{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor -%}"
        "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif -%}",
        ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
    ),
    # Gemma names the assistant "model"; a system turn is kept as its own turn rather than folded
    # into the first user turn, so that every turn renders the same wherever it stands.
    "gemma": ChatTemplate(
        "{%- if bos_token %}{{ bos_token }}{% endif -%}"
        "{%- for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
        "{{ m['content'] }}<end_of_turn>\n{% endfor -%}"
        "{%- if add_generation_prompt %}<start_of_turn>model\n{% endif -%}",
        ("<start_of_turn>", "<end_of_turn>"),
    ),
}
MAX_TEMPLATE_BYTES = 64 * 1024
# Marker-shaped literals of a template file: <|name|> (ChatML, Llama 3, Phi) or <word_word> (Gemma).
_MARKER = re.compile(r"<\|[A-Za-z0-9_.-]{1,64}\|>|<[a-z]+(?:_[a-z]+)+>")


def read_template(choice: str) -> ChatTemplate:
    """A built-in template by name, or a ``.jinja`` file (which transformers renders sandboxed),
    parsed and rendered once on a sample conversation within bounds (:func:`trial_render`)."""
    if choice in TEMPLATES:
        return TEMPLATES[choice]
    option = f"--chat-template {choice}"

    def refused(reason: str) -> SettingError:
        return SettingError("chat_template", option, reason)

    if choice.startswith("tokenizer_default"):  # Axolotl's
        raise refused("the tokenizer's own template is what lmtune uses when none is given: remove it")
    path = Path(choice).expanduser()
    if path.suffix != ".jinja":
        close = difflib.get_close_matches(choice.lower(), TEMPLATES, n=1, cutoff=0.7)
        meant = f"; did you mean {close[0]}?" if close else ""
        raise refused(f"must be one of {', '.join(TEMPLATES)} or a .jinja file{meant}")
    try:
        source = read_text(path, limit=MAX_TEMPLATE_BYTES)
    except FileNotFoundError:
        raise refused("no such file") from None
    except TooLarge:
        raise refused(f"over {MAX_TEMPLATE_BYTES // 1024} KiB, not a chat template") from None
    except UserError as e:
        raise refused(str(e).removeprefix(f"{path}: ")) from None
    if "messages" not in source:
        raise refused("the template never reads 'messages', so it renders no conversation")
    trial_render(source, option)
    return ChatTemplate(source, tuple(dict.fromkeys(_MARKER.findall(source))))


# A sample conversation renders in a few hundred characters; these bounds are far above any real
# template and far below what hurts a machine.
TRIAL_MEMORY_BYTES = 1 << 30
TRIAL_SECONDS = 5
TRIAL_WALL_SECONDS = 30  # CPU seconds run slower than wall seconds on a busy machine
TRIAL_OUTPUT_CHARS = 1 << 20
_TRIAL_CONVERSATION = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6"},
]


def trial_render(source: str, origin: str) -> None:
    """Parse a chat template and render a sample conversation with it in a child process limited to
    1 GiB of memory, 10 s of CPU and 1 MiB of output, so a template that multiplies a string by
    four billion, loops without end or nests loops to the same effect is refused with one line
    here instead of exhausting the machine at the first example. A template that raises an error
    of its own for the sample is accepted: the data decides."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(source)
    except TemplateSyntaxError as e:
        if "generation" not in (e.message or ""):  # transformers' {% generation %} tag parses there
            raise UserError(f"{origin}: line {e.lineno}: {brief(e.message or '', 160)}") from None
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    limits = f"{TRIAL_MEMORY_BYTES}, {TRIAL_SECONDS}, {TRIAL_OUTPUT_CHARS}"
    command = [sys.executable, "-c", f"from lmtune.data.chat import trial_child; trial_child({limits})"]
    try:
        done = subprocess.run(
            command, input=source, capture_output=True, text=True, env=env, timeout=TRIAL_WALL_SECONDS
        )
    except subprocess.TimeoutExpired:
        raise UserError(
            f"{origin}: rendering a sample conversation took over {TRIAL_WALL_SECONDS} s"
        ) from None
    if done.returncode == 0:
        return
    said = done.stdout.strip().splitlines()[-1:] or done.stderr.strip().splitlines()[-1:] or [""]
    problem = said[0]
    if done.returncode < 0:  # ended by the kernel: past its CPU limit
        problem = f"it did not finish within {TRIAL_SECONDS} s of CPU"
    raise UserError(f"{origin}: rendering a sample conversation: {one_line(problem) or 'it failed'}")


def trial_child(memory_bytes: int, cpu_seconds: int, output_chars: int) -> None:
    """The child of :func:`trial_render`: limits first, then the render, as transformers sets up
    its sandbox (trim_blocks, loop controls, raise_exception, tojson, namespace)."""
    import json
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it so)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> Any:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
    env.globals.update(raise_exception=raise_exception, namespace=jinja2.utils.Namespace, dict=dict)
    env.globals["strftime_now"] = lambda f: "2024-01-01"
    try:
        template = env.from_string(sys.stdin.read())
        for messages, prompt in ((_TRIAL_CONVERSATION, False), (_TRIAL_CONVERSATION[:4], True)):
            written = 0
            context = {
                "messages": messages,
                "add_generation_prompt": prompt,
                "bos_token": "<s>",
                "eos_token": "</s>",
            }
            for piece in template.generate(**context):
                written += len(piece)
                if written > output_chars:
                    print(f"it writes over {output_chars:,} characters for five short messages")
                    sys.exit(3)
    except MemoryError:
        print(f"it needs over {memory_bytes >> 20:,} MiB of memory")
        sys.exit(3)
    except jinja2.TemplateSyntaxError as e:
        print(f"line {e.lineno}: {e.message}")
        sys.exit(3)
    except Exception:
        pass  # the template's own complaint about the sample (roles, a missing field)


def render_error(origin: str, e: Exception) -> UserError:
    """A chat template's failure while rendering, as one line naming the template."""
    lineno = getattr(e, "lineno", None)
    at = f" (line {lineno})" if lineno else ""
    return UserError(
        f"{origin}: the chat template failed{at}: {type(e).__name__}: {brief(str(e), 160).strip(chr(39))}"
    )


_CHECKED, _ORIGIN = "_lmtune_checked_template", "_lmtune_template_origin"


def template_origin(tokenizer: Any) -> str:
    """Where a tokenizer's chat template came from, as an error names it."""
    origin = getattr(tokenizer, _ORIGIN, None)
    name = getattr(tokenizer, "name_or_path", "") or "the tokenizer"
    return str(origin) if origin else f"the chat template of {name}"


def check_chat_template(tokenizer: Any, known: tuple[str, ...] = ()) -> None:
    """Trial-render the tokenizer's own template (once per template; lmtune's ``known`` ones are
    trusted), so a model folder's template is bounded like a --chat-template file."""
    source = getattr(tokenizer, "chat_template", None)
    sources = list(source.values()) if isinstance(source, dict) else [source]
    if getattr(tokenizer, _CHECKED, None) == source:
        return
    trusted = {*known, *(t.source for t in TEMPLATES.values())}
    for one in sources:
        if not isinstance(one, str):
            raise UserError(f"{template_origin(tokenizer)}: not a Jinja template (got {brief(one)})")
        if len(one) > MAX_TEMPLATE_BYTES * 4:
            raise UserError(f"{template_origin(tokenizer)}: over {MAX_TEMPLATE_BYTES * 4 // 1024} KiB")
        if one not in trusted:
            trial_render(one, template_origin(tokenizer))
    setattr(tokenizer, _CHECKED, source)


def render_chat(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    """The conversation rendered by the tokenizer's (checked) template; its errors are one line."""
    try:
        return str(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        )
    except UserError:
        raise
    except Exception as e:  # jinja2's UndefinedError, SecurityError, TemplateError from raise_exception
        raise render_error(template_origin(tokenizer), e) from None


def use_chat_template(tokenizer: Any, choice: str) -> list[str]:
    """Give ``tokenizer`` the chosen template (saved with every model folder) and its turn markers
    as special tokens, so each is one token that decoding hides. Returns the markers that were not
    in the vocabulary: the model's embeddings must grow by that many rows."""
    from tokenizers import AddedToken

    template = read_template(choice)
    vocabulary = tokenizer.get_vocab()
    new = [m for m in template.markers if m not in vocabulary]
    tokenizer.add_tokens(
        [AddedToken(m, special=True, normalized=False) for m in template.markers], special_tokens=True
    )
    tokenizer.chat_template = template.source
    setattr(tokenizer, _ORIGIN, f"--chat-template {choice}")
    setattr(tokenizer, _CHECKED, template.source)  # read_template rendered it on a sample
    return new


def drop_unlearned_template(tokenizer: Any, had_one: bool, info: dict[str, Any]) -> None:
    """The built-in template that reading the data gave a tokenizer that had none (``had_one``;
    the data's key hashes it) off again where the data (``info``: its record per part, an
    --eval-split's formats being --data's) held no conversation: saved with the model, vLLM,
    pipelines and TRL prompted a model tuned on text in a format it never learned."""
    from lmtune.data.formats import BUILTIN_CHAT_TEMPLATE, CHAT_FORMATS  # it renders with this module

    formats = {f for part in info.values() for f in part.get("formats", ())}
    if not had_one and not set(CHAT_FORMATS) & formats and tokenizer.chat_template == BUILTIN_CHAT_TEMPLATE:
        tokenizer.chat_template = None
