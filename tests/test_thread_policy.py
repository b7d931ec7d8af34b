"""pagedattn.thread_policy.

The OpenMP wait policy: applied when pagedattn loads torch, never over the user's own
settings, never leaked to child processes, and reported. libgomp prints the settings it
read when OMP_DISPLAY_ENV=verbose, so each case runs in a fresh interpreter and reads that.

The threads of a step (StepThreads): the user's count while the machine is otherwise
idle, the cores other processes leave free while they are busy, set for the step only;
the neighbours' load read from /proc/stat less this process's own CPU time.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

from pagedattn import thread_policy
from pagedattn.thread_policy import NeighbourLoad, StepThreads


def run_fresh(code: str, **env: str) -> tuple[str, str]:
    """``(stdout, libgomp's GOMP_SPINCOUNT)`` of ``code`` in a new interpreter."""
    clean = {k: v for k, v in os.environ.items() if k not in thread_policy.USER_VARIABLES}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**clean, "OMP_DISPLAY_ENV": "verbose", **env}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    spin = re.search(r"GOMP_SPINCOUNT = '(\d+)'", proc.stdout + proc.stderr)
    if spin is None:
        pytest.skip("torch's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT in its report)")
    return proc.stdout, spin.group(1)


REPORT = ("import os; from pagedattn import thread_policy; print(thread_policy.describe()); "
          "print('child sees', os.environ.get('GOMP_SPINCOUNT'))")


def test_importing_pagedattn_first_loads_torch_with_its_spin_count():
    out, spin = run_fresh("import pagedattn\n" + REPORT.replace("; ", "\n"))
    assert spin == str(thread_policy.SPIN_COUNT)
    assert f"spins {thread_policy.SPIN_COUNT} then sleeps (pagedattn's default)" in out
    assert "child sees None" in out  # set only while torch loaded


@pytest.mark.parametrize("name, value", [("GOMP_SPINCOUNT", "1234"),
                                         ("OMP_WAIT_POLICY", "active")])
def test_the_users_own_setting_wins(name, value):
    out, spin = run_fresh("import pagedattn\n" + REPORT.replace("; ", "\n"), **{name: value})
    if name == "GOMP_SPINCOUNT":
        assert spin == "1234"
    else:
        assert spin != str(thread_policy.SPIN_COUNT)
    assert f"from the environment ({name}={value})" in out


def test_torch_imported_first_keeps_openmps_default_and_says_so():
    out, spin = run_fresh("import torch\nimport pagedattn\n" + REPORT.replace("; ", "\n"))
    assert spin != str(thread_policy.SPIN_COUNT)
    assert "torch was imported before pagedattn" in out


def test_the_engine_line_names_the_policy():
    from pagedattn.engine.cli import describe_engine

    class FakeLLM:  # describe_engine reads args and engine only
        class args:
            model, dtype, linear_impl, huge_pages = "m", "bfloat16", "auto", False
        engine = None
        embedder = type("E", (), {"builder": object()})()
        act_dtype = "bfloat16"
        weights_on_huge_pages = False

    assert describe_engine(FakeLLM()).endswith(thread_policy.describe())
    assert "threads" in thread_policy.describe()


# ------------------------------------------------------------------ the threads of a step


class FakeMachine:
    """A clock and counters for NeighbourLoad: each ``tick`` of wall time the neighbours
    use ``others`` cores and this process ``own`` cores."""

    def __init__(self, others: float, own: float = 0.0) -> None:
        self.others, self.own = others, own
        self.t = self.busy = self.own_s = 0.0
        self.reads = 0

    def tick(self, dt: float = 1.0) -> None:
        self.t += dt
        self.busy += (self.others + self.own) * dt
        self.own_s += self.own * dt

    def read_busy(self) -> float:
        self.reads += 1
        return self.busy

    def load(self, cpus: int = 2, window_s: float = 0.25) -> NeighbourLoad:
        return NeighbourLoad(list(range(cpus)), busy_seconds=self.read_busy,
                             own_seconds=lambda: self.own_s, clock=lambda: self.t,
                             window_s=window_s)


def test_the_neighbours_load_is_the_busy_time_less_our_own():
    machine = FakeMachine(others=1.25, own=0.75)
    load = machine.load()
    assert load.update() == 0.0  # no window has passed yet
    machine.tick()
    assert load.update() == pytest.approx(1.25)
    machine.others = 0.0
    machine.tick()
    assert load.update() == pytest.approx(0.0)


def test_the_load_is_read_once_per_window():
    machine = FakeMachine(others=1.0)
    load = machine.load(window_s=0.25)
    reads = machine.reads
    machine.tick(0.1)
    load.update()
    assert machine.reads == reads  # inside the window: the last estimate, no read
    machine.tick(0.2)
    assert load.update() == pytest.approx(1.0)
    assert machine.reads == reads + 1


def test_the_load_is_clamped_to_the_cpus():
    machine = FakeMachine(others=9.0)
    load = machine.load(cpus=2)
    machine.tick()
    assert load.update() == 2.0


@pytest.mark.parametrize("cpus, others, ceiling, threads", [
    (2, 0.0, 2, 2),    # quiet: the user's count
    (2, 0.4, 2, 2),    # a light neighbour: still the user's count
    (2, 1.0, 2, 1),    # another engine on one core
    (2, 2.0, 2, 1),    # every core busy: never below one
    (2, 1.0, 8, 1),    # an oversubscribed user count is capped by the free cores
    (16, 3.4, 16, 13),
    (16, 3.4, 4, 4),   # never above the user's count
    (16, 0.3, 32, 32),  # quiet: the user's count, even above the cores
])
def test_a_step_runs_on_the_cores_the_neighbours_leave(cpus, others, ceiling, threads):
    machine = FakeMachine(others=others)
    policy = StepThreads(True, machine.load(cpus=cpus))
    machine.tick()
    assert policy.choose(ceiling) == threads
    assert StepThreads(False).choose(ceiling) == ceiling


def test_the_count_is_set_for_the_step_and_restored_after():
    machine = FakeMachine(others=1.0)
    policy = StepThreads(True, machine.load(cpus=2))
    machine.tick()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with policy.step() as threads:
            assert threads == torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="boom"), policy.step():
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2
        assert policy.steps_by_threads == {1: 2}
        assert policy.last_threads == 1 and policy.steps_on_fewer == 2
        assert "fewer threads while other processes keep cores busy (steps: 2 on 1)" \
            in policy.describe()
    finally:
        torch.set_num_threads(before)


def test_without_proc_stat_every_step_runs_the_users_count():
    policy = StepThreads(True, NeighbourLoad([0, 1], busy_seconds=lambda: None))
    assert policy.choose(2) == 2
    assert "/proc/stat unreadable" in policy.describe()
    assert "adaptive_threads=False" in StepThreads(False).describe()


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads Linux's /proc/stat")
def test_a_spinning_process_counts_and_our_own_spinning_thread_does_not():
    def others_while(start, stop) -> float:
        load = NeighbourLoad(window_s=0.0)
        start()
        time.sleep(0.2)
        load.update()
        time.sleep(0.8)
        cores = load.update()
        stop()
        return cores

    child = []
    spin_child = (lambda: child.append(subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 20\n"
                               "while time.time() < end: pass"])))

    def stop_child():
        child[0].kill()
        child[0].wait()

    done = threading.Event()
    worker = threading.Thread(target=lambda: [None for _ in iter(done.is_set, True)])
    ours = others_while(worker.start, lambda: (done.set(), worker.join()))
    cpus = NeighbourLoad().num_cpus
    if ours > cpus - 1:
        pytest.skip(f"other processes keep {ours:.1f} of {cpus} CPUs busy: no core is free "
                    "for the spinning child to show on")
    theirs = others_while(spin_child, stop_child)
    # the machine's other load is in both readings; the spinning child is one core more
    assert theirs - ours >= 0.5, (ours, theirs)


# ------------------------------------------------------------------ in the engine


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    path = tmp_path_factory.mktemp("llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def recording(llm) -> list[tuple[int, torch.Tensor]]:
    """Each step's ``(thread count, final hidden states)`` of ``llm``'s model, from now."""
    steps, forward = [], llm.engine.runner.model.forward

    def recording_forward(*a, **kw):
        out = forward(*a, **kw)
        steps.append((torch.get_num_threads(), out.clone()))
        return out

    llm.engine.runner.model.forward = recording_forward
    return steps


def test_an_engine_beside_busy_neighbours_steps_on_fewer_threads(tiny_llama):
    from pagedattn import LLM, SamplingParams

    prompts = [[(5 * i + j) % 90 + 3 for j in range(n)] for i, n in enumerate((9, 30, 17))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    args = dict(skip_tokenizer_init=True, kv_cache_memory="8MiB", max_model_len=128,
                dtype="float32", batch_invariant=True)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone = LLM(tiny_llama, adaptive_threads=False, **args)
        assert alone.engine.runner.threads.describe().endswith("(adaptive_threads=False)")
        alone_steps = recording(alone)
        expected = alone.generate(prompts, params)

        beside = LLM(tiny_llama, adaptive_threads=True, **args)
        machine = FakeMachine(others=1.0)
        beside.engine.runner.threads = StepThreads(True, machine.load(cpus=2))
        machine.tick()
        beside_steps = recording(beside)
        got = beside.generate(prompts, params)
        assert {t for t, _ in alone_steps} == {2}
        assert {t for t, _ in beside_steps} == {1}
        assert torch.get_num_threads() == 2
        load = beside.engine.load()
        assert load.step_threads == 1 and load.steps_on_fewer_threads == len(beside_steps)
        # batch-invariant results do not depend on the thread count
        assert [r.token_ids for r in got] == [r.token_ids for r in expected]
        assert len(alone_steps) == len(beside_steps)
        for (_, a), (_, b) in zip(alone_steps, beside_steps):
            assert torch.equal(a, b)

        machine.others = 0.0  # the neighbours left: the next steps run on two again
        machine.tick()
        beside_steps.clear()
        beside.generate(prompts[:1], params)
        assert {t for t, _ in beside_steps} == {2}
        assert beside.engine.load().step_threads == 2
    finally:
        torch.set_num_threads(before)


def test_the_option_and_its_flag():
    import argparse

    from pagedattn.engine.args import EngineArgs
    from pagedattn.engine.cli import add_generate_arguments, engine_args

    with pytest.raises(ValueError, match="adaptive_threads must be a bool, got 'no'"):
        EngineArgs(adaptive_threads="no")
    p = argparse.ArgumentParser()
    add_generate_arguments(p)
    assert engine_args(p.parse_args([])).adaptive_threads is False
    assert EngineArgs().adaptive_threads is False
    assert engine_args(p.parse_args(["--adaptive-threads"])).adaptive_threads is True
    assert engine_args(p.parse_args(["--no-adaptive-threads"])).adaptive_threads is False


def test_the_description_names_the_kernels_pool_where_the_extension_is_loaded():
    from pagedattn.ops import native_available

    if not native_available():
        pytest.skip("no native extension: no kernel pool to describe")
    spin = torch.ops.pagedattn.work_pool_spin_micros()
    assert 0 < spin < 10_000
    assert "pagedattn's kernels on their own pool" in thread_policy.describe()
    assert f"idle workers spin {spin} us, then sleep" in thread_policy.describe()
