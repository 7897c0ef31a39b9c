"""Token log-probabilities in the two OpenAI shapes.

- completions (``logprobs: N``): ``tokens / token_logprobs / top_logprobs / text_offset``; with
  ``echo`` the prompt's tokens come first;
- chat (``logprobs: true, top_logprobs: N``): ``content: [{token, logprob, bytes, top_logprobs}]``.

A token's text is its own bytes, not a decode of it in isolation (which drops SentencePiece's
leading space and turns half a UTF-8 character into U+FFFD): byte-level BPE pieces are mapped back
through GPT-2's byte alphabet, SentencePiece pieces through ``▁`` and ``<0xNN>``. A token that is
not valid UTF-8 on its own is named ``bytes:\\xNN…``, as OpenAI does.
"""
from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass

from specdecode.runtime.engine.sequence import TokenLogprob
from specdecode.runtime.server.protocol import ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs
from specdecode.runtime.tokenizer import Tokenizer, bytes_to_unicode

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _uses_byte_level(tokenizer: Tokenizer) -> bool:
    decoder = json.loads(tokenizer.backend.to_str()).get("decoder")
    return '"ByteLevel"' in json.dumps(decoder)


class TokenTexts:
    """Token id → bytes and display string, cached per id."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = _uses_byte_level(tokenizer)
        self._unicode_to_byte = {c: b for b, c in bytes_to_unicode().items()}
        self._bytes: dict[int, bytes] = {}

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._piece_bytes(token_id)
        return cached

    def _piece_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.tokenizer.all_special_ids:
            return piece.encode("utf-8")
        if self.byte_level and all(c in self._unicode_to_byte for c in piece):
            return bytes(self._unicode_to_byte[c] for c in piece)
        match = _BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def token_str(self, token_id: int) -> str:
        data = self.token_bytes(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    # -- chat ---------------------------------------------------------------------------------
    def chat(self, logprobs: list[TokenLogprob]) -> list[ChatTokenLogprob]:
        return [
            ChatTokenLogprob(
                **self._chat_top(lp.token_id, lp.logprob).model_dump(),
                top_logprobs=[self._chat_top(i, v) for i, v in lp.top],
            )
            for lp in logprobs
        ]

    def _chat_top(self, token_id: int, logprob: float) -> ChatTopLogprob:
        return ChatTopLogprob(token=self.token_str(token_id), logprob=logprob, bytes=list(self.token_bytes(token_id)))


class CompletionLogprobBuilder:
    """Completions-shape logprobs of one choice; ``text_offset`` counts characters across chunks."""

    def __init__(self, texts: TokenTexts):
        self.texts = texts
        self._chars = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="ignore")

    def build(self, logprobs: list[TokenLogprob], echo: Echo | None = None) -> CompletionLogprobs:
        """The entries of ``logprobs``, after those of the echoed prompt when ``echo`` is given: its
        first token's logprob and top list are null (nothing predicts it, as OpenAI returns it)."""
        out = CompletionLogprobs()
        if echo is not None:
            self._add(out, echo.token_ids[0], None, None)
            for lp in echo.logprobs:
                self._add(out, lp.token_id, lp.logprob, lp.top)
        for lp in logprobs:
            self._add(out, lp.token_id, lp.logprob, lp.top)
        return out

    def _add(self, out: CompletionLogprobs, token_id: int, logprob: float | None,
             top: list[tuple[int, float]] | None) -> None:
        out.tokens.append(self.texts.token_str(token_id))
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(None if top is None else {self.texts.token_str(i): v for i, v in top})
        out.text_offset.append(self._chars)
        self._chars += len(self._utf8.decode(self.texts.token_bytes(token_id)))


@dataclass
class Echo:
    """An echoed prompt's tokens and the logprobs of every one after the first."""

    token_ids: list[int]
    logprobs: list[TokenLogprob]
