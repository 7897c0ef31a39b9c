"""Requests as the engine sees them: sampling parameters, sequences and their outputs.

A *request* carries one prompt and ``n`` *sequences* (its completions). Each sequence owns its
token list (prompt + generated), its KV block table and its status.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # this module stays torch-free (``specdecode validate`` imports it without torch)
    from specdecode.runtime.engine.grammar import Grammar, StructuredOutput


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation controls (validated at the API edge; ranges re-checked here)."""

    max_tokens: int = 16  # 0: the prompt's logprobs only (echo), nothing generated
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; N ≥ 0 = chosen token's logprob + N top alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (from the prefill)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit before sampling)
    n: int = 1
    num_speculative_tokens: int | None = None  # per-request cap on draft tokens (0 = no speculation)
    structured: StructuredOutput | None = None  # the language the output must belong to (grammar.py)

    def __post_init__(self) -> None:
        checks = {
            "max_tokens": self.max_tokens >= 0,
            "temperature": 0.0 <= self.temperature <= 2.0,
            "top_p": 0.0 < self.top_p <= 1.0,
            "top_k": self.top_k >= -1,
            "presence_penalty": -2.0 <= self.presence_penalty <= 2.0,
            "frequency_penalty": -2.0 <= self.frequency_penalty <= 2.0,
            "logprobs": self.logprobs is None or 0 <= self.logprobs <= 20,
            "prompt_logprobs": self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "logit_bias": all(-100.0 <= bias <= 100.0 for _, bias in self.logit_bias),
            "n": 1 <= self.n <= 16,
            "num_speculative_tokens": self.num_speculative_tokens is None or 0 <= self.num_speculative_tokens <= 16,
        }
        bad = [name for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid value for {bad[0]}: {getattr(self, bad[0])!r}")
        if self.structured is not None and (self.ignore_eos or self.stop or self.stop_token_ids):
            # each would end (or never end) an output where the grammar does not: "stop" must mean valid
            raise ValueError("ignore_eos, stop and stop_token_ids cannot be combined with structured outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass
class TokenLogprob:
    """The chosen token's log-probability under the target, and the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first, len = requested N


@dataclass
class SpecCounts:
    """Speculation outcome of one completion (or a whole server, summed)."""

    num_drafts: int = 0  # steps that scored at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i] = drafts accepted at position i

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_accepted:
            self.accepted_per_position += [0] * (num_accepted - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def record_counts(self, other: "SpecCounts") -> None:
        """Add another tally into this one."""
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, n in enumerate(other.accepted_per_position):
            if i == len(self.accepted_per_position):
                self.accepted_per_position.append(0)
            self.accepted_per_position[i] += n


@dataclass
class Sequence:
    """One completion being generated. ``num_computed_tokens`` have K/V in the cache."""

    seq_id: int
    request_id: str
    index: int  # which of the request's n completions
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float
    seed: int = 0  # keys this completion's random draws (rng.py)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_prefix_tokens: int = 0  # prefix-cache hit length of the latest admission
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # [i] = prompt token i + 1's, when asked
    first_token_time: float | None = None
    spec: SpecCounts = field(default_factory=SpecCounts)
    grammar: Grammar | None = None  # advanced by emitted tokens only, when the request has a constraint

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def missing_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some are not computed yet."""
        return self.wants_prompt_logprobs and len(self.prompt_logprobs) < self.num_prompt_tokens - 1


@dataclass
class CompletionDelta:
    """What one sequence produced since the last output of its request."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    prompt_logprobs: list[TokenLogprob] | None = None  # on a completion's first delta, when asked: prompt tokens 1…


@dataclass
class RequestOutput:
    """An increment of a request's output; ``finished`` once every completion has ended."""

    request_id: str
    deltas: list[CompletionDelta]
    num_prompt_tokens: int
    num_output_tokens: int  # total so far, summed over completions
    num_cached_tokens: int
    finished: bool
    spec: SpecCounts = field(default_factory=SpecCounts)  # summed over the request's completions
