"""The native kernels' thread pool (csrc/cpu/work_pool.cpp).

Every index of a loop runs exactly once at any thread count, range and grain; a chunk's
exception reaches the caller and leaves the pool usable; two Python threads may run loops
at once; a forked child runs its own loops; lowering the thread count after a higher one
neither hangs nor changes a result. That the kernels on it give the same bits at every
thread count is what test_linear.py, test_layer_ops.py, test_native_stack.py and
test_batch_invariance.py check against one thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from pagedattn.ops import native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="needs the native extension")


def visits(n: int, grain: int, throw_at: int = -1) -> torch.Tensor:
    return torch.ops.pagedattn.work_pool_visits(n, grain, throw_at)


@pytest.fixture
def threads():
    old = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(old)


@pytest.mark.parametrize("num_threads", [1, 2, 3, 7])
@pytest.mark.parametrize("n, grain", [(0, 1), (1, 1), (5, 1), (64, 3), (1000, 1), (1000, 64),
                                      (1000, 999), (1000, 5000), (4099, 7)])
def test_every_index_runs_exactly_once(threads, num_threads, n, grain):
    threads(num_threads)
    for _ in range(3):
        assert torch.equal(visits(n, grain), torch.ones(n, dtype=torch.int32))


def test_thousands_of_short_loops_back_to_back(threads):
    # Workers arrive late to some loops and early to others: a late worker must never run
    # a chunk of the next loop with the last loop's range, nor count it twice.
    threads(4)
    for i in range(3000):
        n = 1 + (i * 7919) % 61
        assert torch.equal(visits(n, 1), torch.ones(n, dtype=torch.int32)), (i, n)


@pytest.mark.parametrize("num_threads", [1, 4])
def test_a_chunks_exception_reaches_the_caller_and_the_pool_goes_on(threads, num_threads):
    threads(num_threads)
    with pytest.raises(ValueError, match=r"chunk \[\d+, \d+\) raised as asked"):
        visits(1000, 1, throw_at=517)
    assert torch.equal(visits(1000, 1), torch.ones(1000, dtype=torch.int32))


def test_fewer_threads_after_more(threads):
    threads(6)
    assert torch.equal(visits(600, 1), torch.ones(600, dtype=torch.int32))
    for count in (2, 1, 3):
        threads(count)
        for _ in range(50):
            assert torch.equal(visits(600, 1), torch.ones(600, dtype=torch.int32))


def test_two_python_threads_run_loops_at_once(threads):
    threads(3)
    bad: list[str] = []

    def loop(seed: int) -> None:
        for i in range(200):
            n = 100 + (seed * 37 + i) % 900
            got = visits(n, 1 + i % 5)
            if not torch.equal(got, torch.ones(n, dtype=torch.int32)):
                bad.append(f"thread {seed} loop {i}: {got.tolist()}")

    workers = [threading.Thread(target=loop, args=(s,)) for s in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers), "a loop did not finish"
    assert bad == []


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity")
                    else True, reason="needs Linux and two CPUs this process may use")
def test_workers_run_where_torchs_openmp_threads_run_not_on_the_callers_core():
    # vLLM's CPU workers bind each OpenMP thread to one core, the caller included; a new
    # thread inherits its creator's mask, so a pool worker must take its OpenMP twin's.
    code = """
import os, torch
import pagedattn.ops
torch.set_num_threads(2)
torch.ones(1 << 22).sum()                     # OpenMP's team starts with the whole mask
first = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {first})              # the calling thread alone is bound
assert torch.equal(torch.ops.pagedattn.work_pool_visits(999, 1, -1), torch.ones(999, dtype=torch.int32))
import time
for _ in range(200):                          # the worker names itself as it starts
    named = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == "pagedattn-pool":
                named.append(int(tid))
    if named:
        break
    time.sleep(0.01)
for tid in named:
    print("worker", sorted(os.sched_getaffinity(tid)))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    workers = [line for line in proc.stdout.splitlines() if line.startswith("worker")]
    assert len(workers) == 1, proc.stdout
    assert len(eval(workers[0].split(" ", 1)[1])) >= 2, workers[0]


def test_a_forked_child_runs_its_own_loops():
    code = """
import os, torch
import pagedattn.ops
torch.set_num_threads(3)
assert torch.equal(torch.ops.pagedattn.work_pool_visits(999, 1, -1), torch.ones(999, dtype=torch.int32))
# torch's own OpenMP regions do not survive fork (libgomp): the expected values come
# first, and the child compares on one thread, after our ops ran on the pool
x = torch.randn(300, 256)
w = torch.randn(256)
want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
ones = torch.ones(999, dtype=torch.int32)
pid = os.fork()
if pid == 0:
    visits = torch.ops.pagedattn.work_pool_visits(999, 1, -1)
    got = pagedattn.ops.rms_norm(x, w, 1e-6)
    torch.set_num_threads(1)
    ok = torch.equal(visits, ones) and torch.allclose(got, want, atol=1e-5)
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "child 0" in proc.stdout
