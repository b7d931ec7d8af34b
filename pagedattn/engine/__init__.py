"""The inference engine: block pool, scheduler, input batch, model runner, sampler, LLM."""

from pagedattn.engine.llm import LLM, CompletionOutput, RequestOutput
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.structured_output import StructuredOutput

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutput"]
