"""Compatibility layers for code written against vLLM interfaces this package does not
build on: the v0 model-runner helpers (:mod:`.vllm_v0`) and the stand-in runner and
scheduler types they read (:mod:`.runner_types`). The core is :mod:`pagedattn.paging`,
:mod:`pagedattn.common_metadata` and :mod:`pagedattn.backend`."""
