"""`lmtune data audit`: what training would make of a data set, before any training."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from lmtune.config.groups import ExampleSettings
from lmtune.config.mixture import parse_weights, source_names
from lmtune.data.chat import end_of_turn_ids
from lmtune.data.dataset import held_out_count, held_per_source
from lmtune.data.formats import CHAT_FORMATS, FieldMap, ensure_chat_template
from lmtune.data.mixture import Mixture, SourceIndex, mixture_of, mixture_order
from lmtune.data.pair_audit import PairAudit, audit_pairs, pair_lines
from lmtune.data.pairs import examples_noun, unread_said
from lmtune.data.prepare import encode_into
from lmtune.data.readers import records
from lmtune.data.repeats import Repeats
from lmtune.data.sampling import epoch_order, largest_global_batch, rank_indices
from lmtune.data.sources import BadLines, first_places, in_parentheses, resolve_components
from lmtune.data.tokenize import Encoded, EncodeStats
from lmtune.errors import SettingError, UserError


@dataclass(frozen=True)
class Imbalance:
    """How unevenly the tokens of a step spread over ranks (1.0 is perfectly even)."""

    world_size: int
    mean: float  # mean over steps of max(rank tokens) / mean(rank tokens)
    worst: float
    padding: float  # padded tokens / real tokens, with dynamic padding per micro-batch


@dataclass
class AuditReport:
    spec: str
    stats: EncodeStats
    bad: BadLines
    lengths: np.ndarray
    max_length: int
    truncation: str
    pad_is_eos: bool
    imbalance: Imbalance | None
    stops: list[str]  # the tokens that end an example: EOS, and in chat data the end of turn
    skip_bad_lines: bool = False  # training would skip bad lines (else it stops at the first)
    pairs: PairAudit | None = None  # preference data
    mixture: Mixture | None = None  # --data-weights: the sources, each of lengths[starts:+sizes]
    # The examples' lengths less what --eval-split holds out (the mixture's, once it is held out).
    trained_lengths: np.ndarray | None = None
    global_batch_size: int = 1  # train stops when the data holds less than one global batch
    micro_batch_size: int | None = None  # with the processes, what a global batch must be a multiple of
    nproc_per_node: int = 1
    held_out: int = 0  # --eval-split's examples: evaluated, never trained on
    # Under --truncation error, the over-long examples (counted as dropped) that would stop training.
    stops_on_length: int = 0
    chat_template: str | None = None  # --chat-template: training refuses it for data of no conversation
    kind_refused: str = ""  # what the objective of a --config or --objective refuses of this data
    objective: str = ""  # that objective: pairs under a preference one are not told to take one
    repeats: Repeats | None = None  # records that repeat an earlier one
    # Evaluation data's: how many of its records training trains on too, and the first few places.
    in_training: tuple[int, list[tuple[str, str]]] | None = None

    @property
    def trained(self) -> int:
        """The examples left to train on."""
        return self.stats.examples - self.held_out

    @property
    def stops_lost(self) -> int:
        """Kept examples that train no stop token (the model would not learn to end them)."""
        return self.stats.examples - self.stats.eos_trained

    @property
    def unusable(self) -> list[str]:
        """What would stop a training run on this data as it is (exit code 2)."""
        found = [self.kind_refused] if self.kind_refused else []
        if self.bad.count and not self.skip_bad_lines:  # all bad: skipping them leaves nothing
            fix = "--skip-bad-lines skips them" if self.stats.examples else "above: what they need"
            found.append(f"{_count(self.bad.count, 'bad line')} would stop training ({fix})")
        if self.stops_on_length:
            found.append(
                f"{_count(self.stops_on_length, 'example')} longer than --max-length {self.max_length} "
                "would stop training (--truncation error; drop leaves them out, right or left cut them)"
            )
        if (
            self.chat_template is not None
            and self.stats.examples
            and not set(CHAT_FORMATS) & set(self.stats.formats)
        ):
            found.append(
                f"--chat-template {self.chat_template} applies to conversations (messages records), and the "
                f"data holds {', '.join(sorted(self.stats.formats))}"
            )
        examples = self.trained
        held = f" left after --eval-split holds out {self.held_out:,}" if self.held_out else ""
        s = self.stats
        if not s.examples + s.dropped_too_long + s.dropped_no_targets + self.bad.count:
            found.append("it holds no records (empty)")  # as training says it
        elif examples <= 0:
            found.append("no example to train on" + held)
        elif examples < self.global_batch_size:
            fits = largest_global_batch(examples, self.micro_batch_size, self.nproc_per_node)
            fix = f"give --global-batch-size {fits} or less{', a smaller --eval-split' if held else ''}, or "
            found.append(
                f"{_count(examples, 'example')}{held}, fewer than one global batch (--global-batch-size "
                f"{self.global_batch_size}); {fix if fits else 'give '}more data"
            )
        return found

    @property
    def problems(self) -> list[str]:
        """What would train, but badly (exit code 1)."""
        s = self.stats
        found = []
        if self.stops_lost:
            found.append(
                f"{self.stops_lost:,} of {_count(s.examples, 'example')} lose their stop token's label"
                + self._at("no_stop", self.stops_lost)
            )
        if unread := unread_said(asdict(s)):
            found.append(unread)
        if self.in_training and self.in_training[0]:
            found.append(
                f"{_count(self.in_training[0], 'evaluation record')} also in --data: their loss says how "
                "well the model remembers them, not how it generalises"
            )
        if s.empty_answers:
            found.append(
                f"{_count(s.empty_answers, 'example')} with an empty or blank answer"
                f"{self._at('empty_answer', s.empty_answers)}: only the stop token (after any blank space) "
                "trains, so the model learns to say nothing"
            )
        if s.dropped_no_targets:
            found.append(
                f"{_count(s.dropped_no_targets, 'example')} with nothing to train"
                + self._at("no_targets", s.dropped_no_targets)
            )
        if self.bad.count and self.skip_bad_lines:
            found.append(f"{_count(self.bad.count, 'bad line')} skipped")
        p = self.pairs
        if p is not None and p.useless:
            found.append(f"{_count(p.useless, 'pair')} with identical or empty answers")
        return found

    def _at(self, kind: str, count: int) -> str:
        return in_parentheses(first_places(self.stats.where, kind, count))

    @property
    def exit_code(self) -> int:
        """0 clean, 1 it would train badly, 2 it cannot train as it is."""
        return 2 if self.unusable else 1 if self.problems else 0

    @property
    def clean(self) -> bool:
        return self.exit_code == 0


def stops_lost_warning(
    lost: int, kept: int, chat: bool, unit: str, examples: ExampleSettings, cut_any: bool
) -> str:
    """The start's warning when most training examples train no stop token, with its likely cause:
    a chat template with no end-of-turn token after the reply, or --max-length's cut where it cut
    any (of a pair's answers whatever --truncation says; of an example's end unless left)."""
    cut = f"--max-length {examples.max_length} cut"
    why = " after the reply" if chat else ""
    if not chat and cut_any and unit == "pairs":
        why = f" ({cut} the answers' ends; a larger --max-length or smaller --max-prompt-length keeps them)"
    elif not chat and cut_any and examples.truncation != "left":
        why = f" ({cut} it off; --truncation left keeps the ends)"
    return (
        f"warning: {lost:,} of {kept:,} training {examples_noun(unit)} train no stop token{why}, so the "
        "model may not learn to stop (lmtune data audit shows which)"
    )


def _also(text: str) -> str:
    return f"; {text}" if text else ""


def _count(n: int, thing: str) -> str:
    return f"{n:,} {thing}{'' if n == 1 else 's'}"


def rank_imbalance(
    lengths: np.ndarray,
    world_size: int,
    global_batch_size: int,
    micro_batch_size: int,
    seed: int,
    mixture: Mixture | None = None,
) -> Imbalance | None:
    """Tokens per rank per optimizer step in the first epoch, as the training sampler deals them."""
    order = mixture_order(mixture, seed, 0) if mixture is not None else epoch_order(len(lengths), seed, 0)
    steps = len(order) // global_batch_size
    if steps == 0:
        return None
    share = global_batch_size // world_size
    ratios: list[float] = []
    real = padded = 0
    shards = [
        rank_indices(order, r, world_size, global_batch_size, lengths.tolist()) for r in range(world_size)
    ]
    for step in range(steps):
        per_rank = []
        for shard in shards:
            mine = lengths[shard[step * share : (step + 1) * share]]
            per_rank.append(int(mine.sum()))
            for lo in range(0, len(mine), micro_batch_size):
                micro = mine[lo : lo + micro_batch_size]
                padded += int(micro.max()) * len(micro)
            real += int(mine.sum())
        ratios.append(max(per_rank) / max(float(np.mean(per_rank)), 1e-9))
    return Imbalance(
        world_size=world_size,
        mean=float(np.mean(ratios)),
        worst=float(max(ratios)),
        padding=padded / max(real, 1),
    )


def holding_out(
    report: AuditReport, eval_split: float | None, seed: int = 42, weights: str | None = None
) -> AuditReport:
    """``report`` with what --eval-split holds out as training would: its share of each source of a
    mixture (the very examples: the mixture is then of what is left), else of the whole."""
    if eval_split is None:
        return report
    m = report.mixture
    if m is None or weights is None:
        return replace(report, held_out=held_out_count(eval_split, report.stats.examples))
    sources = SourceIndex(m.names, (*m.starts, m.starts[-1] + m.sizes[-1]))
    try:
        held = held_per_source(sources, eval_split, seed)
    except ValueError as e:  # as train refuses it
        raise SettingError("eval_split", f"--eval-split {eval_split:g}", str(e)) from None
    sizes = [n - held_out_count(eval_split, n) for n in m.sizes]
    return replace(
        report,
        held_out=len(held),
        mixture=mixture_of(list(m.names), sizes, parse_weights(weights, len(sizes))),
        trained_lengths=np.delete(report.lengths, held),
    )


def audit(
    spec: str,
    tokenizer: Any,
    settings: ExampleSettings,
    nproc_per_node: int = 1,
    global_batch_size: int = 32,
    micro_batch_size: int | None = None,
    seed: int = 42,
    weights: str | None = None,
) -> AuditReport:
    """Read every record, collect every bad line, and measure what training would see; with
    ``weights`` (--data-weights) also the mixture of the sources."""
    bad = BadLines(skip=True, keep=50)
    components = [part for _, part in resolve_components(spec, "audit")]
    sources = [s for part in components for s in part]
    if not sources:
        raise UserError("audit: no data given")
    # Over-long examples are counted as truncation would treat them, not raised as errors.
    mode = "drop" if settings.truncation == "error" else settings.truncation
    counting = replace(settings, truncation=mode, skip_bad_lines=True)
    ensure_chat_template(tokenizer)
    sink = _Lengths()
    stats, sizes = EncodeStats(), list[int]()
    repeats = Repeats(FieldMap.of(settings))
    for part in components if weights is not None else [sources]:
        read = repeats.tap(records(part, counting, bad))
        stats.merge(encode_into(read, tokenizer, counting, sink, bad))
        sizes.append(len(sink.lengths) - sum(sizes))
    mixture = None
    if weights is not None:
        named = source_names(spec, "--data")
        mixture = mixture_of(named, sizes, parse_weights(weights, len(named)))
    lengths = np.asarray(sink.lengths, dtype=np.int64)
    micro = micro_batch_size or max(1, global_batch_size // nproc_per_node)
    imbalance = None
    if nproc_per_node > 1 and global_batch_size % (micro * nproc_per_node) == 0:
        imbalance = rank_imbalance(lengths, nproc_per_node, global_batch_size, micro, seed, mixture)
    stops = [tokenizer.eos_token_id]
    if set(CHAT_FORMATS) & set(stats.formats):
        stops += [t for t in end_of_turn_ids(tokenizer) if t not in stops]
    pairs = None
    if {"preference", "preference_messages"} & set(stats.formats):
        names = FieldMap.of(settings)
        mapped = (names.record(r) for r in records(sources, counting, BadLines(skip=True)))
        pairs = audit_pairs(mapped, tokenizer, (settings.max_length, settings.max_prompt_length), names)
    return AuditReport(
        spec=spec,
        stats=stats,
        bad=bad,
        lengths=lengths,
        max_length=settings.max_length,
        truncation=mode,
        pad_is_eos=tokenizer.pad_token_id == tokenizer.eos_token_id,
        imbalance=imbalance,
        stops=tokenizer.convert_ids_to_tokens(stops),
        skip_bad_lines=settings.skip_bad_lines,
        pairs=pairs,
        mixture=mixture,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        nproc_per_node=nproc_per_node,
        stops_on_length=stats.dropped_too_long if settings.truncation == "error" else 0,
        chat_template=settings.chat_template,
        repeats=repeats,
    )


class _Lengths:
    """Keeps each example's length: the audit needs no token arrays."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def write(self, examples: list[Encoded]) -> None:
        self.lengths += [len(e.ids) for e in examples]


def _histogram(lengths: np.ndarray, max_length: int, bins: int = 12) -> list[tuple[int, int, int]]:
    """At most ``bins`` bins of whole token counts, from the shortest to the longest example, each
    as (first, last, examples): every length lands in exactly one."""
    lengths = np.asarray(lengths)
    low, top = int(lengths.min()), max(int(lengths.min()), min(int(lengths.max()), max_length))
    width = -(-(top - low + 1) // bins)
    firsts = range(low, top + 1, width)
    index = np.minimum((np.clip(lengths, low, top) - low) // width, len(firsts) - 1)
    counts = np.bincount(index, minlength=len(firsts))
    return [(first, min(first + width - 1, top), int(c)) for first, c in zip(firsts, counts, strict=True)]


_WHERE = re.compile(r"(.+?):(\d+): (.*)", re.S)


def _grouped(messages: list[str]) -> list[str]:
    """Bad lines with the same problem in one file as one line (``f.jsonl:1, 2, 3: problem``):
    a data set in another format has the same problem on every line."""
    groups: dict[tuple[str, str], list[str]] = {}
    for message in messages:
        found = _WHERE.fullmatch(message)
        source, line, problem = found.groups() if found else ("", "", message)
        groups.setdefault((source, problem), []).append(line)

    def first_line(item: tuple[tuple[str, str], list[str]]) -> int:
        return min((int(n) for n in item[1] if n.isdigit()), default=0)

    shown = []
    # Each file's groups by their first line: a problem found while reading (bad JSON) and one
    # found while encoding (a missing field) reach the list at different times.
    sources = list(dict.fromkeys(source for source, _ in groups))
    for (source, problem), where in sorted(
        groups.items(), key=lambda g: (sources.index(g[0][0]), first_line(g))
    ):
        where = sorted(where, key=lambda n: int(n) if n.isdigit() else 0)
        numbers = ", ".join(where[:5]) + (f" and {len(where) - 5} more" if len(where) > 5 else "")
        shown.append(f"{source}:{numbers}: {problem}" if source else problem)
    return shown


def _over_line(report: AuditReport) -> str:
    s = report.stats
    at = _also(first_places(s.where, "too_long", s.dropped_too_long))
    if report.stops_on_length:
        return (
            f"  over --max-length   {s.truncated:,} truncated, {s.dropped_too_long:,} would stop training "
            f"(--max-length {report.max_length}, --truncation error{at})"
        )
    if s.documents_split:  # --truncation split
        places = in_parentheses(first_places(s.where, "split", s.documents_split))
        return (
            f"  over --max-length   {_count(s.documents_split, 'document')} split into "
            f"{s.documents_split + s.pieces_added:,} pieces of at most --max-length {report.max_length}"
            f"{places}; {s.truncated:,} other examples truncated, {s.dropped_too_long:,} dropped"
        )
    return (
        f"  over --max-length   {s.truncated:,} truncated, {s.dropped_too_long:,} dropped "
        f"(--max-length {report.max_length}; dropped: too long, or left with nothing to train, as a "
        f"prompt that fills it{at})"
    )


def format_report(report: AuditReport) -> str:
    """The report as the terminal shows it."""
    s = report.stats
    lines = [f"audit of {report.spec}"]
    total_read = s.examples - s.pieces_added + s.dropped_too_long + s.dropped_no_targets + report.bad.count
    formats = ", ".join(f"{k} {v:,}" for k, v in sorted(s.formats.items())) or "none"
    pieces = f" (as {s.examples:,} examples: --truncation split)" if s.pieces_added else ""
    lines += [
        f"  records             {total_read:,} read, {s.examples - s.pieces_added:,} kept{pieces}",
        f"  formats             {formats}",
        f"  bad lines           {report.bad.count:,}",
    ]
    lines += [f"    {m}" for m in _grouped(report.bad.messages)]
    if report.bad.count > len(report.bad.messages):
        listed = len(report.bad.messages)
        later = _count(report.bad.count - listed, "later bad line")
        lines.append(f"    ... and {later} (the first {'is' if listed == 1 else f'{listed} are'} above)")
    if report.held_out:
        lines.append(
            f"  held out            {report.held_out:,} (--eval-split): {report.trained:,} left to train on"
        )
    steps, left = divmod(report.trained, report.global_batch_size)
    if steps and left:
        lines.append(
            f"  per epoch           {steps * report.global_batch_size:,} of {report.trained:,} in "
            f"{_count(steps, 'step')} of --global-batch-size {report.global_batch_size}; the {left:,} left "
            "over sit each epoch out (other ones each epoch)"
        )
    lines += [
        _over_line(report),
        f"  no trainable tokens {s.dropped_no_targets:,} (dropped: they would train on nothing"
        f"{_also(first_places(s.where, 'no_targets', s.dropped_no_targets))})",
        _stop_line(report),
        f"  tokens              {s.tokens:,} ({s.target_tokens:,} trained)",
    ]
    if report.repeats is not None:
        lines.insert(-1, report.repeats.line())
    if report.in_training is not None:
        count, places = report.in_training
        shown = f" ({', '.join(f'{mine} = {theirs}' for mine, theirs in places)})" if places else ""
        lines.insert(-1, f"  also in --data      {count:,}{shown}")
    if len(report.lengths):
        q = np.percentile(report.lengths, [0, 50, 95, 100]).astype(int)
        lines.append(f"  token lengths       min {q[0]}, median {q[1]}, p95 {q[2]}, max {q[3]}")
        # A pair runs its prompt and both answers as one sequence, longer than --max-length.
        top = report.max_length if report.pairs is None else int(report.lengths.max())
        hist = _histogram(report.lengths, top)
        widest = max(c for _, _, c in hist) or 1
        for first, last, count in hist:
            bar = "#" * max(1 if count else 0, round(40 * count / widest))
            span = f"{first:>6}-{last:<6}" if last > first else f"{first:>6} {'':<6}"
            lines.append(f"    {span} {count:>9,} {bar}")
    if report.pairs is not None:
        lines += pair_lines(report.pairs, report.objective)
    if report.mixture is not None:
        trained = report.trained_lengths
        lines += mixture_lines(report.mixture, report.lengths if trained is None else trained)
    if report.imbalance is not None:
        im = report.imbalance
        lines.append(
            f"  rank imbalance      {im.world_size} ranks: busiest rank has {im.mean:.2f}x the mean tokens "
            f"per step (worst step {im.worst:.2f}x); padding adds {100 * (im.padding - 1):.0f}%"
        )
    lines.append("  result              " + _verdict(report))
    return "\n".join(lines)


def mixture_lines(mixture: Mixture, lengths: np.ndarray) -> list[str]:
    """Per source: its examples and tokens, its draws per epoch, their share and repetitions."""
    lines = [f"  mixture             an epoch of {mixture.epoch_size:,} examples (--data-weights)"]
    for d, start in zip(mixture.describe(), mixture.starts, strict=True):
        tokens = int(lengths[start : start + d["examples"]].sum())
        lines.append(
            f"    {d['name']:<16} {d['examples']:>9,} examples {tokens:>12,} tokens -> "
            f"{d['per_epoch']:>9,} per epoch ({d['share']:6.1%}), x{d['repeats']:.2f} each"
        )
    return lines


def _stop_line(report: AuditReport) -> str:
    s = report.stats
    label = f"  {'EOS' if len(report.stops) == 1 else 'stop'} keeps its label "
    if s.examples == 0:
        return label + "-: no example to check"
    pad_is_eos = "yes" if report.pad_is_eos else "no"
    line = (
        # A split document's pieces but its last end nothing: its record is counted by that one.
        f"{'yes' if not report.stops_lost else 'NO'}: {s.eos_trained - s.pieces_added:,} of "
        f"{s.examples - s.pieces_added:,} kept {'records' if s.pieces_added else 'examples'} "
        f"train a stop token ({' or '.join(report.stops)}); pad == eos: {pad_is_eos}"
    )
    # Of pairs, the answers cut at the end (a prompt cut by --max-prompt-length keeps its answers).
    cut = s.answers_truncated if report.pairs is not None else s.truncated
    if report.stops_lost and cut and report.truncation == "right":
        # Documents (text records): the rest is lost whichever end is cut; lmtune does not chunk them
        # as HF's run_clm does.
        fix = (
            "raise it, or --truncation split trains each document as pieces of that many tokens"
            if set(s.formats) == {"text"}
            else "raise it, or use --truncation left or drop"
        )
        line += f"; {cut:,} lost their end to --max-length {report.max_length} ({fix})"
    return label + line


def _verdict(report: AuditReport) -> str:
    if report.unusable:
        return f"unusable as it is (exit code 2): {'; '.join(report.unusable + report.problems)}"
    if report.problems:
        return f"will train badly (exit code 1): {'; '.join(report.problems)}"
    return "clean"
