"""Memory that runs out, said in a sentence: the allocator's figures (CPU and CUDA wording), the
settings that lower it as the run has them, and the same outside a training step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmtune.config.advice import memory_advice
from lmtune.config.settings import TrainConfig
from lmtune.errors import UserError
from lmtune.training.failures import is_out_of_memory, said_plainly, what_it_asked, what_to_lower

CPU_SAYS = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
    "allocate 268435456 bytes. Error code 12 (Cannot allocate memory)"
)
CUDA_SAYS = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
    "1.06 GiB is free. Including non-PyTorch memory, this process has 138.7 GiB memory in use."
)


def test_the_allocators_own_figures() -> None:
    assert is_out_of_memory(RuntimeError(CPU_SAYS)) and is_out_of_memory(torch.OutOfMemoryError(CUDA_SAYS))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 9x2)"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only what torch raises
    assert what_it_asked(RuntimeError(CPU_SAYS)) == ": it asked for 256 MiB more"
    assert what_it_asked(torch.OutOfMemoryError(CUDA_SAYS)) == (
        ": it asked for 2.00 GiB more with 1.06 GiB of 139.80 GiB free"
    )
    assert what_it_asked(RuntimeError("MPS backend out of memory")) == ""


def test_what_to_lower_is_what_this_run_can_still_lower(tmp_path: Path) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    plain = TrainConfig(output_dir=str(tmp_path), max_length=1024, global_batch_size=64)
    said = what_to_lower(plain, cpu, batched=True)
    assert said.startswith("; to fit, try a smaller --micro-batch-size (the global batch stays 64")
    assert "--activation-checkpointing or a shorter --max-length (now 1,024) (`lmtune plan`" in said
    assert "--precision" not in said and "--lora" not in said  # nothing of these helps a CPU run
    on_gpu = what_to_lower(plain, gpu, batched=False)  # one example: the micro-batch is as small as it gets
    assert "--micro-batch-size" not in on_gpu
    assert "--precision bf16 or --lora (or --optimizer adamw8bit)" in on_gpu
    lean = plain.replace(activation_checkpointing=True, precision="bf16", lora=True)
    assert what_to_lower(lean, gpu, batched=False) == (
        "; to fit, try a shorter --max-length (now 1,024) (`lmtune plan` with the same model, data and batch "
        "flags shows what fits)"
    )


def test_outside_a_step_too(tmp_path: Path) -> None:
    cfg = TrainConfig(output_dir=str(tmp_path))
    with pytest.raises(UserError) as raised, said_plainly(cfg, torch.device("cpu")):
        raise RuntimeError(CPU_SAYS)  # as loading, evaluating or sampling would
    assert str(raised.value).startswith(
        "out of memory on cpu outside a training step (loading, reference log-probs, evaluating, sampling): "
        "it asked for "
        "256 MiB more; to fit, try a smaller --micro-batch-size"
    )
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"), said_plainly(cfg, cpu):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")  # not ours to reword


def test_the_other_commands_say_it_with_their_own_options() -> None:
    from lmtune.cli import _out_of_memory
    from lmtune.cli.parser import build_parser

    argv = ["eval", "--batch-size", "64", "--max-length", "2048", "d.jsonl"]
    args, _ = build_parser().parse_known_args(argv)
    assert _out_of_memory(RuntimeError(CPU_SAYS), args) == (
        "lmtune eval: out of memory: it asked for 256 MiB more; to fit, try a smaller --batch-size (now 64) "
        "or a shorter --max-length (now 2048)"
    )
    args, _ = build_parser().parse_known_args(["generate", "--model", "m", "--max-new-tokens", "512"])
    said = _out_of_memory(torch.OutOfMemoryError(CUDA_SAYS), args)
    assert said.startswith("lmtune generate: out of memory: it asked for 2.00 GiB more with 1.06 GiB")
    assert said.endswith("; to fit, try fewer --max-new-tokens (now 512)")


def test_several_cpu_processes_are_told_to_start_fewer(tmp_path: Path) -> None:
    cfg = TrainConfig(output_dir=str(tmp_path), micro_batch_size=1, global_batch_size=8)
    said = memory_advice(cfg, on_gpu=False, batched=False, processes=2)
    assert said == (
        "; to fit, try --activation-checkpointing, a shorter --max-length (now 512) or fewer "
        "--nproc-per-node (now 2; each holds the model and its optimizer) (`lmtune plan` with the same "
        "model, data and batch flags shows what fits)"
    )
