"""Pipeline stages in one process: the real ``PipelineExecution``, ``StageWorker`` and ``PipelineTail``
over an in-process ``PipelineTransport``, so the engine fuzzer drives pipeline steps without
process groups. Nothing of the pipeline is re-implemented here: only how messages travel.

Every rank gets its own stage model and KV pools (loaded as a worker process loads them); objects
travel pickled and tensors copied, as over gloo, so no rank sees another's memory. The other
ranks run a step lazily, in stage order, when rank 0 reads its verdict: rank 0's overlap
look-ahead happens between the launch and that read, as it does between processes.
Tensor parallelism needs collectives and is left to the real gloo runs: one tensor rank per stage.
"""
from __future__ import annotations

import copy
import pickle
from collections import deque
from typing import Any

import torch

from specdecode.runtime.config import EngineConfig
from specdecode.runtime.engine.llm_engine import LLMEngine
from specdecode.runtime.engine.model_runner import ModelRunner
from specdecode.runtime.models.attention import AttentionBatch
from specdecode.runtime.models.loader import load_model
from specdecode.runtime.models.tensor_parallel import TensorParallel
from specdecode.runtime.parallel.leader import pipeline_engine
from specdecode.runtime.parallel.pipeline import StageWorker, TailPlan
from specdecode.runtime.parallel.step_channel import Forward, TensorParallelBroken
from specdecode.runtime.parallel.transport import PipelineTransport
from specdecode.runtime.parallel.workers import rank_stage, stage_worker


class InProcessTransport(PipelineTransport):
    def __init__(self) -> None:
        self.workers: list[StageWorker] = []  # global ranks 1, 2, …: one per stage after the first
        self.broken = False
        self._steps: deque[tuple[torch.Tensor, AttentionBatch]] = deque()  # launched, not yet run by the others
        self._plans: deque[bytes] = deque()
        self._hidden: dict[int, deque[torch.Tensor]] = {}  # destination rank → hidden (+ aux) states [T, (1 + a)·H]
        self._verdicts: deque[torch.Tensor] = deque()
        self._logprobs: deque[bytes] = deque()

    def run_step(self, input_ids: torch.Tensor, batch: AttentionBatch, forward: Forward) -> torch.Tensor:
        if self.broken:
            raise TensorParallelBroken("an earlier step failed part-way; the pipeline is unusable")
        self._steps.append(copy.deepcopy((input_ids, batch)))
        return forward(input_ids, batch)

    def send_plan(self, plan: TailPlan) -> None:
        self._plans.append(pickle.dumps(plan))

    def receive_plan(self) -> TailPlan:
        return pickle.loads(self._plans.popleft())

    def send_hidden(self, hidden: torch.Tensor, dst: int) -> None:
        self._hidden.setdefault(dst, deque()).append(hidden.detach().clone())

    def receive_hidden(self, out: torch.Tensor, src: int) -> torch.Tensor:
        return out.copy_(self._hidden[src + 1].popleft())  # one tensor rank per stage: src's next stage is src + 1

    def send_verdict(self, flat: torch.Tensor) -> None:
        self._verdicts.append(flat.clone())

    def receive_verdict(self, numel: int, device: torch.device) -> torch.Tensor:
        while self._steps:  # the other ranks run what rank 0 launched, in stage order
            input_ids, batch = self._steps.popleft()
            for worker in self.workers:
                worker.run(input_ids, batch)
        flat = self._verdicts.popleft()
        if flat.numel() != numel:
            raise RuntimeError(f"the verdict has {flat.numel()} elements; rank 0 expected {numel}")
        return flat.to(device)

    def send_logprobs(self, logprobs: list[Any]) -> None:
        self._logprobs.append(pickle.dumps(logprobs))

    def receive_logprobs(self) -> list[Any]:
        return pickle.loads(self._logprobs.popleft())


def in_process_pipeline_engine(cfg: EngineConfig) -> tuple[LLMEngine, InProcessTransport]:
    """Rank 0's engine over ``cfg.parallel.pipeline_parallel_size`` stages in this process (TP 1)."""
    par = cfg.parallel
    if par.tensor_parallel_size != 1:
        raise ValueError("the in-process pipeline runs one tensor rank per stage")
    transport = InProcessTransport()
    for rank in range(1, par.world_size):
        loaded = load_model(cfg.load, TensorParallel(0, 1), rank_stage(cfg, rank))
        runner = ModelRunner(loaded.model, _num_blocks(cfg), cfg.cache.block_size, loaded.device, loaded.dtype)
        transport.workers.append(stage_worker(cfg, rank, loaded, runner, transport))
    aux_layers = transport.workers[-1].tail.aux_layers  # the verifier's head's, as the group's store hands them out
    for worker in transport.workers:
        worker.runner.aux_layers = aux_layers
    first = load_model(cfg.load, TensorParallel(0, 1), rank_stage(cfg, 0))
    return pipeline_engine(cfg, first, transport, aux_layers), transport


def _num_blocks(cfg: EngineConfig) -> int:
    if not cfg.cache.num_blocks:
        raise ValueError("the in-process pipeline needs cache.num_blocks (every stage sizes its pool alike)")
    return cfg.cache.num_blocks
