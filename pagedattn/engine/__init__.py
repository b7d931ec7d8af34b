"""The inference engine: block pool, scheduler, input batch, model runner, sampler, LLM."""

from pagedattn.engine.llm import LLM, RequestOutput
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.structured_output import StructuredOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams", "StructuredOutput"]
