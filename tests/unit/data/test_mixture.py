"""Data mixtures: exact shares per epoch, even repetition, no repeats of a downsampled source, the
same order whatever the ranks and across a resume, and every bad --data-weights refused."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from lmtune.checkpoint.fingerprint import mixture_fingerprint
from lmtune.cli import main
from lmtune.config.groups import ExampleSettings
from lmtune.config.io import build_config, load_yaml
from lmtune.config.settings import TrainConfig
from lmtune.config.validate import check_settings
from lmtune.data.dataset import split_off
from lmtune.data.mixture import (
    COMPONENTS_META,
    Mixture,
    SourceIndex,
    mixture_of,
    mixture_order,
    shares,
    source_index,
)
from lmtune.data.prepare import Wanted, prepare
from lmtune.data.sampling import TrainSampler
from lmtune.errors import UserError
from lmtune.model.modeling import byte_tokenizer
from lmtune.outputs.runlog import ExampleOrderLog
from lmtune.parallel.distributed import read_dist_env
from tests.conftest import write_jsonl


def by_source(m: Mixture, order: list[int]) -> list[Counter[int]]:
    """Per source, how often each of its examples (0-based in the source) is in ``order``."""
    counts: list[Counter[int]] = [Counter() for _ in m.sizes]
    for i in order:
        s = max(k for k, start in enumerate(m.starts) if start <= i)
        counts[s][i - m.starts[s]] += 1
    return counts


def test_shares_are_the_largest_remainders_and_sum_exactly() -> None:
    assert shares(10, [1, 1, 1]) == [4, 3, 3]  # ties go to the earlier source
    assert shares(100, [0.5, 0.3, 0.2]) == [50, 30, 20]
    assert shares(7, [0.6, 0.25, 0.15]) == [4, 2, 1]  # quotas 4.2, 1.75, 1.05
    assert shares(57, [2, 2]) == [29, 28]
    assert shares(3, [1, 1]) == [2, 1]
    rng = random.Random(0)
    for _ in range(200):
        weights = [rng.choice([0.01, 0.3, 1.0, 2.5, 7.0]) for _ in range(rng.randint(1, 5))]
        total = rng.randint(1, 500)
        got = shares(total, weights)
        assert sum(got) == total
        assert all(abs(c - total * w / sum(weights)) < 1 for c, w in zip(got, weights, strict=True))


def test_an_upsampled_and_a_downsampled_source_get_exact_counts() -> None:
    # 8 and 92 examples, weighted 1:1 -> 50 each per epoch: the small one x6.25, the large one 50/92.
    m = mixture_of(["small", "large"], [8, 92], [1.0, 1.0])
    assert m.draws == (50, 50) and m.epoch_size == 100
    over_epochs: list[Counter[int]] = [Counter(), Counter()]
    seen_large: list[int] = []
    for epoch in range(4):
        order = mixture_order(m, seed=5, epoch=epoch)
        assert len(order) == 100
        small, large = by_source(m, order)
        assert sum(small.values()) == 50 and sum(large.values()) == 50
        assert set(small) == set(range(8)) and set(small.values()) <= {6, 7}  # spread <= 1
        assert set(large.values()) == {1}  # distinct within the epoch
        seen_large += sorted(large)
        over_epochs[0].update(small)
    # The small source's extra draws walk it: over 4 epochs (2 extra each) every example 6*4+1 times.
    assert set(over_epochs[0].values()) == {25}
    # The large one is walked: epoch 1 continues where epoch 0 stopped, and only wraps around
    # (into epoch 0's first 8) once all 92 were drawn.
    first_two = mixture_order(m, 5, 0), mixture_order(m, 5, 1)
    large_0, large_1 = (set(by_source(m, o)[1]) for o in first_two)
    assert len(large_0 | large_1) == 92 and len(large_0 & large_1) == 100 - 92
    assert len(set(seen_large)) == 92  # 4 epochs x 50 > 92: everything reached, nothing starved


def test_every_example_of_a_downsampled_source_comes_before_any_repeats() -> None:
    m = mixture_of(["a", "b"], [10, 90], [0.7, 0.3])
    assert m.draws == (70, 30)
    taken = [sorted(by_source(m, mixture_order(m, 1, e))[1]) for e in range(3)]
    assert sorted(i for t in taken for i in t) == list(range(90))  # 3 epochs cover it exactly once
    assert all(set(c.values()) == {7} for c in (by_source(m, mixture_order(m, 1, e))[0] for e in range(3)))


def test_order_is_a_pure_function_of_seed_epoch_and_sources() -> None:
    m = mixture_of(["a", "b"], [13, 40], [3.0, 1.0])
    assert mixture_order(m, 2, 3) == mixture_order(m, 2, 3)
    assert mixture_order(m, 2, 3) != mixture_order(m, 2, 4)
    assert mixture_order(m, 2, 3) != mixture_order(m, 3, 3)


def steps_of(
    n: int, g: int, world: int, m: Mixture, epoch: int, lengths: list[int], start: int = 0
) -> list[list[int]]:
    """The examples of each optimizer step of ``epoch`` from ``start`` on, over ``world`` ranks
    (each step's examples sorted: ranks share a step out in their own order)."""
    shards = []
    for r in range(world):
        s = TrainSampler(n, g, r, world, seed=9, lengths=lengths, mixture=m)
        s.set_epoch(epoch, start)
        shards.append(list(s))
        assert len(shards[-1]) == len(s)
    per = g // world
    steps = len(shards[0]) // per
    return [sorted(i for sh in shards for i in sh[k * per : (k + 1) * per]) for k in range(steps)]


def test_one_and_two_ranks_train_on_the_same_steps_and_resume_exactly() -> None:
    m = mixture_of(["a", "b", "c"], [5, 30, 17], [0.5, 0.2, 0.3])
    n, g = m.epoch_size, 8
    lengths = [(7 * i) % 23 + 1 for i in range(n)]
    for epoch in range(3):
        one = steps_of(n, g, 1, m, epoch, lengths)
        assert len(one) == n // g
        assert steps_of(n, g, 2, m, epoch, lengths) == one
        assert steps_of(n, g, 4, m, epoch, lengths) == one
        # Resumed at step 3, on 2 ranks or on 1 (a change of world size): the rest of the same steps.
        assert steps_of(n, g, 2, m, epoch, lengths, start=3) == one[3:]
        assert steps_of(n, g, 1, m, epoch, lengths, start=3) == one[3:]
    # The global order is the one the mixture defines (a rank's sampler reads it, not a copy).
    s = TrainSampler(n, g, 1, 2, seed=9, mixture=m)
    s.set_epoch(2)
    assert s.order() == mixture_order(m, 9, 2)


@pytest.mark.parametrize(
    ("data", "weights", "needle"),
    [
        ("a.jsonl,b.jsonl", "1", r"--data-weights: 1 weight for 2 --data sources"),
        ("a.jsonl,b.jsonl", "1,2,3", r"--data-weights: 3 weights for 2"),
        ("a.jsonl,b.jsonl", "1,0", r"--data-weights: every weight must be a positive number \(got '?0"),
        ("a.jsonl,b.jsonl", "1,-2", r"--data-weights: every weight must be a positive"),
        ("a.jsonl,b.jsonl", "1,nan", r"--data-weights: every weight must be a positive"),
        ("a.jsonl,b.jsonl", "1,inf", r"--data-weights: every weight must be a positive"),
        ("a.jsonl,b.jsonl", "1,x", r"--data-weights: '?x'? is not a number"),
        ("a.jsonl,b.jsonl", "1,", r"--data-weights: '?'? is not a number"),
        ("x/a.jsonl,y/a.jsonl", "1,1", r"--data: two sources are named 'a'"),
        ("a=x.jsonl,a=y.jsonl", "1,1", r"--data: two sources are named 'a'"),
        # A glob's stem is no name for a metric (eval_loss/NAME): it is asked for.
        ("x/a*.jsonl,b.jsonl", "1,1", r"--data: the source 'x/a\*\.jsonl' has no usable name .*NAME="),
        ("a.jsonl", "1", r"--data-weights: applies to a mixture of two or more --data sources only"),
    ],
)
def test_bad_weights_and_names_are_refused_naming_the_option(data: str, weights: str, needle: str) -> None:
    with pytest.raises(UserError, match=needle):
        check_settings(TrainConfig(data=data, data_weights=weights), 1)


def test_named_sources_and_distinct_eval_names() -> None:
    check_settings(TrainConfig(data="x/a.jsonl,y/a.jsonl"), 1)  # no mixture: names do not matter
    check_settings(TrainConfig(data="x/a*.jsonl,y/[ab].jsonl"), 1)
    check_settings(TrainConfig(data="one=x/a.jsonl,two=y/a.jsonl", data_weights="1,3"), 1)
    with pytest.raises(UserError, match=r"--eval-data: two sources are named 'e'"):
        check_settings(TrainConfig(eval_data="x/e.jsonl,y/e.jsonl"), 1)


def test_a_source_left_without_examples_is_refused() -> None:
    with pytest.raises(UserError, match=r"--data-weights: source 'tiny' gets no example"):
        mixture_of(["big", "tiny"], [1000, 3], [1.0, 0.0001])


def test_yaml_lists_sources_with_weights_and_names(tmp_path: Path) -> None:
    f = tmp_path / "run.yaml"
    f.write_text("data:\n  - {path: a.jsonl, weight: 0.7, name: chat}\n  - {path: b.jsonl, weight: 0.3}\n")
    assert load_yaml(str(f)) == {"data": "chat=a.jsonl,b.jsonl", "data_weights": "0.7,0.3"}
    assert build_config({"data": "a.jsonl,b.jsonl", "data_weights": [3, 1.5]}).data.weights == "3,1.5"
    with pytest.raises(UserError, match="--data-weights: expected str"):
        build_config({"data_weights": [True, 1]})
    f.write_text("data:\n  - {path: a.jsonl, weight: 0.7}\n  - {path: b.jsonl}\n")
    with pytest.raises(
        UserError, match=r"run.yaml:1: --data: entry 2 has no weight, and 1 of the 2 have one"
    ):
        load_yaml(str(f))
    f.write_text("data:\n  - {path: a.jsonl, weigth: 1}\n")
    with pytest.raises(UserError, match=r"--data: entry 1: unknown key 'weigth'"):
        load_yaml(str(f))
    f.write_text("data:\n  - {path: a.jsonl, weight: 1}\n  - {path: b.jsonl, weight: heavy}\n")
    with pytest.raises(UserError, match=r"run.yaml:1: --data: entry 2: weight 'heavy' is not a number"):
        load_yaml(str(f))


def test_sources_are_tokenized_apart_and_held_out_per_source(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", ["one", "two", "three"])
    b = write_jsonl(tmp_path / "b.jsonl", [f"b{i}" for i in range(5)])
    env, cache = read_dist_env("cpu"), tmp_path / "cache"
    spec = f"first={a},{b}"
    whole = prepare(spec, byte_tokenizer(), ExampleSettings(), env, cache)
    apart = prepare(Wanted(spec, per_source=True), byte_tokenizer(), ExampleSettings(), env, cache)
    assert apart.key != whole.key and COMPONENTS_META not in whole.dataset.meta
    assert apart.dataset.meta[COMPONENTS_META] == [3, 5]
    data = apart.dataset
    data.sources = source_index(spec, data.meta, "--data")
    assert data.sources.names == ("first", "b") and data.source_sizes() == [3, 5]
    assert [data.sources.name(i) for i in range(8)] == ["first"] * 3 + ["b"] * 5
    kept, held = split_off(data, 0.34, seed=1)
    assert held.source_sizes() == [1, 2] and kept.source_sizes() == [2, 3]  # 0.34 of each source
    assert sorted([*kept.indices, *held.indices]) == list(range(8))
    with pytest.raises(ValueError, match=r"holds out 3 of the 3 examples of source 'first'"):
        split_off(data, 3, seed=1)


def test_other_weights_are_another_run_to_resume() -> None:
    spec = "a=x.jsonl,b=y.jsonl"
    assert mixture_fingerprint(spec, "1,1") == mixture_fingerprint(spec, "2,2") == "a=0.5,b=0.5"
    assert mixture_fingerprint(spec, "1,3") == "a=0.25,b=0.75"


def test_the_same_shares_written_otherwise_are_no_change_to_a_finished_run(tmp_path: Path) -> None:
    """A finished run run again with --data-weights 10,6,4 where it had 0.5,0.3,0.2 said the
    weights were a change it did not apply."""
    from lmtune.checkpoint.finished import changed_settings
    from lmtune.config.mixture import same_weights

    assert same_weights("10,6,4", "0.5,0.3,0.2") and not same_weights("1,1,1", "0.5,0.3,0.2")
    assert not same_weights("1,1", "1,1,1") and not same_weights(None, "1")
    (tmp_path / "run.json").write_text(json.dumps({"config": {"data_weights": "0.5,0.3,0.2"}}))
    assert changed_settings(tmp_path, {"data_weights": "10,6,4"}) == []
    assert changed_settings(tmp_path, {"data_weights": "1,1,1"}) == ["--data-weights 1,1,1, was 0.5,0.3,0.2"]


def test_the_audit_shows_the_mixture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write_jsonl(tmp_path / "chat.jsonl", [f"chat {i}" for i in range(4)])
    b = write_jsonl(tmp_path / "b.jsonl", [f"code line {i}" for i in range(12)])
    weighted = ["--data-weights", "3,1", "--model", "tiny", "--global-batch-size", "4"]
    assert main(["data", "audit", str(a), f"code={b}", *weighted]) == 0
    out = capsys.readouterr().out
    assert "mixture             an epoch of 16 examples (--data-weights)" in out
    rows = [" ".join(line.split()) for line in out.splitlines() if "per epoch" in line]
    # Per source: examples, tokens (text + BOS + EOS), draws per epoch, share, repetitions.
    assert rows[0] == "chat 4 examples 32 tokens -> 12 per epoch ( 75.0%), x3.00 each"
    assert rows[1] == "code 12 examples 158 tokens -> 4 per epoch ( 25.0%), x0.33 each"
    assert main(["data", "audit", str(a), str(b), "--data-weights", "1", "--model", "tiny"]) == 2
    assert "--data-weights: 1 weight for 2 --data sources" in capsys.readouterr().err
    # --eval-split: the mixture of what is left, the very examples train holds out (its mixture line).
    split = [*weighted, "--eval-split", "0.25"]
    assert main(["data", "audit", str(a), f"code={b}", *split]) == 0
    said = capsys.readouterr().out
    rows = re.findall(r"(\w+) +(\d+) examples .* -> +(\d+) per epoch \( *([\d.]+%)\)", said)
    assert len(rows) == 2
    out = ["--output-dir", str(tmp_path / "run"), "--max-steps", "1", "--no-progress", "--save-every", "0"]
    assert main(["train", "--data", f"{a},code={b}", *split, *out]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("mixture (an epoch of"))
    assert line.startswith("mixture (an epoch of 12)")  # 16 less a quarter of each source
    for name, examples, draws, share in rows:
        assert f"{name} {examples} examples -> {draws} ({share}" in line
    assert main(["data", "audit", str(a), f"code={b}", *weighted, "--eval-split", "4"]) == 2  # as train
    assert "--eval-split 4: holds out 4 of the 4 examples of source 'chat'" in capsys.readouterr().err


def test_a_data_argument_with_commas_lists_sources_as_data_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lmtune data audit a.jsonl,b.jsonl`, as train's --data reads it; a file whose own name holds
    the comma stays one source."""
    a = write_jsonl(tmp_path / "a.jsonl", [f"first {i}" for i in range(3)])
    b = write_jsonl(tmp_path / "b.jsonl", [f"second {i}" for i in range(5)])
    assert main(["data", "audit", f"{a},{b}", "--model", "tiny", "--global-batch-size", "2"]) == 0
    listed = capsys.readouterr().out
    assert main(["data", "audit", str(a), str(b), "--model", "tiny", "--global-batch-size", "2"]) == 0
    assert listed == capsys.readouterr().out and "8 read, 8 kept" in listed
    odd = write_jsonl(tmp_path / "a.jsonl,b.jsonl", ["one"])
    assert main(["data", "audit", str(odd), "--model", "tiny", "--global-batch-size", "1"]) == 0
    assert "1 read, 1 kept" in capsys.readouterr().out


def test_recorded_samples_name_their_sources(tmp_path: Path) -> None:
    index = SourceIndex(("chat", "code"), (0, 3, 10))
    log = ExampleOrderLog(tmp_path, rank=0, resume_step=0, sources=index)
    log(1, [0, 2, 3, 9])
    log.close()
    row = json.loads((tmp_path / "samples" / "rank-0.jsonl").read_text())
    assert row == {"step": 1, "ids": [0, 2, 3, 9], "sources": ["chat", "chat", "code", "code"]}


def test_a_path_with_a_comma_is_one_source(tmp_path: Path) -> None:
    """A YAML list keeps each path whole (joined with the commas inside escaped); on the command line
    the comma is written \\,."""
    from lmtune.config.mixture import named_items, shown_spec
    from lmtune.data.sources import resolve_sources

    (tmp_path / "chat, v2.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "y"}\n')
    f = tmp_path / "run.yaml"
    f.write_text(f'data:\n  - "{tmp_path}/chat, v2.jsonl"\n  - {{path: "{tmp_path}/b.jsonl"}}\n')
    spec = build_config(load_yaml(str(f))).data.train
    assert [item for _, item in named_items(spec)] == [f"{tmp_path}/chat, v2.jsonl", f"{tmp_path}/b.jsonl"]
    assert [s.name for s in resolve_sources(spec)] == [f"{tmp_path}/chat, v2.jsonl", f"{tmp_path}/b.jsonl"]
    assert named_items("a\\, b.jsonl,c.jsonl") == [("a, b", "a, b.jsonl"), ("c", "c.jsonl")]
    # The log names one such file as it is; a list keeps its escapes (they say where each ends).
    assert shown_spec("a\\, b.jsonl") == "a, b.jsonl"
    assert shown_spec("a\\, b.jsonl,c.jsonl") == "a\\, b.jsonl,c.jsonl"
    assert shown_spec("chat=a\\, b.jsonl") == "chat=a\\, b.jsonl"
    # On the command line, a value that names one file as a whole is that file, as DATA arguments are.
    from lmtune.cli.commands import train_config
    from lmtune.cli.parser import build_parser

    whole = f"{tmp_path}/chat, v2.jsonl"
    cfg = train_config(build_parser().parse_args(["train", "--data", whole, "--eval-data", whole]))
    for spec in (cfg.data.train, cfg.data.eval or ""):
        assert [s.name for s in resolve_sources(spec)] == [whole]


def test_a_config_files_bad_weights_field_map_or_reporter_is_named_by_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """They were named as flags (--data-weights: ...), without the file's line."""
    a, b = (write_jsonl(tmp_path / f"{n}.jsonl", [f"{n} {i}" for i in range(4)]) for n in ("a", "b"))
    config = tmp_path / "run.yaml"
    for line, said in (
        ("data_weights: 1,0", "run.yaml:3: data_weights: every weight must be a positive number (got '0')"),
        ("field_map:\n  bogus: x", "run.yaml:3: field_map: 'bogus' is none of lmtune's fields"),
        ("report_to: all", "run.yaml:3: report_to: unknown all (choose from none, tensorboard"),
    ):
        config.write_text(f"max_steps: 1\ndata: {a},{b}\n{line}\n")
        assert main(["train", "--config", str(config), "--output-dir", str(tmp_path / "out")]) == 2
        assert said in capsys.readouterr().err
