"""Every process of a job runs the same settings: a difference is named, rank by rank."""

from __future__ import annotations

import pytest

from lmtune.config.settings import TrainConfig
from lmtune.errors import UserError
from lmtune.parallel.distributed import read_dist_env
from lmtune.training.preflight import check_same_settings, settings_differences, validate

ENV = read_dist_env("cpu")


def test_differences_name_the_setting_and_the_ranks_of_each_value() -> None:
    same = {"lr": 0.001, "max_steps": 3, "seed": 1}
    by_rank = [same, {**same, "lr": 0.002, "max_steps": 6}, {**same, "max_steps": 6}]
    assert settings_differences(by_rank) == [
        "--lr 0.001 on ranks 0,2, 0.002 on rank 1",
        "--max-steps 3 on rank 0, 6 on ranks 1,2",
    ]
    assert settings_differences([same, dict(same)]) == []


def test_one_process_agrees_with_itself() -> None:
    check_same_settings(TrainConfig(lr=1e-3), ENV, "single")


def test_the_python_api_refuses_what_needs_a_launcher() -> None:
    """lmtune.train(TrainConfig(nproc_per_node=2)) trained one process and recorded 2."""

    for settings in ({"nproc_per_node": 2}, {"nnodes": "2"}, {"max_restarts": 1}):
        with pytest.raises(UserError, match=r"lmtune\.train runs in this process: use `lmtune train`"):
            validate(TrainConfig(**settings, rdzv_endpoint="h:1"), 1, in_process=True)
        validate(TrainConfig(**settings, rdzv_endpoint="h:1"), 2)  # the launcher's own check


def test_nodes_with_another_strategy_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """How each node launches may differ (--nproc-per-node, --node-rank); the strategy may not: DDP
    and FSDP ranks waited on each other's collectives for 30 minutes."""
    import lmtune.training.preflight as preflight

    monkeypatch.setattr(
        preflight,
        "all_gather_object",
        lambda mine, env: [mine, {**mine, "strategy": "fsdp"}, {**mine, "lr": None}],
    )
    with pytest.raises(UserError, match="--strategy ddp on ranks 0,2, fsdp on rank 1") as e:
        check_same_settings(TrainConfig(lr=1e-3), ENV, "ddp")
    assert "--lr 0.001 on ranks 0,1, unset on rank 2" in str(e.value)


def test_processes_that_read_different_data_are_refused_naming_what_each_read() -> None:
    """Two nodes with their own copies of the data (--cache-per-node) that differ drew samples from
    orders of other lengths, silently, or one ended its epoch early and the others hung, the hang
    blamed on the rank that waited."""
    from lmtune.training.preflight import check_same_data

    same = [(True, "a" * 64, 400), (False, "a" * 64, 400)]
    check_same_data("train", "d.jsonl", "--data", same)
    apart = [*same, (True, "a" * 64, 300)]
    with pytest.raises(
        UserError,
        match=r"^--data d.jsonl: the processes of this job read different train data: 400 examples "
        r"on ranks 0,1; 300 examples on rank 2; every node must",
    ):
        check_same_data("train", "d.jsonl", "--data", apart)
