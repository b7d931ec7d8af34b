"""Request schemas of the OpenAI-compatible API, and its error bodies.

Every schema forbids unknown fields, so a misspelt or unsupported option is a 400 that
names it instead of being silently ignored. Besides OpenAI's fields, the completion
schemas take vLLM's sampling extensions (``top_k``, ``min_tokens``, ``ignore_eos``,
``repetition_penalty``, ``stop_token_ids``, ``skip_special_tokens``).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedattn.engine.sampling_params import SamplingParams


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


def validation_message(err: dict[str, Any]) -> tuple[str, str | None]:
    """``(message, param)`` of one pydantic error, naming the field and the value."""
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {err.get('msg')}", None
    if err.get("type") == "extra_forbidden":
        return f"unknown field {param!r}: it is not a parameter of this endpoint", param
    value = err.get("input")
    shown = "" if isinstance(value, dict) else f", got {value!r:.100}"
    return f"{param or 'body'}: {err.get('msg')}{shown}", param


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's sampling extensions
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def check_n(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n: only n=1 is supported, got {self.n}", param="n")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                max_tokens=max_tokens, seed=self.seed, stop=self.stop,
                ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids or [],
                min_tokens=self.min_tokens, repetition_penalty=self.repetition_penalty,
                logprobs=logprobs, skip_special_tokens=self.skip_special_tokens)
        except (TypeError, ValueError) as exc:
            raise APIError(400, str(exc)) from exc


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)


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
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class EmbeddingRequest(_Strict):
    model: str
    input: Union[str, list[str], list[int], list[list[int]]]
    encoding_format: Literal["float", "base64"] = "float"  # the openai client asks for base64
    user: str | None = None
