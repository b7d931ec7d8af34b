"""Incremental detokenization (engine stop strings, server streaming) against the
tokenizer's decode of the whole output, on the built-in models' real tokenizers."""

from __future__ import annotations

import random

import pytest
from builtin_models import MINILM, SMOLLM2, needs_minilm, needs_smollm2

from pagedattn.engine.detokenizer import IncrementalDetokenizer, StreamingText
from pagedattn.models.loader import load_checkpoint, load_tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 3:45 p.m., isn't it?",
    "Grüße aus Köln! Ça va? naïve café — “quoted” text… 東京は大きい都市です。",
    "Emoji split over byte tokens: 🦙🚀👩‍💻 and a flag 🇫🇷, then plain words again.",
    "def f(x):\n    return x ** 2  # code, with\ttabs and   runs of spaces\n\n",
]


def _tokenizers():
    params = []
    for path, mark, name in ((SMOLLM2, needs_smollm2, "smollm2"), (MINILM, needs_minilm, "minilm")):
        params.append(pytest.param(path, marks=mark, id=name))
    return params


@pytest.fixture(scope="module", params=_tokenizers())
def tokenizer(request):
    return load_tokenizer(load_checkpoint(request.param))


def _token_streams(tokenizer):
    """Token sequences: the texts, and random ids from the whole vocabulary (a sampler at
    high temperature emits those), fed in chunks of 1-3 tokens."""
    rng = random.Random(0)
    seqs = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    seqs += [[rng.randrange(len(tokenizer)) for _ in range(60)] for _ in range(6)]
    for ids in seqs:
        chunks, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 3)
            chunks.append(ids[i:i + n])
            i += n
        yield ids, chunks


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_joins_to_the_whole_decode(tokenizer, skip_special_tokens):
    for ids, chunks in _token_streams(tokenizer):
        stream = StreamingText(tokenizer, skip_special_tokens)
        pieces = [stream.add(c, finished=False) for c in chunks[:-1]]
        pieces.append(stream.add(chunks[-1], finished=True))
        whole = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) == whole
        # Nothing was sent that the final text takes back, and no partial character.
        assert not any(p.endswith("\ufffd") for p in pieces[:-1])


def test_incremental_text_is_the_whole_decode_for_real_text(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        det = IncrementalDetokenizer(tokenizer)
        for i, t in enumerate(ids, 1):
            det.feed([t])
            whole = tokenizer.decode(ids[:i], skip_special_tokens=True)
            # Behind only by a character still being assembled from byte tokens.
            assert whole.startswith(det.text), (i, det.text, whole)
            assert len(whole) - len(det.text) <= 1 or whole.endswith("\ufffd")
        assert det.text == tokenizer.decode(ids, skip_special_tokens=True)


@needs_smollm2
def test_stop_strings_are_held_back_and_cut():
    tokenizer = load_tokenizer(load_checkpoint(SMOLLM2))
    text = "Alpha beta gamma. STOP here and delta epsilon after it."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = StreamingText(tokenizer, True, stop=["STOP here", "never"])
    sent = ""
    for i, t in enumerate(ids):
        sent += stream.add([t], finished=i == len(ids) - 1)
        # What was sent never holds a stop string, nor a prefix of one at its end.
        assert "STOP here" not in sent
    assert sent == "Alpha beta gamma. "
    det = IncrementalDetokenizer(tokenizer, True, stop=["gamma", "never"])
    for t in ids:
        det.feed([t])
        if det.first_stop() is not None:
            break
    assert det.text[det.first_stop():].startswith("gamma")
    assert len(det.tokens) < len(ids)  # found as soon as it appeared


def test_decodes_are_windows_not_the_whole_output():
    """Linear time: each step decodes a window of at most CONTEXT_TOKENS + new tokens."""
    lengths = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return "".join(f"<{i}>" for i in ids)

    det = IncrementalDetokenizer(Counting())
    for t in range(500):
        det.feed([t])
    assert det.text == "".join(f"<{i}>" for i in range(500))
    assert max(lengths) <= 6
