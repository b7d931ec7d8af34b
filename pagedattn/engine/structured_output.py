"""Structured output: a request's tokens held to a JSON schema, any JSON object, a regular
expression or an EBNF grammar, with xgrammar (what vLLM uses).

:class:`StructuredOutput` says what a request must produce (a field of
``SamplingParams``; plain data, no xgrammar needed to build one). :class:`Grammars`, one
per engine, compiles it against the model's tokenizer (cached by its key, so a schema
sent by many requests is compiled once) and gives each request a :class:`GrammarState`:
its matcher and a one-row token bitmask. The sampler masks the logits of the
constrained rows only (:meth:`GrammarState.mask`); the engine advances the matcher with
each sampled token and finishes the request when the grammar has terminated.

xgrammar is optional (the ``serve`` extra installs it); without it a structured-output
request is refused with a ``StructuredOutputError`` naming the missing package.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "grammar")

MISSING_XGRAMMAR = ("structured output needs the 'xgrammar' package, which is not installed "
                    "(pip install 'pagedattn[serve]' or pip install xgrammar)")


# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message.
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class StructuredOutputError(ValueError):
    """A structured-output request that cannot be served: an invalid schema, regular
    expression or grammar, or xgrammar missing. The message names the problem."""


def xgrammar_available() -> bool:
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match; exactly one field is set.

    ``json``: a JSON schema (a dict, or its JSON text); ``json_object``: any JSON object;
    ``regex``: a regular expression the whole output matches; ``grammar``: an EBNF
    grammar (GBNF style, a ``root ::= ...`` rule) as xgrammar reads it. JSON is generated
    without free whitespace (one space after ``,`` and ``:``, no newlines), so a small
    model cannot spend its tokens on blank lines. The request finishes (``stop``) when the grammar is
    complete and the model ends it."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutput takes exactly one of {', '.join(KINDS)}; "
                             f"got {given or 'none'}")
        if not isinstance(self.json_object, bool):
            raise TypeError(f"json_object must be a bool, got {self.json_object!r}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise StructuredOutputError(f"json schema: not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise StructuredOutputError(
                    f"json schema: a schema must be a JSON object, got {schema!r:.100}")
            # canonical text: the cache key, and what xgrammar compiles (key order kept:
            # properties are generated in the order the schema lists them)
            object.__setattr__(self, "json", json.dumps(schema, separators=(",", ":")))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputError(f"{name}: expected a non-empty string, got {value!r:.100}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar is cached by."""
        kind = self.kind
        return kind, "" if kind == "json_object" else getattr(self, kind)

    @property
    def schema(self) -> dict | None:
        """The JSON schema as a dict (``json`` requests only)."""
        return json.loads(self.json) if self.json is not None else None


class GrammarState:
    """One request's matcher and its one-row token bitmask."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import torch
        import xgrammar as xgr

        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._apply = xgr.apply_token_bitmask_inplace
        self._torch = torch

    def mask(self, row) -> None:
        """Set to -inf, in place, the logits (one float32 row) of the tokens the grammar
        does not allow next."""
        if self.matcher.fill_next_token_bitmask(self.bitmask, 0):
            self._apply(row.view(1, -1), self.bitmask, vocab_size=self.vocab_size)

    def accept(self, token: int) -> None:
        """Advance the matcher past the sampled ``token`` (ValueError if it may not come next)."""
        if not self.matcher.accept_token(token):
            raise ValueError(f"token {token} does not continue the output's grammar")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class Grammars:
    """Compiles structured-output specs against one tokenizer, caching the compiled
    grammars by key (LRU, ``max_cached`` entries). Thread-safe: the server compiles on
    its input threads while the engine thread makes matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None,
                 max_cached: int = 256) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.max_cached = max_cached
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._compile_lock = threading.Lock()
        """One compilation at a time: the compiler object is shared by the input threads."""
        self.num_compiled = 0
        """Grammars compiled (cache misses), for tests and logs."""

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise StructuredOutputError(MISSING_XGRAMMAR) from None
                if self.tokenizer is None:
                    raise StructuredOutputError("structured output needs the model's tokenizer; "
                                                "this model has none")
                stop = [self.eos_token_id] if self.eos_token_id is not None else None
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=stop)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, spec: StructuredOutput) -> Any:
        """The compiled grammar of ``spec`` (cached); ``StructuredOutputError`` naming
        what is wrong with an invalid schema, regex or grammar."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiler = self._get_compiler()
        with self._compile_lock:
            return self._compile_new(compiler, key)

    def _compile_new(self, compiler: Any, key: tuple[str, str]) -> Any:
        kind, text = key
        with self._lock:  # compiled by another thread while this one waited
            hit = self._cache.get(key)
            if hit is not None:
                return hit
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":
                compiled = compiler.compile_builtin_json_grammar()
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            else:
                compiled = compiler.compile_grammar(text)
        except Exception as exc:  # noqa: BLE001 - xgrammar raises several types; all are the input's fault
            what = {"json": "json schema", "json_object": "json object grammar",
                    "regex": "regex", "grammar": "grammar"}[kind]
            detail = str(exc).strip().splitlines()
            detail = _XGRAMMAR_LOG_PREFIX.sub("", detail[0]) if detail else type(exc).__name__
            raise StructuredOutputError(f"invalid {what} {text!r:.200}: {detail:.300}") from None
        with self._lock:
            self._cache[key] = compiled
            self.num_compiled += 1
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return compiled

    def new_state(self, spec: StructuredOutput) -> GrammarState:
        """A fresh matcher for one request (``StructuredOutputError`` if it cannot be made)."""
        compiled = self.compile(spec)
        try:
            import xgrammar as xgr

            return GrammarState(xgr.GrammarMatcher(compiled), self.vocab_size)
        except Exception as exc:  # noqa: BLE001 - refuse this request, not the engine
            raise StructuredOutputError(f"structured output: the grammar matcher could not be "
                                        f"made: {type(exc).__name__}: {exc}") from None
