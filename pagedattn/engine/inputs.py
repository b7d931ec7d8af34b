"""A request's inputs turned into checked token ids: written once, for the offline ``LLM``
and for ``pagedattn serve``.

Every check raises ``ValueError`` (``TypeError`` for a value of the wrong kind) with a
message that names the input and the bad value, so the server can answer it as a 400
and ``LLM`` can raise it unchanged.
"""

from __future__ import annotations

from typing import Any, Sequence

from pagedattn.checks import is_int
from pagedattn.engine.scheduler import ContextLengthError

# A text this many times longer (in characters) than its token budget times the longest
# token's length cannot fit: it is refused before the tokenizer spends seconds on it.
# The factor leaves room for normalisers that drop characters.
_CHARS_SLACK = 2


def check_text(text: Any, what: str) -> str:
    """``text`` if it is a string that UTF-8 can encode. JSON's ``"\\ud800"`` escape gives
    Python a lone surrogate, which no tokenizer and no UTF-8 response can carry."""
    if not isinstance(text, str):
        raise TypeError(f"{what} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise ValueError(f"{what}: the text holds a lone surrogate (U+{ord(bad):04X}) at "
                         f"character {exc.start}; send valid Unicode") from None
    return text


def check_token_ids(ids: Any, vocab_size: int, what: str) -> list[int]:
    """``ids`` as a list if every one is an int (bools refused) in ``[0, vocab_size)``."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{what} must be a list of token ids, got {type(ids).__name__}")
    for t in ids:
        if not is_int(t):
            raise TypeError(f"{what}: token ids must be ints, got {t!r:.40}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{what}: token id {t} is outside the vocabulary [0, {vocab_size})")
    return list(ids)


def longest_token_chars(tokenizer) -> int:
    """Characters in the tokenizer's longest token (its string form); at least 1."""
    vocab = tokenizer.get_vocab()
    return max((len(t) for t in vocab), default=1) or 1


class PromptInputs:
    """Text to token ids for one model: plain prompts and chat messages, with the checks
    above and a bound on text length that refuses, before tokenizing, a text that cannot
    fit in ``max_tokens`` tokens."""

    def __init__(self, tokenizer, vocab_size: int, max_tokens: int,
                 model_description: str = "model") -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.model_description = model_description
        self._max_chars: int | None = None

    def template_missing(self) -> str | None:
        """Why chat messages cannot be formatted (``None`` when they can): no tokenizer,
        or a checkpoint that carries no chat template (the pretrained Gemma 3 GGUF)."""
        if self.tokenizer is None:
            return "it has no tokenizer (built with skip_tokenizer_init=True)"
        if not getattr(self.tokenizer, "chat_template", None):
            return f"the {self.model_description} carries no chat template"
        return None

    def max_chars(self) -> int:
        """Characters above which a text needs more than ``max_tokens`` tokens."""
        if self._max_chars is None:
            self._max_chars = self.max_tokens * longest_token_chars(self.tokenizer) * _CHARS_SLACK
        return self._max_chars

    def _check_length(self, n_chars: int, what: str) -> None:
        if n_chars > self.max_chars():
            raise ContextLengthError(f"{what}: the text has {n_chars} characters, more than a context "
                             f"of {self.max_tokens} tokens can hold")

    def encode(self, text: Any, what: str = "prompt") -> list[int]:
        """Token ids of a plain text prompt (special tokens added as the tokenizer does)."""
        if self.tokenizer is None:
            raise ValueError(f"{what}: text needs a tokenizer (the model was loaded with "
                             "skip_tokenizer_init=True); send token ids")
        check_text(text, what)
        self._check_length(len(text), what)
        return self.tokenizer(text).input_ids

    def chat(self, messages: Any, what: str = "messages") -> list[int]:
        """Token ids of one conversation (``[{"role", "content"}]``) through the chat
        template, with the generation prompt added."""
        missing = self.template_missing()
        if missing:
            raise ValueError(f"{what}: this model cannot format chat messages: {missing}")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"{what} must be a non-empty list of messages")
        total = 0
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise TypeError(f"{what}[{i}] must be a dict with 'role' and 'content'")
            for key, value in m.items():
                if isinstance(value, str):
                    check_text(value, f"{what}[{i}].{key}")
                    total += len(value)
        self._check_length(total, what)
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                  tokenize=False)
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def check_ids(self, ids: Any, what: str = "prompt") -> list[int]:
        return check_token_ids(ids, self.vocab_size, what)
