"""Incremental detokenization and stop-string handling for one completion.

Text is decoded over a sliding window of ids (the last few already-read ids give the next
piece its spacing; a piece ending in U+FFFD waits for the rest of its UTF-8 bytes). When stop
strings are set, the last ``len(longest stop) - 1`` characters are held back from streaming,
since they may be the start of a stop string; OpenAI semantics: the stop string is not returned.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specdecode.runtime.tokenizer import Tokenizer


CONTEXT_TOKENS = 5  # prompt ids used as left context for the first output piece


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters of self.text already handed out
        self.stop_reason: str | None = None

    def append(self, token_id: int) -> None:
        """Add one generated token; sets ``stop_reason`` when a stop string completes."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        searched_from = max(0, len(self.text) - self.holdback)
        self.text += full[len(prefix) :]
        self._check_stop(searched_from)

    def _check_stop(self, searched_from: int) -> None:
        hits = [(self.text.find(s, searched_from), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, stop = min(hits)
            self.text = self.text[:index]
            self.stop_reason = stop

    def take(self, final: bool) -> str:
        """Text not yet handed out; keeps the hold-back unless the completion is over."""
        end = len(self.text) if final or self.stop_reason else max(self.emitted, len(self.text) - self.holdback)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
