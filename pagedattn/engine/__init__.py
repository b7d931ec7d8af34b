"""The inference engine: block pool, scheduler, input batch, model runner, sampler, LLM."""

from pagedattn.engine.llm import LLM, RequestOutput
from pagedattn.engine.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
