"""The engine reads shared prefixes once: the n samples of one prompt, and requests behind
one system prompt with prefix caching, share their prompt's KV blocks, and the step's
attention plan (CPU_ATTN's builder, from the block table) reads those keys once for all
of them. The answers are those of the engine with sharing switched off."""

from __future__ import annotations

import pytest

from pagedattn import LLM, SamplingParams
from pagedattn.engine.args import EngineArgs
from pagedattn.engine.cli import engine_args
from pagedattn.ops.isa import METADATA_HEADER

from builtin_models import needs_smollm2


class PlanLog:
    """The shared-prefix groups of every step the engine planned (wraps its builder)."""

    def __init__(self, llm: LLM, monkeypatch) -> None:
        self.groups: list[tuple[int, int]] = []  # (groups, members) per step
        builder = llm.engine.attention.builder
        build = builder.build

        def logged(*args, **kwargs):
            md = build(*args, **kwargs)
            header = dict(zip(METADATA_HEADER, md.scheduler_metadata[:len(METADATA_HEADER)].tolist()))
            self.groups.append((header["num_groups"], header["num_members"]))
            return md

        monkeypatch.setattr(builder, "build", logged)


def _engines():
    # fp32: sharing changes a row's summation order only, far below any greedy tie.
    common = dict(model="smollm2", dtype="float32", max_model_len=1024, kv_cache_memory="160MiB")
    return LLM(**common), LLM(**common, shared_prefix_attention=False)


@pytest.fixture(scope="module")
def engines():
    return _engines()


@needs_smollm2
def test_n_samples_read_their_prompt_once(engines, monkeypatch):
    shared, alone = engines
    # ~600 tokens: a prefix long enough for sharing to pay (the planner's rule)
    ids = shared.engine.inputs.encode("The committee met on Tuesday to discuss the budget. " * 70)
    log = PlanLog(shared, monkeypatch)
    sp = SamplingParams(temperature=0, max_tokens=8, n=4, ignore_eos=True)
    out = shared.generate(ids, sp)[0]
    assert any(members == 4 for _, members in log.groups), log.groups
    want = alone.generate(ids, sp)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1


@needs_smollm2
def test_requests_behind_one_system_prompt_share_it(engines, monkeypatch):
    """Four chats behind one long system prompt, submitted together: one computes the
    prompt's blocks, the others take them from the prefix cache, and their decode steps
    read them once (one group of four)."""
    shared, alone = engines
    system = "You are a careful assistant. Paged attention keeps keys in blocks. " * 40
    questions = ["What is a block?", "Why page the cache?", "Name a river.",
                 "What is two plus two?"]
    prompts = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
               for q in questions]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    log = PlanLog(shared, monkeypatch)
    got = shared.chat(prompts, sp)
    assert any(groups >= 1 and members == 4 for groups, members in log.groups), log.groups
    want = alone.chat(prompts, sp)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_the_switch_is_checked_and_reaches_the_engine_args():
    with pytest.raises(ValueError, match="shared_prefix_attention"):
        EngineArgs(shared_prefix_attention="no")
    import argparse

    from pagedattn.engine.cli import add_generate_arguments

    parser = argparse.ArgumentParser()
    add_generate_arguments(parser)
    assert engine_args(parser.parse_args([])).shared_prefix_attention is True
    args = parser.parse_args(["--no-shared-prefix-attention"])
    assert engine_args(args).shared_prefix_attention is False
