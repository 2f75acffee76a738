"""A model fine-tuned on chat data stops at the end of its turn, in every folder lmtune saves and in
every tool that generates with it (transformers' generate, `lmtune generate --chat`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from lmtune.cli import main
from lmtune.data.chat import end_of_turn_ids
from lmtune.data.formats import BUILTIN_CHAT_TEMPLATE
from lmtune.model.modeling import byte_tokenizer, load_model
from lmtune.model.tokens import stop_ids

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_tokenizer() -> Any:
    """The byte tokenizer with ChatML's turn markers: its end of turn is not its EOS, as in Qwen."""
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def test_the_end_of_turn_is_the_special_token_after_a_reply() -> None:
    tok = chatml_tokenizer()
    assert end_of_turn_ids(tok) == [tok.convert_tokens_to_ids("<|im_end|>")]
    from lmtune.data.formats import ensure_chat_template

    builtin = byte_tokenizer()
    ensure_chat_template(builtin)
    assert end_of_turn_ids(builtin) == [builtin.eos_token_id]  # lmtune's template ends turns with EOS


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    tok = chatml_tokenizer()
    base = load_model("tiny", 0).model
    base.resize_token_embeddings(len(tok))
    base.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    data = root / "chat.jsonl"
    questions = [f"what is {a} plus {b}?" for a in range(8) for b in range(8)]
    data.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "ok"}]})
            + "\n"
            for q in questions
        )
    )
    common = ["--data", str(data), "--max-steps", "100", "--global-batch-size", "16", "--lr", "3e-3"]
    common += ["--save-every", "100", "--no-progress", "--seed", "1"]
    out = root / "full"
    assert main(["train", "--model", str(root / "base"), *common, "--output-dir", str(out)]) == 0
    # LoRA cannot teach a frozen head a new token: its base is a chat model that already writes
    # <|im_end|> (as Qwen's instruct models do), whose generation config does not list it.
    import shutil

    shutil.copytree(out / "final", root / "chat-base")
    config = json.loads((root / "chat-base" / "generation_config.json").read_text())
    (root / "chat-base" / "generation_config.json").write_text(
        json.dumps({**config, "eos_token_id": tok.eos_token_id})
    )
    lora = root / "lora"
    lora_args = ["--lora", "--lora-rank", "8", "--lora-dropout", "0", "--merge-lora", "--max-steps", "10"]
    argv = ["train", "--model", str(root / "chat-base"), *common, *lora_args, "--save-every", "10"]
    assert main([*argv, "--output-dir", str(lora)]) == 0
    exported = root / "exported"
    assert main(["export", str(out / "checkpoints" / "step-000100"), str(exported)]) == 0
    return {"root": root, "final": out / "final", "merged": lora / "final" / "merged", "exported": exported}


@pytest.mark.parametrize("folder", ["final", "merged", "exported"])
def test_a_saved_chat_model_stops_at_the_end_of_turn(chat_run: dict[str, Path], folder: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = chat_run[folder]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == [
        tok.eos_token_id,
        im_end,
    ]
    messages = [{"role": "user", "content": "what is 3 plus 4?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=20, do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, ids["input_ids"].shape[1] :].tolist()
    assert new[-1] == im_end and len(new) < 20, tok.decode(new)  # stopped, not ran on into a next turn
    assert tok.decode(new, skip_special_tokens=True) == "ok"


def test_generate_chat_answers_and_stops(chat_run: dict[str, Path]) -> None:
    from lmtune.model.modeling import load_model as load

    loaded = load(str(chat_run["final"]), 0)
    assert loaded.tokenizer.convert_tokens_to_ids("<|im_end|>") in stop_ids(loaded.model, loaded.tokenizer)
    generate = [sys.executable, "-m", "lmtune", "generate", "--chat", "--max-new-tokens", "20"]
    one = subprocess.run(
        [*generate, "--model", str(chat_run["final"]), "--prompt", "what is 1 plus 2?"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert one.returncode == 0, one.stderr
    assert one.stdout == "ok\n" and "warning" not in one.stderr
    turns = subprocess.run(
        [*generate, "--model", str(chat_run["merged"]), "--system", "be brief"],
        input="what is 1 plus 2?\n\nwhat is 5 plus 5?\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert turns.returncode == 0, turns.stderr
    assert turns.stdout == "ok\nok\n"


def test_generate_chat_on_a_model_that_never_learned_its_template_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chat = ["generate", "--chat", "--prompt", "hi", "--max-new-tokens", "2"]
    assert main([*chat, "--model", "tiny"]) == 0
    err = capsys.readouterr().err
    assert "warning: the model has no chat template, so --chat renders the turns with lmtune's" in err
    # Trained on prompt/completion records: saved with the built-in template all the same, which
    # vLLM, pipelines and TRL then applied. Saved without it now; the warning is the same as before.
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f" a{i}"}) + "\n" for i in range(4)))
    out = tmp_path / "out"
    train = ["train", "--data", str(data), "--max-steps", "1", "--global-batch-size", "4", "--no-progress"]
    assert main([*train, "--output-dir", str(out), "--save-every", "1"]) == 0
    capsys.readouterr()
    for saved in (out / "final", out / "checkpoints" / "step-000001"):
        assert AutoTokenizer.from_pretrained(saved).chat_template is None, saved
    assert main([*chat, "--model", str(out / "final")]) == 0
    assert "warning: the model has no chat template, so --chat renders" in capsys.readouterr().err
    # The run trains on: the data's key is unchanged (it hashes the template the data was read with).
    assert main([*train, "--output-dir", str(out), "--max-steps", "2"]) == 0
    assert "resuming from" in capsys.readouterr().out
    # A folder an earlier lmtune saved with the built-in template, its run on no conversation.
    (out / "final" / "chat_template.jinja").write_text(BUILTIN_CHAT_TEMPLATE)
    assert main([*chat, "--model", str(out / "final")]) == 0
    assert (
        "warning: the model's chat template is lmtune's built-in one, and the run that saved it trained on "
        "prompt_completion records, not on conversations in it" in capsys.readouterr().err
    )


def test_audit_names_the_end_of_turn_as_the_trained_stop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "base"
    tok = chatml_tokenizer()
    tok.save_pretrained(base)
    (base / "config.json").write_text("{}")  # the audit reads only the tokenizer
    data = tmp_path / "chat.jsonl"
    long_prompt = "x" * 300
    rows = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]] * 3
    rows.append([{"role": "user", "content": long_prompt}, {"role": "assistant", "content": "late"}])
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    audit = [
        "data",
        "audit",
        str(data),
        "--model",
        str(base),
        "--max-length",
        "64",
        "--global-batch-size",
        "3",
    ]
    assert main(audit) == 0
    out = capsys.readouterr().out
    assert "stop keeps its label yes: 3 of 3 kept examples train a stop token (<|eos|> or <|im_end|>)" in out
    assert "1 truncated, 1 dropped" not in out and "0 truncated, 1 dropped" in out  # the long prompt
    assert "no trainable tokens 0" in out and "result              clean" in out


def test_train_on_prompt_trains_every_token_and_keeps_the_end_of_turn() -> None:
    from lmtune.config.groups import ExampleSettings
    from lmtune.data.prepare import encode_in_memory
    from lmtune.data.sources import Record
    from lmtune.data.tokenize import IGNORE_INDEX

    tok = chatml_tokenizer()
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    records = [
        Record("mem", 1, {"messages": conversation}),
        Record("mem", 2, {"prompt": "Q: ", "completion": "A"}),
    ]
    replies, _ = encode_in_memory(records, tok, ExampleSettings())
    everything, _ = encode_in_memory(records, tok, ExampleSettings(train_on_prompt=True))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    chat = everything[0]
    assert (chat.labels == chat.input_ids).all()  # every token of the conversation, markers included
    assert list(chat.labels).count(im_end) == 2  # both turns' ends
    assert (replies[0].labels != IGNORE_INDEX).sum() == 4  # by default: "o", "k", <|im_end|>, "\n"
    completion = everything[1]
    assert completion.labels[0] == IGNORE_INDEX and (completion.labels[1:] == completion.input_ids[1:]).all()
    assert (replies[1].labels != IGNORE_INDEX).sum() == 2  # by default: "A" and EOS


def _chat_data(path: Path) -> Path:
    questions = [f"what is {a} plus {b}?" for a in range(8) for b in range(8)]
    turns = [[{"role": "user", "content": q}, {"role": "assistant", "content": "ok"}] for q in questions]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in turns))
    return path


@pytest.mark.parametrize(("template", "end"), [("chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_chat_template_option_adds_its_markers_and_the_model_stops(
    tmp_path: Path, template: str, end: str
) -> None:
    """A tokenizer without the template's markers (the byte preset): they become special tokens,
    the embeddings grow, and the saved model ends its reply at the template's end of turn."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmtune.data.chat import TEMPLATES

    data = _chat_data(tmp_path / "chat.jsonl")
    out = tmp_path / "out"
    argv = ["train", "--data", str(data), "--chat-template", template, "--max-steps", "60", "--lr", "3e-3"]
    argv += ["--global-batch-size", "16", "--no-progress", "--output-dir", str(out)]
    assert main(argv) == 0
    final = out / "final"
    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    assert tok.chat_template == TEMPLATES[template].source
    assert model.config.vocab_size == len(tok) == len(byte_tokenizer()) + len(TEMPLATES[template].markers)
    end_id = tok.convert_tokens_to_ids(end)
    assert tok(f"a{end}", add_special_tokens=False)["input_ids"][-1] == end_id  # one token
    generation_config = json.loads((final / "generation_config.json").read_text())
    assert generation_config["eos_token_id"] == [tok.eos_token_id, end_id]
    messages = [{"role": "user", "content": "what is 3 plus 4?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        generated = model.generate(**ids, max_new_tokens=20, do_sample=False, pad_token_id=tok.pad_token_id)
    new = generated[0, ids["input_ids"].shape[1] :].tolist()
    assert new[-1] == end_id and tok.decode(new, skip_special_tokens=True) == "ok"


def test_gemma_template_renders_turn_by_turn_and_ends_turns_with_its_marker() -> None:
    from lmtune.data.chat import use_chat_template
    from lmtune.data.formats import PLAIN_FIELDS, render
    from lmtune.data.sources import Record

    tok = byte_tokenizer()
    assert use_chat_template(tok, "gemma") == ["<start_of_turn>", "<end_of_turn>"]
    assert use_chat_template(tok, "gemma") == []  # a second time adds nothing
    assert end_of_turn_ids(tok) == [tok.convert_tokens_to_ids("<end_of_turn>")]
    conversation = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ]
    r = render(Record("mem", 1, {"messages": conversation}), "messages", PLAIN_FIELDS, tok)
    assert r.text.startswith("<|bos|><start_of_turn>system\nbe brief<end_of_turn>\n")
    assert [r.text[a:b] for a, b in r.spans] == ["hello<end_of_turn>\n"]
    assert "<start_of_turn>model\n" in r.text


def test_a_chat_template_file_is_checked_and_its_markers_found(tmp_path: Path) -> None:
    from lmtune.data.chat import read_template
    from lmtune.errors import UserError

    good = tmp_path / "mine.jinja"
    good.write_text(
        "{% for m in messages %}<|turn|>{{ m['role'] }}: {{ m['content'] }}<end_of_reply>\n{% endfor %}"
        "{% if add_generation_prompt %}<|turn|>assistant: {% endif %}"
    )
    assert read_template(str(good)).markers == ("<|turn|>", "<end_of_reply>")
    cases = {
        "broken.jinja": ("{% for m in messages %}x", "line 1:"),
        "empty.jinja": ("hello", "never reads 'messages'"),
        "latin1.jinja": (b"{{ messages }}\xe9", "not UTF-8"),
        "huge.jinja": ("{{ messages }}" + " " * 70_000, "KiB"),
        "template.txt": ("{{ messages }}", "or a .jinja file"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(UserError, match=message):
            read_template(str(path))
    with pytest.raises(UserError, match="no such file"):
        read_template(str(tmp_path / "missing.jinja"))


def test_lora_with_new_turn_markers_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _chat_data(tmp_path / "chat.jsonl")
    argv = ["train", "--data", str(data), "--chat-template", "chatml", "--lora", "--max-steps", "1"]
    assert main([*argv, "--output-dir", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "LoRA leaves new token embeddings untrained" in capsys.readouterr().err


def test_a_chat_template_on_data_without_conversations_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing would render through it: it only saved a template, and grown embeddings, that
    nothing trained (and a generation config without the template's end of turn)."""
    data = tmp_path / "pc.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)}) + "\n" for i in range(8))
    )
    argv = [
        "train",
        "--data",
        str(data),
        "--chat-template",
        "chatml",
        "--max-steps",
        "1",
        "--global-batch-size",
        "8",
    ]
    assert main([*argv, "--output-dir", str(tmp_path / "out"), "--no-progress"]) == 2
    said = capsys.readouterr().err
    assert (
        "--chat-template: applies to conversations (messages records)" in said and "prompt_completion" in said
    )
    assert not (tmp_path / "out" / "final").exists()


def test_a_template_that_ends_no_reply_with_a_stop_token_is_warned_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Such a template trains (it is the user's), but the model would never learn to stop."""
    data = _chat_data(tmp_path / "chat.jsonl")
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]: {{ m['content'] }}\n{% endfor %}")
    argv = ["train", "--data", str(data), "--chat-template", str(template), "--max-steps", "1"]
    assert (
        main([*argv, "--global-batch-size", "8", "--output-dir", str(tmp_path / "out"), "--no-progress"]) == 0
    )
    said = "warning: 64 of 64 training examples train no stop token after the reply"
    out = capsys.readouterr().out
    assert said in out and "lmtune's built-in one" not in out
    assert main(["train", "--data", str(data), "--max-steps", "1", "--output-dir", str(tmp_path / "o2")]) == 0
    out = capsys.readouterr().out
    assert "train no stop token" not in out  # the built-in template ends every reply
    # ... and the log says the tokenizer had none, which template is used, and how to choose another.
    assert "chat data: the tokenizer has no chat template, so lmtune's built-in one renders" in out
    assert "--chat-template chatml|llama3|gemma or a .jinja file chooses another" in out
    # A model lmtune saved holds the built-in template as its own: trained again, it has one.
    again = ["train", "--data", str(data), "--model", str(tmp_path / "o2" / "final"), "--max-steps", "1"]
    assert main([*again, "--output-dir", str(tmp_path / "o3"), "--no-progress"]) == 0
    assert "the tokenizer has no chat template" not in capsys.readouterr().out
