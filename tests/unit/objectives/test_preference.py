"""Preference objectives in one process: the losses of a small batch equal the papers' formulas on
log-probs computed here sequence by sequence; policy == reference gives ln 2; the chunked head's
gradients equal full logits' (pairs longer than a chunk included); the LoRA reference is the base
model; and, where TRL is installed, lmtune's evaluation equals ``DPOTrainer.evaluate``."""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any

import pytest
import torch

from lmtune.config.groups import ExampleSettings, LoraSettings, ObjectiveSettings
from lmtune.data.batch import Batch
from lmtune.data.dataset import TokenizedDataset
from lmtune.data.pair_collate import PairCollator, PairStepCollator, sequences
from lmtune.data.prepare import encode_in_memory
from lmtune.data.sources import Record
from lmtune.data.tokenize import IGNORE_INDEX
from lmtune.model.attention import use_varlen
from lmtune.model.lora import add_lora
from lmtune.model.modeling import load_model
from lmtune.objectives import objective_for
from lmtune.objectives.base import LossSetup
from lmtune.objectives.pair_losses import PairLoss
from lmtune.objectives.preference import PreferenceLoss, PreferenceObjective, Reference
from lmtune.parallel.distributed import read_dist_env
from lmtune.training.evaluate import evaluate
from tests.support.pairs import pair_records

ENV = read_dist_env("cpu")
PAIRS = 6


def _pairs(tokenizer: Any, n: int = PAIRS, seed: int = 4, chat: bool = False) -> TokenizedDataset:
    records = [Record("mem", i + 1, r) for i, r in enumerate(pair_records(n, seed, chat))]
    return encode_in_memory(records, tokenizer, ExampleSettings(max_length=256))[0]


def _logps_by_hand(model: torch.nn.Module, data: TokenizedDataset) -> tuple[torch.Tensor, torch.Tensor]:
    """Each answer's summed log-prob and its token count, one sequence per forward ([n, 2] each)."""
    logps, counts = [], []
    with torch.no_grad():
        for i in range(len(data)):
            row = []
            for seq in sequences(data[i]):
                ids = torch.as_tensor(seq.input_ids)[None]
                logits = model(input_ids=ids).logits[0].double()
                target = torch.as_tensor(seq.labels)[1:]
                keep = target != IGNORE_INDEX
                token = logits[:-1][keep].log_softmax(-1).gather(1, target[keep][:, None])
                row.append((float(token.sum()), int(keep.sum())))
            logps.append([r[0] for r in row])
            counts.append([r[1] for r in row])
    return torch.tensor(logps, dtype=torch.float64), torch.tensor(counts, dtype=torch.float64)


def _paper(name: str, logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """The per-pair losses as the papers write them (TRL's parameterisation), scalar by scalar."""
    beta, eps, gamma, lam = 0.3, 0.1, 0.7, 0.2
    out = []
    for (pc, pr), (nc, nr), (rc, rr) in zip(logps.tolist(), counts.tolist(), ref.tolist(), strict=True):
        if name == "dpo":  # Rafailov et al. (2023), with Mitchell's label smoothing (cDPO)
            z = beta * ((pc - rc) - (pr - rr))
            out.append(-(1 - eps) * math.log(1 / (1 + math.exp(-z))) - eps * math.log(1 / (1 + math.exp(z))))
        elif name == "ipo":  # Azar et al. (2023), eq. 17, log-ratios per token as TRL
            out.append(((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * beta)) ** 2)
        elif name == "simpo":  # Meng et al. (2024), eq. 6
            z = beta * (pc / nc - pr / nr) - gamma
            out.append(-(1 - eps) * math.log(1 / (1 + math.exp(-z))) - eps * math.log(1 / (1 + math.exp(z))))
        else:  # ORPO, Hong et al. (2024), eqs. 4-7: NLL of the chosen answer + lambda * L_OR
            ac, ar = pc / nc, pr / nr
            odds = (ac - math.log1p(-math.exp(ac))) - (ar - math.log1p(-math.exp(ar)))
            out.append(-ac - lam * math.log(1 / (1 + math.exp(-odds))))
    return torch.tensor(out, dtype=torch.float64)


def _objective(name: str, reference: Reference | None = None) -> PreferenceObjective:
    settings = ObjectiveSettings(
        name=name,
        beta=0.3,
        label_smoothing=0.1 if name in ("dpo", "simpo") else 0.0,
        simpo_gamma=0.7,
        orpo_lambda=0.2,
    )
    objective = objective_for(settings)
    assert isinstance(objective, PreferenceObjective)
    return objective.with_reference(reference) if reference else objective


def _reference(n: int) -> torch.Tensor:
    """Reference log-probs that make every loss term matter (chosen favoured, not always)."""
    g = torch.Generator().manual_seed(0)
    return -40.0 - 30.0 * torch.rand(n, 2, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("name", ["dpo", "ipo", "simpo", "orpo"])
def test_losses_equal_the_papers_formulas(name: str) -> None:
    loaded = load_model("tiny", seed=3)
    data = _pairs(loaded.tokenizer)
    logps, counts = _logps_by_hand(loaded.model, data)
    ref = _reference(len(data))
    expected = _paper(name, logps, counts, ref)
    objective = _objective(name)
    for setup in (LossSetup(loss_chunk=0), LossSetup(loss_chunk=8), LossSetup(varlen=True, loss_chunk=4096)):
        model = load_model("tiny", seed=3).model
        if setup.varlen:
            assert use_varlen(model)
        module = objective.loss_module(model, setup)
        batch = PairCollator(loaded.tokenizer.pad_token_id)([data[i] for i in range(len(data))])
        batch.reference = ref
        out = module(*batch.model_inputs())
        assert float(out[0]) == pytest.approx(float(expected.sum()), rel=1e-5), setup
        metrics = dict(zip(objective.metric_names, out[1:].tolist(), strict=True))
        beta = 0.2 if name == "orpo" else 0.3  # ORPO's rewards scale by its lambda, as TRL's do
        averaged = name in ("simpo", "orpo")
        logged = logps / counts if averaged else logps
        rewards = beta * (logged if averaged else logps - ref)
        assert metrics["logps/chosen"] == pytest.approx(float(logged[:, 0].sum()), rel=1e-5)
        assert metrics["rewards/margins"] == pytest.approx(
            float((rewards[:, 0] - rewards[:, 1]).sum()), abs=1e-4
        )
        assert metrics["rewards/accuracies"] == float((rewards[:, 0] > rewards[:, 1]).sum())


def test_policy_equal_to_reference_gives_ln2_exactly() -> None:
    loaded = load_model("tiny", seed=3)
    data = _pairs(loaded.tokenizer)
    for chunk in (0, 8):
        module = _objective("dpo").loss_module(load_model("tiny", seed=3).model, LossSetup(loss_chunk=chunk))
        assert isinstance(module, PreferenceLoss)
        batch = PairCollator(loaded.tokenizer.pad_token_id)([data[i] for i in range(len(data))])
        with module.reference_pass(), torch.no_grad():
            batch.reference = module(*batch.model_inputs())
        out = module(*batch.model_inputs())
        assert float(out[0]) / len(data) == math.log(2)  # label smoothing: still ln 2 at a margin of 0
        assert out[1:].tolist()[:4] == [0.0, 0.0, 0.0, 0.0]  # rewards, accuracy, margin


def _gradients(
    setup: LossSetup, mode: str, name: str, data: TokenizedDataset, pad: int
) -> tuple[float, torch.Tensor]:
    model = load_model("tiny", seed=3).model
    if setup.varlen:
        use_varlen(model)
    module = _objective(name).loss_module(model, setup)
    total = 0.0
    for batch in PairStepCollator(pad, 3, mode, 256)([data[i] for i in range(len(data))]):
        batch.reference = torch.tensor(
            [[-50.0 - 3 * i, -60.0 - 2 * i] for i in batch.example_ids], dtype=torch.float64
        )
        out = module(*batch.model_inputs())
        out[0].backward()  # type: ignore[no-untyped-call]
        total += float(out[0])
    return total, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("name", ["dpo", "orpo"])
def test_the_chunked_head_trains_as_full_logits(name: str) -> None:
    """Pairs in groups of a chunk, pairs longer than a chunk (projected twice), packed or padded
    rows, per-example attention or masks: the loss and every gradient as with full logits."""
    loaded = load_model("tiny", seed=3)
    data, pad = _pairs(loaded.tokenizer), loaded.tokenizer.pad_token_id
    expected, grads = _gradients(LossSetup(loss_chunk=0), "pad", name, data, pad)
    for setup, mode in (
        (LossSetup(loss_chunk=7), "pad"),
        (LossSetup(loss_chunk=64), "group"),
        (LossSetup(varlen=True, loss_chunk=16), "pack"),
        (LossSetup(loss_chunk=16), "pack"),
    ):
        total, got = _gradients(setup, mode, name, data, pad)
        assert total == pytest.approx(expected, rel=1e-6), (setup, mode)
        assert float((got - grads).abs().max()) <= 1e-5 * float(grads.abs().max()), (setup, mode)


def test_lora_reference_is_the_base_model_with_the_adapter_disabled() -> None:
    loaded = load_model("tiny", seed=3)
    data = _pairs(loaded.tokenizer)
    batch = PairCollator(loaded.tokenizer.pad_token_id)([data[i] for i in range(len(data))])
    lora = add_lora(load_model("tiny", seed=3).model, LoraSettings(enabled=True, rank=4, dropout=0.0))
    with torch.no_grad():  # an adapter that has trained: the policy is no longer the base
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    live = _objective("dpo", Reference(kind="adapter")).loss_module(lora, LossSetup(loss_chunk=8))
    assert isinstance(live, PreferenceLoss)
    with live.reference_pass(), torch.no_grad():
        reference = live(*batch.model_inputs())
    base = _objective("dpo").loss_module(load_model("tiny", seed=3).model, LossSetup(loss_chunk=8))
    assert isinstance(base, PreferenceLoss)
    with base.reference_pass(), torch.no_grad():
        expected = base(*batch.model_inputs())
    assert torch.equal(reference, expected)
    batch.reference = expected  # the step's own reference (adapter disabled) gives the same loss
    assert torch.equal(live(*batch.model_inputs())[0], _precomputed_loss(lora, batch))


def test_dropout_is_off_in_the_model_and_its_adapter_as_trl_turns_it_off() -> None:
    lora = add_lora(load_model("tiny", seed=3).model, LoraSettings(enabled=True, rank=4, dropout=0.5))
    dropouts = [m for m in lora.modules() if isinstance(m, torch.nn.Dropout)]
    assert any(m.p > 0 for m in dropouts)
    _objective("dpo").loss_module(lora, LossSetup(loss_chunk=8))
    assert all(m.p == 0 for m in dropouts)
    lora.train()
    ids = torch.arange(1, 20)[None]
    with torch.no_grad():
        assert torch.equal(lora(input_ids=ids).logits, lora(input_ids=ids).logits)


def _precomputed_loss(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    module = _objective("dpo").loss_module(model, LossSetup(loss_chunk=8))
    return module(*batch.model_inputs())[0]


def test_evaluation_equals_trl_dpo_trainer_evaluate() -> None:
    """lmtune's eval loss and reward metrics on the same policy, reference and pairs as TRL's
    ``DPOTrainer.evaluate`` (which tokenizes the pairs itself)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    records = pair_records(12, seed=4)
    policy, ref = load_model("tiny", seed=1), load_model("tiny", seed=2)
    tok = policy.tokenizer
    args = DPOConfig(
        output_dir="/tmp/lmtune-test-trl",
        per_device_eval_batch_size=4,
        report_to="none",
        max_length=None,
        beta=0.1,
        use_cpu=True,
        bf16=False,  # DPOConfig's default is bf16, even on the CPU
        disable_tqdm=True,
    )
    dataset = Dataset.from_list(records)
    trainer = DPOTrainer(
        model=policy.model, ref_model=ref.model, args=args, processing_class=tok, train_dataset=dataset
    )
    theirs = trainer.evaluate(dataset)
    data = _pairs(tok, 12, seed=4)
    frozen = PreferenceLoss(ref.model, LossSetup(loss_chunk=1024), PairLoss("dpo")).reference_mode()
    objective = PreferenceObjective(PairLoss("dpo"), Reference(kind="model", module=frozen))
    module = objective.loss_module(policy.model, LossSetup(loss_chunk=1024))
    batches = [PairCollator(tok.pad_token_id)([data[i] for i in range(k, k + 4)]) for k in range(0, 12, 4)]
    ours = evaluate(module, batches, ENV, nullcontext(), objective=objective).metrics
    for name in (
        "eval_loss",
        "eval_rewards/accuracies",
        "eval_rewards/margins",
        "eval_rewards/chosen",
        "eval_logps/rejected",
    ):
        assert ours[name] == pytest.approx(theirs[name], rel=1e-4, abs=1e-6), name


def test_reward_metrics_and_names_as_trl_logs_them() -> None:
    loss = PairLoss("dpo", beta=0.5)
    logps = torch.tensor([[-10.0, -12.0], [-5.0, -4.0]], dtype=torch.float64)
    ref = torch.tensor([[-11.0, -11.0], [-5.0, -4.0]], dtype=torch.float64)
    m = dict(
        zip(loss.metric_names, loss.metrics(logps, torch.ones_like(logps), ref).sum(0).tolist(), strict=True)
    )
    assert m == {
        "rewards/chosen": 0.5 * (1 + 0),
        "rewards/rejected": 0.5 * (-1 + 0),
        "rewards/accuracies": 1.0,  # the second pair's rewards tie: not counted, as in TRL
        "rewards/margins": 0.5 * (2 + 0),
        "logps/chosen": -15.0,
        "logps/rejected": -16.0,
    }


def test_a_model_mixing_sliding_and_full_layers_runs_pairs_under_its_masks() -> None:
    """Gemma 2 (eager attention with a soft-cap, sliding and full layers) was refused for every
    preference objective. Its pairs, one a row and packed, give the losses of each answer run
    after its own copy of the prompt, with a window shorter than the pairs."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    loaded = load_model("tiny", seed=3)
    data = _pairs(loaded.tokenizer)
    window = 8
    assert min(len(data[i].input_ids) for i in range(len(data))) > 2 * window
    config = Gemma2Config(
        vocab_size=len(loaded.tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"], attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert model.config._attn_implementation == "eager" and not use_varlen(model)
    logps, counts = _logps_by_hand(model, data)
    ref = _reference(len(data))
    expected = _paper("dpo", logps, counts, ref)
    module = _objective("dpo").loss_module(model, LossSetup(loss_chunk=0))
    pairs = [data[i] for i in range(len(data))]
    collate = PairCollator(loaded.tokenizer.pad_token_id)
    for batch in (collate(pairs), collate([pairs[:3], pairs[3:]])):  # one pair a row; packed
        batch.reference = ref
        with torch.no_grad():
            out = module(*batch.model_inputs())
        assert float(out[0]) == pytest.approx(float(expected.sum()), rel=1e-5)


def _no_mask_models(vocab: int) -> dict[str, torch.nn.Module]:
    """A model whose convolution no mask reaches (LFM2) and one whose ALiBi bias takes no mask of
    ours (BLOOM), weights scaled so that every output depends on its context."""
    from transformers import AutoModelForCausalLM, BloomConfig, Lfm2Config

    configs = {
        "lfm2": Lfm2Config(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"],
        ),
        "bloom": BloomConfig(vocab_size=vocab, hidden_size=64, n_layer=2, n_head=4),
    }  # fmt: skip
    models = {}
    for name, config in configs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for key, parameter in model.named_parameters():
                if "norm" not in key:
                    parameter.mul_(3)
        models[name] = model
    return models


@pytest.mark.parametrize("name", ["dpo", "orpo"])
def test_a_model_no_mask_keeps_apart_runs_each_answer_after_its_own_prompt(name: str) -> None:
    """Preference objectives were refused for BLOOM, MPT, Falcon with ALiBi and for models that
    mix tokens outside attention (LFM2, Qwen3-Next, Qwen3.5, Mamba). Their pairs run as two rows
    each: the losses of each answer run after its own copy of the prompt, from one pair a row and
    from packed rows, through full logits and the chunked head."""
    from lmtune.model.masks import mask_obstacle

    loaded = load_model("tiny", seed=3)
    data = _pairs(loaded.tokenizer)
    pairs = [data[i] for i in range(len(data))]
    collate = PairCollator(loaded.tokenizer.pad_token_id)
    for kind, model in _no_mask_models(len(loaded.tokenizer)).items():
        assert mask_obstacle(model) is not None, kind
        logps, counts = _logps_by_hand(model, data)
        ref = _reference(len(data))
        expected = _paper(name, logps, counts, ref)
        for setup in (LossSetup(loss_chunk=0), LossSetup(loss_chunk=8)):
            module = _objective(name).loss_module(model, setup)
            assert module.apart
            for batch in (collate(pairs), collate([pairs[:3], pairs[3:]])):
                batch.reference = ref
                with torch.no_grad():
                    out = module(*batch.model_inputs())
                assert float(out[0]) == pytest.approx(float(expected.sum()), rel=1e-5), (kind, setup)
                metrics = dict(zip(_objective(name).metric_names, out[1:].tolist(), strict=True))
                logged = logps / counts if name == "orpo" else logps
                assert metrics["logps/chosen"] == pytest.approx(float(logged[:, 0].sum()), rel=1e-5)
