"""`lmtune plan`: the fake model's facts agree with the real model, and the CLI answers."""

from __future__ import annotations

import json
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lmtune.config.groups import LoraSettings
from lmtune.errors import UserError
from lmtune.model.lora import add_lora
from lmtune.model.modeling import load_config, load_model
from lmtune.tools.memory import Estimate, Host, Setup, estimate, model_facts
from lmtune.tools.plan import parse_size
from lmtune.tools.trace import saved_bytes
from tests.conftest import run_lmtune

LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear")


def test_parse_size() -> None:
    assert parse_size("24GiB") == 24 * 2**30
    assert parse_size("512M") == 512 * 2**20
    assert parse_size("1.5 GB") == int(1.5 * 2**30)
    assert parse_size("4096b") == 4096
    for wrong in ("lots", "24", "0GiB", "-1GiB", "1e3"):  # a bare number is not taken as bytes
        with pytest.raises(UserError, match="--memory-per-device"):
            parse_size(wrong)
    with pytest.raises(UserError, match=r"^--memory-per-device: must be more than 0, got '-5GiB'$"):
        parse_size("-5GiB")


def _real_saved_bytes(model: torch.nn.Module, length: int, rows: int = 1) -> int:
    """The same measurement as the plan's, on real tensors of the real model."""
    from lmtune.model.loss import token_loss_sum

    params = {id(p) for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(t) not in params and id(base) not in params:
            saved[id(base)] = base.numel() * base.element_size()
        return t

    ids = torch.randint(3, 250, (rows, length))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_loss_sum(model(input_ids=ids, use_cache=False).logits, ids)
    return sum(saved.values())


def test_fake_trace_saves_what_the_real_model_saves() -> None:
    config = load_config("tiny")
    assert saved_bytes(config, "fp32", 64, "cpu").total == _real_saved_bytes(load_model("tiny", 0).model, 64)


def _gpt2_config() -> Any:
    """GPT-2's layout (Conv1D layers, dropout on embeddings and residuals) at the tiny preset's size."""
    from transformers import GPT2Config

    from lmtune.model.modeling import byte_tokenizer

    tok = byte_tokenizer()
    return GPT2Config(
        vocab_size=len(tok),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=128,
        attn_pdrop=0.0,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["full", "lora", "qlora"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_plan_counts_what_a_micro_batch_saves_exactly(arch: str, variant: str, precision: str) -> None:
    """The fake trace against the real model's saved tensors, at 1 and 4 rows: LoRA (peft, with
    dropout) beside a frozen base, and QLoRA (bitsandbytes' 4-bit layers, whose outputs come back in
    the input's dtype); dropout keyed by example, as training runs it. Under autocast the products
    save bf16 copies of the weights once per micro-batch, not per row: counted per row, and LoRA as
    a formula added to the full model's trace, the plan over-predicted a GPU's bf16 peak by 22%
    (full), 30% (LoRA), 32% (QLoRA)."""
    from transformers import AutoModelForCausalLM

    from lmtune.model.dropout import TokenRuns, key_dropout, set_token_runs
    from lmtune.model.quantization import Quantization, quantize_built

    lora = None if variant == "full" else replace(LORA, dropout=0.05)
    quantization = None
    if variant == "qlora":
        pytest.importorskip("bitsandbytes")
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        quantization = Quantization(bits=4, quant_type="nf4", compute_dtype=dtype, storage_dtype=torch.uint8)
    if arch == "llama":
        config, model = load_config("tiny"), load_model("tiny", 0, quantization=quantization).model
    else:
        config = _gpt2_config()
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        if quantization is not None:
            model = quantize_built(model, quantization, torch.device("cpu"))
    if lora is not None:
        model = add_lora(model, lora)
    key_dropout(model)
    model.train()
    facts = model_facts(config, lora, precision, 32, "cpu", quantization is not None)
    for rows in (1, 4):
        set_token_runs(model, TokenRuns((rows, 32), tuple((i, 32 * i, 32 * (i + 1)) for i in range(rows))))
        setup = Setup("single", "adamw", lora is not None, False, precision, rows, 32, 1, 1)
        planned = estimate(setup, facts, Host(), padded=False).activations + rows * facts.logits
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            assert _real_saved_bytes(model, 32, rows) == planned, rows
    # What a block saves once is the weights' copies, which FSDP's bf16 gathers make unnecessary: of
    # the adapters and the base, or (bitsandbytes saves its packed weights) of the adapters alone.
    once = facts.block_once
    first = (".layers.0.", ".h.0.")  # the first block's parameters
    adapters = 2 * sum(
        n for name, n, _ in facts.params if any(b in name for b in first) and name.endswith(".lora")
    )
    assert once.total == once.casts
    if precision == "fp32":
        assert once.casts == 0
    else:
        assert once.casts == adapters if variant == "qlora" else once.casts > adapters


def test_parameters_match_the_real_model_with_and_without_lora() -> None:
    config = load_config("tiny")
    real = load_model("tiny", 0).model
    facts = model_facts(config, None, "fp32", 32, "cpu")
    assert sum(n for _, n, _ in facts.params) == sum(p.numel() for p in real.parameters())
    assert facts.layers == config.num_hidden_layers
    lora_facts = model_facts(config, LORA, "fp32", 32, "cpu")
    adapted = add_lora(real, LORA)
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert sum(n for _, n, t in lora_facts.params if t) == trainable


def test_optimizer_bytes_match_the_real_optimizers() -> None:
    """The estimate the plan and the free-space check before the first step make."""
    from lmtune.checkpoint.state import optimizer_state_bytes, optimizer_state_estimate
    from lmtune.objectives.sft import SummedLoss
    from lmtune.training.optim import build_optimizer

    model = SummedLoss(load_model("tiny", 0).model)
    sizes = [p.numel() for p in model.parameters()]
    ids = torch.randint(3, 250, (2, 16))
    for name, momentum in (
        ("adamw", 0.9),
        ("sgd", 0.9),
        ("sgd", 0.0),
        *((("adamw8bit", 0.9),) if _has_bitsandbytes() else ()),
    ):
        opt = build_optimizer(name, model, 1e-3, 0.0, (0.9, 0.999), 1e-8, momentum)
        model(ids, torch.ones_like(ids), ids).sum().backward()
        opt.step()
        opt.zero_grad()
        assert optimizer_state_estimate(name, sizes, momentum != 0) == optimizer_state_bytes(opt), name


def _has_bitsandbytes() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True


def test_savers_lower_the_estimate() -> None:
    config = load_config("small")
    full, adapters = (model_facts(config, lora, "fp32", 256, "cpu") for lora in (None, LORA))

    def predict(strategy: str = "single", lora: bool = False, ckpt: bool = False, world: int = 1) -> Estimate:
        setup = Setup(strategy, "adamw", lora, ckpt, "fp32", 8, 256, world, 1)
        return estimate(setup, adapters if lora else full, Host(), padded=False)

    plain = predict()
    assert predict(ckpt=True).activations < plain.activations / 2
    lora = predict(lora=True)
    assert lora.optimizer < plain.optimizer / 10 and lora.gradients < plain.gradients / 10
    fsdp = predict("fsdp", world=4)
    assert fsdp.optimizer == plain.optimizer // 4 and fsdp.weights == plain.weights // 4
    ddp = predict("ddp", world=4)  # gradients live in DDP's buckets for the whole run
    assert ddp.buffers == 0 and ddp.tensors == plain.weights + plain.gradients + plain.optimizer + (
        plain.activations + plain.logits
    )


@pytest.mark.e2e
def test_plan_command_prints_a_table_and_json() -> None:
    """`--json -` gives standard output to the JSON alone (for a pipe) and the table to standard error."""
    proc = run_lmtune(
        ["plan", "--model", "small", "--nproc-per-node", "2", "--memory-per-device", "1GiB", "--json", "-"]
    )
    # The setup asked for (3.8 GiB) does not fit: exit 1, as `lmtune plan && lmtune train` needs
    # (it was 0), with the table and the JSON all the same.
    assert proc.returncode == 1, proc.stderr
    assert "the setup asked for does not fit 1.0 GiB per device (exit code 1)" in proc.stderr
    assert "setups that fit 1.0 GiB per device" in proc.stderr and "fsdp x2" in proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["requested"]["setup"]["strategy"] == "ddp"
    labels = {
        (c["setup"]["strategy"], c["setup"]["optimizer"], c["setup"]["lora"]) for c in plan["candidates"]
    }
    assert ("fsdp", "adamw", True) in labels and ("ddp", "adamw8bit", False) in labels
    fits = [c for c in plan["candidates"] if c["largest_micro_batch"] > 0]
    assert fits and all(c["total"] <= 2**30 for c in fits)


def test_plan_rejects_a_bad_size() -> None:
    proc = run_lmtune(["plan", "--memory-per-device", "huge"])
    assert proc.returncode == 2 and "--memory-per-device" in proc.stderr and "Traceback" not in proc.stderr


def test_dp_without_gpus_is_refused_before_any_measuring_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CPU plan measures the machine with real runs (seconds); a setup that cannot run here is
    refused first, not by the measuring run's failure."""
    import subprocess

    from lmtune.config.settings import TrainConfig
    from lmtune.tools import plan as plan_module

    def measuring_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("a measuring run was started")

    monkeypatch.setattr(subprocess, "run", measuring_run)
    with pytest.raises(UserError, match=r"^--strategy dp \(nn.DataParallel\) needs CUDA GPUs"):
        plan_module.plan(TrainConfig(strategy="dp"), None, True, tmp_path)


@pytest.mark.e2e
def test_calibrate_fits_two_real_runs(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    args = ["plan", "--micro-batch-size", "4", "--global-batch-size", "8", "--max-length", "64"]
    proc = run_lmtune([*args, "--calibrate", "--memory-per-device", "4GiB", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    assert "calibrated on two real runs" in proc.stdout
    plan = json.loads(out.read_text())
    points = plan["calibration"]["points"]
    assert [p[0] for p in points] == [4, 2] and all(p[2] > 0 for p in points)
    # The corrected prediction passes through what the real run at the requested size measured.
    assert plan["requested"]["total"] == pytest.approx(points[0][2], rel=0.01)
    assert plan["requested"]["host"]["runtime"] > 0 and plan["requested"]["host"]["allocator"] >= 1.0


def test_a_failed_measuring_run_is_named_for_what_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plan's own runs (on CPU it measures this machine with two) are not blamed on --calibrate, and
    the message shows the run's error, not plan's scratch paths."""
    import subprocess

    from lmtune.config.settings import TrainConfig
    from lmtune.tools import plan as plan_module

    stderr = f"some library noise\nerror: {tmp_path}/cut-1/x.json: broken\n"
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 2, "", stderr))
    setup = Setup(
        strategy="single",
        optimizer="adamw",
        lora=False,
        activation_checkpointing=False,
        precision="fp32",
        micro_batch_size=2,
        length=64,
        world_size=1,
        accumulation=1,
        loss_chunk=0,
    )
    with pytest.raises(UserError) as failed:
        plan_module.measure_peak(TrainConfig(), setup, tmp_path, "m", run="plan measures this machine")
    message = str(failed.value)
    assert message == "plan measures this machine; that run failed (exit code 2): cut-1/x.json: broken"
    with pytest.raises(
        UserError, match=r"^--calibrate trains two steps of .* at micro-batch 2; that run failed"
    ):
        plan_module.measure_peak(TrainConfig(), setup, tmp_path)


def test_without_data_the_host_is_measured_on_rows_of_the_planned_length(tmp_path: Path) -> None:
    """The built-in sample's few-token examples against tensors planned for --max-length rows gave
    a runtime of a third of the real one (965 MiB planned, 1,543 MiB trained)."""
    from lmtune.config.settings import TrainConfig
    from lmtune.data.prepare import encode_in_memory
    from lmtune.data.sources import Record
    from lmtune.tools.plan import _planned_rows

    setup = Setup(
        "single", "adamw", False, False, "fp32", micro_batch_size=4, length=96, world_size=1, accumulation=2
    )
    cfg = _planned_rows(TrainConfig(), setup, tmp_path)
    assert (cfg.examples.max_length, cfg.examples.truncation) == (96, "right")
    rows = [json.loads(line) for line in Path(cfg.data.train).read_text().splitlines()]
    assert len(rows) == 2 * 4 * 2  # two steps of the global batch
    tokenizer = load_model("tiny", 0).tokenizer
    records = [Record("planned-rows.jsonl", i + 1, r) for i, r in enumerate(rows[:2])]
    dataset, stats = encode_in_memory(records, tokenizer, cfg.examples)
    assert dataset.lengths().tolist() == [96, 96] and stats.truncated == 2


def test_plan_refuses_what_train_would_before_measuring(tmp_path: Path) -> None:
    """fp16 on a CPU and a --lora-target-modules name that adapts nothing are refused as train
    refuses them, before the runs that measure this machine (they took 8-12 s to say so)."""
    from lmtune.config.settings import TrainConfig
    from lmtune.tools.plan import plan

    with pytest.raises(UserError, match="fp16 needs a CUDA GPU"):
        plan(TrainConfig(model="tiny", precision="fp16"), None, False, tmp_path)
    config = load_config("tiny")
    wrong = replace(LORA, target_modules="q_proj,nonexistent_proj")
    with pytest.raises(
        UserError, match=r"nonexistent_proj matched no layer of this model \(its linear layers: "
    ):
        model_facts(config, wrong, "fp32", 16, "cpu")
    # As peft matches them: a name, or its dotted end.
    dotted = model_facts(config, replace(LORA, target_modules="self_attn.q_proj,v_proj"), "fp32", 16, "cpu")
    adapted = [name for name, _, _ in dotted.params if name.endswith(".lora")]
    assert len(adapted) == 2 * config.num_hidden_layers and all("_proj.lora" in n for n in adapted)
    assert not list(tmp_path.iterdir())  # nothing was trained to find out


@pytest.mark.parametrize(
    ("lora", "compiled"), [("lm_head,q_proj", False), ("q_proj,v_proj", False), ("", True), ("", False)]
)
def test_the_plan_keeps_full_logits_where_training_does(lora: str, compiled: bool) -> None:
    """An adapted head is not a plain linear layer: training keeps full logits, and the plan must
    size them so. A --compile run of a model with decoder blocks keeps the chunked loss."""
    from lmtune.config.settings import TrainConfig
    from lmtune.model.chunked_loss import choose
    from lmtune.model.compiled import compiles_whole
    from lmtune.model.lora import add_lora
    from lmtune.model.modeling import build_preset
    from lmtune.tools.memory import loss_chunk

    model = build_preset("tiny", 0).model
    cfg = TrainConfig(lora=bool(lora), lora_target_modules=lora or "all-linear", compile=compiled)
    trained = add_lora(model, cfg.lora) if lora else model
    chosen = choose(trained, None, compiled and compiles_whole(trained), device_type="cpu").chunk
    assert loss_chunk(cfg, model.config, "cpu") == chosen
    assert (chosen == 0) == lora.startswith("lm_head")


class _LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """The peak bytes of the tensors the dispatched operations made and that are alive together.
    A kernel's own temporaries (torch.logsumexp's, say) are not seen: the loss must not call such
    kernels on a chunk's size."""

    def __init__(self, *inputs: torch.Tensor) -> None:
        super().__init__()
        # The inputs' storages are there before: their views (a weight's transpose) are not new.
        self.live: dict[int, int] = {t.untyped_storage().data_ptr(): 0 for t in inputs}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        self.live[key] = storage.nbytes()
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)

        def free() -> None:
            self.now -= self.live.pop(key, 0)

        weakref.finalize(storage, free)


@pytest.mark.parametrize("chunk", [0, 48], ids=["full-logits", "chunked"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_plan_sizes_the_peak_the_loss_reaches(precision: str, chunk: int) -> None:
    """What the loss holds at once beyond its inputs, forward and backward, is what the plan counts
    for it: full logits, three fp32 copies as the log-softmax's backward runs (the plan had two: 12%
    under an H200's peak at Qwen2.5's vocabulary); chunked, one chunk's fp32 logits and their
    low-precision twin (a chunk's logits had outlived it, and logsumexp made a copy)."""
    from transformers import LlamaConfig

    from lmtune.model.chunked_loss import linear_cross_entropy_sum, targets_of
    from lmtune.model.loss import token_loss_sum
    from lmtune.tools.memory import _loss_bytes

    vocab, hidden, rows, length = 4000, 16, 2, 80
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1
    )
    setup = Setup("single", "adamw", False, False, precision, rows, length, 1, 1, loss_chunk=chunk)
    planned = _loss_bytes(setup, model_facts(config, None, precision, length, "cpu"))
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    states = torch.randn(rows, length, hidden, requires_grad=True)
    labels = torch.randint(0, vocab, (rows, length))
    targets = targets_of(labels)
    with _LiveBytes(head.weight, states, labels, targets.index, targets.tokens) as live:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            if chunk:
                loss = linear_cross_entropy_sum(states, head, targets, chunk)
            else:
                loss = token_loss_sum(head(states), labels)[0]
        loss.backward()
    # Autocast's bf16 copy of the head's weight: the plan counts it with the model's weight copies.
    cast = 2 * vocab * hidden if precision == "bf16" else 0
    assert live.peak == pytest.approx(planned + cast, rel=0.02)


@pytest.mark.parametrize(
    ("layers", "vocab", "design"), [(2, 32000, "micro-batches 8 and 4"), (6, 300, "1- and 3-block")]
)
def test_the_host_is_solved_from_the_runs_whose_tensors_differ_most(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layers: int, vocab: int, design: str
) -> None:
    """Two measuring runs whose tensors differ by a few MB (a 2-block model's cuts, its vocabulary
    the bulk) gave a heap factor that was noise; the 1-block cut at two micro-batches differs by
    the activations and logits. Measured peaks here are a known runtime plus a known factor, and
    1 MiB of noise either way."""
    from transformers import LlamaConfig

    from lmtune.config.settings import TrainConfig
    from lmtune.tools import plan as plan_module
    from lmtune.tools.memory import estimate

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32 if layers == 2 else 256,
        intermediate_size=64 if layers == 2 else 1024,
        num_attention_heads=2,
        num_hidden_layers=layers,
        max_position_embeddings=128,
    )
    setup = Setup("single", "adamw", False, False, "fp32", 8, 64, 1, 1)

    def predict_cut(cut: Any, s: Setup) -> Estimate:
        return estimate(s, model_facts(cut, None, "fp32", 64, "cpu"), Host(), False)

    runtime, factor = 300 * 2**20, 1.4
    runs: list[tuple[str, int]] = []

    def measured(cfg: Any, s: Setup, workdir: Path, model: str, run: str) -> int:
        runs.append((Path(model).name, s.micro_batch_size))
        cut = LlamaConfig.from_pretrained(model)
        noise = 2**20 if len(runs) == 1 else -(2**20)
        return int(runtime + factor * predict_cut(cut, s).tensors + noise)

    monkeypatch.setattr(plan_module, "measure_peak", measured)
    host = plan_module.measure_host(TrainConfig(model="tiny"), setup, config, predict_cut, tmp_path)
    assert design in host.measured_on
    assert len(runs) == 2 and (runs[0][0] == runs[1][0]) == ("micro-batches" in design)
    assert abs(host.allocator - factor) < 0.1
    assert host.runtime == pytest.approx(runtime, rel=0.1)


def test_pairs_that_run_as_two_rows_are_planned_as_two_rows(tmp_path: Path) -> None:
    """On a model no mask keeps apart (BLOOM's ALiBi) a preference pair runs as two rows, its prompt
    with each answer: the plan counted one row of prompt and both answers. Its rows are as wide
    as training lays them out (lmtune.objectives.pair_routing)."""
    from transformers import AutoModelForCausalLM, BloomConfig

    from lmtune.config.settings import TrainConfig
    from lmtune.data.pair_collate import PairCollator
    from lmtune.model.modeling import byte_tokenizer, load_tokenizer
    from lmtune.objectives.pair_routing import _answer_rows, _parts
    from lmtune.parallel.distributed import read_dist_env
    from lmtune.tools.plan import plan, setup_from
    from lmtune.tools.rows import _QuietLog, model_obstacle, row_length
    from lmtune.training.build import prepare_data

    tok = byte_tokenizer()
    ids = {
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    bloom = BloomConfig(vocab_size=len(tok), hidden_size=32, n_layer=1, n_head=2, **ids)
    AutoModelForCausalLM.from_config(bloom).save_pretrained(tmp_path / "bloom")
    tok.save_pretrained(tmp_path / "bloom")
    data = tmp_path / "pairs.jsonl"
    pairs = [("a prompt of some length", "yes", "no, a rejected answer"), ("q", "a chosen answer here", "b")]
    keys = ("prompt", "chosen", "rejected")
    data.write_text("".join(json.dumps(dict(zip(keys, p, strict=True))) + "\n" for p in pairs))
    for name, apart in (("tiny", False), (str(tmp_path / "bloom"), True)):
        cfg = TrainConfig(model=name, data=str(data), objective="dpo", cache_dir=str(tmp_path / "cache"))
        why = model_obstacle(load_config(name), "cpu")
        assert (why is not None) == apart and (not apart or "ALiBi" in why)
        length, padded, reason, _ = row_length(cfg, why)
        train = prepare_data(cfg, load_tokenizer(name), read_dist_env("cpu"), _QuietLog())[0]
        widths = []
        for i in range(len(train)):
            batch = PairCollator(tok.pad_token_id)([train[i]])
            assert batch.segment_ids is not None
            rows = _answer_rows(batch.input_ids, batch.labels, *_parts(batch.segment_ids))
            widths.append(rows.inputs["input_ids"].shape[1] if apart else batch.input_ids.shape[1])
        assert length == max(widths) and padded and ("two rows" in reason) == apart, (name, widths)
        setup = setup_from(cfg, 1, length, pairs_apart=why is not None)
        assert setup.rows == setup.micro_batch_size * (2 if apart else 1)
    with pytest.raises(UserError, match="--packing on"):  # as train refuses it, before measuring
        plan(TrainConfig(model=str(tmp_path / "bloom"), packing="on"), None, False, tmp_path / "plan")


def test_packed_rows_are_planned_as_a_steps_longest_examples_fill_them(tmp_path: Path) -> None:
    """With --data, packed rows are as many as a step's examples fill: short examples filled one
    row where a micro-batch of rows of --max-length was planned (3.6x the peak the run reached)."""
    from lmtune.config.settings import TrainConfig
    from lmtune.tools.plan import setup_from
    from lmtune.tools.rows import row_length

    short, long = tmp_path / "short.jsonl", tmp_path / "long.jsonl"
    short.write_text("".join(json.dumps({"text": "ab " * (1 + i % 3)}) + "\n" for i in range(40)))
    long.write_text("".join(json.dumps({"text": "word " * (20 + i % 9)}) + "\n" for i in range(40)))
    common = {"global_batch_size": 8, "max_length": 64, "cache_dir": str(tmp_path / "cache")}
    few = row_length(TrainConfig(data=str(short), **common), None, per_rank=8)
    # The 8 longest: "ab ab ab " with its BOS and EOS, 11 tokens each: 5 in a row of 64, then 3.
    assert (few.length, few.padded, few.most) == (55, True, 2) and "8 longest examples fill 2" in few.reason
    assert setup_from(TrainConfig(data=str(short), **common), 1, few.length, most_rows=few.most).rows == 2
    many = row_length(TrainConfig(data=str(long), **{**common, "max_length": 256}), None, per_rank=8)
    assert many.most == 8 and 128 < many.length < 256  # no two of them fit in one row
    assert row_length(TrainConfig(**common), None, per_rank=8).most == 0  # no --data: rows of --max-length


def test_a_long_setup_keeps_the_tables_columns() -> None:
    """A setup past 40 characters (paged_adamw8bit+lora+nf4+ckpt+dpo) pushed its row's figures
    out from under their headings."""
    from lmtune.tools.plan import PlanReport, format_report

    config = load_config("tiny")
    facts = model_facts(config, LORA, "bf16", 64, "cpu")
    long = Setup(
        "ddp", "paged_adamw8bit", True, True, "bf16", 2, 64, 16, 1, quantization="nf4", objective="dpo"
    )
    short = replace(long, optimizer="adamw", lora=False, quantization=None, objective="sft")
    requested, other = (estimate(s, facts, Host(), padded=False) for s in (long, short))
    report = PlanReport("tiny", requested, [(other, 2), (requested, 2)], 2**30, "given", None, 2)
    lines = format_report(report).splitlines()
    heads, rows = ([x for x in lines if x.startswith(start)] for start in ("setup ", "ddp "))
    assert len(heads) == 2 and len(rows) == 3 and len(long.label()) > 40
    for row in rows:  # each row's micro-batch under "micro", its last figure ending under "total MiB"
        assert len(row) == len(heads[0]) and row.index("B=") == heads[0].index("micro")


def test_a_host_fit_the_noise_decides_counts_each_tensor_byte_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Peaks that differ by more than their tensors can (noise) solved to "0 MiB of its own, 3.00
    resident bytes per tensor byte", a plan 28% over the run."""
    from transformers import LlamaConfig

    from lmtune.config.settings import TrainConfig
    from lmtune.tools import plan as plan_module
    from lmtune.tools.memory import estimate

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_hidden_layers=4
    )
    setup = Setup("single", "adamw", False, False, "fp32", 8, 64, 1, 1)

    def predict_cut(cut: Any, s: Setup) -> Estimate:
        return estimate(s, model_facts(cut, None, "fp32", 64, "cpu"), Host(), False)

    peaks: list[int] = []

    def measured(cfg: Any, s: Setup, workdir: Path, model: str, run: str) -> int:
        tensors = predict_cut(LlamaConfig.from_pretrained(model), s).tensors
        peaks.append(400 * 2**20 + (5 if peaks else 1) * tensors)  # the second 5x its tensors: noise
        return peaks[-1]

    monkeypatch.setattr(plan_module, "measure_peak", measured)
    host = plan_module.measure_host(TrainConfig(model="tiny"), setup, config, predict_cut, tmp_path)
    assert host.allocator == 1.0 and "the two runs' difference was noise" in host.measured_on
    assert host.runtime > 400 * 2**20  # what the second run's tensors leave: no run predicted low


def test_the_largest_micro_batch_divides_the_global_batch_per_device() -> None:
    """The table offered B=19 of a global batch of 32, which training refuses."""
    from lmtune.tools.plan import largest_micro_batch

    setup = Setup("single", "adamw", False, False, "fp32", 1, 64, 1, 1)

    def predict(s: Setup) -> Estimate:
        return Estimate(
            s,
            weights=0,
            gradients=0,
            optimizer=0,
            activations=s.micro_batch_size,
            logits=0,
            buffers=0,
            host=Host(),
        )

    assert largest_micro_batch(setup, predict, memory=19, limit=32) == 16
    assert largest_micro_batch(setup, predict, memory=19, limit=30) == 15
    assert largest_micro_batch(setup, predict, memory=0, limit=32) == 0
