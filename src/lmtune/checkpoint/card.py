"""The model card: README.md in every model folder lmtune writes (final/, final/merged/, export).

Its YAML front matter is what the Hugging Face hub reads (base model, library, tags, data sets);
its body says how the model was trained (objective, data, hyperparameters, hardware, time), what it
reached (final and best evaluation), its chat template and stop tokens, and how to load it. Every
fact comes from the run's run.json and the folder's own files; a README.md that lmtune did not
write is never replaced.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from lmtune.checkpoint.card_rows import result_rows, training_rows
from lmtune.checkpoint.layout import GENERATION_CONFIG
from lmtune.config.mixture import named_items
from lmtune.config.settings import SAMPLE_DATA
from lmtune.data.formats import BUILTIN_CHAT_TEMPLATE, CHAT_FORMATS
from lmtune.data.sources import EXTENSIONS, data_suffix
from lmtune.model.lora import ADAPTER_CONFIG
from lmtune.model.modeling import PRESETS
from lmtune.outputs.hub import CARD_FILE
from lmtune.outputs.runlog import own_loss

if TYPE_CHECKING:
    from lmtune.checkpoint.fingerprint import Fingerprint

RUN_FILE = "run.json"
# The first line of the body: what marks a card as lmtune's own (to be rewritten, never a user's).
MARKER = "<!-- model card written by lmtune; it is rewritten when lmtune writes this folder again -->"
TEMPLATE_SHOWN_CHARS = 2000


def write_run_cards(output_dir: Path) -> None:
    """The cards of a finished run's final/ and final/merged/, from its run.json."""
    run = _read_json(output_dir / RUN_FILE) or {}
    config = run.get("config", {})
    final = output_dir / "final"
    # The folder --push-to-hub uploads loads from the repo; the other one from where it lies.
    pushed = final / "merged" if config.get("merge_lora") else final
    for folder in (final, final / "merged"):
        if folder.is_dir():
            write_model_card(folder, run, repo_id=config.get("push_to_hub") if folder == pushed else None)


def write_model_card(
    folder: Path,
    run: dict[str, Any] | None,
    *,
    repo_id: str | None = None,
    note: str | None = None,
    final: Path | None = None,
) -> bool:
    """Write ``folder/README.md`` (its code loads from ``repo_id``, else from the folder, or from
    ``final``: where a folder being written will be); ``run`` is the run's run.json (None: what the
    folder alone tells). False when a README.md that lmtune did not write is there: it is kept."""
    if not lmtunes_card(folder):
        return False
    card = model_card(folder, run, repo_id=repo_id, note=note, final=final)
    (folder / CARD_FILE).write_text(card, encoding="utf-8")
    return True


def lmtunes_card(folder: Path) -> bool:
    """Whether ``folder``'s README.md is lmtune's to write: missing, or a card lmtune wrote."""
    path = folder / CARD_FILE
    return not path.is_file() or MARKER in path.read_text(encoding="utf-8", errors="replace")


def card_for_repo(folder: Path, repo_id: str) -> str:
    """The card `lmtune push` uploads for ``folder``, whose README.md is lmtune's: made again from
    its run's record where the folder is a run's final model; else (an export, away from its run)
    the folder's own card, loading from ``repo_id`` and titled by it. Made again there, it named
    "an unrecorded model" and lost what export wrote of the run and its step."""
    run = run_record_near(folder)
    path = folder / CARD_FILE
    if run is not None or not path.is_file():
        return model_card(folder, run, repo_id=repo_id)
    text = path.read_text(encoding="utf-8")
    if found := re.search(r'from_pretrained\("([^"\n]*)"\)', text):
        here = found.group(1)
        text = text.replace(f'from_pretrained("{here}")', f'from_pretrained("{repo_id}")')
        generate = "lmtune generate --model "
        text = text.replace(generate + shlex.quote(here), generate + shlex.quote(repo_id))
    title = repo_id.split("/")[-1]
    return re.sub(
        rf"^{re.escape(MARKER)}\n# [^\n]*", lambda _: f"{MARKER}\n# {title}", text, count=1, flags=re.M
    )


def run_record_near(folder: Path) -> dict[str, Any] | None:
    """run.json of the run whose output folder holds ``folder`` (OUTPUT/final, OUTPUT/final/merged)."""
    for parent in (folder.parent, folder.parent.parent):
        run = _read_json(parent / RUN_FILE)
        if run is not None and isinstance(run.get("config"), dict):
            return run
    return None


def checkpoint_record(checkpoint: Path, step: int) -> dict[str, Any] | None:
    """The run.json of a checkpoint's run, with the settings the checkpoint was saved under and the
    results of its step ``step`` (from metrics.jsonl) in place of the end's; None when the
    checkpoint is not in its run's folder."""
    output_dir = checkpoint.parent.parent
    run = _read_json(output_dir / RUN_FILE)
    if run is None:
        return None
    rows = []
    try:
        for line in (output_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                rows.append(row)
    except (OSError, ValueError):
        pass  # a run still being written, or cut short: what was read counts
    trained = [r for r in rows if r.get("kind") == "train" and r["step"] == step]
    evals = [r for r in rows if r.get("kind") == "eval"]
    result: dict[str, Any] = {"steps": step}
    if trained:
        result["last_loss"] = own_loss(trained[-1])
    if evals:
        last = evals[-1]
        result["eval"] = {
            "loss": last.get("eval_loss"),
            "perplexity": last.get("eval_perplexity"),
            **{
                k: last[f"eval_{k}"] for k in ("rewards/accuracies", "rewards/margins") if f"eval_{k}" in last
            },
            "examples": last.get("eval_examples", 0),
            "step": last["step"],  # the last evaluation at or before the checkpoint's step
        }
    resolved = run.get("resolved")
    if isinstance(resolved, dict) and isinstance(resolved.get("changed_on_resume"), list):
        # The card's settings are the last resume's: a later resume's changes, which this
        # checkpoint did not train with, are marked so.
        marked = [
            {**c, "after_checkpoint": not (isinstance(c.get("step"), int) and c["step"] < step)}
            for c in resolved["changed_on_resume"]
            if isinstance(c, dict)
        ]
        run = {**run, "resolved": {**resolved, "changed_on_resume": marked}}
    from lmtune.checkpoint.fingerprint import read_fingerprint
    from lmtune.errors import UserError

    try:
        recorded = read_fingerprint(checkpoint)
    except UserError:  # unreadable: the card keeps run.json's settings
        recorded = None
    return {**_saved_layout(checkpoint, recorded, _saved_settings(recorded, run)), "result": result}


def _saved_settings(recorded: Fingerprint | None, run: dict[str, Any]) -> dict[str, Any]:
    """``run`` with the settings a resume may change as the checkpoint's fingerprint holds them: the
    ones it was saved under, where run.json holds the last resume's."""
    if recorded is None or not isinstance(run.get("config"), dict):
        return run  # saved before fingerprints
    adjustable = recorded.adjustable
    config, resolved = dict(run["config"]), dict(run.get("resolved") or {})
    for label, value in adjustable.items():
        key = label.removeprefix("--").replace("-", "_")
        # The micro-batch is resolved per world size; the card shows the run's resolved one.
        if label.startswith("--") and key in config and key != "micro_batch_size":
            config[key] = value
    config["neftune_alpha"] = adjustable.get("--neftune-alpha", 0.0)  # recorded only when on
    for label, key in (("--lr", "lr"), ("total steps", "total_steps")):
        if label in adjustable:
            resolved[key] = adjustable[label]
    return {**run, "config": config, "resolved": resolved}


def _saved_layout(checkpoint: Path, recorded: Fingerprint | None, run: dict[str, Any]) -> dict[str, Any]:
    """``run`` with the processes and strategy that trained the checkpoint, where a later resume ran
    another layout (run.json describes the last attempt). The micro-batch is the checkpoint's
    when it was given as a number; ``auto`` was resolved for that layout, and is not known here."""
    from lmtune.checkpoint.layout import MANIFEST, SHARDED_METADATA
    from lmtune.checkpoint.store import read_state
    from lmtune.errors import UserError

    resolved = dict(run.get("resolved") or {})
    try:
        world = read_state(checkpoint).world_size
        sharded = SHARDED_METADATA in (_read_json(checkpoint / MANIFEST) or {})
    except (UserError, OSError):  # unreadable: the card keeps run.json's layout
        return run
    if world == resolved.get("world_size") and sharded == (resolved.get("strategy") == "fsdp"):
        return run
    micro = recorded.adjustable.get("--micro-batch-size") if recorded is not None else None
    share = resolved.get("global_batch_size", 0) // max(world, 1)
    known = isinstance(micro, int) and micro > 0 and share % micro == 0
    resolved |= {
        "world_size": world,
        "strategy": "fsdp" if sharded else "ddp" if world > 1 else "single",
        "micro_batch_size": micro if known else None,
        "accumulation": share // micro if known else None,
    }
    environment = {**(run.get("environment") or {}), "world_size": world}
    return {**run, "resolved": resolved, "environment": environment}


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return loaded if isinstance(loaded, dict) else None


def model_card(
    folder: Path,
    run: dict[str, Any] | None,
    *,
    repo_id: str | None = None,
    note: str | None = None,
    final: Path | None = None,
) -> str:
    """The card's text: YAML front matter, then the body."""
    run = run or {}
    config = run.get("config", {})
    adapter = (folder / ADAPTER_CONFIG).is_file()
    base = _hub_model(config.get("model"))
    named_base = (
        (_read_json(folder / ADAPTER_CONFIG) or {}).get("base_model_name_or_path") if adapter else None
    )
    if adapter and base is None:
        base = _hub_model(named_base)
    # An adapter on a preset names no base (only lmtune builds it); on a local folder it names the
    # folder's absolute path, which peft loads.
    preset_base = adapter and not named_base
    meta: dict[str, Any] = {}
    if base:
        meta["base_model"] = base
    meta["library_name"] = "peft" if adapter else "transformers"
    meta["pipeline_tag"] = "text-generation"
    quantized = ["qlora"] if run.get("resolved", {}).get("quantization") else []
    meta["tags"] = [
        "lmtune",
        config.get("objective") or "sft",
        *(["lora"] if config.get("lora") else []),
        *quantized,
    ]
    datasets = [d for d in (_hub_dataset(s) for s in _data_specs(config)) if d]
    if datasets:
        meta["datasets"] = datasets
    place = (final or folder).resolve()
    where = repo_id or str(place)
    title = repo_id.split("/")[-1] if repo_id else _title(place)
    body = [
        MARKER,
        f"# {title}",
        "",
        _summary(config, base, adapter, place.name == "merged"),
        *([f"\n{note}"] if note else []),
        "",
        "## Training",
        "",
        *_table(training_rows(run)),
        "",
        "## Results",
        "",
        *(_table(result_rows(run)) or ["No results were recorded (the folder has no run.json nearby)."]),
        *_chat_section(folder, chat := _chat_trained(folder, run)),
        "",
        "## How to use",
        "",
        *_usage(where, adapter, preset_base, config, chat=chat),
    ]
    front = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)
    return f"---\n{front}---\n\n" + "\n".join(body) + "\n"


def _title(folder: Path) -> str:
    """A run's folder names its model: OUTPUT/final -> OUTPUT, OUTPUT/final/merged -> OUTPUT-merged."""
    if folder.name == "merged" and folder.parent.name == "final":
        return f"{folder.parent.parent.name}-merged"
    return folder.parent.name if folder.name == "final" else folder.name


def _hub_model(name: Any) -> str | None:
    """``name`` when it is a hub id (not a preset, not a local folder)."""
    if not isinstance(name, str) or name in PRESETS or name.startswith((".", "/", "~")):
        return None
    if Path(name).expanduser().exists() or name.count("/") > 1:
        return None
    return name


def _data_specs(config: dict[str, Any]) -> list[str]:
    specs = [config.get("data"), config.get("eval_data")]
    return [item for s in specs if isinstance(s, str) for _, item in named_items(s)]


def _hub_dataset(spec: str) -> str | None:
    """The hub data set a --data item names (``org/name[:split]``), or None for files and the sample."""
    name = spec.split(":", 1)[0]
    if spec.startswith("sample") or any(c in spec for c in "*?[") or name.startswith((".", "/", "~")):
        return None
    if data_suffix(Path(name)) in EXTENSIONS or Path(name).expanduser().exists():
        return None
    return name


def _summary(config: dict[str, Any], base: str | None, adapter: bool, merged: bool) -> str:
    model = config.get("model", "an unrecorded model")
    origin = (
        f"[{base}](https://huggingface.co/{base})"
        if base
        else (f"lmtune's built-in preset `{model}`" if model in PRESETS else f"`{model}`")
    )
    what = (
        "A LoRA adapter"
        if adapter
        else "The base model with its LoRA adapter merged in"
        if merged
        else "A causal language model"
    )
    return f"{what}, fine-tuned from {origin} with lmtune."


def _table(rows: list[tuple[str, str]]) -> list[str]:
    if not rows:
        return []
    cells = [(k.replace("|", "\\|"), v.replace("|", "\\|")) for k, v in rows]  # a | would end the cell
    return ["| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in cells)]


def _template_of(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = (_read_json(folder / "tokenizer_config.json") or {}).get("chat_template")
    return template if isinstance(template, str) else None


def _token_names(folder: Path, ids: list[int]) -> list[str]:
    """Token strings of ``ids``, from the folder's tokenizer.json (no tokenizer is loaded)."""
    tokenizer = _read_json(folder / "tokenizer.json") or {}
    names = {t.get("id"): t.get("content") for t in tokenizer.get("added_tokens", []) if isinstance(t, dict)}
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):
        names.update({v: k for k, v in vocab.items() if v in ids and v not in names})
    return [str(names.get(i, f"id {i}")) for i in ids]


def trained_formats(run: dict[str, Any] | None) -> set[str]:
    """The data formats a run trained on, as its run.json records them (none when it does not)."""
    train = ((run or {}).get("data") or {}).get("train") or {}
    formats = train.get("formats") if isinstance(train, dict) else None
    return set(formats) if isinstance(formats, dict) else set()


def _chat_trained(folder: Path, run: dict[str, Any]) -> bool:
    """Whether the model was tuned on conversations: its run's data formats say so; without a
    run record, whether it carries a chat template. A preset's tokenizer has a template whatever
    it was trained on, and a model tuned on plain text answers a chat-rendered prompt badly."""
    formats = trained_formats(run)
    if formats:
        return bool(formats & set(CHAT_FORMATS))
    return _template_of(folder) is not None


def _chat_section(folder: Path, chat: bool) -> list[str]:
    template = _template_of(folder) if chat else None
    generation = _read_json(folder / GENERATION_CONFIG) or {}
    stops = generation.get("eos_token_id")
    stop_ids = [stops] if isinstance(stops, int) else [s for s in stops or [] if isinstance(s, int)]
    if template is None and not stop_ids:
        return []
    lines = ["", "## Chat template and stop tokens" if template is not None else "## Stop tokens", ""]
    if stop_ids:
        shown = ", ".join(f"`{t}`" for t in _token_names(folder, stop_ids))
        lines.append(
            f"Generation stops at {shown} (`eos_token_id` {stop_ids} in generation_config.json, which "
            "transformers' `generate` reads)."
        )
    if template is not None:
        origin = (
            "lmtune's built-in template (the tokenizer had none)"
            if template == BUILTIN_CHAT_TEMPLATE
            else "the template saved with the tokenizer"
        )
        lines += ["", f"Conversations are rendered with {origin}:", "", "```jinja"]
        cut = "\n..." if len(template) > TEMPLATE_SHOWN_CHARS else ""
        lines += [template[:TEMPLATE_SHOWN_CHARS] + cut, "```"]
    return lines


def _usage(where: str, adapter: bool, preset_base: bool, config: dict[str, Any], chat: bool) -> list[str]:
    if preset_base:
        return [
            f"The adapter's base is lmtune's built-in preset `{config.get('model')}`, which only lmtune "
            "builds (`lmtune generate` and `lmtune eval` load this folder in its run's folder): elsewhere, "
            "load the merged model (a run's `--merge-lora` writes it to final/merged/; `lmtune export "
            "CHECKPOINT DIR --merge-lora` merges a checkpoint's adapter)."
        ]
    load = (
        [
            "from peft import AutoPeftModelForCausalLM",
            "from transformers import AutoTokenizer",
            "",
            f'model = AutoPeftModelForCausalLM.from_pretrained("{where}")  # the base, then this adapter',
        ]
        if adapter
        else [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{where}")',
        ]
    )
    load.append(f'tokenizer = AutoTokenizer.from_pretrained("{where}")')
    # The built-in sample teaches sums: a prompt of its own kind shows what the model learned.
    prompt = "Hello!" if chat else "27+45=" if config.get("data") == SAMPLE_DATA else "Once upon a time"
    if chat:
        load += [
            'messages = [{"role": "user", "content": "Hello!"}]',
            "inputs = tokenizer.apply_chat_template(",
            '    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True',
            ").input_ids",
            "# generate stops at the end of the assistant's turn (generation_config.json)",
            "reply = model.generate(inputs, max_new_tokens=128)[0][inputs.shape[1] :]",
        ]
    else:
        load += [
            f'inputs = tokenizer("{prompt}", return_tensors="pt").input_ids',
            "reply = model.generate(inputs, max_new_tokens=64)[0][inputs.shape[1] :]",
        ]
    load.append("print(tokenizer.decode(reply, skip_special_tokens=True))")
    # Quoted: a folder's path with a space in it was two arguments when pasted.
    command = f'lmtune generate --model {shlex.quote(where)}{" --chat" if chat else ""} --prompt "{prompt}"'
    return ["```python", *load, "```", "", "or with lmtune:", "", "```bash", command, "```"]
