"""Text from tokens as they are sampled, in time linear in the output.

Decoding a request's whole output again at every step costs O(n) per token, O(n^2) per
request. :class:`IncrementalDetokenizer` decodes a short window instead: the tokens not
yet turned into text plus a few before them, which the tokenizer needs as context
(sentencepiece drops a word's leading space at the start of a decode; a character may be
split over byte tokens). What the window decodes to beyond its context's own text is the
new text. A window that ends inside a character (U+FFFD) waits for the next token.

The engine uses it to find stop strings; the server (:class:`StreamingText`) to stream
text that can no longer change.
"""

from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"
# Tokens of context before the undecoded ones: enough for a leading space and for a
# character split over several byte tokens (UTF-8: at most 4 bytes).
CONTEXT_TOKENS = 5


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` cut before the first stop string in it (all of it when none appears): the
    rule for a finished request's text, offline and served."""
    cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[:min(cuts)] if cuts else text


class IncrementalDetokenizer:
    """One request's output text, fed its tokens as they are sampled."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True,
                 stop: tuple[str, ...] | list[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        """Characters at the end of the text that may still begin a stop string."""
        self.tokens: list[int] = []
        self.text = ""
        """The text of ``tokens[:decoded_upto]``."""
        self.decoded_upto = 0
        self._context_start = 0
        self._stop_from = 0  # no stop string begins before this character
        self._stop_at: int | None = None

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens)

    def feed(self, token_ids: list[int]) -> None:
        self.tokens.extend(token_ids)
        if self.decoded_upto == len(self.tokens):
            return
        context = self.decode(self.tokens[self._context_start:self.decoded_upto])
        window = self.decode(self.tokens[self._context_start:])
        if window.endswith(REPLACEMENT) or not window.startswith(context):
            return  # mid-character, or the context reads differently now: wait for more
        self.text += window[len(context):]
        self.decoded_upto = len(self.tokens)
        self._context_start = max(0, self.decoded_upto - CONTEXT_TOKENS)

    def first_stop(self) -> int | None:
        """Where the first stop string begins in :attr:`text`, if one has appeared."""
        if self._stop_at is None and self.stop:
            hits = [i for i in (self.text.find(s, self._stop_from) for s in self.stop) if i >= 0]
            if hits:
                self._stop_at = min(hits)
            else:
                self._stop_from = max(0, len(self.text) - self.hold)
        return self._stop_at


class StreamingText:
    """The text a stream may send: final pieces only, never a stop string."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True,
                 stop: tuple[str, ...] | list[str] = ()) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens, stop)
        self.sent = 0

    def add(self, token_ids: list[int], finished: bool) -> str:
        """Feed the request's new tokens; returns the text that became final."""
        det = self.detokenizer
        if finished:
            # One whole decode at the end, so the text is exactly the tokenizer's decode of
            # the whole output (what offline generation returns), cut before a stop string.
            det.tokens.extend(token_ids)
            text = cut_at_stop(det.decode(det.tokens), det.stop)
            end = len(text)
        else:
            det.feed(token_ids)
            text, stop = det.text, det.first_stop()
            end = stop if stop is not None else len(text) - det.hold
        out = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out

    def flush(self) -> str:
        """The text held back so far, final now that no token will follow (an abort)."""
        return self.add([], True)
