"""Generations during training: the prompts file is read strictly, and lmtune's decoding loop over
the training wrapper writes what transformers' generate writes."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from lmtune.errors import UserError
from lmtune.model.modeling import load_model
from lmtune.model.tokens import stop_ids
from lmtune.objectives.sft import SummedLoss
from lmtune.parallel.distributed import read_dist_env
from lmtune.training.samples import decode, read_prompts


@pytest.mark.parametrize("varlen", [False, True])
def test_decoding_matches_transformers_generate(varlen: bool) -> None:
    from lmtune.model.attention import use_varlen

    loaded = load_model("tiny", 3)
    model, tok = loaded.model.eval(), loaded.tokenizer
    root = SummedLoss(model, varlen=varlen and use_varlen(model))
    stops = stop_ids(model, tok)
    for prompt in ("12+7=", "hello there, ", "x"):
        ids = tok(prompt)["input_ids"]
        new, stopped, late = decode(
            root,
            ids,
            stop=set(stops),
            max_new_tokens=12,
            temperature=0.0,
            seed=0,
            env=read_dist_env("cpu"),
            lockstep=False,
            autocast=nullcontext,
            deadline=float("inf"),
        )
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=stops, pad_token_id=0
            )
        expected = out[0, len(ids) :].tolist()
        assert not late
        if stopped:
            assert expected == [*new, expected[-1]] and expected[-1] in stops
        else:
            assert new == expected and len(new) == 12


def test_sampling_is_seeded() -> None:
    loaded = load_model("tiny", 3)
    root = SummedLoss(loaded.model.eval())
    ids = loaded.tokenizer("abc")["input_ids"]

    def run(seed: int) -> list[int]:
        options = {"stop": set(), "max_new_tokens": 10, "temperature": 1.5, "env": read_dist_env("cpu")}
        return decode(root, ids, seed=seed, lockstep=False, autocast=nullcontext, deadline=1e18, **options)[0]

    assert run(1) == run(1) != run(2)


def test_the_time_budget_ends_decoding() -> None:
    loaded = load_model("tiny", 3)
    new, stopped, late = decode(
        SummedLoss(loaded.model.eval()),
        loaded.tokenizer("abc")["input_ids"],
        stop=set(),
        max_new_tokens=50,
        temperature=0.0,
        seed=0,
        env=read_dist_env("cpu"),
        lockstep=False,
        autocast=nullcontext,
        deadline=0.0,  # long past
    )
    assert (len(new), stopped, late) == (1, False, True)


def test_prompt_files_are_read_strictly(tmp_path: Path) -> None:
    tok = load_model("tiny", 0).tokenizer
    good = tmp_path / "good.jsonl"
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    trained = [*conversation, {"role": "assistant", "content": "4"}]  # a line of training data
    lines = [
        json.dumps("1+1="),
        "",
        json.dumps({"messages": conversation}),
        json.dumps({"messages": trained}),
    ]
    good.write_text("\n".join(lines) + "\n")
    plain, chat, copied = read_prompts(good, tok)
    assert plain.shown == "1+1=" and plain.ids == tok("1+1=")["input_ids"]
    assert chat.shown == "2+2?" and tok.decode(chat.ids).endswith("<|assistant|>\n")
    assert (copied.shown, copied.ids) == (chat.shown, chat.ids)  # up to the reply, which is left out
    cases = {
        "bad.jsonl": ('"a"\n{"prompt": 3}\n', "bad.jsonl:2: expected a string"),
        "json.jsonl": ("not json\n", "json.jsonl:1: not JSON"),
        "role.jsonl": ('{"messages": [{"role": "wizard", "content": "x"}]}\n', "role.jsonl:1: .*role"),
        "reply.jsonl": ('{"messages": [{"role": "assistant", "content": "x"}]}\n', "no turn before"),
        "empty.jsonl": ("\n\n", "no prompts in it"),
        "many.jsonl": ('"a"\n' * 65, "at most 64"),
        "latin.jsonl": (b'"\xe9"\n', "not UTF-8"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(UserError, match=message):
            read_prompts(path, tok)
    with pytest.raises(UserError, match="no such file"):
        read_prompts(tmp_path / "missing.jsonl", tok)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps("ab" * 40) + "\n")
    with pytest.raises(UserError, match=r"long.jsonl:1: the prompt is 81 tokens; .* at most 50"):
        read_prompts(long, tok, max_tokens=50)  # found at start, not at the sampling step


def test_samples_fit_a_learned_position_table() -> None:
    """GPT-2's 64 positions under --max-length 512: sampling 200 tokens failed at the run's end,
    before its final checkpoint and model were saved."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from lmtune.training.samples import _prompt_room

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=64))
    said = r"--sample-max-new-tokens 200: past the model's 64 positions .* give 63 or fewer"
    with pytest.raises(UserError, match=said):
        _prompt_room(gpt2, 512, 200)
    assert _prompt_room(gpt2, 512, 40) == 24 and _prompt_room(gpt2, 48, 40) == 8
    assert _prompt_room(load_model("tiny", 0).model, 512, 40) == 472  # rotary: --max-length alone


def test_top_k_cuts_sampling_to_the_likeliest_tokens() -> None:
    """--top-k 1 samples the likeliest token at every step: greedy decoding, whatever the seed and
    temperature; without it the model's generation config (transformers' 50) decides."""
    from lmtune.model.generate import Sampling, complete

    loaded = load_model("tiny", 3)
    model, tok = loaded.model, loaded.tokenizer
    greedy = complete(model, tok, "12+7=", max_new_tokens=12)
    for seed in (0, 1, 2):
        top_1 = Sampling(temperature=5.0, top_k=1, seed=seed)
        assert complete(model, tok, "12+7=", max_new_tokens=12, sampling=top_1) == greedy
    hot = [Sampling(temperature=5.0, seed=s) for s in (0, 1, 2)]
    assert greedy not in {complete(model, tok, "12+7=", max_new_tokens=12, sampling=h) for h in hot}
    # An unset --top-p is the model's own (it was 1.0 always, over a model's 0.8): a nucleus this
    # narrow keeps the likeliest token alone, and a given --top-p 1 cuts nothing.
    model.generation_config.top_p = 1e-6
    assert {complete(model, tok, "12+7=", max_new_tokens=12, sampling=h) for h in hot} == {greedy}
    uncut = [Sampling(temperature=5.0, top_p=1.0, seed=s) for s in (0, 1, 2)]
    assert greedy not in {complete(model, tok, "12+7=", max_new_tokens=12, sampling=u) for u in uncut}


def test_a_cut_of_the_sampling_without_sampling_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--top-k or --top-p at temperature 0 would do nothing (decoding is greedy): refused, as train
    refuses settings that do not apply."""
    from lmtune.cli import main

    for cut in (["--top-k", "5"], ["--top-p", "0.9"]):
        assert main(["generate", "--model", "tiny", "--prompt", "x", *cut]) == 2
        assert f"{cut[0]} applies when sampling: give --temperature T > 0" in capsys.readouterr().err
