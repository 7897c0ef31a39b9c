"""Owns the KV pools and runs one target forward per step over every scheduled token: the logits
of the rows that decide tokens, every row's hidden state (what an MTP head drafts from) and, for
the layers in ``aux_layers``, the residual streams entering them (what an EAGLE-3 head drafts from).

All host→device traffic of the forward's inputs happens in ``prepare``: the flat token batch,
the rows to sample, positions, slot mapping and the attention metadata (block tables, sequence
lengths, query offsets) are built on the host as lists and moved in one non-blocking copy from
pinned memory (``upload``): no sync with the device. Under tensor
parallelism rank 0's runner hands what ``prepare`` built to its ``StepChannel``, which sends it
to the other ranks and runs the forward in lockstep with theirs; each rank's pools hold its own
KV heads under the same block tables.
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
        return self.run(self.prepare(scheduled))

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

    def prepare(self, scheduled: list[ScheduledSeq], pad: bool = True) -> PreparedStep:
        """The step's inputs on the device; a decode/verify step padded to its batch bucket where the
        runner has buckets (``pad``: False for rows that will be joined to others)."""
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
        lists = attention_lists(spans, self.block_size, self.null_block)
        input_ids, sample_at, prompt_at, *batch = upload([tokens, sample_rows, prompt_rows, *lists.parts], self.device)
        return PreparedStep(input_ids, lists.batch(batch), sample_at, prompt_at, prompt_token_ids, prompt_num_top,
                            self.null_block)

    def _prepare_bucketed(self, scheduled: list[ScheduledSeq]) -> PreparedStep:
        lists = bucketed_lists(scheduled, self.buckets, self.block_size, self.null_block,
                               self.model.config.max_position_embeddings, self.graphs.width if self.graphs else 0)
        input_ids, sample_at, prompt_at, positions, slots, tables, seq_lens, starts = upload(
            [lists.tokens, lists.sample_rows, [], lists.positions, lists.slots, lists.tables, lists.seq_lens,
             lists.starts], self.device)
        batch = AttentionBatch(positions=positions, slot_mapping=slots,
                               block_tables=tables.view(lists.num_seqs, lists.width), seq_lens=seq_lens,
                               query_start=starts, block_size=self.block_size, max_query_len=lists.query_len,
                               query_start_list=lists.starts, seq_lens_list=lists.seq_lens,
                               uniform_query_len=lists.query_len)
        return PreparedStep(input_ids, batch, sample_at, prompt_at, [], [], self.null_block,
                            bucket=(lists.num_seqs, lists.query_len))


@dataclass
class PreparedStep:
    """A step's model inputs, built on the host and moved to the device once."""

    input_ids: torch.Tensor  # [T] long
    batch: AttentionBatch
    sample_rows: torch.Tensor  # [R] long: the rows whose logits decide tokens
    prompt_rows: torch.Tensor  # [P] long: the rows that score the next prompt token's logprob
    prompt_token_ids: list[int]  # [P] the prompt token each of them scores
    prompt_num_top: list[int]  # [P] the alternatives asked for with each
    null_block: int  # the pools' null block (block-table padding)
    bucket: tuple[int, int] | None = None  # (B_pad, Q) of a bucketed step (``buckets.py``); None: exact shapes

    def then(self, other: PreparedStep) -> PreparedStep:
        """This step's rows followed by ``other``'s (built apart: overlap scheduling builds a
        step's prompt chunks while the previous step runs, its decode rows after)."""
        offset = self.input_ids.numel()
        return PreparedStep(torch.cat([self.input_ids, other.input_ids]), joined(self.batch, other.batch, self.null_block),
                            torch.cat([self.sample_rows, other.sample_rows + offset]),
                            torch.cat([self.prompt_rows, other.prompt_rows + offset]),
                            self.prompt_token_ids + other.prompt_token_ids, self.prompt_num_top + other.prompt_num_top,
                            self.null_block)


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

    @property
    def parts(self) -> list[list[int]]:
        return [self.positions, self.slots, self.tables, self.seq_lens, self.starts, self.hidden_keys]

    def batch(self, parts: list[torch.Tensor]) -> AttentionBatch:
        """The batch over ``parts``: these lists on the device, in ``parts`` order (``upload``)."""
        positions, slots, tables, seq_lens, starts, hidden = parts
        return AttentionBatch(positions=positions, slot_mapping=slots, block_tables=tables.view(self.num_seqs, self.width),
                              seq_lens=seq_lens, query_start=starts, block_size=self.block_size,
                              max_query_len=self.max_query_len,
                              hidden_keys=hidden.view(self.num_seqs, self.hidden_width) if self.hidden_width else None,
                              query_start_list=self.starts, seq_lens_list=self.seq_lens)


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
        len(spans), width, hidden_width, block_size, max((span.count for span in spans), default=0))


def build_attention_batch(spans: list[Span], block_size: int, null_block: int, device: torch.device) -> AttentionBatch:
    """``attention_lists`` of ``spans`` on ``device`` (one copy)."""
    lists = attention_lists(spans, block_size, null_block)
    return lists.batch(upload(lists.parts, device))


def joined(first: AttentionBatch, second: AttentionBatch, null_block: int) -> AttentionBatch:
    """``first``'s rows and sequences followed by ``second``'s."""
    width = max(first.block_tables.shape[1], second.block_tables.shape[1])

    def padded(tables: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(tables, (0, width - tables.shape[1]), value=null_block)

    if first.hidden_keys is not None or second.hidden_keys is not None:
        raise ValueError("an MTP chain step (hidden keys) is never joined to another")
    return AttentionBatch(
        positions=torch.cat([first.positions, second.positions]),
        slot_mapping=torch.cat([first.slot_mapping, second.slot_mapping]),
        block_tables=torch.cat([padded(first.block_tables), padded(second.block_tables)]),
        seq_lens=torch.cat([first.seq_lens, second.seq_lens]),
        query_start=torch.cat([first.query_start, second.query_start[1:] + first.positions.numel()]),
        block_size=first.block_size, max_query_len=max(first.max_query_len, second.max_query_len),
        **_joined_lists(first, second))


def _joined_lists(first: AttentionBatch, second: AttentionBatch) -> dict[str, list[int]]:
    """The host lists of ``joined``'s batch, where both batches have theirs."""
    if any(x is None for x in (first.query_start_list, second.query_start_list, first.seq_lens_list,
                               second.seq_lens_list)):
        return {}
    offset = first.query_start_list[-1]
    return {"query_start_list": first.query_start_list + [s + offset for s in second.query_start_list[1:]],
            "seq_lens_list": first.seq_lens_list + second.seq_lens_list}
