"""A node of a multi-node replica other than the leader: it runs its share of the ranks.

A replica that spans nodes (``nnodes > 1``, one LeaderWorkerSet group in a cluster) is one
engine: node 0, the leader, runs the scheduler and serves the API as any engine does, and its
``Worker`` sends every step to all ranks. Each other node runs ``tandem serve`` with its
``node_rank``: this module. Its process joins the process group at the leader's
``leader_addr`` as its node's first rank (starting the node's other ranks as the leader's
process does), builds its share of the model, and then acts on rank 0's messages until
"stop", which the leader sends when it shuts down. It serves no HTTP: a client, the proxy and
the readiness probes only ever see the leader.
"""

from __future__ import annotations

import logging
import signal

from ..config import EngineConfig
from ..loader import read_model_config
from ..model_runner import ModelRunner
from ..worker import resolve_device
from .launch import RankGroup, follow_steps

log = logging.getLogger(__name__)


def run_member(config: EngineConfig) -> None:
    """Join the leader's group, follow its steps until it says "stop", then end this node's ranks."""
    if config.node_rank == 0:
        raise ValueError("node 0 is the leader: it runs the engine, not run_member")
    model_config = read_model_config(config.model)
    device = resolve_device(config.device)
    log.info(
        "node %d of %d: joining %s as ranks %d..%d of %d",
        config.node_rank,
        config.nnodes,
        config.leader_addr,
        config.node_rank * config.ranks_per_node,
        (config.node_rank + 1) * config.ranks_per_node - 1,
        config.tensor_parallel_size,
    )
    ranks = RankGroup.start(config, model_config, device)
    try:
        runner = ModelRunner(config, model_config, device, ranks.tp)
        ranks.wait_ready()
    except BaseException:
        ranks.abort()
        raise
    # A group is stopped as a whole (all its pods get SIGTERM at once): the leader drains its
    # requests in flight, which needs this node's ranks, then sends "stop". So SIGTERM is
    # ignored here; a leader that is gone without a word fails the next collective instead.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log.info("node %d: ready; following the leader's steps", config.node_rank)
    try:
        follow_steps(runner, ranks.tp)
    except BaseException:
        ranks.abort()
        raise
    ranks.close()
    log.info("node %d: the leader said stop", config.node_rank)
