"""The engine's public interface for front ends (``pagedattn serve``, or any other).

A front end imports the engine from here and nowhere else (``tests/test_layering.py``
holds ``serve/`` to it). What it gets:

* the facade and the engine: :class:`LLM` (loading, ``generate``, ``chat``, ``embed``,
  ``chat_template_missing``) and its :class:`LLMEngine` (``add_request``, ``step``,
  ``abort``, ``has_unfinished``, ``running_request_ids``);
* the request's inputs, checked once for every front end: ``LLMEngine.inputs`` (prompt
  text and chat messages to token ids, ``engine/inputs.py``), ``check_prompt``,
  ``max_new_tokens``, ``check_sampling_params``, ``compile_structured_output``;
* what the engine holds (:class:`EngineLoad`: running and waiting sequences, KV blocks
  used and total, prefix-cache hits and queries, preemptions, from ``LLMEngine.load()``)
  and each sequence's progress (:class:`RequestProgress`, from ``LLMEngine.progress``:
  its request's id, which of the request's ``n`` sequences it is, new tokens and
  logprobs, finish reason, error). A step's :class:`StepResult` lists sequences as
  handles (one per request for ``n == 1``): a front end reads their ``request_id`` and
  ``index`` (to know which sequence's tokens it has sent) and asks ``progress`` for the
  rest;
* the text of a stream, with stop strings found the same way as offline
  (:class:`StreamingText`), and the engine's option parser for command lines.
"""

from __future__ import annotations

from pagedattn.engine.cli import add_engine_arguments, describe_engine, engine_args
from pagedattn.engine.detokenizer import StreamingText, cut_at_stop
from pagedattn.engine.llm import LLM, CompletionOutput, RequestOutput
from pagedattn.engine.llm_engine import EngineLoad, LLMEngine, RequestProgress, StepResult
from pagedattn.engine.request import FinishReason
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.scheduler import ContextLengthError, RequestRejectedError
from pagedattn.engine.structured_output import StructuredOutput, StructuredOutputError

__all__ = [
    "LLM", "CompletionOutput", "RequestOutput", "LLMEngine", "EngineLoad", "RequestProgress",
    "StepResult",
    "FinishReason", "SamplingParams", "StructuredOutput", "StructuredOutputError",
    "ContextLengthError", "RequestRejectedError", "StreamingText", "cut_at_stop",
    "add_engine_arguments", "describe_engine", "engine_args",
]
