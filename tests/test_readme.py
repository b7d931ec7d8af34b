"""The README's usage example runs as written and produces the reference's answer."""

import pathlib
import re

import torch

from pagedattn import ops
from pagedattn.ops import reference as ref
from pagedattn.testing import TOLERANCES

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs_and_is_correct():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README lost its usage example"
    scope: dict = {}
    exec(compile(blocks[0], str(README), "exec"), scope)
    out, q, kv_cache, metadata = scope["out"], scope["q"], scope["kv_cache"], scope["metadata"]
    common = scope["common"]
    want = ref.paged_attention(
        q.float(), kv_cache[0].float(), kv_cache[1].float(), common.query_start_loc,
        common.seq_lens, common.block_table_tensor, scale=128 ** -0.5,
    )
    # Request 0's 39 context tokens were never written (zeros): still a valid attention.
    atol, rtol = TOLERANCES[torch.bfloat16]
    torch.testing.assert_close(out.float(), want, atol=atol, rtol=rtol)
    # Which kernel variant the backend picks depends on the CPU (AMX, Arm): any usable one.
    assert metadata.isa in ops.usable_isa_hints()
