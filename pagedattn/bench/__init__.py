"""``pagedattn bench``: a side-by-side attention benchmark with a roofline.

Modules: :mod:`~pagedattn.bench.scenarios` (what is timed), :mod:`~pagedattn.bench.contenders`
and :mod:`~pagedattn.bench.vllm_contender` (who is timed, a registry),
:mod:`~pagedattn.bench.probes` (this machine's limits), :mod:`~pagedattn.bench.runner`
(check, then time), :mod:`~pagedattn.bench.report` (table, JSON, plot),
:mod:`~pagedattn.bench.schema` (the JSON's schema), :mod:`~pagedattn.bench.cli` (options).
"""

from pagedattn.bench import vllm_contender  # noqa: F401  (registers the optional contender)
from pagedattn.bench.cli import add_arguments, options_from_args, run_from_args
from pagedattn.bench.contenders import CONTENDERS, Contender, Prepared, register, unregister
from pagedattn.bench.runner import BenchOptions, BenchResult, run_bench
from pagedattn.bench.scenarios import Scenario, default_suite, quick_suite, tiny_suite

__all__ = [
    "CONTENDERS", "BenchOptions", "BenchResult", "Contender", "Prepared", "Scenario",
    "add_arguments", "default_suite", "options_from_args", "quick_suite", "register",
    "run_bench", "run_from_args", "tiny_suite", "unregister",
]
