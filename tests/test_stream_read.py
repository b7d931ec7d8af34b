"""``ops.stream_read``, the bench's DRAM roof: the sum of a buffer's bytes under every ISA
(lengths on and off each load width, unaligned starts, the parallel split), its
validation, its fake implementation, and the reference it falls back to."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedattn import ops
from pagedattn.ops import reference

native = pytest.mark.skipif(not ops.native_available(), reason="native extension not built")

CHUNK = 1 << 18  # stream_ops.cpp's parallel grain: longer buffers split over the threads
# 1 byte; around the 16/32/64-byte loads and their 4-load unroll (64/128/256); one chunk
# and just past it (two threads); several uneven chunks.
LENGTHS = [1, 15, 16, 17, 31, 33, 63, 64, 65, 127, 255, 257, 4099, CHUNK, CHUNK + 1,
           3 * CHUNK + 4097]


def random_bytes(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)


def numpy_sum(t: torch.Tensor) -> int:
    """The expected value, computed by numpy over the tensor's bytes."""
    return int(t.reshape(-1).view(torch.uint8).numpy().astype(np.uint64).sum())


@native
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("offset", [0, 1, 7], ids=lambda o: f"at+{o}")
def test_sum_of_bytes_matches_numpy(isa, n, offset):
    buf = random_bytes(n + offset, n)[offset:]  # a view: its data starts `offset` bytes in
    assert buf.numel() == n and buf.is_contiguous()
    assert ops.stream_read(buf) == numpy_sum(buf)


@native
@pytest.mark.parametrize("threads", [1, 2])
def test_threads_split_the_same_sum(isa, threads):
    buf = random_bytes(5 * CHUNK + 12345, 3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert ops.stream_read(buf) == numpy_sum(buf)
    finally:
        torch.set_num_threads(before)


@native
def test_all_ones_bytes_do_not_overflow_the_lane_sums(isa):
    # 255 per byte: each u64 lane of a vector accumulator takes 8 x 255 per load.
    buf = torch.full((4 << 20,), 255, dtype=torch.uint8)
    assert ops.stream_read(buf) == 255 * (4 << 20)


@native
@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 1001),
    lambda: torch.randn(513).bfloat16(),
    lambda: (torch.randn(77) * 100).to(torch.float8_e4m3fn),
    lambda: torch.tensor(-7, dtype=torch.int64),  # 0-d
    lambda: torch.tensor([True, False, True]),
], ids=["fp32", "bf16", "fp8", "int64-0d", "bool"])
def test_any_dtype_is_read_as_its_bytes(make):
    buf = make()
    assert ops.stream_read(buf) == numpy_sum(buf) == reference.stream_read(buf)


@native
def test_changing_one_byte_changes_the_result():
    buf = torch.zeros(CHUNK * 3, dtype=torch.uint8)
    assert ops.stream_read(buf) == 0
    buf[CHUNK * 2 + 5] = 9  # in the last thread's range, off any vector boundary
    assert ops.stream_read(buf) == 9


@pytest.mark.parametrize("buf, exc, match", [
    ([1, 2, 3], TypeError, "buf must be a torch.Tensor, got list"),
    (torch.zeros(0), ValueError, r"buf must be non-empty, got shape \(0,\)"),
    (torch.zeros(4, 0, dtype=torch.uint8), ValueError, r"got shape \(4, 0\)"),
    (torch.zeros(4, 6)[:, ::2], ValueError,
     r"buf must be contiguous, got shape \(4, 3\) with strides \(6, 2\)"),
    (torch.zeros(3, 4).T, ValueError, "buf must be contiguous"),
    (torch.zeros(8, device="meta"), ValueError, "buf must be a CPU tensor, got device meta"),
    (torch.zeros(4).to_sparse(), ValueError, "buf must be a dense"),
])
def test_bad_buffers_are_rejected(buf, exc, match):
    with pytest.raises(exc, match=match):
        ops.stream_read(buf)


@native
@pytest.mark.parametrize("buf, match", [
    (torch.zeros(0), "buf must be non-empty"),
    (torch.zeros(4, 6)[:, ::2], "buf must be contiguous"),
])
def test_the_native_op_checks_its_input_too(buf, match):
    with pytest.raises(ValueError, match=match):
        torch.ops.pagedattn.stream_read(buf)


@native
def test_opcheck_and_fullgraph_compile():
    buf = random_bytes(1000, 5)
    torch.library.opcheck(torch.ops.pagedattn.stream_read, (buf,))
    torch.library.opcheck(torch.ops.pagedattn.stream_read, (torch.randn(33),))

    def step(b):
        return torch.ops.pagedattn.stream_read(b) + 1

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert int(compiled(buf)) == numpy_sum(buf) + 1


def test_without_the_extension_the_reference_gives_the_same_sum(monkeypatch):
    from pagedattn.ops import _native

    buf = random_bytes(1001, 9)[1:]
    monkeypatch.setattr(_native, "AVAILABLE", False)
    monkeypatch.setattr(ops, "_warned_fallback", True)  # the one-time warning is not tested here
    assert ops.stream_read(buf) == numpy_sum(buf)
