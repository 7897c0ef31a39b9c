"""Owns the KV pools and runs one target forward per step over every scheduled token: the logits
of the rows that decide tokens, every row's hidden state (what an MTP head drafts from) and, for
the layers in ``aux_layers``, the residual streams entering them (what an EAGLE-3 head drafts from).

``prepare`` builds a step's inputs on the host as lists: the flat token batch, the rows to
sample, positions, slot mapping and the attention metadata (block tables, sequence lengths, query
offsets), ``StepLists``. They reach the device in the step's one non-blocking copy from pinned
memory, with the verifier's and the proposer's lists (``LocalExecution.launch``, ``upload``): no
sync with the device. Under tensor parallelism rank 0's runner hands the step to its
``StepChannel``, which sends it to the other ranks and runs the forward in lockstep with theirs;
each rank's pools hold its own KV heads under the same block tables.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from specdecode.runtime.config import CacheConfig
from specdecode.runtime.engine.buckets import bucketable, bucketed_lists
from specdecode.runtime.engine.cuda_graphs import CudaGraphs
from specdecode.runtime.engine.sampler import gather_logprobs
from specdecode.runtime.engine.scheduler import ScheduledSeq
from specdecode.runtime.engine.sequence import TokenLogprob
from specdecode.runtime.engine.transfer import upload
from specdecode.runtime.models.attention import AttentionBatch, kv_pool
from specdecode.runtime.models.decoder import DecoderLM

if TYPE_CHECKING:
    from specdecode.runtime.parallel.step_channel import StepChannel

# Prompt logprobs are scored this many rows at a time: bounds the [rows, vocab] logits they need.
PROMPT_LOGPROB_ROWS = 256


def kv_bytes_per_block(model: DecoderLM, block_size: int, dtype: torch.dtype) -> int:
    """A block's bytes on the rank with the most layers (the first stage): every stage sizes its
    pool alike, so the block tables rank 0 sends are valid on each."""
    c = model.config
    layers = len(replace(model.stage, rank=0).layers(c.num_layers))
    return 2 * layers * block_size * model.num_local_kv_heads * c.head_dim * torch.finfo(dtype).bits // 8


def num_kv_blocks(cache: CacheConfig, model: DecoderLM, dtype: torch.dtype) -> int:
    """The pool size in blocks: as configured, or what the memory budget holds (the same on every rank)."""
    if cache.num_blocks:
        return cache.num_blocks
    return max(2, int(cache.memory_gib * 2**30) // kv_bytes_per_block(model, cache.block_size, dtype) - 1)  # + null block


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        channel: StepChannel | None = None,
        buckets: list[int] | None = None,
        graph_width: int | None = None,
    ):
        """``buckets``: pad decode/verify steps to these batch sizes (``buckets.py``); ``graph_width``:
        with them, replay each bucket's forward as a CUDA graph over block tables this wide."""
        c = model.config
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.channel = channel  # rank 0 of a tensor-parallel group; None otherwise
        self.null_block = num_blocks  # one past the block manager's: padding reads and writes it
        self.kv_pools = [kv_pool(num_blocks, block_size, model.num_local_kv_heads, c.head_dim, dtype=dtype, device=device)
                         for _ in range(model.num_local_layers)]
        self.num_forwards = 0
        self.buckets = buckets
        # target layers whose entering residual streams each step returns (``StepOutput.aux``): the
        # proposer's ``aux_layer_ids``, set where the two are wired together (``LocalExecution``)
        self.aux_layers: tuple[int, ...] = ()
        self.graphs = None if graph_width is None else CudaGraphs(self._forward, graph_width)  # captured lazily:
        # with the aux layers wired by then

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> StepOutput:
        """Forward every scheduled token (rows in scheduled order, each item's ``num_tokens`` rows)."""
        return self.run(self.prepare(scheduled).upload(self.device))

    @torch.inference_mode()
    def run(self, step: PreparedStep) -> StepOutput:
        """The forward of a prepared step (with the other tensor-parallel ranks, through the channel).
        A bucketed step's padding rows are dropped: its real rows are its sample rows (``buckets.py``)."""
        if self.graphs is not None and step.bucket is not None and self.graphs.fits(step.batch):
            self.num_forwards += 1
            hidden, aux = self.graphs.run(step.input_ids, step.batch, step.bucket)
        elif self.channel is None:
            hidden, aux = self.forward_aux(step.input_ids, step.batch)
        else:  # rank 0's own forward returns its aux states with its hidden states
            hidden, aux = self.channel.run_step(step.input_ids, step.batch, self.forward_aux)
        if step.bucket is not None:
            hidden, aux = hidden[step.sample_rows], aux[step.sample_rows]
            return StepOutput(self.model.compute_logits(hidden), hidden, aux)
        return StepOutput(self.model.compute_logits(hidden[step.sample_rows]), hidden, aux)

    def prompt_logprobs(self, step: PreparedStep, hidden: torch.Tensor) -> list[TokenLogprob]:
        """The logprobs of the prompt tokens ``step``'s prompt rows predict, in row order.
        hidden: [T, hidden] pre-norm, the step's forward."""
        out: list[TokenLogprob] = []
        for first in range(0, len(step.prompt_token_ids), PROMPT_LOGPROB_ROWS):
            rows = step.prompt_rows[first : first + PROMPT_LOGPROB_ROWS]  # [P]
            logits = self.model.compute_logits(hidden[rows])  # [P, vocab] fp32
            token_ids = step.prompt_token_ids[first : first + PROMPT_LOGPROB_ROWS]
            num_top = step.prompt_num_top[first : first + PROMPT_LOGPROB_ROWS]
            out += gather_logprobs(logits, list(range(len(token_ids))), token_ids, num_top)
        return out

    def forward(self, inputs: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """inputs: token ids [T] long (first stage) or the previous stage's hidden [T, hidden] →
        hidden states [T, hidden] (pre-norm), K/V written into the pools."""
        return self.forward_aux(inputs, batch)[0]

    def forward_aux(self, inputs: torch.Tensor, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` → (hidden [T, hidden], aux [T, len(aux_layers)·hidden]) in one pass."""
        self.num_forwards += 1
        return self._forward(inputs, batch)

    def _forward(self, inputs: torch.Tensor, batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Without aux layers through the module's own call, as every target forward was before (its
        hooks see it); aux [T, 0] then."""
        if not self.aux_layers:
            hidden = self.model(inputs, self.kv_pools, batch)
            return hidden, hidden.new_empty(hidden.shape[0], 0)
        return self.model.forward_aux(inputs, self.kv_pools, batch, self.aux_layers)

    def prepare(self, scheduled: list[ScheduledSeq], pad: bool = True) -> StepLists:
        """The step's inputs as host lists (no torch op: they reach the device in the step's one
        upload, ``StepLists``); a decode/verify step padded to its batch bucket where the runner has
        buckets (``pad``: False for rows that will be joined to others)."""
        if pad and self.buckets is not None and bucketable(scheduled, self.buckets):
            return self._prepare_bucketed(scheduled)
        tokens: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[int] = []
        prompt_token_ids: list[int] = []
        prompt_num_top: list[int] = []
        for item in scheduled:
            seq, start = item.seq, item.start
            num_real = item.num_tokens - item.num_draft
            positions = item.prompt_logprob_positions
            if positions:
                prompt_rows += (len(tokens) + p - start for p in positions)
                prompt_token_ids += seq.token_ids[positions.start + 1 : positions.stop + 1]
                prompt_num_top += [seq.params.prompt_logprobs] * len(positions)
            tokens += seq.token_ids[start : start + num_real] + item.draft_token_ids
            if item.samples:
                sample_rows += range(len(tokens) - item.num_draft - 1, len(tokens))
        spans = [Span(item.seq.block_table, item.start, item.num_tokens) for item in scheduled]
        return StepLists(tokens, sample_rows, prompt_rows, prompt_token_ids, prompt_num_top,
                         attention_lists(spans, self.block_size, self.null_block))

    def _prepare_bucketed(self, scheduled: list[ScheduledSeq]) -> StepLists:
        lists = bucketed_lists(scheduled, self.buckets, self.block_size, self.null_block,
                               self.model.config.max_position_embeddings, self.graphs.width if self.graphs else 0)
        attention = AttentionLists(lists.positions, lists.slots, lists.tables, lists.seq_lens, lists.starts, [],
                                   lists.num_seqs, lists.width, 0, self.block_size, lists.query_len, self.null_block,
                                   uniform_query_len=lists.query_len)
        return StepLists(lists.tokens, lists.sample_rows, [], [], [], attention, bucket=(lists.num_seqs, lists.query_len))


@dataclass
class StepLists:
    """A step's model inputs as host lists, what ``prepare`` builds. They reach the device in the
    step's one upload (``parts`` there, ``on_device`` back), with the verifier's and the proposer's
    lists (``LocalExecution.launch``): one non-blocking copy a step."""

    tokens: list[int]  # [T]
    sample_rows: list[int]  # [R]: the rows whose logits decide tokens
    prompt_rows: list[int]  # [P]: the rows that score the next prompt token's logprob
    prompt_token_ids: list[int]  # [P] the prompt token each of them scores
    prompt_num_top: list[int]  # [P] the alternatives asked for with each
    attention: AttentionLists
    bucket: tuple[int, int] | None = None  # (B_pad, Q) of a bucketed step (``buckets.py``); None: exact shapes

    @property
    def parts(self) -> list[list[int]]:
        return [self.tokens, self.sample_rows, self.prompt_rows, *self.attention.parts]

    def on_device(self, parts: list[torch.Tensor]) -> PreparedStep:
        """The step over ``parts``: these lists on the device, in ``parts`` order."""
        input_ids, sample_rows, prompt_rows, *batch = parts
        return PreparedStep(input_ids, self.attention.batch(batch), sample_rows, prompt_rows, self.prompt_token_ids,
                            self.prompt_num_top, self.attention.null_block, self.bucket)

    def upload(self, device: torch.device) -> PreparedStep:
        """On ``device`` in a copy of its own (a step whose verification runs elsewhere)."""
        return self.on_device(upload(self.parts, device))

    def then(self, other: StepLists) -> StepLists:
        """This step's rows followed by ``other``'s (built apart: overlap scheduling builds a
        step's prompt chunks while the previous step runs, its decode rows after)."""
        offset = len(self.tokens)
        return StepLists(self.tokens + other.tokens, self.sample_rows + [r + offset for r in other.sample_rows],
                         self.prompt_rows + [r + offset for r in other.prompt_rows],
                         self.prompt_token_ids + other.prompt_token_ids, self.prompt_num_top + other.prompt_num_top,
                         self.attention.then(other.attention))


@dataclass
class PreparedStep:
    """A step's model inputs on the device (``StepLists.on_device``)."""

    input_ids: torch.Tensor  # [T] long
    batch: AttentionBatch
    sample_rows: torch.Tensor  # [R] long: the rows whose logits decide tokens
    prompt_rows: torch.Tensor  # [P] long: the rows that score the next prompt token's logprob
    prompt_token_ids: list[int]  # [P] the prompt token each of them scores
    prompt_num_top: list[int]  # [P] the alternatives asked for with each
    null_block: int  # the pools' null block (block-table padding)
    bucket: tuple[int, int] | None = None  # (B_pad, Q) of a bucketed step (``buckets.py``); None: exact shapes


@dataclass
class StepOutput:
    logits: torch.Tensor  # [R, vocab] fp32: the deciding rows, R = Σ (num_draft + 1) over sampling items
    hidden: torch.Tensor  # [T, hidden]: every scheduled token's hidden state before the final norm
    aux: torch.Tensor  # [T, A·hidden]: the residual streams entering the runner's A ``aux_layers`` (A = 0: none)


@dataclass
class Span:
    """One sequence's tokens in a forward: ``count`` positions from ``start``, KV slots by ``block_table``;
    its queries never attend the keys at ``hidden_keys`` (positions another MTP module wrote)."""

    block_table: list[int]
    start: int
    count: int
    hidden_keys: tuple[int, ...] = ()


@dataclass
class AttentionLists:
    """``AttentionBatch``'s metadata as host lists, to go to the device with the step's other inputs."""

    positions: list[int]  # [T]
    slots: list[int]  # [T]
    tables: list[int]  # [B·M], padded with the null block
    seq_lens: list[int]  # [B]
    starts: list[int]  # [B + 1]
    hidden_keys: list[int]  # [B·H], −1 padded; empty without hidden keys
    num_seqs: int  # B
    width: int  # M, blocks per table
    hidden_width: int  # H
    block_size: int
    max_query_len: int
    null_block: int  # what the tables are padded with
    uniform_query_len: int | None = None  # Q of a bucketed step: every sequence has Q rows

    @property
    def parts(self) -> list[list[int]]:
        return [self.positions, self.slots, self.tables, self.seq_lens, self.starts, self.hidden_keys]

    def then(self, other: AttentionLists) -> AttentionLists:
        """This batch's rows and sequences followed by ``other``'s, the tables padded to the wider."""
        if self.hidden_width or other.hidden_width:
            raise ValueError("an MTP chain step (hidden keys) is never joined to another")
        width = max(self.width, other.width)
        offset = self.starts[-1]
        return AttentionLists(self.positions + other.positions, self.slots + other.slots,
                              self._tables(width) + other._tables(width), self.seq_lens + other.seq_lens,
                              self.starts + [s + offset for s in other.starts[1:]], [], self.num_seqs + other.num_seqs,
                              width, 0, self.block_size, max(self.max_query_len, other.max_query_len), self.null_block)

    def _tables(self, width: int) -> list[int]:
        """The tables, each padded with the null block to ``width`` entries."""
        pad = [self.null_block] * (width - self.width)
        return [b for s in range(self.num_seqs) for b in self.tables[s * self.width : (s + 1) * self.width] + pad]

    def batch(self, parts: list[torch.Tensor]) -> AttentionBatch:
        """The batch over ``parts``: these lists on the device, in ``parts`` order (``upload``)."""
        positions, slots, tables, seq_lens, starts, hidden = parts
        return AttentionBatch(positions=positions, slot_mapping=slots, block_tables=tables.view(self.num_seqs, self.width),
                              seq_lens=seq_lens, query_start=starts, block_size=self.block_size,
                              max_query_len=self.max_query_len,
                              hidden_keys=hidden.view(self.num_seqs, self.hidden_width) if self.hidden_width else None,
                              query_start_list=self.starts, seq_lens_list=self.seq_lens,
                              uniform_query_len=self.uniform_query_len)


def attention_lists(spans: list[Span], block_size: int, null_block: int) -> AttentionLists:
    """Positions, KV slots and the attention metadata for a flat batch of ``spans`` laid out in
    order; block tables padded with ``null_block``."""
    positions: list[int] = []
    slots: list[int] = []
    for span in spans:
        for pos in range(span.start, span.start + span.count):
            positions.append(pos)
            slots.append(span.block_table[pos // block_size] * block_size + pos % block_size)
    width = max((len(span.block_table) for span in spans), default=0)
    starts = [0]
    for span in spans:
        starts.append(starts[-1] + span.count)
    hidden_width = max((len(span.hidden_keys) for span in spans), default=0)
    return AttentionLists(
        positions, slots, [b for span in spans for b in span.block_table + [null_block] * (width - len(span.block_table))],
        [span.start + span.count for span in spans], starts,
        [k for span in spans for k in list(span.hidden_keys) + [-1] * (hidden_width - len(span.hidden_keys))],
        len(spans), width, hidden_width, block_size, max((span.count for span in spans), default=0), null_block)


def build_attention_batch(spans: list[Span], block_size: int, null_block: int, device: torch.device) -> AttentionBatch:
    """``attention_lists`` of ``spans`` on ``device`` (one copy)."""
    lists = attention_lists(spans, block_size, null_block)
    return lists.batch(upload(lists.parts, device))
