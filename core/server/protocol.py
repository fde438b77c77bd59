"""Request bodies of /v1/completions and /v1/chat/completions, checked and turned into SamplingParams.

Every field the engine serves is declared here. A field it does not serve gets a 400 naming it,
except a few that are accepted at their neutral value only (presence_penalty 0, echo false, ...),
so clients that always send the defaults keep working. Extensions shared with vLLM and SGLang:
top_k, min_p, ignore_eos, stop_token_ids, return_token_ids.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from backplane.engine.sampling_params import SamplingParams
from backplane.server.errors import ApiError, bad_request

MAX_N = 128
SEED_RANGE = 2**64  # seeds are unsigned 64-bit integers


class _Body(BaseModel):
    # strict: "stream": "yes" or "max_tokens": "8" is a 400, not a guess
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, le=SEED_RANGE - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    user: str | None = None  # an end-user id for the caller's own logs; it changes nothing here
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


# Fields accepted only at these values; anything else is refused by name.
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "logit_bias": (None, {}),
    "echo": (False,), "suffix": (None,), "best_of": (None, 1), "top_logprobs": (None, 0),
    "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
}
UNION_EXPECTED = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
}
SAMPLING_NAMES = {"max_new_tokens": "max_tokens"}  # SamplingParams field -> request field


def parse(model: type[_Body], data: Any) -> Any:
    """Validate a decoded JSON body; a 400 naming the first bad field."""
    if not isinstance(data, dict):
        raise bad_request(f"request body: expected a JSON object, got {type(data).__name__}")
    try:
        body = model.model_validate(data)
    except ValidationError as err:
        raise _field_error(model, err.errors()[0]) from None
    _check_supported(body)
    return body


def _field_error(model: type[_Body], error: dict[str, Any]) -> ApiError:
    param = ".".join(str(p) for p in error["loc"] if not _is_union_tag(str(p)))
    if error["type"] == "extra_forbidden":
        accepted = ", ".join(sorted(model.model_fields))
        return bad_request(f"{param}: unsupported field; this endpoint accepts: {accepted}", param)
    if error["type"] == "missing":
        return bad_request(f"{param}: required field is missing", param)
    if param in UNION_EXPECTED:
        return bad_request(f"{param}: expected {UNION_EXPECTED[param]}, got {error.get('input')!r}", param)
    return bad_request(f"{param}: {error['msg']}, got {error.get('input')!r}", param)


def _is_union_tag(part: str) -> bool:
    """pydantic puts the union member tried into the error location ("list[int]", "str")."""
    return part in ("str", "int", "float", "bool") or part.startswith(("list[", "dict[", "function-"))


def _check_supported(body: SamplingFields) -> None:
    for name, allowed in NEUTRAL.items():
        value = getattr(body, name, None)
        if name in type(body).model_fields and value not in allowed:
            raise bad_request(f"{name}: not supported by this engine; only {allowed[-1]!r} is accepted, "
                              f"got {value!r}", name)
    if isinstance(body, CompletionRequest) and body.logprobs not in (None, 0):
        raise bad_request(f"logprobs: only 0 is supported (the chosen token's log-probability, no "
                          f"alternatives), got {body.logprobs}", "logprobs")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options: only allowed when stream is true", "stream_options")
    if isinstance(body, ChatRequest) and body.max_tokens and body.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens: pass one, not both", "max_completion_tokens")


def sampling_params(body: SamplingFields, max_tokens: int) -> list[SamplingParams]:
    """The n SamplingParams of one prompt; copy i of a seeded request uses seed + i modulo 2**64
    (distinct samples, and never a seed outside the range the client could send)."""
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    try:
        return [SamplingParams(
            max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            min_p=body.min_p, seed=None if body.seed is None else (body.seed + i) % SEED_RANGE, stop=stop,
            stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
        ) for i in range(body.n)]
    except ValueError as err:  # "SamplingParams.top_p: expected ..., got ..."
        field, _, rest = str(err).removeprefix("SamplingParams.").partition(":")
        field = SAMPLING_NAMES.get(field, field)
        raise bad_request(f"{field}:{rest}", field) from None


def chat_messages(body: ChatRequest) -> list[dict[str, str]]:
    """Messages for the chat template: content as one string (text parts joined)."""
    out = []
    for i, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            content = "".join(_text_part(part, f"messages.{i}.content.{j}") for j, part in enumerate(content))
        item = {"role": message.role, "content": content or ""}
        if message.name:
            item["name"] = message.name
        out.append(item)
    return out


def _text_part(part: dict[str, Any], where: str) -> str:
    if part.get("type") != "text" or not isinstance(part.get("text"), str):
        raise bad_request(f"{where}: only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                          f"got type {part.get('type')!r}", where)
    return part["text"]
