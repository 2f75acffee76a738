"""The memory model behind `lmtune plan`: a setup (strategy, optimizer, precision, LoRA,
checkpointing, micro-batch) and the model's facts -> bytes per device, term by term.

The model is built from its config alone on a fake device (lmtune.tools.trace), so nothing of it is
allocated. Weights, gradients, optimizer state and communication buffers follow from the parameter
list and the strategy. The activations are not guessed from a formula: a fake forward pass records
every tensor autograd saves for the backward pass, for a model cut to one decoder block and to two
(the difference is one block; the rest is embeddings, head and loss), of one row and of two (what a
second row adds is paid per row; the rest, such as autocast's low-precision copies of the weights,
once per micro-batch whatever its rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from lmtune.checkpoint.state import optimizer_state_estimate
from lmtune.config.groups import LoraSettings
from lmtune.config.settings import TrainConfig
from lmtune.errors import UserError
from lmtune.model.compiled import compiles_whole
from lmtune.model.lora import check_every_target, target_modules
from lmtune.model.precision import low_precision_dtype
from lmtune.model.quantization import quantized_bytes
from lmtune.parallel.wrap import decoder_blocks
from lmtune.tools.trace import (
    Saved,
    cut_layers,
    fake_device,
    fake_model,
    lora_targets,
    quantizable_modules,
    saved_bytes,
)

MIB = 2**20


@dataclass(frozen=True)
class Setup:
    strategy: str  # single | ddp | fsdp
    optimizer: str
    lora: bool
    activation_checkpointing: bool
    precision: str
    micro_batch_size: int
    length: int  # tokens per row of a micro-batch
    world_size: int
    accumulation: int  # micro-steps per optimizer step
    loss_chunk: int = 0  # tokens per chunk of the chunked linear cross-entropy; 0: full logits
    quantization: str = ""  # the frozen base's (--load-in-4bit: nf4 | fp4; --load-in-8bit: int8)
    # A preference objective's example is a pair: its prompt and both answers in one row (length),
    # or, on a model no mask keeps apart (lmtune.model.masks.mask_obstacle), two rows: the prompt
    # and each answer (length: the longer of them).
    objective: str = "sft"
    live_reference: bool = False  # a frozen copy of the model runs beside it (without LoRA)
    pairs_apart: bool = False
    most_rows: int = 0  # packed rows a micro-batch holds at most (a step's examples fill no more); 0: any

    @property
    def rows(self) -> int:
        rows = self.micro_batch_size * (2 if self.pairs_apart else 1)
        return min(rows, self.most_rows) if self.most_rows else rows

    @property
    def reference_copy(self) -> bool:
        """A live reference without LoRA is a second copy of the weights (LoRA's is its base)."""
        return self.live_reference and not self.lora

    def label(self) -> str:
        extras = (
            [self.optimizer]
            + (["lora"] if self.lora else [])
            + ([self.quantization] if self.quantization else [])
            + (["ckpt"] if self.activation_checkpointing else [])
            + ([self.objective] if self.objective != "sft" else [])
        )
        return f"{self.strategy} x{self.world_size} {self.precision} " + "+".join(extras)


@dataclass(frozen=True)
class Host:
    """What a CPU process holds besides the tensors the plan counts: a fixed footprint (Python,
    torch, transformers, kernel code) and the allocator's resident bytes per live tensor byte (freed
    activations stay resident in the C heap). On a GPU the allocator counts none of that, only the
    CUDA libraries' workspaces it holds beside the tensors (``gpu``)."""

    runtime: int = 0
    allocator: float = 1.0
    gpu: bool = False
    measured_on: str = ""  # on CPU, the runs the two above were solved from


@dataclass(frozen=True)
class Estimate:
    """Predicted peak bytes on one device, by what holds them."""

    setup: Setup
    weights: int
    gradients: int
    optimizer: int
    activations: int  # saved for backward by the decoder blocks and embeddings
    logits: int  # vocab x length x batch: the saved log-softmax and its gradient
    # FSDP all-gather and reduce-scatter buffers (DDP's buckets are the gradients); a quantized
    # base's layer dequantized for its product (forward, and again in backward)
    buffers: int
    host: Host = Host()
    activation_scale: float = 1.0  # set by --calibrate
    offset: int = 0  # set by --calibrate

    @property
    def tensors(self) -> int:
        """Peak bytes of live tensors."""
        dynamic = (self.activations + self.logits) * self.activation_scale
        state = self.weights + self.optimizer + self.buffers
        if self.setup.accumulation > 1 or self.setup.strategy == "ddp":
            # Gradients of earlier micro-steps stay while the next one's activations are alive;
            # DDP's gradients are views into its buckets, allocated once for the whole run.
            return int(state + self.gradients + dynamic)
        # One micro-step: gradients appear as the backward frees activations, so they overlap little.
        return int(state + max(dynamic, self.gradients + self.logits * 0.5 * self.activation_scale))

    @property
    def total(self) -> int:
        return int(self.host.runtime + self.host.allocator * self.tensors + self.offset)


@dataclass(frozen=True)
class ModelFacts:
    """What the fake model tells about one variant (with or without LoRA) at one row length."""

    params: list[tuple[str, int, bool]]  # name, elements, trainable (tied weights once)
    layers: int
    hidden: int
    vocab: int
    block_elements: int  # parameters of one decoder block
    per_layer: int  # bytes saved for backward by one block, one row
    other: int  # bytes saved outside the blocks (embeddings, final norm), one row
    # Saved once per micro-batch whatever its rows, by one block and by the rest: the weights' copies
    # of autocast, and tensors every row shares (rotary tables).
    block_once: Saved
    other_once: Saved
    logits: int  # bytes of vocab-wide tensors saved for the loss, one row
    quantizable: list[tuple[int, int]]  # [out, in] of each linear layer bitsandbytes would quantize


def model_facts(
    config: Any, lora: LoraSettings | None, precision: str, length: int, device: str, quantized: bool = False
) -> ModelFacts:
    """Parameters of the whole model; saved activations of a one-block and a two-block cut of it
    (with ``lora``, adapted; ``quantized``, its base as bitsandbytes packs it)."""
    with fake_device(device):
        full = fake_model(config)
        blocks = decoder_blocks(full)
        params = [(n, p.numel(), lora is None) for n, p in full.named_parameters()]
        block_elements = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
        targets = lora_targets(full, lora) if lora is not None else []
        quantizable = _quantizable(full)
        if lora is not None:
            _check_targets(full, lora, [name for name, _, _ in targets])
    if lora is not None:
        params += [(f"{n}.lora", lora.rank * (i + o), True) for n, i, o in targets]

    def trace(layers: int, rows: int) -> Saved:
        return saved_bytes(cut_layers(config, layers), precision, length, device, rows, lora, quantized)

    # A second row adds what each row saves; the rest is saved once per micro-batch.
    one_once, two_once = trace(1, 1), trace(2, 1)
    one_row, two_row = trace(1, 2).minus(one_once), trace(2, 2).minus(two_once)
    one_once, two_once = one_once.minus(one_row), two_once.minus(two_row)
    one, two, logits = one_row.total, two_row.total, one_row.wide
    per_layer = two - one
    block_once = two_once.minus(one_once)
    return ModelFacts(
        params=params,
        layers=len(blocks),
        hidden=int(config.hidden_size),
        vocab=int(config.vocab_size),
        block_elements=block_elements,
        per_layer=per_layer,
        other=one - per_layer - logits,
        logits=logits,
        quantizable=quantizable,
        block_once=block_once,
        other_once=one_once.minus(block_once),
    )


def cuda_workspaces(precision: str) -> Host:
    """What the CUDA allocator holds beside the tensors: cuBLAS's workspace for each thread that
    multiplies (the forward's, and autograd's device thread for the backward). Measured by one small
    product and its backward, all tensors freed after: the size depends on the GPU, the torch
    version and CUBLAS_WORKSPACE_CONFIG."""
    dtype = low_precision_dtype(precision)
    torch.cuda.synchronize()
    # Freed first: in a process that has multiplied before (the Python API) they would not be new.
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    base = torch.cuda.memory_allocated()
    layer = torch.nn.Linear(64, 64, device="cuda")
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        y = layer(x) @ layer.weight  # addmm and mm: cuBLASLt and cuBLAS, where they differ
    y.float().sum().backward()
    torch.cuda.synchronize()
    del layer, x, y
    workspaces = max(0, torch.cuda.memory_allocated() - base)
    if clear is not None:  # --calibrate's runs share this GPU: hold nothing while they run
        clear()
    torch.cuda.empty_cache()
    return Host(runtime=workspaces, gpu=True)


def _check_targets(model: torch.nn.Module, lora: LoraSettings, adapted: list[str]) -> None:
    """What training would refuse: a --lora-target-modules name that adapts no layer."""
    names = target_modules(lora)
    if isinstance(names, list):
        check_every_target(model, adapted, names, lora.target_modules)
    elif not adapted:
        raise UserError(f"--lora-target-modules {lora.target_modules}: no linear layer of the model matches")


def _quantizable(model: torch.nn.Module) -> list[tuple[int, int]]:
    """[out, in] of each layer :func:`quantizable_modules` names."""
    found = []
    for module in quantizable_modules(model):
        rows, cols = module.get_parameter("weight").shape
        found.append((int(cols), int(rows)) if type(module).__name__ == "Conv1D" else (int(rows), int(cols)))
    return found


def _weight_bytes(setup: Setup, facts: ModelFacts) -> tuple[int, int]:
    """Bytes of the weights (fp32; a quantized base's linear layers packed, with their constants)
    and of one quantized layer dequantized for its product (0 in full precision)."""
    total = 4 * sum(n for _, n, _ in facts.params)
    if not setup.quantization:
        return total, 0
    bits = 8 if setup.quantization == "int8" else 4
    full = sum(4 * rows * cols for rows, cols in facts.quantizable)
    packed = sum(quantized_bytes(bits, rows, cols) for rows, cols in facts.quantizable)
    compute = 2 if low_precision_dtype(setup.precision) is not None or bits == 8 else 4
    largest = max((rows * cols for rows, cols in facts.quantizable), default=0)
    return total - full + packed, 2 * compute * largest


def _mask_bytes(setup: Setup, padded: bool) -> int:
    """A padded or packed micro-batch carries a boolean [B, 1, L, L] attention mask."""
    return setup.rows * setup.length * setup.length if padded else 0


def estimate(setup: Setup, facts: ModelFacts, host: Host, padded: bool) -> Estimate:
    world = setup.world_size
    shard = world if setup.strategy == "fsdp" else 1
    total_elements = sum(n for _, n, _ in facts.params)
    trainable = [n for _, n, t in facts.params if t]
    gathered_bytes = 2 if setup.precision in ("bf16", "fp16") else 4  # FSDP casts what it gathers
    all_weights, buffers = _weight_bytes(setup, facts)
    weights = all_weights // shard * (2 if setup.reference_copy else 1)
    gradients = 4 * sum(trainable) // shard
    if setup.strategy == "fsdp":
        root = total_elements - facts.block_elements * facts.layers
        gathered = (root + 2 * facts.block_elements) * gathered_bytes
        if setup.quantization:  # a block gathers its packed weights: scale by the packed share
            gathered = int(gathered * all_weights / (4 * total_elements))
        buffers += gathered + 4 * facts.block_elements  # plus one block's unsharded gradients
        if setup.accumulation > 1:
            gradients = 4 * sum(trainable)  # without sync, FSDP2 keeps gradients unsharded
    optimizer = optimizer_state_estimate(setup.optimizer, trainable) // shard
    rows = setup.rows
    if setup.activation_checkpointing:
        # Kept: each block's input; recomputed during its backward: one block's activations.
        # (The residual stream between blocks stays fp32 under autocast.)
        kept = facts.layers * setup.length * facts.hidden * 4 + facts.per_layer
    else:
        kept = facts.layers * facts.per_layer
    activations = rows * (kept + facts.other) + _once_bytes(setup, facts) + _mask_bytes(setup, padded)
    logits = _loss_bytes(setup, facts)
    return Estimate(
        setup=setup,
        weights=weights,
        gradients=gradients,
        optimizer=optimizer,
        activations=activations,
        logits=logits,
        buffers=buffers,
        host=host,
    )


def _once_bytes(setup: Setup, facts: ModelFacts) -> int:
    """What a micro-batch saves once whatever its rows (see ModelFacts.block_once). Under FSDP the
    gathered weights are already in the compute dtype, not copied (counted with its buffers); with
    activation checkpointing only the block being recomputed holds its copies."""

    def kept(saved: Saved) -> int:
        return saved.total - saved.casts if setup.strategy == "fsdp" else saved.total

    blocks = 1 if setup.activation_checkpointing else facts.layers
    return kept(facts.other_once) + blocks * kept(facts.block_once)


def _loss_bytes(setup: Setup, facts: ModelFacts) -> int:
    """Bytes the loss holds at its peak."""
    tokens = setup.rows * setup.length
    if not setup.loss_chunk:
        # The saved log-softmax and, as its backward runs, two more fp32 copies: the gradient it
        # gets from the loss and the one it gives the logits (all three live at the step's peak).
        return setup.rows * facts.logits + 8 * tokens * facts.vocab
    # One chunk's fp32 logits (the softmax and its gradient are made in place) and, in low
    # precision, the logits as the product gave them or the gradient cast back to its dtype;
    # kept from forward to backward: the gradients of the hidden states and, unless LoRA freezes
    # it, of the output layer's weight (fp32; in low precision each chunk's part is a product of
    # the weight's size before it is added).
    low = 2 if low_precision_dtype(setup.precision) is not None else 0
    chunk = min(setup.loss_chunk, tokens) * facts.vocab * (4 + low)
    head = 0 if setup.lora else (4 + low) * facts.vocab * facts.hidden
    return chunk + head + 4 * tokens * facts.hidden


def loss_chunk(cfg: TrainConfig, config: Any, device_type: str) -> int:
    """The chunk lmtune train would use on this device (chunked_loss.choose decides it on the real
    model): none for a soft-capped head, one LoRA adapts, or a --compile run that compiles the
    model whole (it lists no decoder blocks)."""
    from lmtune.model.chunked_loss import default_chunk_size

    if cfg.model.loss_chunk_size == 0 or getattr(config, "final_logit_softcapping", None):
        return 0
    # all-linear leaves the head alone; a list may name it.
    if cfg.model.compile or (cfg.lora.enabled and isinstance(target_modules(cfg.lora), list)):
        with fake_device("cpu"):
            model = fake_model(config)
        head = model.get_output_embeddings()  # type: ignore[operator]
        head_name = next((n for n, m in model.named_modules() if m is head), None)
        adapted = cfg.lora.enabled and head_name in {n for n, _, _ in lora_targets(model, cfg.lora)}
        if adapted or (cfg.model.compile and compiles_whole(model)):
            return 0
    return cfg.model.loss_chunk_size or default_chunk_size(int(config.vocab_size), device_type)
