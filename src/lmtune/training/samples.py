"""Generations during training (--sample-prompts): what the model writes for a few fixed prompts,
every --sample-every steps and at the end, in metrics.jsonl (``"kind": "sample"``) and the log.

Decoding is lmtune's own short loop over the training wrapper (no KV cache; prompts are short):
under FSDP2 every forward gathers parameters from all ranks, so every rank decodes the same prompt
in lockstep and rank 0's choice of each token is broadcast. Under DDP rank 0 decodes alone while
the others wait in the next step's collective, so a time budget bounds that wait.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

if TYPE_CHECKING:
    from typing_extensions import Unpack

import torch
from torch import nn

from lmtune.config.files import TooLarge, read_text
from lmtune.config.run_groups import SampleSettings
from lmtune.errors import UserError
from lmtune.model.tokens import prompt_ids, stop_ids
from lmtune.outputs.runlog import RunLog
from lmtune.parallel.distributed import DistEnv, broadcast
from lmtune.parallel.wrap import unwrap
from lmtune.training.build import Built
from lmtune.training.callbacks import Callback, Control, StepEnd
from lmtune.training.context import RunContext

MAX_PROMPTS_BYTES = 1 << 20
MAX_PROMPTS = 64
# Under DDP the other ranks wait for rank 0 in a collective whose timeout is minutes, not hours.
TIME_BUDGET_S = 120.0


@dataclass(frozen=True)
class Prompt:
    shown: str  # as the log and metrics.jsonl show it
    ids: list[int]


def _prompt_text(line: str, path: Path, number: int, tokenizer: Any) -> tuple[str, str, bool]:
    """(shown, rendered, whether the tokenizer adds its own specials) of one line."""
    where = f"{path}:{number}"
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: not JSON ({e.msg})") from None
    if isinstance(value, str):
        return value, value, True
    if isinstance(value, dict) and isinstance(value.get("prompt"), str):
        return value["prompt"], value["prompt"], True
    if not isinstance(value, dict) or "messages" not in value:
        raise UserError(f'{where}: expected a string, {{"prompt": ...}} or {{"messages": [...]}}')
    from lmtune.data.formats import chat_prompt
    from lmtune.data.sources import Record

    shown, rendered = chat_prompt(Record(str(path), number, value), tokenizer)
    return shown, rendered, False


def read_prompts(path: Path, tokenizer: Any, max_tokens: int | None = None) -> list[Prompt]:
    """The prompts of a --sample-prompts file; every problem is an error naming the line.
    ``max_tokens``: the longest prompt plus generation the run allows (found now, not at the
    sampling step hours into training)."""
    option = f"--sample-prompts {path}"
    try:
        lines = read_text(path, limit=MAX_PROMPTS_BYTES).splitlines()
    except FileNotFoundError:
        raise UserError(f"{option}: no such file") from None
    except TooLarge:
        raise UserError(f"{option}: over {MAX_PROMPTS_BYTES >> 20} MiB; a few prompts are enough") from None
    except UserError as e:
        raise UserError(f"{option}: {str(e).removeprefix(f'{path}: ')}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        shown, rendered, specials = _prompt_text(line, path, number, tokenizer)
        ids = prompt_ids(tokenizer, rendered, specials)
        if not ids:
            raise UserError(f"{path}:{number}: the prompt is empty")
        if max_tokens is not None and len(ids) > max_tokens:
            raise UserError(
                f"{path}:{number}: the prompt is {len(ids)} tokens; with --sample-max-new-tokens it may be "
                f"at most {max_tokens} (--max-length, or the model's learned positions where fewer)"
            )
        prompts.append(Prompt(shown, list(ids)))
    if not prompts:
        raise UserError(f"{option}: no prompts in it")
    if len(prompts) > MAX_PROMPTS:
        raise UserError(f"{option}: {len(prompts)} prompts; at most {MAX_PROMPTS} are generated from")
    return prompts


@dataclass(frozen=True)
class Generation:
    prompt: str
    completion: str
    tokens: int
    stopped: bool  # ended by a stop token (else by the token limit or the time budget)


class DecodeOptions(TypedDict):
    stop: set[int]  # token ids that end a generation
    max_new_tokens: int
    temperature: float  # 0: greedy
    seed: int
    env: DistEnv
    lockstep: bool  # FSDP: every rank forwards; rank 0's token is broadcast
    autocast: Callable[[], AbstractContextManager[object]]
    deadline: float  # time.monotonic() after which decoding ends


@torch.no_grad()
def decode(
    root: nn.Module, prompt: list[int], **options: Unpack[DecodeOptions]
) -> tuple[list[int], bool, bool]:
    """New tokens after ``prompt``, whether a stop token ended them, and whether the time budget
    ran out (the same on every rank). ``root`` is the training wrapper, whose forward without
    labels returns the last position's logits."""
    stop, max_new_tokens, temperature = options["stop"], options["max_new_tokens"], options["temperature"]
    env, lockstep, autocast, deadline = (
        options["env"],
        options["lockstep"],
        options["autocast"],
        options["deadline"],
    )
    seed = options["seed"]
    ids = torch.tensor([prompt], device=env.device)
    generator = torch.Generator().manual_seed(seed)
    new: list[int] = []
    for _ in range(max_new_tokens):
        with autocast():
            logits = root(ids, torch.ones_like(ids), None)[0].float()
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1).cpu()
            token = int(torch.multinomial(probs, 1, generator=generator))
        else:
            token = int(logits.argmax())
        late = int(time.monotonic() > deadline)
        if lockstep:  # rank 0 decides, so no rank can leave the loop while another forwards
            token, late = (int(v) for v in broadcast(torch.tensor([token, late], device=env.device), env))
        if token in stop:
            return new, True, bool(late)
        new.append(token)
        if late:
            return new, False, True
        ids = torch.cat([ids, torch.tensor([[token]], device=env.device)], dim=1)
    return new, False, False


@dataclass(frozen=True)
class SamplePlan:
    """What to generate and when: --sample-prompts read and checked, with the samples settings."""

    prompts: list[Prompt]
    settings: SampleSettings  # every (0: at the end only), temperature, max_new_tokens
    seed: int


@dataclass(frozen=True)
class SampleModel:
    """The model generations run on: under FSDP every rank decodes in lockstep (``lockstep``)."""

    root: nn.Module  # the loss module (its call gathers FSDP2's parameters)
    tokenizer: Any
    stop: list[int]  # token ids that end a generation
    lockstep: bool
    autocast: Callable[[], AbstractContextManager[object]]


class SampleGenerator(Callback):
    """Generates from the prompts every ``plan.settings.every`` steps and at the end."""

    def __init__(
        self, plan: SamplePlan, model: SampleModel, env: DistEnv, log: RunLog, beat: Callable[[], None]
    ):
        self.plan, self.model, self.env, self.log, self.beat = plan, model, env, log, beat

    def on_step_end(self, end: StepEnd, control: Control) -> None:
        state = end.state
        step, every = state.step, self.plan.settings.every
        if not (end.finished or (every and step % every == 0)):
            return
        if not (self.model.lockstep or self.env.is_main):
            return  # DDP: rank 0 alone; the others go on to the next step's collective
        self.beat()
        root = self.model.root
        was_training = root.training
        root.eval()
        try:
            generations = self._generate()
        finally:
            root.train(was_training)
        for g in generations:
            self.log.record({"kind": "sample", "step": step, "epoch": state.epochs_done, **asdict(g)})
        shown = [f"  {g.prompt!r} -> {g.completion!r}{'' if g.stopped else ' ...'}" for g in generations]
        self.log.info(f"step {step}: samples\n" + "\n".join(shown))

    def _generate(self) -> list[Generation]:
        s, plan = self.plan.settings, self.plan
        deadline = time.monotonic() + TIME_BUDGET_S
        out = []
        for i, prompt in enumerate(plan.prompts):
            m = self.model
            new, stopped, late = decode(
                m.root,
                prompt.ids,
                stop=set(m.stop),
                max_new_tokens=s.max_new_tokens,
                temperature=s.temperature,
                seed=plan.seed + i,
                env=self.env,
                lockstep=m.lockstep,
                autocast=m.autocast,
                deadline=deadline,
            )
            text = str(m.tokenizer.decode(new, skip_special_tokens=True))
            out.append(Generation(prompt=prompt.shown, completion=text, tokens=len(new), stopped=stopped))
            if late:
                self.log.info(f"samples: the {TIME_BUDGET_S:.0f} s budget ran out after {i + 1} prompts")
                break
        return out


def sample_generator(run: RunContext, built: Built) -> SampleGenerator:
    """The component that generates from --sample-prompts during a run."""
    cfg = run.cfg
    assert cfg.samples.prompts is not None
    room = _prompt_room(built.loaded.model, cfg.examples.max_length, cfg.samples.max_new_tokens)
    prompts = read_prompts(Path(cfg.samples.prompts).expanduser(), built.tokenizer, room)
    model = SampleModel(
        root=unwrap(built.model),
        tokenizer=built.tokenizer,
        stop=stop_ids(built.loaded.model, built.tokenizer),
        lockstep=built.parts.sharded,
        autocast=built.autocast,
    )
    plan = SamplePlan(prompts=prompts, settings=cfg.samples, seed=cfg.seed)
    return SampleGenerator(plan, model, run.env, run.log, partial(run.heartbeat.beat, "sample"))


def _prompt_room(model: Any, max_length: int, new_tokens: int) -> int:
    """The longest prompt that leaves room for ``new_tokens`` within --max-length and a learned
    position table (GPT-2's, OPT's): past the table, sampling failed at the run's end, its
    checkpoint and model unsaved."""
    from lmtune.model.tokens import position_limit

    limit, learned = position_limit(model)
    if learned and limit is not None and limit < max_length:
        if new_tokens >= limit:
            raise UserError(
                f"--sample-max-new-tokens {new_tokens}: past the model's {limit} positions (a learned "
                f"table: it cannot run past it); give {limit - 1} or fewer"
            )
        return limit - new_tokens
    return max_length - new_tokens
