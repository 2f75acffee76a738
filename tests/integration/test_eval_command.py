"""`lmtune eval`: a model's loss on data as a training run's evaluation computes it. Compared with
the run itself: its last evaluation (of final/) and its --eval-on-start baseline (of the model it
started from) are what `lmtune eval` gives for those models on the same data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lmtune.cli import main
from tests.conftest import one_line_error, train_rows


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("eval") / "run"
    argv = ["train", "--max-steps", "4", "--eval-on-start", "--output-dir", str(out), "--no-progress"]
    assert main(argv) == 0
    return out


def _eval(tmp_path: Path, model: str, *more: str) -> dict[str, float]:
    figures = tmp_path / f"{Path(model).name}.json"
    assert main(["eval", "sample:eval", "--model", model, "--json", str(figures), *more]) == 0
    return json.loads(figures.read_text())


def test_eval_gives_the_runs_own_figures_for_its_start_and_its_end(run: Path, tmp_path: Path) -> None:
    start, end = train_rows(run, kind="eval")[0], train_rows(run, kind="eval")[-1]
    assert start["step"] == 0 and end["step"] == 4
    tuned = _eval(tmp_path, str(run / "final"))
    base = _eval(tmp_path, "tiny")  # the preset, built from the run's seed as the run built it
    for figures, row in ((tuned, end), (base, start)):
        assert figures["loss"] == pytest.approx(row["eval_loss"], abs=1e-6)
        assert (figures["examples"], figures["target_tokens"]) == (row["eval_examples"], row["eval_tokens"])
        assert figures["written_by"] == "lmtune eval"
    assert tuned["loss"] < base["loss"]
    # The batch size changes how the sums are grouped, not what they are.
    assert _eval(tmp_path, str(run / "final"), "--batch-size", "3")["loss"] == pytest.approx(
        tuned["loss"], abs=1e-6
    )


def test_eval_on_the_data_a_model_was_trained_on_says_so(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lmtune eval --model RUN/final sample` scored the examples the run trained on, unsaid, as if
    held out (the run's own evaluation is of `sample:eval`)."""
    for model in (run / "final", run / "checkpoints" / "step-000004"):
        capsys.readouterr()
        assert main(["eval", "sample", "--model", str(model), "--json", "-"]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["trained_on"] == "sample"
        assert (
            f"note: these are the examples {model} was trained on (its run's --data sample; it "
            "evaluated on sample:eval): their loss says how well it fits them, not how it does on data "
            "it has not seen"
        ) in " ".join(err.split())
    assert _eval(tmp_path, str(run / "final"))["trained_on"] is None
    assert "note:" not in capsys.readouterr().err
    # Of a run that held some out with --eval-split: all but those trained.
    rows = [{"prompt": f"{i} plus {i}:", "completion": f" {2 * i}"} for i in range(30)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    split = ["--eval-split", "6", "--max-steps", "1", "--global-batch-size", "4", "--no-progress"]
    assert (
        main(["train", "--data", str(tmp_path / "d.jsonl"), *split, "--output-dir", str(tmp_path / "s")]) == 0
    )
    capsys.readouterr()
    assert main(["eval", str(tmp_path / "d.jsonl"), "--model", str(tmp_path / "s" / "final")]) == 0
    assert "d.jsonl, less the 6 examples its --eval-split 6 held out): their loss" in capsys.readouterr().err


@pytest.mark.parametrize("held", ["eval_split: 6", "eval_data: held.jsonl"])
def test_eval_of_a_config_scores_what_its_run_evaluates(
    held: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lmtune eval --config run.yaml` scored the file's training data: it scores its eval_data, or
    the examples its eval_split holds out (per source under --data-weights, as the run does)."""
    rows = [{"prompt": f"{i} plus {i}:", "completion": f" {2 * i}"} for i in range(40)]
    for name, part in (("a.jsonl", rows[:25]), ("b.jsonl", rows[25:]), ("held.jsonl", rows[::7])):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    config = tmp_path / "run.yaml"
    config.write_text(
        f"data: a.jsonl,b.jsonl\ndata_weights: 2,1\n{held}\nmax_steps: 2\nglobal_batch_size: 4\n"
        f"output_dir: {tmp_path / 'run'}\nprogress: false\n"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert main(["train", "--config", str(config)]) == 0
        last = train_rows(tmp_path / "run", kind="eval")[-1]
        figures = tmp_path / "figures.json"
        argv = ["eval", "--config", str(config), "--model", str(tmp_path / "run" / "final")]
        assert main([*argv, "--json", str(figures)]) == 0
    scored = json.loads(figures.read_text())
    assert scored["trained_on"] is None  # what its --eval-split holds out is not what it trained on
    assert scored["loss"] == pytest.approx(last["eval_loss"], abs=1e-6)
    assert (scored["examples"], scored["target_tokens"]) == (last["eval_examples"], last["eval_tokens"])
    for name in ("a", "b") if "split" in held else ():  # the run's per-source figures too
        assert scored[f"loss/{name}"] == pytest.approx(last[f"eval_loss/{name}"], abs=1e-6)
        assert scored[f"tokens/{name}"] == last[f"eval_tokens/{name}"]
    said = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("eval of"))
    assert said.startswith(
        "eval of the examples of a.jsonl,b.jsonl its --eval-split 6 holds out (the --config file's) with"
        if "split" in held
        else "eval of held.jsonl (the --config file's eval_data) with"
    )


def test_eval_of_several_sources_scores_each_besides_the_whole(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`lmtune eval a.jsonl b.jsonl` gave one loss for both; each source's is what it gets alone.
    Sources no name tells apart (two files called data.jsonl) are scored whole, as before."""
    rows = [{"prompt": f"{i} plus {i}:", "completion": f" {2 * i}"} for i in range(30)]
    for name, part in (("a.jsonl", rows[:20]), ("b.jsonl", rows[20:])):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    model = str(run / "final")

    def scored(*data: str) -> dict[str, Any]:
        out = tmp_path / "figures.json"
        assert main(["eval", *data, "--model", model, "--json", str(out)]) == 0
        return json.loads(out.read_text())

    both = scored(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"))
    for name in ("a", "b"):
        alone = scored(str(tmp_path / f"{name}.jsonl"))
        assert both[f"loss/{name}"] == pytest.approx(alone["loss"], abs=1e-6)
        assert both[f"tokens/{name}"] == alone["target_tokens"]
    assert "  a: loss " in capsys.readouterr().out
    for folder in ("x", "y"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "data.jsonl").write_text((tmp_path / "a.jsonl").read_text())
    whole = scored(str(tmp_path / "x" / "data.jsonl"), str(tmp_path / "y" / "data.jsonl"))
    assert not any(key.startswith("loss/") for key in whole)
    assert whole["loss"] == pytest.approx(scored(str(tmp_path / "a.jsonl"))["loss"], abs=1e-6)
    assert main(["eval", f"a={tmp_path / 'a.jsonl'}", f"a={tmp_path / 'b.jsonl'}", "--model", model]) == 2
    assert "two sources are named 'a'" in capsys.readouterr().err  # names given: the user's to fix
    # A source of which nothing is left to score read loss 0.0, perplexity 1: refused, as train does.
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": "a long one " * 40}) + "\n")
    argv = ["eval", str(tmp_path / "a.jsonl"), str(tmp_path / "long.jsonl"), "--model", model]
    assert main([*argv, "--max-length", "32", "--truncation", "drop"]) == 2
    assert "lmtune eval: no example of long is left: each was longer than --max-length" in (
        capsys.readouterr().err
    )
    run_argv = ["train", "--data", str(tmp_path / "a.jsonl"), "--max-length", "32", "--truncation", "drop"]
    run_argv += ["--eval-data", f"a={tmp_path / 'a.jsonl'},l={tmp_path / 'long.jsonl'}", "--max-steps", "1"]
    assert main([*run_argv, "--output-dir", str(tmp_path / "run")]) == 2
    assert "--eval-data: no example of l is left" in capsys.readouterr().err


def test_eval_of_a_config_on_the_sample_scores_its_held_out_split(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file naming no data trains on the built-in sample and evaluates its held-out split."""
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 4\n")
    figures = tmp_path / "figures.json"
    assert main(["eval", "--config", str(config), "--model", str(run / "final"), "--json", str(figures)]) == 0
    scored, end = json.loads(figures.read_text()), train_rows(run, kind="eval")[-1]
    assert scored["loss"] == pytest.approx(end["eval_loss"], abs=1e-6) and scored["examples"] == 250
    assert "eval of the built-in sample's held-out split (as its run) with" in capsys.readouterr().out


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_bf16_eval_takes_the_kernels_a_bf16_run_evaluates_with(tmp_path: Path, lora: bool) -> None:
    # On a CPU, a bf16 run's evaluation multiplies with the products and attention its CPU's units
    # decide (lmtune.model.paths); autocast's own bf16 products give other figures (and without
    # bf16 units run ~30x slower), so `lmtune eval --precision bf16` takes the run's. An adapter is
    # scored beside its base, as the run did: merged into it, bf16 rounds their sum, not each.
    out, lora_args = tmp_path / "bf16", []
    if lora:  # an adapter names its base: a model folder, not a preset
        from lmtune.model.modeling import build_preset

        base = build_preset("tiny", seed=0)
        base.model.save_pretrained(tmp_path / "base")
        base.tokenizer.save_pretrained(tmp_path / "base")
        lora_args = ["--model", str(tmp_path / "base"), "--lora", "--lr", "1e-2"]
    argv = ["train", "--max-steps", "2", "--eval-every", "2", "--precision", "bf16", "--output-dir", str(out)]
    assert main([*argv, "--no-progress", *lora_args]) == 0
    last, resolved = train_rows(out, kind="eval")[-1], json.loads((out / "run.json").read_text())["resolved"]
    # bf16 rounds each product's operands, so batches grouped otherwise differ in the last digits:
    # the run's own micro-batch makes the same forwards.
    batch = str(resolved["micro_batch_size"])
    figures = _eval(tmp_path, str(out / "final"), "--precision", "bf16", "--batch-size", batch)
    assert figures["loss"] == pytest.approx(last["eval_loss"], abs=1e-6)

    # The same kernels; how they were decided may differ: a CPU that times a path (AVX-512 BF16
    # without AMX: the products) finds the run's timing in the cache.
    def chosen(paths: dict[str, Any]) -> dict[str, Any]:
        return {k: v["choice"] if isinstance(v, dict) else v for k, v in paths.items()}

    assert chosen(figures["paths"]) == chosen(resolved["paths"])


TINY = ["--model", "tiny"]


def test_eval_refuses_what_it_cannot_score(
    run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "1+1=", "chosen": "2", "rejected": "3"}) + "\n")
    assert "preference pairs; lmtune eval scores supervised examples" in one_line_error(
        ["eval", str(pairs), *TINY], capsys
    )
    said = one_line_error(["eval", "--data", str(pairs), *TINY], capsys)  # train's way of naming it
    assert "give it as arguments: lmtune eval DATA" in said
    assert "name the DATA to eval" in one_line_error(["eval"], capsys)
    # train's default model, the untrained preset, was scored without a word of it
    said = one_line_error(["eval", "sample:eval"], capsys)
    assert "lmtune eval: name the model to score with --model (a folder, a run's final/" in said
    mine = tmp_path / "mine.json"
    mine.write_text('{"my": "notes"}')
    assert "--json" in one_line_error(["eval", "sample:eval", *TINY, "--json", str(mine)], capsys)
    assert mine.read_text() == '{"my": "notes"}'
    assert "lmtune eval DATA --model M" in one_line_error(["evaluate"], capsys)  # litgpt's, Axolotl's
    # Said in lmtune eval's own words: its DATA, its --batch-size, no training's gradient scaler.
    said = one_line_error(["eval", "sample:eval", *TINY, "--per_device_eval_batch_size", "4"], capsys)
    assert said.rstrip().endswith("--per-device-eval-batch-size is --batch-size in lmtune eval")
    said = one_line_error(["eval", str(tmp_path / "nope.jsonl"), *TINY], capsys)
    assert said.startswith("error: lmtune eval: no such file or folder:") and "--data" not in said
    said = one_line_error(["eval", f"{pairs},{pairs}", *TINY], capsys)
    assert "named twice (each of its examples would be counted twice); give it once" in said
    assert "--data-weights" not in said
    assert (
        one_line_error(["eval", "sample:eval", *TINY, "--precision", "fp16"], capsys)
        .rstrip()
        .endswith("--precision: fp16 needs a CUDA GPU; use bf16 on CPU")
    )
    # Past a learned position table (GPT-2's): an IndexError, where train names --max-length.
    from transformers import GPT2Config, GPT2LMHeadModel

    from lmtune.model.modeling import byte_tokenizer

    tok = byte_tokenizer()
    GPT2LMHeadModel(
        GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=1, n_head=2, n_positions=16)
    ).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": "a longer text than sixteen bytes"}) + "\n")
    said = one_line_error(["eval", str(tmp_path / "long.jsonl"), "--model", str(tmp_path / "gpt2")], capsys)
    assert "the model has 16 positions (a learned table" in said and "--max-length 16 or less" in said


@pytest.mark.parametrize("command", [["eval"], ["data", "show"], ["data", "audit"]])
def test_a_field_map_naming_no_field_is_warned_of_as_train_warns(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "pc.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    batch = ["--global-batch-size", "1"] if command[-1] == "audit" else []
    model = ["--model", "tiny"] if command == ["eval"] else []
    main([*command, str(data), "--field-map", "prompt=question", *batch, *model])
    said = f"warning: --field-map prompt=question: the first record of {data} has no 'question' field"
    assert said in capsys.readouterr().err


def test_lines_skipped_by_skip_bad_lines_are_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """4 of 6 lines skipped, and neither the line nor the JSON said so."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "one"}\n"a string"\n3\nnull\n[1]\n{"text": "two"}\n')
    figures = tmp_path / "e.json"
    argv = ["eval", str(data), "--model", "tiny", "--skip-bad-lines", "--json", str(figures)]
    assert main(argv) == 0
    assert "(2 examples, " in capsys.readouterr().out
    assert json.loads(figures.read_text())["bad_lines_skipped"] == 4
    assert main(argv[:-2]) == 0
    assert "0 dropped, 4 bad lines skipped: lmtune data audit lists them)" in capsys.readouterr().out
