"""What ``lmtune data audit`` says of preference pairs: pairs that teach nothing (identical answers,
an empty answer), prompts that alone fill ``--max-length``, and the lengths of chosen against
rejected answers (DPO learns a preference for length where chosen answers are longer: a known bias)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lmtune.config.validate import PREFERENCE
from lmtune.data.formats import FieldMap
from lmtune.data.pairs import answer_texts, rendered_pairs, tokenize_pairs
from lmtune.data.sources import BadLines, Record
from lmtune.data.tokenize import chunks


@dataclass
class PairAudit:
    pairs: int = 0
    identical: int = 0  # chosen and rejected the same answer
    empty: int = 0  # an answer with no text
    useless: int = 0  # identical or empty answers, or both: pairs that teach nothing
    prompt_fills: int = 0  # the prompt alone reaches --max-length: truncation cuts it
    chosen_longer: int = 0  # pairs whose chosen answer has more tokens than the rejected one
    same_length: int = 0  # pairs whose answers have as many tokens (no length to learn)
    chosen_tokens: int = 0
    rejected_tokens: int = 0
    examples: list[str] = field(default_factory=list)  # where the first problems are

    def line(self, where: str, what: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(f"{where}: {what}")


def audit_pairs(
    recs: Iterable[Record], tokenizer: Any, lengths: tuple[int, int | None], names: FieldMap
) -> PairAudit:
    """Read every pair (unreadable ones are the main audit's business) and count the problems.
    ``lengths``: --max-length, and --max-prompt-length (a longer prompt is cut to it first) or None."""
    max_length, max_prompt = lengths
    report = PairAudit()
    for chunk in chunks(recs):
        records, texts = rendered_pairs(chunk, tokenizer, BadLines(skip=True), names)
        for record, pair in zip(records, tokenize_pairs(texts, tokenizer), strict=True):
            chosen, rejected = answer_texts(record, names)
            report.pairs += 1
            report.useless += chosen == rejected or not chosen.strip() or not rejected.strip()
            if chosen == rejected:
                report.identical += 1
                report.line(record.where, "chosen and rejected are the same answer")
            if not chosen.strip() or not rejected.strip():
                report.empty += 1
                report.line(record.where, "an empty answer")
            prompt = len(pair.prompt) if max_prompt is None else min(len(pair.prompt), max_prompt)
            if prompt >= max_length:
                report.prompt_fills += 1
                report.line(record.where, f"the prompt alone has {prompt} tokens (--max-length {max_length})")
            report.chosen_longer += len(pair.chosen) > len(pair.rejected)
            report.same_length += len(pair.chosen) == len(pair.rejected)
            report.chosen_tokens += len(pair.chosen)
            report.rejected_tokens += len(pair.rejected)
    return report


def pair_lines(report: PairAudit, objective: str = "") -> list[str]:
    """The audit's lines about pairs; where ``objective`` (the run's, where known) is not a preference
    one, which objectives take them."""
    n = max(report.pairs, 1)
    # Ties say nothing about length: the share is of the pairs whose answers differ in length.
    differ = report.pairs - report.same_length
    longer = 100 * report.chosen_longer / max(differ, 1)
    # Within 40-60% length says little about which answer is chosen; beyond, DPO learns it too.
    lesson = (
        "far from 50%: DPO learns that length too"
        if abs(longer - 50) > 10
        else "near 50%: length does not tell them apart"
    )
    share = (
        f"chosen longer than rejected in {longer:.0f}% of the pairs whose answers differ in length ({lesson})"
        if differ
        else "every pair's answers have the same length"
    )
    lines = [
        f"  preference pairs    {report.pairs:,}: identical chosen and rejected  {report.identical:,}, "
        f"an empty answer  {report.empty:,}, prompt alone over --max-length  {report.prompt_fills:,}"
        + ("" if objective in PREFERENCE else " (train on them with --objective dpo, ipo, simpo or orpo)"),
        f"  answer lengths      chosen {report.chosen_tokens / n:.1f} tokens on average, rejected "
        f"{report.rejected_tokens / n:.1f}; {share}",
    ]
    return lines + [f"    {m}" for m in report.examples]


def kind_refused(pairs: bool, objective: str, takes_pairs: bool | None = None) -> str:
    """Why training with ``objective`` (``takes_pairs``: its loss's unit, by default a preference
    objective's) refuses data that holds ``pairs`` (or single examples): what `lmtune train` and the
    audit of its config say ("" where it takes them)."""
    preference = objective in PREFERENCE if takes_pairs is None else takes_pairs
    if pairs and not preference:
        return (
            f"--objective {objective} trains on single examples, and the data holds preference pairs "
            "(prompt, chosen, rejected); tune on them with --objective dpo, ipo, simpo or orpo (records "
            "that hold 'messages' too, as UltraFeedback's, train on those with --data-format messages)"
        )
    if preference and not pairs:
        return (
            f"--objective {objective} tunes on preference pairs, and the data holds single examples (a "
            "pair is a record of 'prompt', 'chosen' and 'rejected': strings, or lists of messages)"
        )
    return ""
