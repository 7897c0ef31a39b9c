"""Text ↔ token ids and chat-template rendering, over a ``tokenizers.Tokenizer``.

Two sources: a Hugging Face folder (``tokenizer.json`` + ``tokenizer_config.json``), or the
``tokenizer.ggml.*`` metadata of a GGUF file, from which the byte-level BPE is rebuilt exactly
as transformers rebuilds it (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), so both give
the same ids.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

logger = logging.getLogger(__name__)

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre → split regex applied before the byte-level mapping. Names not listed
# (``smollm``, ``gpt2``, ``default`` …) use GPT-2's own regex, as llama.cpp and transformers do.
_PRE_TOKENIZER_SPLITS = {
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
}
_GPT2_REGEX_PRE = {"smollm", "gpt2", "default", "gpt-2", "starcoder", "refact"}


@dataclass(frozen=True)
class TokenizerMetadata:
    """The tokenizer a GGUF file describes (llama.cpp's ``tokenizer.ggml.*`` keys)."""

    model: str  # tokenizer.ggml.model; "gpt2" = byte-level BPE
    pre: str | None  # tokenizer.ggml.pre: names the pre-tokenizer split regex
    tokens: list[str]
    token_types: list[int]
    merges: list[str]  # "left right" pairs, best first
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eot_token_id: int | None = None
    eom_token_id: int | None = None
    padding_token_id: int | None = None
    unknown_token_id: int | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    chat_template: str | None = None


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[byte] = chr(byte)
        else:
            chars[byte] = chr(256 + extra)
            extra += 1
    return chars


def build_byte_level_bpe(meta: TokenizerMetadata) -> Backend:
    """Rebuild the byte-level BPE a GGUF describes, the way transformers' GGUF converter does."""
    if meta.model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {meta.model!r}: only byte-level BPE ('gpt2') is supported")
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())

    def spell(token: str) -> str:  # tokens outside the byte alphabet are re-spelled byte by byte
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spell(token): index for index, token in enumerate(meta.tokens)}
    merges = [tuple(merge.split(" ")) for merge in meta.merges]
    backend = Backend(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                          end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = _pre_tokenizer(meta.pre)
    backend.decoder = decoders.ByteLevel()
    types = meta.token_types or [0] * len(meta.tokens)
    # CONTROL tokens (<|im_start|> …) and the bos/eos/pad/unk ones are special: matched whole, skipped
    # by decode(skip_special_tokens). One spelled outside the byte alphabet is a llama.cpp mislabel,
    # left out as transformers does.
    named = {meta.bos_token_id, meta.eos_token_id, meta.eot_token_id, meta.eom_token_id,
             meta.padding_token_id, meta.unknown_token_id}
    backend.add_special_tokens([
        AddedToken(token, normalized=False, special=True)
        for index, (token, kind) in enumerate(zip(meta.tokens, types, strict=True))
        if (kind == TOKEN_TYPE_CONTROL or index in named) and set(token) <= alphabet
    ])
    # USER_DEFINED tokens (<tool_call> …) are matched whole too, but are ordinary text on decode.
    backend.add_tokens([
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(meta.tokens, types, strict=True)
        if kind == TOKEN_TYPE_USER_DEFINED and token in vocab
    ])
    template = _bos_eos_template(meta)
    if template is not None:
        backend.post_processor = template
    return backend


def _bos_eos_template(meta: TokenizerMetadata) -> processors.TemplateProcessing | None:
    """BOS/EOS around every text encoded with ``add_special_tokens``, where the file asks for them."""
    pieces, specials = ["$A"], []
    if meta.add_bos_token and meta.bos_token_id is not None:
        pieces.insert(0, meta.tokens[meta.bos_token_id])
        specials.append((meta.tokens[meta.bos_token_id], meta.bos_token_id))
    if meta.add_eos_token and meta.eos_token_id is not None:
        pieces.append(meta.tokens[meta.eos_token_id])
        specials.append((meta.tokens[meta.eos_token_id], meta.eos_token_id))
    return processors.TemplateProcessing(single=" ".join(pieces), special_tokens=specials) if specials else None


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    split = _PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        if pre not in _GPT2_REGEX_PRE:
            logger.warning("unknown GGUF pre-tokenizer %r: using GPT-2's split regex", pre)
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (assistant-mask markers): render the body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=1)
def _template_env() -> ImmutableSandboxedEnvironment:
    """Like transformers': sandboxed, trim_blocks + lstrip_blocks, its globals and filters."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@lru_cache(maxsize=8)
def compile_chat_template(source: str) -> jinja2.Template:
    return _template_env().from_string(source)


@lru_cache(maxsize=8)
def template_reads_tools(source: str) -> bool:
    """Whether a chat template reads the ``tools`` variable (renders tool definitions itself)."""
    return "tools" in jinja2.meta.find_undeclared_variables(_template_env().parse(source))


@dataclass(frozen=True)
class Tokenizer:
    backend: Backend
    eos_token_ids: frozenset[int]
    bos_token_id: int | None = None
    chat_template: str | None = None
    # Variables every chat template may read (bos_token, eos_token, pad_token, unk_token).
    template_tokens: dict[str, str] = field(default_factory=dict)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: TokenizerMetadata) -> "Tokenizer":
        backend = build_byte_level_bpe(meta)
        eos_ids = frozenset(i for i in (meta.eos_token_id, meta.eot_token_id, meta.eom_token_id) if i is not None)
        names = {"bos_token": meta.bos_token_id, "eos_token": meta.eos_token_id,
                 "pad_token": meta.padding_token_id, "unk_token": meta.unknown_token_id}
        return cls(
            backend=backend,
            eos_token_ids=eos_ids,
            bos_token_id=meta.bos_token_id,
            chat_template=meta.chat_template,
            template_tokens={name: meta.tokens[i] for name, i in names.items() if i is not None},
        )

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> "Tokenizer":
        """``tokenizer.json``; ``tokenizer_config.json`` (template, bos/eos); ``generation_config.json`` eos ids."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path} has no tokenizer.json (only fast tokenizers are supported)")
        backend = Backend.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        template_tokens = {
            name: _token_content(config[name])
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
            if config.get(name) is not None
        }
        eos_ids = set()
        if "eos_token" in template_tokens and backend.token_to_id(template_tokens["eos_token"]) is not None:
            eos_ids.add(backend.token_to_id(template_tokens["eos_token"]))
        generation_eos = _read_json(path / "generation_config.json").get("eos_token_id")
        eos_ids.update([generation_eos] if isinstance(generation_eos, int) else generation_eos or [])
        bos = template_tokens.get("bos_token")
        return cls(
            backend=backend,
            eos_token_ids=frozenset(eos_ids),
            bos_token_id=backend.token_to_id(bos) if bos else None,
            chat_template=_hf_chat_template(path, config),
            template_tokens=template_tokens,
        )

    def with_chat_template(self, template: str) -> "Tokenizer":
        return dataclasses.replace(self, chat_template=template)

    def with_chat_template_file(self, path: str | Path) -> "Tokenizer":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"chat template file not found: {path}")
        return self.with_chat_template(path.read_text(encoding="utf-8"))

    def save(self, folder: str | Path) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json`` (eos ids)
        that ``from_hf_folder`` reads back."""
        folder = Path(folder)
        self.backend.save(str(folder / "tokenizer.json"))
        config = {**self.template_tokens, "chat_template": self.chat_template}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(self.eos_token_ids)}))

    # -- text ↔ ids -----------------------------------------------------------------------------
    # The batch calls release the GIL (``encode``/``decode`` hold it throughout): a long text
    # tokenized in a worker thread then never stalls the server's event loop or the engine thread.
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)[0]

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        return frozenset(i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special)

    # -- chat -----------------------------------------------------------------------------------
    @property
    def chat_template_renders_tools(self) -> bool:
        return bool(self.chat_template) and template_reads_tools(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render ``messages`` with the model's Jinja chat template (as transformers renders it)."""
        if not self.chat_template:
            raise ValueError(
                "this model has no chat template: pass one with --chat-template FILE, or use /v1/completions"
            )
        variables = {**self.template_tokens, "tools": None, "documents": None, **template_kwargs}
        return compile_chat_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(token: str | dict[str, Any]) -> str:
    return token["content"] if isinstance(token, dict) else token


def _hf_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """``chat_template.jinja`` beside the tokenizer, else ``tokenizer_config.json``'s (a string or named list)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry["name"]: entry["template"] for entry in template}
        template = named.get("default", next(iter(named.values()), None))
    return template

