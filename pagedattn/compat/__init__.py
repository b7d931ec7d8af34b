"""Parity code: vLLM interfaces this package keeps for code written against them but does
not build on.

* :mod:`.backend_utils`: the names of vLLM's ``attention/backends/utils.py`` (re-exported at
  that path as :mod:`pagedattn.backends.utils`): the v0 helpers and the v1 batch split;
* :mod:`.vllm_v0`: the v0 ``CommonMetadataBuilder``, slot-mapping and MLA helpers;
* :mod:`.graph_state`: the v0 CUDA-graph capture state;
* :mod:`.runner_types`: the stand-in runner and scheduler types those read.

Who may use it: code ported from those interfaces, and its tests. Nothing in the core
(``backend.py``, ``paging.py``, ``ops/``, ``backends/``, ``models/``, ``engine/``) imports
it (``tests/test_layering.py``); the live equivalents are in :mod:`pagedattn.paging`,
:mod:`pagedattn.common_metadata` and :mod:`pagedattn.backend`.
"""
