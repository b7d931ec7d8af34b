"""Request schemas of the OpenAI-compatible API, and its error bodies.

Every schema forbids unknown fields, so a misspelt or unsupported option is a 400 that
names it instead of being silently ignored. Besides OpenAI's fields, the completion
schemas take vLLM's sampling extensions (``top_k``, ``min_tokens``, ``ignore_eos``,
``repetition_penalty``, ``stop_token_ids``, ``skip_special_tokens``) and structured
output: OpenAI's ``response_format`` and vLLM's ``guided_json``, ``guided_regex``
(``regex``), ``guided_grammar`` (``grammar``) and ``structured_outputs``.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from pagedattn.engine.interface import SamplingParams, StructuredOutput


class APIError(Exception):
    """An error answered to the client with OpenAI's body shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# The names pydantic puts in an error's location for the member of a union it tried.
_UNION_TAG = re.compile(r"^(str|int|float|bool|(list|dict|tuple)\[.*\])$")


def pick_error(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The most telling of pydantic's errors. For a value that matches no member of a
    union, pydantic reports every member's errors: take the member that came closest
    (fewest errors), and in it the error deepest inside the value, which names the bad
    element (``prompt: [1, true]`` -> ``prompt.1 ... got True``)."""
    def branch(err: dict[str, Any]) -> tuple:
        loc = tuple(str(p) for p in err.get("loc", ()))
        tags = [i for i, p in enumerate(loc) if _UNION_TAG.match(p)]
        return loc[:tags[0] + 1] if tags else loc

    sizes: dict[tuple, int] = {}
    for err in errors:
        sizes[branch(err)] = sizes.get(branch(err), 0) + 1
    return min(errors, key=lambda e: (sizes[branch(e)], -len(e.get("loc", ()))))


def validation_message(err: dict[str, Any]) -> tuple[str, str | None]:
    """``(message, param)`` of one pydantic error, naming the field and the value."""
    loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _UNION_TAG.match(str(p))]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('msg')}", None
    if err.get("type") == "extra_forbidden":
        return f"unknown field {param!r}: it is not a parameter of this endpoint", param
    value = err.get("input")
    shown = "" if isinstance(value, dict) else f", got {value!r:.100}"
    return f"{param or 'body'}: {err.get('msg')}{shown}", param


class _Strict(BaseModel):
    # strict: JSON's true is not the integer 1 nor the number 1.0, and "3" is not 3
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: StrictBool = False


class JSONSchemaFormat(_Strict):
    """``response_format.json_schema`` (OpenAI's shape). The output is always held to the
    schema; ``strict`` is accepted for compatibility and changes nothing."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` object: one of its fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: StrictBool | None = None
    regex: str | None = None
    grammar: str | None = None


STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_grammar", "regex", "grammar")
"""The request fields that ask for structured output; at most one may be set."""


class _Sampling(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat = Field(default=1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(default=1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(default=-1, ge=-1)
    seed: StrictInt | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: StrictInt | None = 1
    """Choices per request (``null``: 1, as OpenAI's API documents it); see ``check_n``."""
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's sampling extensions
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(default=0, ge=0)
    repetition_penalty: StrictFloat = Field(default=1.0, gt=0.0)
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    # structured output: OpenAI's response_format, and vLLM's names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    regex: str | None = None
    grammar: str | None = None

    def structured_output(self) -> tuple[StructuredOutput | None, str | None]:
        """``(what the output must match, the field that asked for it)``; ``(None, None)``
        for free text. A 400 names the field where two ask at once or one is invalid."""
        given = [f for f in STRUCTURED_FIELDS if getattr(self, f) is not None
                 and not (f == "response_format" and self.response_format.type == "text")]
        if not given:
            return None, None
        if len(given) > 1:
            raise APIError(400, f"{given[0]} and {given[1]}: only one structured-output field "
                                f"may be set", param=given[1])
        name = given[0]
        value = getattr(self, name)
        param = name
        try:
            if name == "response_format":
                if value.type == "json_object":
                    return StructuredOutput(json_object=True), name
                param = "response_format.json_schema"
                if value.json_schema is None:
                    raise ValueError("response_format: type 'json_schema' needs a 'json_schema' "
                                     "object with a 'schema'")
                param = "response_format.json_schema.schema"
                if value.json_schema.schema_ is None:
                    raise ValueError("response_format.json_schema.schema is required")
                return StructuredOutput(json=value.json_schema.schema_), name
            if name == "structured_outputs":
                fields = {"json": value.json_, "json_object": bool(value.json_object),
                          "regex": value.regex, "grammar": value.grammar}
                return StructuredOutput(**fields), name
            kind = {"guided_json": "json", "guided_regex": "regex", "regex": "regex",
                    "guided_grammar": "grammar", "grammar": "grammar"}[name]
            return StructuredOutput(**{kind: value}), name
        except (TypeError, ValueError) as exc:
            raise APIError(400, f"{param}: {exc}", param=param) from None

    def check_n(self, max_n: int) -> None:
        """``n`` (an int or null already: the schema is strict) in ``[1, max_n]``, else a
        400 naming it."""
        if self.n is None:
            self.n = 1
        if not 1 <= self.n <= max_n:
            raise APIError(400, f"n must be an int in [1, {max_n}] (this server's --max-n), "
                                f"got {self.n}", param="n")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured_output: StructuredOutput | None = None) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                max_tokens=max_tokens, seed=self.seed, stop=self.stop,
                ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids or [],
                min_tokens=self.min_tokens, repetition_penalty=self.repetition_penalty,
                logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                structured_output=structured_output, n=self.n)
        except (TypeError, ValueError) as exc:
            # SamplingParams' messages start with the field they are about
            field = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc),
                           param=field if field in type(self).model_fields else None) from exc


DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions`` when the field is absent."""


class CompletionRequest(_Sampling):
    prompt: Union[str, list[StrictInt], list[str]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)

    def requested_max_tokens(self) -> int | None:
        # absent: OpenAI's 16 (cut to what the context leaves); null: up to the context
        if "max_tokens" not in self.model_fields_set:
            return DEFAULT_COMPLETION_MAX_TOKENS
        return self.max_tokens

    def defaulted_max_tokens(self) -> bool:
        return "max_tokens" not in self.model_fields_set


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[dict[str, Any]]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages: only text content parts are supported, got "
                                    f"{part!r:.100}", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class EmbeddingRequest(_Strict):
    model: str
    input: Union[str, list[str], list[StrictInt], list[list[StrictInt]]]
    encoding_format: Literal["float", "base64"] = "float"  # the openai client asks for base64
    user: str | None = None
