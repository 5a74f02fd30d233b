"""Start the tensor-parallel ranks of one engine and carry each step from rank 0 to them.

Rank 0 is the engine's own process (its ``Worker``). Ranks 1..N-1 are spawned processes
(``spawn``, never ``fork``: CUDA and threads do not survive a fork) that build their
``ModelRunner`` and then loop: receive a message from rank 0, act on it. Messages are Python
objects broadcast over a gloo group (``("step", StepInputs)``, ``("sleep", level)``,
``("wake_up", level)``, ``("load_weights", path)``, ``("stop",)``); the model's all-reduces
go over the device group (NCCL on CUDA, the same gloo group on CPU). The rendezvous is a free
loopback TCP port, or, for a replica that spans nodes (``nnodes > 1``), the leader's
``leader_addr``: each node's process starts its own node's ranks here and joins as the first of
them; node 0's first rank is rank 0, the engine (``parallel/member.py`` runs the others).

Cleanup is the launcher's job, whatever happens: ``close`` stops the ranks, joins them, kills
what does not exit, and destroys the process group; it also runs when the ``Worker`` is
garbage-collected and at interpreter exit. A rank whose parent dies exits on its own.
Collectives time out after ``TANDEM_TP_TIMEOUT_S`` seconds (default 600).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
import traceback
import weakref
from typing import TYPE_CHECKING, Any

import torch

from tandem.server.net import free_port

from ..model_runner import ModelRunner
from . import RankGroupLost, TensorParallel, rank_device

if TYPE_CHECKING:
    from ..config import EngineConfig
    from ..models.config import ModelConfig

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("TANDEM_TP_TIMEOUT_S", "600")))


def init_group(rank: int, size: int, addr: str, device: torch.device) -> TensorParallel:
    """Join the process group at ``addr`` (HOST:PORT, rank 0 listens there); the device group
    is NCCL on CUDA, gloo on CPU."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process; "
            "one tensor-parallel engine per process"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}",
        rank=rank,
        world_size=size,
        timeout=_timeout(),
    )
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=_timeout()) if backend != "gloo" else group
    return TensorParallel(rank=rank, size=size, group=group, cpu_group=cpu_group)


def broadcast(obj: Any, tp: TensorParallel) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    return box[0]


class RankGroup:
    """Rank 0's view of ranks 1..N-1: start, send, close."""

    def __init__(self, procs: list[Any], conns: list[Any], tp: TensorParallel) -> None:
        self.procs = procs
        self.conns = conns
        self.tp = tp
        self._broken = False
        # Collected without close() (or at exit): no "stop" can be sent, so end the ranks now.
        self._finalizer = weakref.finalize(self, _shutdown, procs, conns, 0.0, True)

    @classmethod
    def start(
        cls, config: EngineConfig, model_config: ModelConfig, device: torch.device
    ) -> RankGroup:
        import torch.multiprocessing as mp

        size, local = config.tensor_parallel_size, config.ranks_per_node
        if device.type == "cuda" and (device.index or 0) + local > torch.cuda.device_count():
            raise ValueError(
                f"{local} ranks on this node need {local} GPUs from {device}; "
                f"{torch.cuda.device_count()} visible"
            )
        first = config.node_rank * local  # this node's ranks: first .. first + local - 1
        addr = config.leader_addr if config.nnodes > 1 else f"127.0.0.1:{free_port()}"
        ctx = mp.get_context("spawn")
        procs, conns = [], []
        tp = None
        try:
            for local_rank in range(1, local):
                parent_end, child_end = ctx.Pipe()
                p = ctx.Process(
                    target=rank_main,
                    name=f"tandem-tp-rank{first + local_rank}",
                    daemon=True,
                    args=(
                        first + local_rank,
                        size,
                        addr,
                        config,
                        model_config,
                        rank_device(device, local_rank),
                        child_end,
                        os.getpid(),
                    ),
                )
                p.start()
                child_end.close()
                procs.append(p)
                conns.append(parent_end)
            # Every rank says it is about to join before rank 0 blocks in the rendezvous, so a
            # rank that died on import fails the start at once instead of at the timeout.
            _wait_for(procs, conns, "joining")
            tp = init_group(first, size, addr, device)
        except BaseException:
            _shutdown(procs, conns, 0.0, tp is not None)
            raise
        return cls(procs, conns, tp)

    def wait_ready(self) -> None:
        try:
            _wait_for(self.procs, self.conns, "ready")
        except BaseException:
            self._broken = True
            raise

    def send(self, msg: tuple) -> None:
        dead = [p.name for p in self.procs if not p.is_alive()]
        if dead:
            self._broken = True
            raise RankGroupLost(f"tensor-parallel ranks exited: {', '.join(dead)}")
        try:
            broadcast(msg, self.tp)
        except Exception as exc:  # a rank of another node exited: its connection closed
            self._broken = True
            raise RankGroupLost(f"a tensor-parallel rank is unreachable: {exc}") from exc
        except BaseException:
            self._broken = True
            raise

    def abort(self) -> None:
        """End the ranks without a goodbye: they may be inside another collective."""
        self._broken = True
        self.close()

    def close(self) -> None:
        if not self._finalizer.alive:
            return
        # only rank 0 sends: another node's ranks got the same "stop" its own process did
        if self.tp.rank == 0 and not self._broken and all(p.is_alive() for p in self.procs):
            try:
                broadcast(("stop",), self.tp)
            except Exception:  # a broken group: the kill below still ends the ranks
                log.warning("could not send stop to the tensor-parallel ranks", exc_info=True)
        self._finalizer.detach()
        _shutdown(self.procs, self.conns, 10.0, True)


def _wait_for(procs: list[Any], conns: list[Any], what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    for p, conn in zip(procs, conns):
        while not conn.poll(0.05):
            if not p.is_alive():
                raise RuntimeError(f"{p.name} exited with code {p.exitcode} before it was {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{p.name} not {what} after {START_TIMEOUT_S:.0f} s")
        try:
            status, detail = conn.recv()
        except EOFError:
            p.join(5.0)
            raise RuntimeError(
                f"{p.name} exited (code {p.exitcode}) before it was {what}; a script that starts "
                'a tensor-parallel engine needs an `if __name__ == "__main__":` guard'
            ) from None
        if status == "error":
            raise RuntimeError(f"{p.name} failed:\n{detail}")
        if status != what:
            raise RuntimeError(f"{p.name} sent {status!r}, expected {what!r}")


def _shutdown(procs: list[Any], conns: list[Any], grace_s: float, destroy_group: bool) -> None:
    """Join the ranks (they exit on "stop"), then terminate and kill what is left."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for c in conns:
        c.close()
    if destroy_group:
        _destroy_group()


def _destroy_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            log.warning("destroy_process_group failed", exc_info=True)


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(1.0)


def rank_main(
    rank: int,
    size: int,
    addr: str,
    config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device,
    conn: Any,
    parent_pid: int,
) -> None:
    """A spawned rank: join, build its runner, then serve rank 0's messages until "stop"."""
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.ranks_per_node))
    try:
        conn.send(("joining", None))
        tp = init_group(rank, size, addr, device)
        runner = ModelRunner(config, model_config, device, tp)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise
    try:
        follow_steps(runner, tp)
    finally:
        _destroy_group()
        conn.close()


def follow_steps(runner: ModelRunner, tp: TensorParallel) -> None:
    """Act on rank 0's messages, in order, until "stop": every rank but rank 0 does this."""
    while True:
        msg = broadcast(None, tp)
        kind = msg[0]
        if kind == "step":
            runner.run(msg[1], compute_logits=False)
        elif kind == "sleep":
            runner.sleep(msg[1])
        elif kind == "wake_up":
            runner.wake_up(msg[1])
        elif kind == "load_weights":
            runner.load_weights(msg[1])
        elif kind == "stop":
            return
        else:
            raise RuntimeError(f"unknown message {kind!r}")
