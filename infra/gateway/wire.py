"""Request wire formats of the gateway: pydantic models of each JSON body, and OpenAI's errors.

Each body is parsed and validated in one pass (``parse_body``: pydantic's JSON parser, strict
types where OpenAI and SGLang are strict: ``"stream": "no"`` is not a boolean, ``1.0`` is not
an integer, ``top_p`` must be in (0, 1] as SGLang requires). A bad body raises `ApiError`,
rendered as OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}`` with
``param`` naming the field (``messages[0].role``, ``sampling_params.top_p``). Unknown fields
are ignored, as OpenAI-compatible servers do. Validation happens before any engine work, so a
rejected call stores nothing and takes no ``seq_no``.

Response bodies are in `infra.gateway.replies`. JSON is orjson throughout (``dumps``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    ValidationError,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
MAX_STOPS = 16


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)


loads = orjson.loads


class ApiError(Exception):
    """An error answered to the harness in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# -- parsing --------------------------------------------------------------------------------


class Body(BaseModel):
    """A request body: strict types, finite numbers, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, frozen=True)


B = TypeVar("B", bound=BaseModel)


# pydantic names the member of a union that failed ("str", "list[int]"): not a field
_UNION_TAG = re.compile(r"^(str|int|float|bool|list|dict|tuple|none)(\[.*\])?$|^function-")


def field_path(loc: tuple) -> str:
    """pydantic's error location as a field path: ``messages[0].role``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _UNION_TAG.match(part):
            out += f".{part}" if out else part
    return out


def validation_error(exc: ValidationError, prefix: str = "") -> ApiError:
    """One 400 naming every bad field (``param``: the first); a union's failed members are
    one entry ("a valid string or a valid array")."""
    by_path: dict[str, list[str]] = {}
    got: dict[str, str] = {}
    for e in exc.errors(include_url=False):
        path = field_path((prefix, *e["loc"]) if prefix else e["loc"])
        by_path.setdefault(path, []).append(e["msg"])
        v = e.get("input")
        if path not in got and not (v is None or isinstance(v, dict | list)):
            got[path] = f" (got {v!r:.40})"
    parts = []
    for path, msgs in by_path.items():
        msg = " or ".join(dict.fromkeys(msgs)) + got.get(path, "")
        parts.append(f"'{path}': {msg}" if path else msg)
    return bad("; ".join(parts), next(iter(by_path)) or None)


def parse_body(model: type[B], raw: bytes) -> B:
    """Parse and validate a JSON body in one pass; `ApiError` (400) when it is not one."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        e = exc.errors(include_url=False)[0]
        if e["type"] == "json_invalid":
            raise bad(f"malformed JSON body: {e['msg']}", code="invalid_json") from None
        if e["loc"] == () and e["type"] in ("model_type", "dict_type"):
            raise bad("the JSON body must be an object", code="invalid_json") from None
        raise validation_error(exc) from None


def validate(model: type[B], data: Any) -> B:
    """Validate already-parsed JSON (strict, as `parse_body`)."""
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None


class JsonObject(RootModel[dict[str, Any]]):
    """Any JSON object (a body whose shape depends on its keys)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


# -- chat messages ---------------------------------------------------------------------------


class _Open(BaseModel):
    """A nested object: strict where it matters, any other field kept as sent."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def _invalid(model: str, loc: tuple, kind: str, message: str, value: Any) -> ValidationError:
    """A validation error at ``loc`` inside the object being validated (pydantic prefixes
    the outer location: ``messages[3].tool_call_id``)."""
    err = PydanticCustomError(kind, message)
    return ValidationError.from_exception_data(
        model, [InitErrorDetails(type=err, loc=loc, input=value)]
    )


class ToolCallFunction(_Open):
    name: str
    arguments: Any = None

    @model_validator(mode="after")
    def _json_arguments(self) -> ToolCallFunction:
        """Arguments are a JSON text (OpenAI's shape), an object, empty or left out: text that
        is not JSON would be trained on as a call the model never could have made."""
        a = self.arguments
        if a is None or a == "" or isinstance(a, dict):
            return self
        if isinstance(a, str):
            try:
                orjson.loads(a)
                return self
            except orjson.JSONDecodeError:
                pass
        raise _invalid(
            "ToolCallFunction", ("arguments",), "json_arguments", "must be a JSON text", a
        )


class ToolCallIn(_Open):
    function: ToolCallFunction
    id: str | None = None
    type: Literal["function"] | None = None


_NEEDS_CONTENT = ("system", "developer", "user", "tool")


class ChatMessage(_Open):
    """One OpenAI chat message as a harness sends it (other fields, e.g. ``name``,
    ``tool_call_id``, ``reasoning_content``, are kept for the chat template). As OpenAI
    requires: content on every message but the assistant's (whose may be null), and a
    ``tool_call_id`` on a tool message."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = None

    @model_validator(mode="after")
    def _role_fields(self) -> ChatMessage:
        if self.content is None and self.role in _NEEDS_CONTENT:
            raise _invalid(
                "ChatMessage",
                ("content",),
                "content_missing",
                f"a {self.role} message needs content (a string or a list of parts)",
                None,
            )
        if self.role == "tool":
            cid = (self.__pydantic_extra__ or {}).get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise _invalid(
                    "ChatMessage",
                    ("tool_call_id",),
                    "tool_call_id_missing",
                    "a tool message needs the id of the tool call it answers (a string)",
                    cid,
                )
        return self


# -- tools ------------------------------------------------------------------------------------

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDef(_Open):
    """A function tool's definition: a name, and its parameters as a JSON Schema object."""

    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _object_schema(self) -> FunctionDef:
        p = self.parameters
        if p is None:
            return self
        problems = []
        if p.get("type", "object") != "object":
            problems.append(("type", "must be 'object' (the arguments are one JSON object)"))
        if not isinstance(p.get("properties", {}), dict):
            problems.append(("properties", "must be an object of JSON Schemas"))
        req = p.get("required", [])
        if not (isinstance(req, list) and all(isinstance(r, str) for r in req)):
            problems.append(("required", "must be a list of property names"))
        if problems:
            key, msg = problems[0]
            raise _invalid("FunctionDef", ("parameters", key), "json_schema", msg, p.get(key))
        return self


class FunctionTool(_Open):
    """One entry of ``tools``: ``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionDef


def _check_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool as sent (the template renders it as is), once it is a valid function tool."""
    FunctionTool.model_validate(tool, strict=True)
    return tool


ToolIn = Annotated[dict[str, Any], AfterValidator(_check_tool)]


# -- sampling -------------------------------------------------------------------------------


@dataclass
class GenParams:
    """What the gateway asks of an engine, whatever the endpoint."""

    max_new_tokens: int | None  # None: fill the context up to the gateway default
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False

    def sampling_params(self, max_new_tokens: int) -> dict:
        sp: dict[str, Any] = {
            "max_new_tokens": int(max_new_tokens),
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        if self.top_k not in (-1, 0):
            sp["top_k"] = self.top_k
        if self.seed is not None:
            sp["sampling_seed"] = self.seed
        if self.stop:
            sp["stop"] = list(self.stop)  # SGLang stops early; the gateway also trims
        if self.stop_token_ids:
            sp["stop_token_ids"] = list(self.stop_token_ids)
        return sp


def _stops(v: str | list[str] | None) -> list[str]:
    if v is None:
        return []
    return [s for s in ([v] if isinstance(v, str) else v) if s]


Stop = str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None


class StreamOptions(Body):
    include_usage: bool = False


# Sampling settings no engine behind the gateway honours (the embedded one refuses them as
# well, infra/engine/sampling.py): taken at their neutral value, which clients send by
# default, and refused (400 naming the parameter) otherwise, never recorded as if honoured.
NEUTRAL = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "logit_bias": {},
}
_CONSTRAINTS = ("json_schema", "regex", "ebnf")  # SGLang's constrained decoding


def refuse_unhonoured(obj: BaseModel, prefix: str = "") -> None:
    """400 for the first of ``NEUTRAL``'s fields (and constraints) that ``obj`` sets to
    anything but its neutral value (None, the field left out, is neutral too)."""
    for name, neutral in NEUTRAL.items():
        v = getattr(obj, name, None)
        if v is not None and v != neutral:
            raise bad(
                f"{prefix}{name}={dumps(v).decode()[:60]} is not supported: gyre samples the "
                f"policy's tokens with temperature, top_p and top_k only (and records them as "
                f"sampled); leave {name} out or send {dumps(neutral).decode()}",
                prefix + name,
            )
    for name in _CONSTRAINTS:
        if getattr(obj, name, None) is not None:
            raise bad(
                f"{prefix}{name} is not supported: gyre does not constrain the policy's output",
                prefix + name,
            )


def refuse_one_tool_call(parallel_tool_calls: bool | None) -> None:
    if parallel_tool_calls is False:
        raise bad(
            "parallel_tool_calls=false is not supported: gyre cannot hold the policy to one "
            "tool call per reply (its tokens are sampled, never constrained); leave it out "
            "and use the first tool call",
            "parallel_tool_calls",
        )


Penalty = Annotated[float, Field(ge=-2, le=2)]


class OpenAISampling(Body):
    """Fields that chat and text completions share."""

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # an SGLang/vLLM extension
    seed: Int64 | None = None
    stop: Stop = None
    n: int | None = Field(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    repetition_penalty: float | None = Field(None, gt=0)  # SGLang/vLLM extensions
    min_p: float | None = Field(None, ge=0, le=1)

    def _gen_params(self, max_tokens: int | None, logprobs: bool) -> GenParams:
        if self.n not in (None, 1):
            raise bad("only n=1 is supported", "n")
        refuse_unhonoured(self)
        return GenParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=_stops(self.stop),
            logprobs=logprobs,
            stream=self.stream,
            include_usage=bool(self.stream_options and self.stream_options.include_usage),
        )


def refuse_unsupported(
    tool_choice: Any, formats: list[tuple[str, Any]], reasoning: list[tuple[str, Any]]
) -> None:
    """Refuse (400) what gyre would otherwise ignore and so answer wrongly: a forced tool
    call (``tool_choice`` "required" or a named function), a constrained output format
    (JSON mode, a JSON schema), a reasoning setting. The policy's tokens are sampled as
    they come, never constrained; a harness asks for these in the prompt and checks the
    answer itself. ``formats``/``reasoning``: (parameter, value) pairs as sent."""
    if tool_choice not in (None, "auto", "none"):
        raise bad(
            f"tool_choice={dumps(tool_choice).decode()} is not supported: gyre cannot force a "
            "tool call (the policy's tokens are sampled, never constrained); use 'auto' and "
            "ask for the tool in the prompt",
            "tool_choice",
        )
    for param, fmt in formats:
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        if kind not in (None, "text"):
            raise bad(
                f"{param} type {kind!r} is not supported: gyre does not constrain the "
                "policy's output to a format; ask for JSON in the prompt and parse the text",
                param,
            )
    for param, value in reasoning:
        if isinstance(value, dict):
            value = {k: v for k, v in value.items() if v is not None} or None
        if value is not None:
            raise bad(
                f"{param} is not supported: the served policy has no reasoning settings; "
                "leave it out",
                param,
            )


class ChatRequest(OpenAISampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolIn] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)

    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    parallel_tool_calls: bool | None = None

    def gen_params(self) -> GenParams:
        refuse_one_tool_call(self.parallel_tool_calls)
        refuse_unsupported(
            self.tool_choice,
            [("response_format", self.response_format)],
            [("reasoning_effort", self.reasoning_effort)],
        )
        if self.top_logprobs:
            raise bad(
                "top_logprobs > 0 is not supported (the sampled token's logprob is)", "top_logprobs"
            )
        mt = self.max_completion_tokens
        return self._gen_params(self.max_tokens if mt is None else mt, bool(self.logprobs))

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def request_json(self, after: str | None, at: int, offset: int = 0) -> str:
        """The request as the harness sent it, for the TITO record's ``request_json``: its
        messages (each as sent) and tools. When the messages extend an earlier call ``after``
        (``messages[:at]`` are that call's messages, ``messages[at]`` its reply as the harness
        sent it back), only ``messages[at:]`` are stored, with ``after`` naming that call.

        Why not the whole list: a harness re-sends its whole conversation on every call, so
        storing each request in full costs O(calls x context) bytes (a session of N calls,
        about N/2 times its size: for a 1M-token one, gigabytes), where TITO stores each token
        once. The gateway knows
        ``after`` already (it is how it extends a call token-exactly), so the delta is free;
        a call's full list is its ``after`` chain's lists, concatenated from the root.

        ``offset``: this request holds only ``messages[offset:]`` (a body parsed from where
        the session's previous one ended, infra/gateway/chat_body.py); ``at`` >= ``offset``."""
        d: dict[str, Any] = {"after": after} if after is not None else {}
        start = (at if after is not None else 0) - offset
        if start < 0:
            raise ValueError(f"request_json from message {start + offset}: only {offset}.. held")
        d["messages"] = [m.model_dump(exclude_unset=True) for m in self.messages[start:]]
        if self.tools is not None:
            d["tools"] = self.tools
        return dumps(d).decode()


class CompletionRequest(OpenAISampling):
    """``POST /v1/completions`` (one prompt: text or token ids)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)

    def gen_params(self) -> GenParams:
        if self.logprobs:
            raise bad("logprobs > 0 (top alternatives) is not supported; use 0", "logprobs")
        return self._gen_params(self.max_tokens, self.logprobs is not None)

    def one_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise bad("batched prompts are not supported: send one prompt per call", "prompt")
            p = p[0]
        if not p:
            raise bad("'prompt' must not be empty", "prompt")
        return p


class NativeSampling(Body):
    """SGLang's ``sampling_params`` (the fields the gateway passes on; others are ignored)."""

    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    sampling_seed: Int64 | None = None
    seed: Int64 | None = None
    n: int | None = Field(None, ge=1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None


class GenerateRequest(Body):
    """SGLang-native ``POST /generate`` (``rid`` is ignored: the gateway names each call)."""

    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: NativeSampling | None = None
    return_logprob: bool = False
    stream: bool = False

    def gen_params(self) -> GenParams:
        sp = self.sampling_params or NativeSampling()
        refuse_unhonoured(sp, "sampling_params.")
        return GenParams(
            max_new_tokens=sp.max_new_tokens,
            temperature=1.0 if sp.temperature is None else sp.temperature,
            top_p=1.0 if sp.top_p is None else sp.top_p,
            top_k=-1 if sp.top_k is None else sp.top_k,
            seed=sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
            stop=_stops(sp.stop),
            stop_token_ids=list(sp.stop_token_ids or []),
            logprobs=self.return_logprob,
            stream=self.stream,
        )


class ScoreItem(Body):
    """One sub-task score (``POST /gyre/scores``, alone or as ``{"scores": [...]}``)."""

    subtask_id: str = Field(min_length=1)
    score: float = Field(ge=0, le=1)
    weight: float = Field(1.0, ge=0)
    at_request_id: str | None = None
    source: str | None = None
    status: str | None = None
    reason: str | None = None


class ScoresRequest(Body):
    scores: list[ScoreItem] = Field(min_length=1)


class SessionRequest(Body):
    """``POST /gyre/sessions`` (admin)."""

    session_id: str | None = Field(None, min_length=1, max_length=200)
    group_id: str = ""
    meta: dict[str, Any] | None = None


def check_token_ids(ids: list[int] | None, vocab_size: int, param: str) -> np.ndarray:
    """Token ids (already integers) within the vocabulary, as int32 (vectorised: a 1M-token
    input costs milliseconds)."""
    if not ids:
        raise bad(f"'{param}' must be a non-empty list of token ids", param)
    try:
        arr = np.fromiter(ids, np.int64, count=len(ids))
    except OverflowError:  # beyond int64: certainly not a token id
        t = next(t for t in ids if not -(2**63) <= t < 2**63)
        raise bad(f"'{param}' holds an invalid token id {t}", param, "invalid_token_id") from None
    out = (arr < 0) | (arr >= vocab_size)
    if out.any():
        t = int(arr[int(np.argmax(out))])
        raise bad(
            f"'{param}' holds an invalid token id {t} (vocabulary size {vocab_size})",
            param,
            "invalid_token_id",
        )
    return arr.astype(np.int32)
