"""The engine's weights and KV caches on transparent huge pages (engine/huge_pages.py):
arenas aligned and advised where the kernel allows it, modules moved without a change in
what they compute, the engine's tokens the same either way, and the option checked."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedattn import LLM, SamplingParams
from pagedattn.engine import huge_pages
from pagedattn.engine.args import EngineArgs
from pagedattn.engine.cli import describe_engine

from builtin_models import needs_smollm2

needs_thp = pytest.mark.skipif(not huge_pages.available(),
                               reason=f"no transparent huge pages here (THP "
                                      f"{huge_pages.kernel_mode()})")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_thp
def test_an_arena_starts_on_a_huge_page_and_its_mapping_is_advised():
    raw, offset, advised = huge_pages.allocate(5 * 2**20 + 3)
    start = raw.data_ptr() + offset
    assert advised
    assert start % huge_pages.HUGE_PAGE_BYTES == 0
    assert raw.numel() - offset >= 5 * 2**20 + 3
    assert "hg" in _vm_flags(start)  # the kernel recorded MADV_HUGEPAGE for it


def test_without_the_advice_an_arena_is_plain_memory(monkeypatch):
    # (the memory itself may sit in a range an earlier arena advised: the heap reuses it)
    def refuse(*args):
        raise AssertionError(f"madvise called with {args}")

    monkeypatch.setattr(huge_pages, "_madvise_fn", refuse)
    raw, offset, advised = huge_pages.allocate(3 * 2**20, huge=False)
    assert (offset, advised) == (0, False)
    assert raw.numel() == 3 * 2**20
    tensors, advised = huge_pages.zeros((4, 1024), torch.float32, 3, huge=False)
    assert not advised and all(torch.count_nonzero(t) == 0 for t in tensors)


@pytest.mark.parametrize("nbytes", [-1, 2.5, "1MiB"])
def test_a_bad_size_is_refused_by_name(nbytes):
    with pytest.raises(ValueError, match=f"nbytes must be an int >= 0, got {nbytes!r}"):
        huge_pages.allocate(nbytes)


def test_kv_cache_arenas_are_zeroed_disjoint_and_aligned():
    shape, count = (2, 7, 16, 3, 8), 5
    tensors, advised = huge_pages.zeros(shape, torch.bfloat16, count)
    assert advised == huge_pages.available()
    assert len(tensors) == count
    spans = []
    for t in tensors:
        assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
        assert torch.count_nonzero(t) == 0
        assert t.data_ptr() % 64 == 0
        spans.append((t.data_ptr(), t.data_ptr() + t.nbytes))
    for t in tensors:  # writing one leaves the others alone
        t.fill_(1)
    assert all(torch.all(t == 1) for t in tensors)
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(300, 64)
        self.proj = nn.Linear(64, 300, bias=True)
        self.proj.weight = self.embed.weight  # tied, as a tied lm_head
        self.register_buffer("table", torch.randn(40, 64))
        self.register_buffer("view", self.table[10:20])  # a view: stays where it is
        self.register_buffer("tiny", torch.randn(8))  # below a page: stays

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.table[ids % 40].sum(-1, keepdim=True) + self.tiny.sum()
        return self.proj(h) + self.view.sum()


def test_moving_a_module_keeps_its_outputs_ties_and_views():
    model = _Tied().eval()
    ids = torch.arange(0, 300, 7)
    with torch.no_grad():
        before = model(ids)
    weight = model.embed.weight
    old_table, old_tiny, old_view, old_bias = (model.table.data_ptr(), model.tiny.data_ptr(),
                                               model.view.data_ptr(), model.proj.bias.data_ptr())
    moved, advised = huge_pages.move_module(model)
    assert advised == huge_pages.available()
    # the embedding (proj's weight too) and the table; not the view, nor the bias and the
    # tiny buffer (under a page each)
    assert moved == (300 * 64 + 40 * 64) * 4
    assert model.embed.weight is weight and model.proj.weight is weight
    assert isinstance(model.embed.weight, nn.Parameter)
    assert model.table.data_ptr() != old_table
    assert (model.tiny.data_ptr(), model.view.data_ptr(), model.proj.bias.data_ptr()) == \
        (old_tiny, old_view, old_bias)
    with torch.no_grad():
        assert torch.equal(model(ids), before)


def test_the_option_is_checked_by_name():
    with pytest.raises(ValueError, match="huge_pages must be a bool, got 'yes'"):
        EngineArgs(huge_pages="yes")


@pytest.fixture(scope="module")
def engines():
    kwargs = dict(model="smollm2", max_model_len=512, kv_cache_memory="64MiB")
    return LLM(huge_pages=True, **kwargs), LLM(huge_pages=False, **kwargs)


@needs_smollm2
def test_the_engine_generates_the_same_tokens_on_either_pages(engines):
    on, off = engines
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    assert [o.token_ids for o in on.generate(prompts, greedy)] == \
        [o.token_ids for o in off.generate(prompts, greedy)]


@needs_smollm2
def test_the_engine_says_which_pages_it_runs_on(engines):
    on, off = engines
    assert "weights and KV cache on 4 KiB pages (huge_pages=False)" in describe_engine(off)
    assert not off.weights_on_huge_pages and not off.engine.runner.kv_on_huge_pages
    if huge_pages.available():
        assert on.weights_on_huge_pages and on.engine.runner.kv_on_huge_pages
        assert (f"weights and KV cache on 2 MiB pages (THP {huge_pages.kernel_mode()})"
                in describe_engine(on))
        kv = on.engine.runner.kv_caches[0]
        assert "hg" in _vm_flags(kv.data_ptr())
    else:
        assert f"on 4 KiB pages (THP {huge_pages.kernel_mode()})" in describe_engine(on)


def test_info_names_the_kernels_huge_page_mode(capsys):
    from pagedattn.cli import main

    assert main(["info"]) == 0
    size = "2 MiB" if huge_pages.available() else "4 KiB"
    assert (f"pages     THP {huge_pages.kernel_mode()}: the engine's weights and KV cache on "
            f"{size} pages") in capsys.readouterr().out
