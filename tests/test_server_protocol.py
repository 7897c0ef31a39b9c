"""Server pieces without a server: error parameter names, token texts for logprobs, SSE deltas."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders
from tokenizers.models import BPE

from specdecode.runtime.engine.sequence import TokenLogprob
from specdecode.runtime.server.errors import param_from_loc
from specdecode.runtime.server.logprobs import CompletionLogprobBuilder, TokenTexts
from specdecode.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, DeltaMessage
from specdecode.runtime.tokenizer import Tokenizer


@pytest.mark.parametrize("loc,param", [
    (("temperature",), "temperature"),
    (("messages", 0, "content", 1, "type"), "messages[0].content[1].type"),
    (("prompt", "list[int]", 3), "prompt[3]"),
    (("prompt", "str"), "prompt"),
    (("stop", "function-after[_no_empty_stop(), list[str]]"), "stop"),
    (("body", "n"), "n"),
    ((), None),
])
def test_param_from_loc_drops_union_tags(loc, param):
    assert param_from_loc(loc) == param


def test_requests_map_to_sampling_params():
    chat = ChatCompletionRequest.parse({
        "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
        "max_completion_tokens": 7, "max_tokens": 3, "logprobs": True, "top_logprobs": 4, "stop": "x",
        "temperature": None, "seed": 3, "n": 2,
    })
    assert chat.template_messages() == [{"role": "system", "content": "a\nb"}]
    params = chat.sampling_params(chat.requested_max_tokens)
    assert (params.max_tokens, params.logprobs, params.stop, params.temperature, params.seed, params.n) == (
        7, 4, ("x",), 1.0, 3, 2)
    assert ChatCompletionRequest.parse({"messages": [{"role": "user", "content": "q"}]}).num_logprobs is None
    completion = CompletionRequest.parse({"prompt": [[1, 2, 3]], "logprobs": 0, "stop_token_ids": [5]})
    params = completion.sampling_params(4)
    assert completion.prompt == [1, 2, 3] and params.logprobs == 0 and params.stop_token_ids == (5,)


def test_delta_message_serializes_only_what_is_set():
    assert DeltaMessage(role="assistant", content="").model_dump() == {"role": "assistant", "content": ""}
    assert DeltaMessage(content="hi").model_dump() == {"content": "hi"}


def test_byte_level_token_texts(tiny_hf_model_dir):
    tok = Tokenizer.from_hf_folder(tiny_hf_model_dir)
    texts = TokenTexts(tok)
    assert texts.byte_level
    ids = tok.encode("é hello")
    assert b"".join(texts.token_bytes(i) for i in ids).decode() == "é hello"
    half = tok.token_to_id("Ã")  # byte 0xC3 alone (the byte-level alphabet spells it "Ã")
    assert texts.token_bytes(half) == b"\xc3" and texts.token_str(half) == "bytes:\\xc3"
    eos = tok.token_to_id("<|im_end|>")
    assert texts.token_str(eos) == "<|im_end|>"

    builder = CompletionLogprobBuilder(texts)
    split = [tok.token_to_id("Ã"), tok.token_to_id("©"), tok.token_to_id("h")]  # "é" as two bytes, then "h"
    first = builder.build([TokenLogprob(split[0], -1.0, [(split[1], -2.0)])])
    rest = builder.build([TokenLogprob(i, -1.0, []) for i in split[1:]])
    assert first.text_offset + rest.text_offset == [0, 0, 1]  # offsets count characters, across chunks
    assert first.top_logprobs == [{"bytes:\\xa9": -2.0}]


def test_sentencepiece_token_texts():
    vocab = {"<unk>": 0, "\u2581hello": 1, "<0xE2>": 2, "\u00e9t\u00e9": 3}
    backend = Backend(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    texts = TokenTexts(Tokenizer(backend=backend, eos_token_ids=frozenset()))
    assert not texts.byte_level
    assert texts.token_bytes(1) == b" hello"
    assert texts.token_bytes(2) == b"\xe2" and texts.token_str(2) == "bytes:\\xe2"
    assert texts.token_str(3) == "\u00e9t\u00e9"  # not mistaken for byte-level spelling
    chat = texts.chat([TokenLogprob(1, -0.5, [(1, -0.5), (3, -1.5)])])
    assert chat[0].token == " hello" and chat[0].bytes == list(b" hello")
    assert [t.token for t in chat[0].top_logprobs] == [" hello", "\u00e9t\u00e9"]
