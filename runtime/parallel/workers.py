"""A pod's worker processes: every rank but global rank 0.

Each is a spawned process (``worker_main``) that binds its device, loads its part of the model
(its stage's layers, its tensor-parallel shard of them), joins the group, starts its heartbeat
(``heartbeat``) and then runs every step rank 0 sends — with pipeline stages, on the hidden states the previous stage sends, and on the
verifier rank verifying too — until rank 0 says stop or its connection closes.
``LocalWorkers`` starts and supervises them: they are daemonic (they never outlive a normal
exit of the process that started them), ignore Ctrl-C (which reaches the whole process group;
rank 0 stops them), and report once they have joined the group.
"""
from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from specdecode.runtime.config import HEAD_METHODS, EngineConfig
from specdecode.runtime.engine.model_runner import ModelRunner, num_kv_blocks
from specdecode.runtime.models.loader import LoadedModel, load_model
from specdecode.runtime.models.pipeline_stage import PipelineStage
from specdecode.runtime.models.tensor_parallel import TensorParallel
from specdecode.runtime.parallel.group import (
    await_aux_layers, bind_device, connect_store, join_group, publish_aux_layers, store_client,
)
from specdecode.runtime.parallel.heartbeat import start_beating
from specdecode.runtime.parallel.pipeline import PipelineTail, StageWorker, hands_on_aux
from specdecode.runtime.parallel.step_channel import StepChannel
from specdecode.runtime.parallel.transport import GlooTransport, PipelineTransport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs (pickled to it)."""

    engine: EngineConfig
    rank: int  # global
    local_rank: int  # its device in this pod
    store_addr: str
    store_port: int


def worker_main(spec: WorkerSpec, joined: Connection) -> None:
    """A worker process: load this rank's part of the model, join the group, run steps until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg, par = spec.engine, spec.engine.parallel
    stage = rank_stage(cfg, spec.rank)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank {spec.rank}, stage {stage.rank}] "
                                                   "%(name)s: %(message)s")
    device = bind_device(cfg.load.device, spec.local_rank, par.ranks_per_node)
    store = connect_store(par, spec.store_addr, spec.store_port)
    loaded = load_model(cfg.load, TensorParallel(par.tp_rank_of(spec.rank), par.tensor_parallel_size), stage)
    num_blocks = num_kv_blocks(cfg.cache, loaded.model, loaded.dtype)
    runner = ModelRunner(loaded.model, num_blocks, cfg.cache.block_size, loaded.device, loaded.dtype)
    groups = join_group(store, par, spec.rank, device)
    beats = store_client(spec.store_addr, spec.store_port, par.group_heartbeat_timeout_s)
    start_beating(beats, spec.rank, par.group_heartbeat_timeout_s)
    channel = StepChannel(groups.control, loaded.device)
    run = runner.forward
    if par.pipeline_parallel_size > 1:
        worker = stage_worker(cfg, spec.rank, loaded, runner, GlooTransport(groups.link, par.verifier_rank))
        if hands_on_aux(cfg, spec.rank):
            if worker.tail is not None:
                publish_aux_layers(store, worker.tail.aux_layers)
            runner.aux_layers = await_aux_layers(store, par)
        run = worker.run
    joined.send(spec.rank)
    log.info("joined the group (%d ranks: %d stages × %d); layers %s; %d KV blocks", par.world_size,
             par.pipeline_parallel_size, par.tensor_parallel_size, list(stage.layers(loaded.config.num_layers)),
             num_blocks)
    with torch.inference_mode():
        while (step := channel.receive()) is not None:
            run(*step)
    dist.destroy_process_group()
    log.info("stopped")


def stage_worker(cfg: EngineConfig, rank: int, loaded: LoadedModel, runner: ModelRunner,
                 transport: PipelineTransport) -> StageWorker:
    """Global ``rank``'s part of every pipeline step (any rank but 0): its stage's layers over
    ``runner``, and on the verifier rank the ``PipelineTail``."""
    par = cfg.parallel
    tail = None
    if rank == par.verifier_rank:
        max_model_len = min(cfg.scheduler.max_model_len or loaded.max_model_len, loaded.config.max_position_embeddings)
        tail = PipelineTail(loaded.model, loaded.tokenizer, cfg, transport, loaded.device, loaded.dtype,
                            max_model_len, runner.num_blocks)
    return StageWorker(runner, par, rank, tail, transport)


def rank_stage(cfg: EngineConfig, rank: int) -> PipelineStage:
    """The pipeline stage a global rank runs (the last keeps an embedding copy for MTP and EAGLE-3 heads)."""
    par = cfg.parallel
    return PipelineStage(par.stage_of(rank), par.pipeline_parallel_size,
                         embedding_on_last=cfg.speculative.method in HEAD_METHODS)


class LocalWorkers:
    """This pod's worker processes for global ``ranks``, meeting rank 0's store at ``store_addr:store_port``."""

    def __init__(self, cfg: EngineConfig, ranks: Sequence[int], store_addr: str, store_port: int):
        ctx = multiprocessing.get_context("spawn")
        first = cfg.parallel.local_ranks.start
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._joined: dict[int, Connection] = {}  # rank → pipe, until that rank reports it joined
        self._joined_lock = threading.Lock()  # probes may ask from several threads
        for rank in ranks:
            receiver, sender = ctx.Pipe(duplex=False)
            spec = WorkerSpec(cfg, rank, rank - first, store_addr, store_port)
            proc = ctx.Process(target=worker_main, args=(spec, sender), name=f"specdecode-tp-rank-{rank}", daemon=True)
            proc.start()
            sender.close()  # the child holds the only writer: its exit reads as EOF here
            self._procs.append(proc)
            self._joined[rank] = receiver

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    @property
    def joined(self) -> bool:
        """Every worker has joined the group (and is still alive)."""
        with self._joined_lock:
            for rank, pipe in list(self._joined.items()):
                if pipe.poll() and self._read_join(pipe):
                    del self._joined[rank]
            return not self._joined and self.alive

    @property
    def exit_codes(self) -> list[int | None]:
        return [p.exitcode for p in self._procs]

    def wait_any_exit(self) -> None:
        """Block until at least one worker has exited."""
        wait([p.sentinel for p in self._procs])

    def stop(self, grace_s: float) -> None:
        """Give the workers ``grace_s`` to exit on their own (after a shutdown message), then kill them."""
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                if grace_s > 0:
                    log.warning("%s did not exit within %.0fs; killing it", proc.name, grace_s)
                proc.kill()
                proc.join()

    @staticmethod
    def _read_join(pipe: Connection) -> bool:
        try:
            pipe.recv()
        except EOFError:  # the worker died before joining: it never will
            return False
        return True
