"""Global rank 0 of a parallel group: the engine, plus what keeps the other ranks in step.

``start_leader_engine`` hosts the rendezvous store, spawns this pod's other ranks, loads rank
0's part while they load theirs, forms the group and returns an ``LLMEngine`` that sends every
step through the ``StepChannel``. Tensor parallelism only: the scheduler, the proposer (a draft
model or a head stays whole, on rank 0, a head drafting from the replicated states of rank 0's
forward) and the verifier run here. With pipeline stages rank 0 holds the
first stage and the engine's steps go through ``PipelineExecution``: the last stage verifies,
and the draft model or the MTP or EAGLE-3 heads sit there (``pipeline``); with an EAGLE-3 head
rank 0 waits for its aux layers (``group.await_aux_layers``) before its first step. Every other
rank's heartbeat is watched (``heartbeat``) once the server starts.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch.distributed as dist

from specdecode.runtime.config import HEAD_METHODS, MTP_PIPELINE_WARNING, EngineConfig, ParallelConfig
from specdecode.runtime.engine.llm_engine import LLMEngine
from specdecode.runtime.engine.model_runner import ModelRunner
from specdecode.runtime.models.loader import LoadedModel, load_model
from specdecode.runtime.models.tensor_parallel import TensorParallel
from specdecode.runtime.parallel.group import await_aux_layers, bind_device, host_store, join_group, store_client
from specdecode.runtime.parallel.heartbeat import GroupWatch
from specdecode.runtime.parallel.step_channel import StepChannel
from specdecode.runtime.parallel.pipeline import PipelineExecution, RelayedDrafts, hands_on_aux, proposes_on_verifier
from specdecode.runtime.parallel.transport import GlooTransport, PipelineTransport
from specdecode.runtime.parallel.workers import LocalWorkers, rank_stage

log = logging.getLogger(__name__)
WORKER_EXIT_GRACE_S = 30.0


class Leader:
    """Rank 0's hold on the group: the store, this pod's worker processes, the step channel, the
    watch on every rank's heartbeat."""

    def __init__(self, store: dist.TCPStore, workers: LocalWorkers, par: ParallelConfig):
        self.store = store  # the workers' rendezvous; kept alive with the group
        self.workers = workers
        self.par = par
        self.channel: StepChannel | None = None  # once the group has formed
        self.lost: str | None = None  # why the group is lost: a rank stopped beating
        self._watch: GroupWatch | None = None

    @property
    def alive(self) -> bool:
        """This pod's workers run and the group is whole: no step broke it, every rank beats."""
        return self.workers.alive and not (self.channel is not None and self.channel.broken)

    def watch(self, on_lost: Callable[[str], None]) -> None:
        """Watch every other rank's heartbeat; once one stops: ``lost`` says why, and ``on_lost(line)``
        runs on the watch's thread."""
        def lost(line: str) -> None:
            self.lost = line
            if self.channel is not None:
                self.channel.broken = True  # no step, nor the shutdown message, goes to a group short of a rank
            on_lost(line)

        timeout = self.par.group_heartbeat_timeout_s
        store = store_client("127.0.0.1", self.store.port, timeout)
        self._watch = GroupWatch(store, range(1, self.par.world_size), timeout, lost)
        self._watch.start()

    def shutdown(self) -> None:
        """Tell the workers to stop, wait for them a while, kill what is left. Call with no step running."""
        if self._watch is not None:
            self._watch.stop()  # ranks stop beating as they exit: not a loss
        grace = 0.0
        if self.channel is not None:
            try:
                self.channel.close()
                grace = 0.0 if self.channel.broken else WORKER_EXIT_GRACE_S  # broken: no message went out
            except RuntimeError as exc:  # a worker is gone already: kill the rest
                log.warning("could not send the shutdown message: %s", exc)
            dist.destroy_process_group()
        self.workers.stop(grace)


def start_leader_engine(cfg: EngineConfig) -> tuple[LLMEngine, str, Leader]:
    """(rank 0's engine, the served model name, the leader); raises (with the workers stopped) on failure."""
    par = cfg.parallel
    device = bind_device(cfg.load.device, 0, par.ranks_per_node)
    store = host_store(par)
    leader = Leader(store, LocalWorkers(cfg, par.local_ranks[1:], "127.0.0.1", store.port), par)
    try:
        loaded = load_model(cfg.load, TensorParallel(0, par.tensor_parallel_size), rank_stage(cfg, 0))
        groups = join_group(store, par, 0, device, peers_alive=lambda: leader.workers.alive)
        leader.channel = StepChannel(groups.control, loaded.device)
        if par.pipeline_parallel_size == 1:
            engine = LLMEngine(loaded.model, loaded.tokenizer, cfg, loaded.max_model_len, loaded.device, loaded.dtype,
                               leader.channel)
        else:
            aux_layers = await_aux_layers(store, par, lambda: leader.workers.alive) if hands_on_aux(cfg, 0) else ()
            engine = pipeline_engine(cfg, loaded, GlooTransport(groups.link, par.verifier_rank, leader.channel),
                                     aux_layers)
    except BaseException:
        leader.shutdown()
        raise
    log.info("parallel group formed: %d ranks, %d stages × %d", par.world_size, par.pipeline_parallel_size,
             par.tensor_parallel_size)
    return engine, loaded.name, leader


def pipeline_engine(cfg: EngineConfig, loaded: LoadedModel, transport: PipelineTransport,
                    aux_layers: tuple[int, ...] = ()) -> LLMEngine:
    """Rank 0's engine over pipeline stages reached through ``transport``: its steps go through
    ``PipelineExecution``; a draft model or heads on the verifier relay their drafts; ``aux_layers``:
    an EAGLE-3 head's, whose entering residual streams rank 0's stage sends on (``hands_on_aux``)."""
    spec = cfg.speculative
    if spec.method in HEAD_METHODS:
        log.warning(MTP_PIPELINE_WARNING)
    relayed = RelayedDrafts() if proposes_on_verifier(spec.method) else None

    def execution(runner: ModelRunner) -> PipelineExecution:
        k = spec.max_drafts  # forced drafts alone with method 'none' and grammar_drafts
        slots_ahead = k if spec.method in HEAD_METHODS else 0  # the heads write K/V as they draft
        return PipelineExecution(runner, transport, cfg.parallel, k, relayed, slots_ahead, aux_layers)

    return LLMEngine(loaded.model, loaded.tokenizer, cfg, loaded.max_model_len, loaded.device, loaded.dtype,
                     proposer=relayed, execution=execution)
