"""The nodes' meeting under lmtune's launcher: torch's c10d rendezvous, which also tells the workers
the round every node joined.

A job's ranks meet in the store under a namespace per attempt, so that restarted workers never read
an earlier attempt's keys. torch numbers attempts per node (``TORCHELASTIC_RESTART_COUNT`` counts
the restarts that node's own workers caused), so after one node's worker fails the nodes would wait
under different names until the join timeout. The rendezvous round is the same on every node."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.launcher.api import LaunchConfig

from lmtune.config import environment
from lmtune.config.run_groups import LaunchSettings
from lmtune.config.settings import parse_nnodes

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousInfo

BACKEND = "lmtune-c10d"


def launch_config(launch: LaunchSettings, run_id: str, single_node: bool) -> LaunchConfig:
    """torch's launcher settings for this node: lmtune's rendezvous (:func:`backend`) at
    ``--rdzv-endpoint``, or on a free local port for one node."""
    min_nodes, max_nodes = parse_nnodes(launch.nnodes)
    # The same bound as the process group's (LMTUNE_JOIN_TIMEOUT): the nodes' launchers meet first.
    # And for reaching node 0's store (torch's read_timeout, 60 s, bounds connecting too, and torch
    # tries twice): a node started before node 0 waits for it about as long as for the others.
    wait = int(environment.join_timeout_s())
    rdzv_configs: dict[str, object] = {"join_timeout": wait, "read_timeout": max(1, wait // 2)}
    if launch.node_rank is not None:
        # Every node may resolve the endpoint's host as its own (loopback tests, one-host setups):
        # say which one hosts the store instead of leaving it to a race.
        rdzv_configs["is_host"] = launch.node_rank == 0
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=launch.nproc_per_node,
        run_id=run_id,
        rdzv_backend=backend(),
        rdzv_endpoint="localhost:0" if single_node else str(launch.rdzv_endpoint),
        rdzv_configs=rdzv_configs,
        max_restarts=launch.max_restarts,
        monitor_interval=0.1,
    )


def backend() -> str:
    """The rendezvous backend name to give torch's launcher (registered once per process)."""
    rendezvous_handler_registry.register(BACKEND, _create)
    return BACKEND


def _create(params: RendezvousParameters) -> RendezvousHandler:
    c10d = RendezvousParameters(
        "c10d",
        params.endpoint,
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        **params.config,
    )
    return _TellsTheRound(rendezvous_handler_registry.create_handler(c10d))


class _TellsTheRound(RendezvousHandler):
    """torch's handler, with each round it joins (and its workers' store) written to this launcher's
    environment, which the agent copies into the workers it starts next."""

    def __init__(self, inner: RendezvousHandler) -> None:
        self._inner = inner
        self._joined = 0

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        self._joined += 1
        os.environ[environment.RDZV_ROUND] = str(_round(self._inner, self._joined))
        if (where := info.bootstrap_store_info) is not None:
            os.environ[environment.RDZV_STORE] = f"{where.master_addr}:{where.master_port}"
        return info

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()  # type: ignore[no-untyped-call]

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def _round(handler: RendezvousHandler, joined: int) -> int:
    """The round torch's dynamic rendezvous shares between the nodes; where a torch keeps it
    elsewhere, the rounds this node joined (the same on every node of a fixed-size job)."""
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    found = getattr(state, "round", None)
    return found if isinstance(found, int) else joined - 1
