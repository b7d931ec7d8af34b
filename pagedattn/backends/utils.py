"""vLLM's ``attention/backends/utils.py`` import path, kept for code written against it.

Everything here is parity code and lives in :mod:`pagedattn.compat.backend_utils`; this
module only re-exports it. It sits above the core: no module of the core imports it
(``tests/test_layering.py`` checks), and the live code takes the same helpers from
:mod:`pagedattn.paging`.
"""

from pagedattn.compat.backend_utils import *  # noqa: F401,F403
from pagedattn.compat.backend_utils import __all__  # noqa: F401
