"""OpenAI response bodies: completions, chat completions (whole and as stream chunks),
their logprobs blocks and usage. A request with ``n`` choices answers with ``n`` entries
in ``choices`` (``index`` 0 to n - 1); each stream chunk carries the one choice it is
about; usage counts the prompt once and the completion tokens of every choice."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from pagedattn.serve.engine_loop import Delta


def sse(obj: dict[str, Any] | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n"


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


@dataclass
class Choice:
    """What a handler has gathered of one choice: its text and logprobs blocks per delta,
    and its end."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[dict | None] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    offset: int = 0
    """Characters of text so far (the completions logprobs' ``text_offset``)."""

    def add(self, kind: "Kind", tokenizer, delta: Delta) -> dict | None:
        """Take ``delta`` in; returns its logprobs block (``None`` if not asked for)."""
        logprobs = kind.logprobs(tokenizer, delta, self.offset)
        self.texts.append(delta.text)
        self.logprobs.append(logprobs)
        self.offset += len(delta.text)
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.num_output_tokens = delta.num_output_tokens
        return logprobs


@dataclass
class Kind:
    """Which endpoint a response is for, and the fields that say so."""

    chat: bool
    req_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, stream: bool) -> dict[str, Any]:
        obj = ("chat.completion.chunk" if stream else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.req_id, "object": obj, "created": self.created, "model": self.model}

    # ------------------------------------------------------------------ logprobs

    def logprobs(self, tokenizer, delta: Delta, offset: int) -> dict[str, Any] | None:
        """The logprobs block of ``delta`` (``offset``: characters before it, for the
        completions format's ``text_offset``)."""
        if not delta.logprobs:
            return None

        def tok(t: int) -> str:
            return tokenizer.decode([t]) if tokenizer is not None else str(t)

        if self.chat:
            content = []
            for t, (lp, top) in zip(delta.token_ids, delta.logprobs):
                s = tok(t)
                content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                                "top_logprobs": [{"token": tok(a), "logprob": v,
                                                  "bytes": list(tok(a).encode())} for a, v in top]})
            return {"content": content}
        tokens, offsets, pos = [], [], offset
        for t in delta.token_ids:
            tokens.append(tok(t))
            offsets.append(pos)
            pos += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in delta.logprobs],
                "top_logprobs": [{tok(a): v for a, v in top} for _, top in delta.logprobs],
                "text_offset": offsets}

    # ------------------------------------------------------------------ bodies

    def whole(self, choices: list[Choice], prompt: int) -> dict[str, Any]:
        """The whole answer: ``choices`` in index order, usage summed over them."""
        out = []
        for index, c in enumerate(choices):
            choice: dict[str, Any] = {"index": index,
                                      "logprobs": merge_logprobs(c.logprobs, self.chat),
                                      "finish_reason": c.finish_reason}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": "".join(c.texts)}
            else:
                choice["text"] = "".join(c.texts)
            out.append(choice)
        completion = sum(c.num_output_tokens for c in choices)
        return {**self._head(False), "choices": out, "usage": usage(prompt, completion)}

    def chunk(self, text: str | None, finish: str | None, logprobs: dict | None,
              role: bool = False, index: int = 0) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return {**self._head(True), "choices": [choice]}

    def usage_chunk(self, prompt: int, completion: int) -> dict[str, Any]:
        return {**self._head(True), "choices": [], "usage": usage(prompt, completion)}


def merge_logprobs(blocks: list[dict | None], chat: bool) -> dict | None:
    """One logprobs block from the per-delta ones (non-streaming answers)."""
    blocks = [b for b in blocks if b]
    if not blocks:
        return None
    if chat:
        return {"content": [c for b in blocks for c in b["content"]]}
    return {k: [v for b in blocks for v in b[k]] for k in blocks[0]}
