"""Structured outputs: a request's constraint, compiled once, and each sequence's grammar state.

A *constraint* (``StructuredOutput``, a small frozen value on ``SamplingParams``) names the language
the output must belong to: a JSON schema, any JSON object, a regex, one of several strings, or a
grammar (GBNF or llguidance's lark). ``GrammarCompiler`` turns it into an llguidance matcher over
the engine's vocabulary; each sequence gets its own copy (``Grammar``), advanced by the tokens
the sequence emits and nothing else.

Masks: for a sequence with drafts ``d_0 … d_{K-1}``, verified row ``j`` may only pick a token the
grammar allows after ``d_0 … d_{j-1}``. ``fill_masks`` writes every row's packed bitmask (bit
``t % 32`` of word ``t // 32`` = token ``t`` allowed) through llguidance's batched calls, which
advance each matcher through its drafts and roll it back. Rows after the first draft the grammar refuses keep
an all-allowed mask: verification stops at that draft (it is never accepted: its probability is
zero), so they are never read. EOS is allowed exactly where the grammar accepts; once the grammar
is complete (the matcher *stopped*) the sequence finishes with ``stop``.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer
from llguidance.gbnf_to_lark import any_to_lark
from llguidance.torch import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

if TYPE_CHECKING:
    from specdecode.runtime.tokenizer import Tokenizer

ALL_ALLOWED = -1  # a bitmask word with every bit set


class StructuredKind(str, Enum):
    JSON = "json"  # text: a JSON schema, serialized
    JSON_OBJECT = "json_object"  # text: "" (any JSON object)
    REGEX = "regex"
    CHOICE = "choice"  # text: a JSON list of strings; the output is exactly one of them
    GRAMMAR = "grammar"  # GBNF (converted to lark) or lark
    LARK = "lark"  # llguidance's lark, as is (``%json {…}`` inside a rule embeds a schema)


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match."""

    kind: StructuredKind
    text: str = ""

    def llguidance_grammar(self) -> str:
        """The llguidance grammar this constraint compiles to; ValueError when it is malformed."""
        if self.kind is StructuredKind.JSON:
            return LLMatcher.grammar_from_json_schema(self.text)
        if self.kind is StructuredKind.JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.kind is StructuredKind.REGEX:
            return LLMatcher.grammar_from_regex(self.text)
        if self.kind is StructuredKind.CHOICE:
            return LLMatcher.grammar_from_lark(choice_lark(json.loads(self.text)))
        if self.kind is StructuredKind.GRAMMAR:
            try:
                return LLMatcher.grammar_from_lark(any_to_lark(self.text))
            except Exception as exc:  # the GBNF converter raises whatever its parser meets
                raise ValueError(f"could not read the grammar as GBNF or lark: {exc}") from None
        return LLMatcher.grammar_from_lark(self.text)


def choice_lark(choices: list[str]) -> str:
    if not choices or not all(isinstance(c, str) for c in choices):
        raise ValueError("choice must be a non-empty list of strings")
    return "start: " + " | ".join(json.dumps(c) for c in choices)


class Grammar:
    """One sequence's grammar state: the tokens it emitted so far, nothing speculative."""

    def __init__(self, matcher: LLMatcher):
        self.matcher = matcher

    def valid_prefix(self, draft_token_ids: list[int]) -> int:
        """How many of the drafts, in order, the grammar allows (the state is left unchanged)."""
        return self.matcher.validate_tokens(draft_token_ids) if draft_token_ids else 0

    def advance(self, token_id: int) -> bool:
        """Consume an emitted token; False if the grammar refuses it (the masks should make that impossible)."""
        return self.matcher.consume_token(token_id)

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next: llguidance's fast-forward tokens, the
        canonical tokenization of the bytes every continuation starts with (a last token that a
        longer token could swallow is left out). Another tokenization of the same bytes may also be
        allowed: then the target decides, as for any draft."""
        return self.matcher.compute_ff_tokens()[:limit] if limit > 0 else []

    def copy(self) -> Grammar:
        """An independent state to advance through drafts (llguidance's rollback does not restore a
        state that had stopped, so drafting never touches the sequence's own)."""
        return Grammar(self.matcher.deep_copy())

    @property
    def complete(self) -> bool:
        """No token but EOS can follow: the output is finished."""
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles constraints for one engine's vocabulary and fills masks. The llguidance tokenizer
    (about a second for a 50k vocabulary) is built on first use, so unconstrained serving never
    pays for it; compiled constraints are kept (most recent ``cache_size``) and copied per sequence."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 64):
        self.tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)  # mask width: the wider of the logits and the tokenizer
        self.num_words = (self.vocab_size + 31) // 32
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._ll_tokenizer: LLTokenizer | None = None
        self._compiled: OrderedDict[StructuredOutput, LLMatcher] = OrderedDict()
        self._executor = LLExecutor()

    def compile(self, structured: StructuredOutput) -> None:
        """Compile and keep ``structured``; ValueError with llguidance's reason when it is invalid.
        The server calls this in a worker thread (llguidance releases the GIL while compiling)."""
        self._prototype(structured)

    def grammar(self, structured: StructuredOutput) -> Grammar:
        """A fresh grammar state for one sequence."""
        return Grammar(self._prototype(structured).deep_copy())

    def fill_masks(
        self,
        grammars: list[tuple[Grammar, int, list[int]]],  # (state, first row, that sequence's drafts)
        num_rows: int,
    ) -> torch.Tensor:  # [num_rows, ceil(V/32)] int32 packed bitmask; rows no grammar reaches stay all allowed
        masks = torch.full((num_rows, self.num_words), ALL_ALLOWED, dtype=torch.int32)
        plain = [(g.matcher, row) for g, row, drafts in grammars if not drafts]
        drafted = [(g.matcher, row, drafts) for g, row, drafts in grammars if drafts]
        if plain:  # llguidance's draft-token call refuses an empty draft list
            fill_next_token_bitmask_par(self._executor, plain, masks)
        if drafted:
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, masks)
        return masks

    def allowed(self, grammars: list[Grammar], vocab_size: int) -> torch.Tensor:  # [len(grammars), vocab_size] bool
        """What each grammar allows next, unpacked (a proposer masks its draft logits with it)."""
        return ~forbidden_tokens(self.fill_masks([(g, i, []) for i, g in enumerate(grammars)], len(grammars)), vocab_size)

    def _prototype(self, structured: StructuredOutput) -> LLMatcher:
        with self._lock:
            matcher = self._compiled.get(structured)
            if matcher is not None:
                self._compiled.move_to_end(structured)
                return matcher
        matcher = LLMatcher(self._llguidance_tokenizer(), structured.llguidance_grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        with self._lock:
            self._compiled[structured] = matcher
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return matcher

    def _llguidance_tokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance_tokenizer(self.tokenizer, self.vocab_size)
            return self._ll_tokenizer


def llguidance_tokenizer(tokenizer: Tokenizer, vocab_size: int) -> LLTokenizer:
    """llguidance's view of our in-memory tokenizer (GGUF models have no tokenizer.json on disk):
    the backend serialized as tokenizer.json, the mask's vocabulary width, our EOS ids."""
    if not tokenizer.eos_token_ids:
        raise ValueError("structured outputs need a tokenizer with an EOS token")
    return LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=sorted(tokenizer.eos_token_ids))


def forbidden_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Packed masks [M, W] int32 (bit ``t % 32`` of word ``t // 32`` = token ``t`` allowed) → [M, vocab_size]
    bool, True where forbidden (tokens past the mask's width are forbidden)."""
    dev = words.device
    # little-endian words: byte t // 8 holds token t at bit t % 8; one table lookup per byte
    byte_bits = torch.arange(256, device=dev)[:, None] >> torch.arange(8, device=dev)  # [256, 8]
    forbidden_bits = (byte_bits & 1) == 0  # [256, 8] bool
    forbidden = forbidden_bits.index_select(0, words.contiguous().view(torch.uint8).view(-1).int()).view(len(words), -1)
    if forbidden.shape[1] < vocab_size:
        forbidden = torch.cat([forbidden, forbidden.new_ones(len(words), vocab_size - forbidden.shape[1])], dim=1)
    return forbidden[:, :vocab_size]
