"""Regression tests for the failures a randomized campaign found: each one
failed before its fix. Crash-prone cases run in a child process, so a segfault fails the
one test instead of the whole session."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from pagedattn import ops
from pagedattn.ops import reference as ref
from pagedattn.testing import TOLERANCES, BatchSpec, make_paged_batch

from test_cpu_ops import (DTYPES, assert_matches_reference, case_inputs, feature_args,
                          run_native, run_reference, _good_call_args)

pytestmark = pytest.mark.skipif(not ops.native_available(), reason="native extension not built")


def run_child(script: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs `script` in a fresh interpreter; a crash shows as a negative return code."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=timeout)


def assert_child_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"child exited with {proc.returncode} (negative: killed by that signal)\n"
        f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")


# ------------------------------------------------------------ 1. failed scratch allocation

RLIMIT_SCRIPT = """
import resource, torch
from pagedattn import ops
from pagedattn.testing import BatchSpec, make_paged_batch
from pagedattn.ops import reference as ref

def call(batch):
    H, D = batch.query.shape[1:]
    meta = ops.cpu_attn_get_scheduler_metadata(
        len(batch.spec.seq_lens), H, batch.key_cache.shape[1], D, batch.seq_lens,
        batch.query.dtype, batch.query_start_loc, True, -1, "vec16", True)
    out = torch.empty_like(batch.query)
    ops.cpu_attention_with_kv_cache(batch.query, batch.key_cache, batch.value_cache, out,
        batch.query_start_loc, batch.seq_lens, 0.1, True, None, (-1, -1), batch.block_table,
        0.0, meta, None)
    return out

def want(batch):
    return ref.paged_attention(batch.query, batch.key_cache, batch.value_cache,
        batch.query_start_loc, batch.seq_lens, batch.block_table, scale=0.1, causal=True)

small = make_paged_batch(BatchSpec("s", (40, 70), (1, 1)), num_heads=8, num_kv_heads=2,
                         head_size=64, block_size=16, dtype=torch.float32)
# Decode of 256 kv heads x 256 dims: ~30 MiB of scratch per worker.
big = make_paged_batch(BatchSpec("b", (20,), (1,)), num_heads=256, num_kv_heads=256,
                       head_size=256, block_size=16, dtype=torch.float32)
torch.testing.assert_close(call(small), want(small), atol=2e-5, rtol=2e-5)  # grows the scratch

def vm_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

soft, hard = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (vm_bytes() + (8 << 20), hard))
failed = None
try:
    call(big)
except (RuntimeError, MemoryError) as exc:
    failed = exc
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
assert failed is not None, "the big call fit under the lowered limit: the test proves nothing"
print("big call raised:", type(failed).__name__, str(failed).splitlines()[0])
for _ in range(3):  # the thread's scratch must still be usable
    torch.testing.assert_close(call(small), want(small), atol=2e-5, rtol=2e-5)
torch.testing.assert_close(call(big), want(big), atol=2e-5, rtol=2e-5)
print("ok")
"""


def test_failed_scratch_allocation_raises_and_leaves_the_thread_usable():
    """Under a lowered RLIMIT_AS a call whose scratch does not fit raises; the calls after
    it on the same thread work (the scratch kept its old capacity with a null buffer and
    the next small call wrote through it: SIGSEGV)."""
    pytest.importorskip("resource")
    proc = run_child(RLIMIT_SCRIPT)
    assert_child_ok(proc)
    assert "big call raised: " in proc.stdout and proc.stdout.rstrip().endswith("ok")


def test_metadata_with_a_corrupt_query_tile_is_rejected():
    args = _good_call_args()
    meta = args["scheduler_metadata"].clone()
    meta[10] = 2 ** 30  # q_tile_tokens: scratch sized from it would be enormous
    with pytest.raises(ValueError, match=r"q_tile_tokens.*1073741824"):
        ops.cpu_attention_with_kv_cache(**{**args, "scheduler_metadata": meta})


# ------------------------------------------------------------ 2. windows near 2**63

@pytest.mark.parametrize("window", [(2 ** 63 - 1, 2 ** 63 - 1), (2 ** 62, -1), (-1, 2 ** 63 - 1),
                                    (2 ** 40, 2 ** 35)])
@pytest.mark.parametrize("causal", [True, False])
def test_huge_windows_mean_unbounded(isa, window, causal):
    batch = case_inputs("mixed", "fp32", 64, 16, 8, 2)
    args = {**feature_args("causal", 8, 64), "causal": causal}
    want = run_reference(batch, {**args, "sliding_window": (-1, -1)})
    got = run_native(batch, {**args, "sliding_window": window}, block_size=16)
    assert_matches_reference(got, want, torch.float32)


# ------------------------------------------------------------ 3. softcap precision

@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize("cap", [1e4, 1e6, 1e8, 0.05])
def test_softcap_is_accurate_over_its_whole_range(isa, cap, dtype_name):
    """cap * tanh(s / cap) for caps far above the scores (tanh of tiny arguments) and far
    below them (saturated): the old 1 - 2 / (exp(2x) + 1) lost all precision at 1e6+."""
    batch = case_inputs("mixed", dtype_name, 64, 16, 8, 2)
    args = {**feature_args("causal", 8, 64), "softcap": cap, "scale": 0.7}
    want = run_reference(batch, args)
    assert_matches_reference(run_native(batch, args, block_size=16), want, DTYPES[dtype_name])


@pytest.mark.parametrize("cap", [1e-46, 1e-40, 1e39, math.inf, math.nan, -1.0])
def test_softcap_that_float32_cannot_hold_is_rejected(cap):
    """1e-46 used to become 0.0f (capping silently off), 1e-40 a denormal whose reciprocal
    is inf."""
    with pytest.raises(ValueError, match=r"softcap"):
        ops.cpu_attention_with_kv_cache(**{**_good_call_args(), "softcap": cap})


# ------------------------------------------------------------ 4. ALiBi far from the origin

def shifted_batch(batch, shift: int, block_size: int):
    """The same requests with `shift` (a block multiple) more keys in front: the table maps
    the front to block 0 (never read: the window hides it), the rest as before."""
    assert shift % block_size == 0
    front = shift // block_size
    table = torch.zeros(batch.block_table.shape[0], front + batch.block_table.shape[1],
                        dtype=torch.int32)
    table[:, front:] = batch.block_table
    return type(batch)(**{**batch.__dict__, "block_table": table,
                          "seq_lens": batch.seq_lens + shift})


@pytest.mark.parametrize("shift_log2", [25, 30])
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_alibi_far_from_the_origin(isa, shift_log2, dtype_name):
    """ALiBi depends on j - p only: moving every position by 2**25 or 2**30 (a window hides
    the front) must not change the output. Positions computed in fp32 lost the low bits."""
    block_size = 256
    spec = BatchSpec("alibi_far", (300, 460), (70, 260))  # every query row p >= 100
    batch = make_paged_batch(spec, num_heads=8, num_kv_heads=2, head_size=64,
                             block_size=block_size, dtype=DTYPES[dtype_name], seed=3)
    args = {**feature_args("alibi", 8, 64), "sliding_window": (100, 0)}
    want = run_reference(batch, args)
    far = shifted_batch(batch, 2 ** shift_log2, block_size)
    got = run_native(far, args, block_size=block_size)
    assert_matches_reference(got, want, DTYPES[dtype_name])


# ------------------------------------------------------------ 5. NaN in V stays where it is seen

@pytest.mark.parametrize("dtype_name", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4), (16, 1)], ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_non_finite_value_reaches_only_the_rows_that_see_it(isa, dtype_name, heads, bad):
    """A 20-token causal prefill with V[19] non-finite: only row 19 may see key 19. The
    rows of the same query tile gave it weight 0, and 0 * NaN = NaN leaked into them."""
    num_heads, num_kv_heads = heads
    batch = make_paged_batch(BatchSpec("p20", (20, 45), (20, 45)), num_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_size=64, block_size=16,
                             dtype=DTYPES[dtype_name], seed=5)
    clean = run_reference(batch, feature_args("causal", num_heads, 64))
    blk = int(batch.block_table[0, 19 // 16])
    value_cache = batch.value_cache.clone()
    value_cache[blk, :, 19 % 16, 5] = float(bad)
    poisoned = type(batch)(**{**batch.__dict__, "value_cache": value_cache})
    got = run_native(poisoned, feature_args("causal", num_heads, 64), block_size=16)
    assert not torch.isfinite(got[19]).all(), "row 19 sees the bad value"
    assert_matches_reference(got[:19], clean[:19], DTYPES[dtype_name])
    assert_matches_reference(got[20:], clean[20:], DTYPES[dtype_name])


def test_reference_drops_keys_a_row_cannot_see():
    batch = make_paged_batch(BatchSpec("p20", (20,), (20,)), num_heads=2, num_kv_heads=1,
                             head_size=32, block_size=16, dtype=torch.float32)
    args = feature_args("causal", 2, 32)
    clean = run_reference(batch, args)
    value_cache = batch.value_cache.clone()
    value_cache[int(batch.block_table[0, 1]), :, 3] = math.nan  # key 19
    got = run_reference(type(batch)(**{**batch.__dict__, "value_cache": value_cache}), args)
    assert torch.isnan(got[19]).all()
    torch.testing.assert_close(got[:19], clean[:19], atol=0, rtol=0)


# ------------------------------------------------------------ 6. invalid input accepted

def test_output_with_overlapping_rows_is_rejected():
    args = _good_call_args()
    q = args["query"]
    overlapping = torch.empty(1, *q.shape[1:]).expand(q.shape)
    with pytest.raises(ValueError, match=r"output.*overlap|output.*stride"):
        ops.cpu_attention_with_kv_cache(**{**args, "output": overlapping})


@pytest.mark.parametrize("heads", [
    (2 ** 32 + 4, 4), (2 ** 32 + 4, 2 ** 32 + 4), (2 ** 61, 2 ** 61), (2 ** 61, 1),
    # Beyond int64, found by the fuzz campaign: the dispatcher said "Expected a value of
    # type 'int' for argument 'num_heads' but instead found type 'int'".
    (2 ** 63, 4), (4, 2 ** 64), (-(2 ** 63) - 1, 1)])
def test_scheduler_metadata_rejects_head_counts_beyond_int32(heads):
    batch = case_inputs("mixed", "fp32", 64, 16, 8, 2)
    with pytest.raises(ValueError, match=rf"num_heads|num_kv_heads"):
        ops.cpu_attn_get_scheduler_metadata(
            num_reqs=5, num_heads=heads[0], num_kv_heads=heads[1], head_dim=64,
            seq_lens=batch.seq_lens, dtype=torch.float32, query_start_loc=batch.query_start_loc,
            causal=True, sliding_window_size=-1, isa="vec16", enable_kv_split=True)


# ------------------------------------------------------------ 7. misleading messages

@pytest.mark.parametrize("change", [-2, 2, 1])
def test_metadata_of_the_wrong_length_says_so(change):
    args = _good_call_args()
    meta = args["scheduler_metadata"]
    meta = meta[:change] if change < 0 else torch.cat([meta, torch.zeros(change, dtype=meta.dtype)])
    with pytest.raises(ValueError) as info:
        ops.cpu_attention_with_kv_cache(**{**args, "scheduler_metadata": meta})
    msg = str(info.value)
    assert str(meta.numel()) in msg and "elements" in msg, msg
    assert "built for 5 requests, this call has 5" not in msg


@pytest.mark.parametrize("name", ["scheduler_metadata", "query", "key_cache", "value_cache",
                                  "output", "block_table", "seq_lens", "query_start_loc"])
def test_none_for_a_tensor_names_the_argument(name):
    with pytest.raises((TypeError, ValueError), match=name):
        ops.cpu_attention_with_kv_cache(**{**_good_call_args(), name: None})


def test_reference_treats_huge_windows_as_unbounded():
    """pos + 2**63 - 1 overflowed int64 in the reference's mask: all keys hidden."""
    for causal in (True, False):
        want = ref.visibility_mask(5, 9, causal, (-1, -1))
        for window in [(2 ** 63 - 1, 2 ** 63 - 1), (-1, 2 ** 63 - 1), (2 ** 62, -1)]:
            assert torch.equal(ref.visibility_mask(5, 9, causal, window), want)
