"""Rendezvous and process groups of one parallel group (``pipeline`` stages × ``tensor`` ranks).

Rank 0 hosts the rendezvous ``TCPStore``: in one pod on a port the operating system picks as the
store binds it (no bind-then-release race, no clash with another listener), across pods on
MASTER_PORT (taken → the bind fails at once, naming the port). Every rank loads its part first,
then announces itself in the store and waits for all the others (``rendezvous_timeout_s``:
loading takes a while, and pods start at different times); only then are the groups created, so
their collectives can have a short timeout (``collective_timeout_s``). A rank that finds the group
formed already (a worker pod restarted while its leader still runs, until the leader sees its
heartbeat gone) fails at once rather than join a group that cannot take it; it meets the
restarted leader on its own next start.

- the default group over every rank (NCCL on CUDA, gloo on the CPU): each step's inputs from rank
  0, the hidden states a stage hands the next, the verdicts back to rank 0;
- each stage's *tensor* group (its ``tensor`` ranks): the row-parallel all-reduces;
- a gloo *control* group for each step's small header. Rank 0 waits on it at most
  ``collective_timeout_s``, so a hung worker fails the step instead of hanging it; the other
  ranks wait there for the next step as long as rank 0 lives (an idle server is normal; a closed
  connection ends the wait at once);
- with pipeline stages, a gloo *link* group of rank 0 and the verifier rank (the last stage's
  first): what the verifier needs to know of the step's sequences, and the verdicts' logprobs.

With pipeline stages and an EAGLE-3 head, the verifier rank loads the head after the groups form,
then publishes its aux layers in the store; every stage's first tensor rank waits for them there
(as long as for a rank's loading) before its first step: they say which residual streams it hands on.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from specdecode.runtime.config import Device, ParallelConfig
from specdecode.runtime.device import resolve_device
from specdecode.runtime.models.tensor_parallel import set_tensor_group

IDLE_WAIT = timedelta(days=365)  # how long a worker waits for rank 0's next step
FORMED_KEY = "formed"  # set by rank 0 once every rank has loaded: a rank arriving later is a restarted one
AUX_LAYERS_KEY = "aux-layers"  # set by the verifier rank once its EAGLE-3 head is loaded (``publish_aux_layers``)
_POLL_S = 0.05


def bind_device(device: Device, local_rank: int, ranks_per_node: int) -> torch.device:
    """Give this rank its share of the machine: GPU ``local_rank``, or its share of the CPU cores."""
    resolved = resolve_device(device)
    if resolved.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ValueError(f"local rank {local_rank} needs GPU {local_rank}, but torch sees "
                             f"{torch.cuda.device_count()}")
        torch.cuda.set_device(local_rank)  # "cuda" now means this rank's GPU, for every allocation
    else:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // ranks_per_node))
    return resolved


def host_store(cfg: ParallelConfig) -> dist.TCPStore:
    """Rank 0's rendezvous store: on MASTER_PORT across pods, else on a port the OS picks (``.port``)."""
    port = cfg.master_port if cfg.num_nodes > 1 else 0
    return dist.TCPStore("127.0.0.1", port, cfg.world_size, is_master=True,
                         timeout=timedelta(seconds=cfg.rendezvous_timeout_s), wait_for_workers=False)


def connect_store(cfg: ParallelConfig, addr: str, port: int) -> dist.TCPStore:
    """A client of rank 0's store (retries until rank 0 listens, up to the rendezvous timeout)."""
    return dist.TCPStore(addr, port, cfg.world_size, is_master=False,
                         timeout=timedelta(seconds=cfg.rendezvous_timeout_s))


def store_client(addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    """One more connection to rank 0's store, for a thread of its own (heartbeats)."""
    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))


@dataclass(frozen=True)
class Groups:
    """This rank's groups beside the default one (see the module docstring)."""

    control: dist.ProcessGroup
    link: dist.ProcessGroup | None  # rank 0 ↔ verifier rank; None without pipeline stages or off that pair


def join_group(
    store: dist.TCPStore,
    cfg: ParallelConfig,
    rank: int,
    device: torch.device,
    peers_alive: Callable[[], bool] = lambda: True,
) -> Groups:
    """Wait until every rank has loaded, create the default group and the others (every rank
    creates every group, in the same order, as torch requires)."""
    _wait_for_every_rank(store, cfg, rank, peers_alive)
    backend = "nccl" if device.type == "cuda" else "gloo"
    collective = timedelta(seconds=cfg.collective_timeout_s)
    dist.init_process_group(backend, store=dist.PrefixStore("pp-tp", store), rank=rank,
                            world_size=cfg.world_size, timeout=collective)
    if cfg.pipeline_parallel_size > 1:
        tp = cfg.tensor_parallel_size
        for stage in range(cfg.pipeline_parallel_size):
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), backend=backend, timeout=collective)
            if cfg.stage_of(rank) == stage:
                set_tensor_group(group)
    control = dist.new_group(backend="gloo", timeout=collective if rank == 0 else IDLE_WAIT)
    link = None
    if cfg.pipeline_parallel_size > 1:
        pair = dist.new_group([0, cfg.verifier_rank], backend="gloo", timeout=collective)
        link = pair if rank in (0, cfg.verifier_rank) else None
    return Groups(control, link)


def _wait_for_every_rank(
    store: dist.TCPStore, cfg: ParallelConfig, rank: int, peers_alive: Callable[[], bool]
) -> None:
    if rank > 0 and store.check([FORMED_KEY]):
        raise RuntimeError("the group at this rendezvous has formed already, without this rank: this rank "
                           "started again while its leader still runs; it can join once the leader has started again")
    store.set(_loaded_key(rank), "1")

    def timed_out() -> str:
        missing = [r for r in range(cfg.world_size) if not store.check([_loaded_key(r)])]
        return f"ranks {missing} did not load their part of the model within {cfg.rendezvous_timeout_s:.0f}s"

    _wait_for(store, [_loaded_key(r) for r in range(cfg.world_size)], cfg, peers_alive, "the group formed", timed_out)
    if rank == 0:
        store.set(FORMED_KEY, "1")


def publish_aux_layers(store: dist.TCPStore, aux_layers: tuple[int, ...]) -> None:
    """The verifier rank's word to the stages: the layers whose entering residual streams its head
    fuses (``Proposer.aux_layer_ids``), known once it has loaded the head."""
    store.set(AUX_LAYERS_KEY, json.dumps(list(aux_layers)))


def await_aux_layers(store: dist.TCPStore, cfg: ParallelConfig,
                     peers_alive: Callable[[], bool] = lambda: True) -> tuple[int, ...]:
    """The aux layers the verifier rank published (``publish_aux_layers``), waited for as a rank's loading is."""
    timed_out = f"the verifier rank {cfg.verifier_rank} did not load its head within {cfg.rendezvous_timeout_s:.0f}s"
    _wait_for(store, [AUX_LAYERS_KEY], cfg, peers_alive, "the verifier rank loaded its head", lambda: timed_out)
    return tuple(json.loads(store.get(AUX_LAYERS_KEY)))


def _wait_for(store: dist.TCPStore, keys: list[str], cfg: ParallelConfig, peers_alive: Callable[[], bool],
              awaited: str, timed_out: Callable[[], str]) -> None:
    """Until every key is in the store: at most ``rendezvous_timeout_s``, and while this pod's workers live."""
    deadline = time.monotonic() + cfg.rendezvous_timeout_s
    while not store.check(keys):
        if not peers_alive():
            raise RuntimeError(f"a worker process of this pod exited before {awaited}")
        if time.monotonic() > deadline:
            raise TimeoutError(timed_out())
        time.sleep(_POLL_S)


def _loaded_key(rank: int) -> str:
    return f"loaded/{rank}"
