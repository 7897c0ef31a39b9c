"""OpenAI-compatible request and response bodies (``/v1/completions``, ``/v1/chat/completions``).

Requests are strict: an unknown field is refused (``extra="forbid"``), and an OpenAI field we do
not implement is refused by name unless it carries its neutral value (``"suffix": ""``,
``"tools": []``…), so nothing a client asks for is ever silently ignored. A ``null`` for a
field we know means "the default". Ranges follow the OpenAI API (and ``SamplingParams``).
"""
from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Literal

from jsonschema import Draft202012Validator, SchemaError
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from specdecode.runtime.engine.grammar import StructuredKind, StructuredOutput
from specdecode.runtime.engine.sequence import SamplingParams
from specdecode.runtime.server.tools import NAME_PATTERN, ToolCallParser, template_arguments, tool_choice_lark

MAX_LOGPROBS = 20
MAX_N = 16
MAX_TOP_K = 2**31 - 1  # past any vocabulary (all of it); larger values would overflow the sampler's tensors
MAX_LOGIT_BIAS = 100.0  # |bias| added to a token's logit (OpenAI's range)


class UnsupportedField(ValueError):
    """A known OpenAI field we do not implement was given a non-neutral value."""

    def __init__(self, field: str):
        super().__init__(f"'{field}' is not supported by this server")
        self.field = field


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # field → the values that mean "not used" (accepted and ignored); anything else is refused
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @classmethod
    def parse(cls, raw: Any):
        """Validate a decoded JSON body; raises ``UnsupportedField`` or pydantic's ValidationError."""
        if isinstance(raw, dict):
            for name, neutral in cls.UNSUPPORTED.items():
                if name in raw and raw[name] not in neutral:
                    raise UnsupportedField(name)
            raw = {k: v for k, v in raw.items() if k not in cls.UNSUPPORTED}
        return cls.model_validate(raw)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if not (v is None and k in cls.model_fields)}
        return data


class StreamOptions(_Request):
    include_usage: bool = False


class SpeculativeOptions(_Request):
    """Per-request speculation control (0 turns it off for this request)."""

    num_speculative_tokens: int = Field(ge=0, le=16)


class JsonSchemaFormat(_Request):
    """OpenAI's ``response_format.json_schema``. ``strict`` is accepted either way: the schema is
    always enforced (the output is decoded under its grammar)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "ResponseFormat":
        if (self.json_schema is not None) != (self.type == "json_schema"):
            raise ValueError("json_schema is required with type 'json_schema', and allowed only there")
        return self

    def constraint(self) -> StructuredOutput | None:
        if self.type == "json_object" or (self.json_schema is not None and self.json_schema.json_schema is None):
            return StructuredOutput(StructuredKind.JSON_OBJECT)
        if self.type == "json_schema":
            return StructuredOutput(StructuredKind.JSON, json.dumps(self.json_schema.json_schema))
        return None


class StructuredOutputsOptions(_Request):
    """vLLM's ``structured_outputs``: exactly one of its forms."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")  # a schema, or its JSON text
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None  # GBNF (llama.cpp) or lark (llguidance)
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputsOptions":
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object") if self._value(name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object (got {given or 'none'})")
        return self

    def _value(self, name: str) -> Any:
        return self.json_schema if name == "json" else getattr(self, name)

    def constraint(self) -> StructuredOutput:
        if self.json_object:
            return StructuredOutput(StructuredKind.JSON_OBJECT)
        if self.json_schema is not None:
            return json_constraint(self.json_schema)
        if self.choice is not None:
            return StructuredOutput(StructuredKind.CHOICE, json.dumps(self.choice))
        if self.regex is not None:
            return StructuredOutput(StructuredKind.REGEX, self.regex)
        return StructuredOutput(StructuredKind.GRAMMAR, self.grammar)


def json_constraint(schema: dict[str, Any] | str) -> StructuredOutput:
    return StructuredOutput(StructuredKind.JSON, schema if isinstance(schema, str) else json.dumps(schema))


class ConflictingConstraints(ValueError):
    """A request constrains its output in more than one way."""

    def __init__(self, fields: list[str]):
        super().__init__(f"{' and '.join(fields)} both constrain the output; send only one")
        self.fields = fields


class _GenerationRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # None = the served model
    max_tokens: int | None = Field(None, ge=1)  # None = what is left of the context
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)  # 0 or -1 = off
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1 - MAX_N)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: list[str] = []
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = []
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOptions | None = None
    user: str | None = None
    logit_bias: dict[int, float] = {}  # token id → bias added to its logit before sampling
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsOptions | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _token_ids_to_biases(cls, v: Any) -> Any:
        """OpenAI's shape: a JSON object from token ids (as strings) to biases in [-100, 100]."""
        if not isinstance(v, dict):
            raise ValueError("must be an object from token ids to biases")
        out = {}
        for key, bias in v.items():
            if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"keys must be token ids, got {key!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not abs(bias) <= MAX_LOGIT_BIAS:
                raise ValueError(f"biases must be numbers in [-100, 100], got {bias!r} for token {key}")
            out[int(key)] = float(bias)
        return out

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, v: StreamOptions, info: ValidationInfo) -> StreamOptions:
        if not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed when stream is true")
        return v

    def structured_forms(self) -> dict[str, StructuredOutput]:
        """Each field that constrains the output → its constraint."""
        forms = {
            "response_format": self.response_format.constraint() if self.response_format else None,
            "structured_outputs": self.structured_outputs.constraint() if self.structured_outputs else None,
            "guided_json": json_constraint(self.guided_json) if self.guided_json is not None else None,
            "guided_regex": (StructuredOutput(StructuredKind.REGEX, self.guided_regex)
                             if self.guided_regex is not None else None),
            "guided_choice": (StructuredOutput(StructuredKind.CHOICE, json.dumps(self.guided_choice))
                              if self.guided_choice is not None else None),
            "guided_grammar": (StructuredOutput(StructuredKind.GRAMMAR, self.guided_grammar)
                               if self.guided_grammar is not None else None),
        }
        return {name: c for name, c in forms.items() if c is not None}

    def structured_output(self) -> tuple[StructuredOutput, str] | None:
        """The request's constraint and the field it came from; ``ConflictingConstraints`` for two."""
        forms = self.structured_forms()
        if len(forms) > 1:
            raise ConflictingConstraints(list(forms))
        return next(((c, name) for name, c in forms.items()), None)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        return None

    def sampling_params(self, max_tokens: int, structured: StructuredOutput | None = None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs,
            prompt_logprobs=self.num_prompt_logprobs,
            logit_bias=tuple(self.logit_bias.items()),
            n=self.n,
            num_speculative_tokens=self.speculative.num_speculative_tokens if self.speculative else None,
            structured=structured,
        )


# ---------------------------------------------------------------------------------- completions


class CompletionRequest(_GenerationRequest):
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "best_of": (None, 1),
        "suffix": (None, ""),
    }

    prompt: str | list[Annotated[int, Field(ge=0)]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, the prompt only (checked when served)
    echo: bool = False  # the prompt before the completion (with its logprobs when ``logprobs`` is set)

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, v: Any) -> Any:
        """Accept a batch of one (``["text"]`` or ``[[ids]]``); refuse larger batches by name."""
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batches of several prompts are not supported; send one request per prompt")
            return v[0]
        return v

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []  # None for an echoed prompt's first token (nothing predicts it)
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class SpeculativeUsage(BaseModel):
    """This request's speculation: drafts scored, draft tokens accepted, and how many were
    accepted at each draft position (position 0 first)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float | None  # accepted / draft tokens; None without drafts
    accepted_per_position: list[int]


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    speculative: SpeculativeUsage | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it (vLLM)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ---------------------------------------------------------------------------------------- chat


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[ToolCall] = []  # assistant: the calls it made
    tool_call_id: str | None = Field(None, validate_default=True)  # tool: the call this message answers
    content: list[TextPart] | None = Field(None, validate_default=True)  # None: an assistant's calls only

    @field_validator("content", mode="before")
    @classmethod
    def _string_is_one_part(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("content is required (only an assistant message with tool_calls may omit it)")
        if isinstance(v, str):
            return [{"type": "text", "text": v}]
        if v is not None and not isinstance(v, list):
            raise ValueError("content must be a string or a list of text parts")
        return v

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(cls, v: list[ToolCall], info: ValidationInfo) -> list[ToolCall]:
        if v and info.data.get("role") != "assistant":
            raise ValueError("tool_calls is only allowed in assistant messages")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _tool_messages_answer_a_call(cls, v: str | None, info: ValidationInfo) -> str | None:
        if (v is None) == (info.data.get("role") == "tool"):
            raise ValueError("tool_call_id is required in tool messages, and allowed only there")
        return v

    @property
    def text(self) -> str:
        return "\n".join(part.text for part in self.content or [])

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template expects it (Hugging Face's convention: ``developer`` is
        OpenAI's new ``system``; a call's arguments are a mapping)."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.name is not None:
            msg["name"] = self.name
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": template_arguments(c.function.arguments)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        return msg


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema for the arguments (an object)
    strict: bool | None = None  # forced calls always follow the schema; auto never is constrained

    @field_validator("name")
    @classmethod
    def _openai_name(cls, v: str) -> str:
        if not NAME_PATTERN.fullmatch(v):
            raise ValueError("function names are 1 to 64 letters, digits, underscores or dashes")
        return v

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any]) -> dict[str, Any]:
        try:
            Draft202012Validator.check_schema(v)
        except SchemaError as exc:
            raise ValueError(f"not a valid JSON schema: {exc.message}") from None
        if v.get("type", "object") != "object":
            raise ValueError("the parameters' schema must describe an object")
        return v


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationRequest):
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {
        "functions": (None, []),
        "function_call": (None, "none"),
        "modalities": (None, ["text"]),
        "audio": (None,),
        "prediction": (None,),
        "reasoning_effort": (None,),
        "web_search_options": (None,),
        "best_of": (None, 1),
        "echo": (None, False),
    }

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM extension, also used by /tokenize
    tools: list[ToolDefinition] = []
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True  # false: at most one call

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v: list[ToolDefinition]) -> list[ToolDefinition]:
        names = [t.function.name for t in v]
        if len(set(names)) != len(names):
            raise ValueError("function names must be unique")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools")
        if v != "none" and not tools:
            raise ValueError("tool_choice needs tools (only 'none' is allowed without them)")
        if isinstance(v, NamedToolChoice) and v.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"the function {v.function.name!r} is not among the tools")
        return v

    @property
    def tool_mode(self) -> str:
        """``none``, ``auto``, ``required`` or ``named`` (see ``tool_choice``)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or ("auto" if self.tools else "none")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows: none under ``tool_choice: "none"``."""
        return [t.for_template() for t in self.tools] if self.tool_mode != "none" else None

    def structured_forms(self) -> dict[str, StructuredOutput]:
        """A forced tool choice constrains the output too: to calls of the tools it allows."""
        forms = super().structured_forms()
        if self.tool_mode in ("required", "named"):
            allowed = [t.function for t in self.tools
                       if self.tool_mode == "required" or t.function.name == self.tool_choice.function.name]
            tools = [{"name": f.name, "parameters": f.parameters} for f in allowed]
            one_call = self.tool_mode == "named" or not self.parallel_tool_calls
            forms["tool_choice"] = StructuredOutput(StructuredKind.LARK, tool_choice_lark(tools, one_call))
        return forms

    def tool_call_parser(self) -> ToolCallParser | None:
        """A parser for one choice's text; None when no calls are read (no tools, or ``none``)."""
        if self.tool_mode == "none":
            return None
        return ToolCallParser(frozenset(t.function.name for t in self.tools),
                              guaranteed=self.tool_mode in ("required", "named"),
                              max_calls=None if self.parallel_tool_calls else 1)

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v: int, info: ValidationInfo) -> int:
        if not info.data.get("logprobs", False):
            raise ValueError("top_logprobs requires logprobs to be true")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = []


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None  # in a call's first delta
    arguments: str  # a fragment of the JSON text


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None  # in a call's first delta, with type and the function's name
    type: Literal["function"] | None = None
    function: DeltaFunctionCall

    @model_serializer
    def _only_set(self) -> dict[str, Any]:
        out = {"index": self.index, "id": self.id, "type": self.type}
        function = {"name": self.function.name, "arguments": self.function.arguments}
        return {k: v for k, v in out.items() if v is not None} | {
            "function": {k: v for k, v in function.items() if v is not None}}


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer
    def _only_set(self) -> dict[str, Any]:
        fields = (("role", self.role), ("content", self.content), ("tool_calls", self.tool_calls))
        return {k: v for k, v in fields if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionStreamChoice(CompletionChoice):
    pass


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------- models, tokenize (vLLM)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "specdecode"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDefinition] = []
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(BaseModel):
    prompt: str
