"""Engine unit tests: block pool, prefix cache, scheduler, input batch (no model), and the
shared-prefix admission rule on SmolLM2 (its outputs against requests run one by one)."""

from __future__ import annotations

import random

import pytest

from builtin_models import needs_smollm2

from pagedattn import LLM
from pagedattn.engine.block_pool import BlockPool, KVCacheManager
from pagedattn.engine.input_batch import InputBatch
from pagedattn.engine.request import FinishReason, Request, RequestStatus, new_sequences
from pagedattn.engine.sampling_params import SamplingParams
from pagedattn.engine.args import EngineArgs
from pagedattn.engine.scheduler import MAX_PASSED_OVER, RequestRejectedError, Scheduler
from pagedattn.paging import cdiv


def _req(i: int, prompt: list[int], max_tokens: int = 8, n: int = 1) -> Request:
    """Request ``r{i}`` (sequence 0 of its ``n``; ``.group`` holds them all)."""
    return new_sequences(f"r{i}", list(prompt),
                         SamplingParams(temperature=0, max_tokens=max_tokens, n=n))[0]


def _step(sched: Scheduler, token: int = 1):
    """One step with ``token`` sampled for every request whose last known token ran."""
    out = sched.schedule()
    sched.update(out, {r: token for r, k in out.num_scheduled_tokens.items()
                       if out.requests[r].num_computed_tokens + k == out.requests[r].num_tokens})
    return out


def _pool_is_consistent(kv: KVCacheManager, live: list[Request]) -> None:
    pool = kv.pool
    held: dict[int, int] = {}
    for req in live:
        for b in req.block_ids:
            held[b] = held.get(b, 0) + 1
    for b in range(pool.num_blocks):
        assert pool.ref_cnt[b] == held.get(b, 0), f"block {b}"
        assert (pool.ref_cnt[b] == 0) == (b in pool.free), f"block {b}"


def test_block_pool_never_leaks_over_1000_random_steps():
    rng = random.Random(0)
    bs = 4
    kv = KVCacheManager(num_blocks=40, block_size=bs, enable_prefix_caching=True)
    sched = Scheduler(kv, max_num_batched_tokens=24, max_model_len=64, max_num_seqs=8)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    n = 0
    for _ in range(1000):
        action = rng.random()
        if action < 0.3:
            prompt = rng.choice(prefixes)[: rng.randrange(1, 13)] + \
                [rng.randrange(50) for _ in range(rng.randrange(0, 20))]
            sched.add_request(_req(n, prompt, max_tokens=rng.randrange(1, 20),
                                   n=rng.choice([1, 1, 2, 3])))
            n += 1
        elif action < 0.4 and sched.requests:
            sched.abort_request(rng.choice(list(sched.requests)))
        elif action < 0.45 and sched.running:  # force a preemption
            out = sched.schedule()
            sched._preempt_newest(out)
            sched.update(out, {})
        else:
            out = sched.schedule()
            assert out.total_num_scheduled_tokens <= 24
            sampled = {rid: rng.randrange(50) for rid, k in out.num_scheduled_tokens.items()
                       if out.requests[rid].num_computed_tokens + k == out.requests[rid].num_tokens}
            sched.update(out, sampled)
        _pool_is_consistent(kv, sched.running + list(sched.waiting))
    for _ in range(2000):  # nothing waits forever: every request ends
        if not sched.has_unfinished():
            break
        _step(sched)
    assert not sched.has_unfinished()
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert sched.num_preemptions > 0


def test_prefix_cache_hits_count_shared_full_blocks():
    bs = 4
    kv = KVCacheManager(num_blocks=16, block_size=bs)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_model_len=64)
    shared = list(range(10))  # 2 full blocks + 2 tokens
    a = _req(0, shared + [20, 21], max_tokens=1)
    sched.add_request(a)
    out = sched.schedule()
    sched.update(out, {"r0": 99})
    assert a.is_finished and kv.pool.num_free_blocks == 16
    b = _req(1, shared + [30, 31, 32], max_tokens=1)
    sched.add_request(b)
    out = sched.schedule()
    # the 2 full blocks of the shared prefix come from the cache: 8 tokens not recomputed
    assert b.num_prefix_hit_tokens == 8
    assert out.num_scheduled_tokens["r1"] == len(b.prompt_token_ids) - 8
    # a prompt equal to a cached one still computes its last token
    sched.update(out, {"r1": 5})
    c = _req(2, shared + [20, 21], max_tokens=1)
    sched.add_request(c)
    out = sched.schedule()
    assert out.num_scheduled_tokens["r2"] >= 1
    assert c.num_prefix_hit_tokens == 8


def test_prefix_cache_evicts_least_recently_freed_first():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.register(b, 100 + i)
    pool.release([blocks[1]])
    pool.release([blocks[0]])
    pool.release([blocks[2]])
    assert pool.allocate(1) == [blocks[1]]
    assert 101 not in pool.cached and 100 in pool.cached and 102 in pool.cached


@pytest.mark.parametrize("budget", [1, 5, 16])
def test_scheduler_respects_budget_and_puts_decodes_first(budget):
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_batched_tokens=budget, max_model_len=64)
    for i in range(4):
        sched.add_request(_req(i, list(range(3 + 5 * i)), max_tokens=6))
    while sched.has_unfinished():
        out = sched.schedule()
        assert 0 < out.total_num_scheduled_tokens <= budget
        kinds = [out.requests[r].num_tokens - out.requests[r].num_computed_tokens > 1
                 for r in out.num_scheduled_tokens]
        assert kinds == sorted(kinds), "a prefill was scheduled before a decode"
        sched.update(out, {r: 7 for r, k in out.num_scheduled_tokens.items()
                           if out.requests[r].num_computed_tokens + k == out.requests[r].num_tokens})
    assert kv.pool.num_free_blocks == 64


@pytest.mark.parametrize("policy", ["fcfs", "shortest_first"])
def test_scheduler_preempts_newest_and_serves_it_first_again(policy):
    bs = 4
    kv = KVCacheManager(num_blocks=6, block_size=bs, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_model_len=24, policy=policy)
    old, new = _req(0, list(range(8)), max_tokens=12), _req(1, list(range(8)), max_tokens=12)
    sched.add_request(old)
    sched.add_request(new)
    preempted = []
    while sched.has_unfinished():
        out = sched.schedule()
        preempted += out.preempted
        sched.update(out, {r: 1 for r, k in out.num_scheduled_tokens.items()
                           if out.requests[r].num_computed_tokens + k == out.requests[r].num_tokens})
    assert preempted and set(preempted) == {"r1"}
    assert old.finish_time < new.finish_time
    assert len(new.output_token_ids) == 12 and new.num_preemptions >= 1


def _admission_order(sched: Scheduler) -> list[str]:
    order = []
    while sched.has_unfinished():
        out = sched.schedule()
        order += [r for r in out.num_scheduled_tokens if r not in order]
        sched.update(out, {r: 1 for r, k in out.num_scheduled_tokens.items()
                           if out.requests[r].num_computed_tokens + k == out.requests[r].num_tokens})
    return order


@pytest.mark.parametrize("policy, expected", [("fcfs", ["r0", "r1", "r2", "r3"]),
                                              ("shortest_first", ["r1", "r3", "r2", "r0"])])
def test_policy_orders_admission(policy, expected):
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(kv, max_num_batched_tokens=4, max_model_len=64, policy=policy)
    for i, n in enumerate([12, 4, 8, 4]):  # shortest first: r1 and r3 tie, r1 came first
        sched.add_request(_req(i, list(range(n)), max_tokens=2))
    assert _admission_order(sched) == expected
    assert kv.pool.num_free_blocks == 32


def test_shortest_first_serves_a_long_prompt_once_passed_over_enough():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_batched_tokens=2, max_model_len=64, policy="shortest_first")
    sched.add_request(_req(0, list(range(40)), max_tokens=1))
    for i in range(1, MAX_PASSED_OVER + 4):  # a stream of 2-token prompts, one per step
        sched.add_request(_req(i, [1, 2], max_tokens=1))
    order = _admission_order(sched)
    # each step admits one short prompt (the budget) until r0 was passed over enough
    assert order.index("r0") == MAX_PASSED_OVER
    assert len(order) == MAX_PASSED_OVER + 4


def test_unknown_scheduling_policy_is_rejected():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match="fcfs, shortest_first, got 'lifo'"):
        Scheduler(kv, max_num_batched_tokens=16, max_model_len=32, policy="lifo")
    with pytest.raises(ValueError, match="scheduling_policy.*'sjf'"):
        EngineArgs(scheduling_policy="sjf")


def test_request_that_can_never_fit_is_rejected():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(kv, max_num_batched_tokens=16, max_model_len=32)
    with pytest.raises(RequestRejectedError, match="32"):
        sched.add_request(_req(0, list(range(40))))
    with pytest.raises(RequestRejectedError, match="empty"):
        sched.add_request(_req(1, []))


def test_pool_smaller_than_one_request_fails_at_start_up():
    with pytest.raises(ValueError, match="max_model_len=64"):
        Scheduler(KVCacheManager(num_blocks=3, block_size=16), 32, max_model_len=64)


def test_abort_frees_blocks_and_finishes():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(kv, max_num_batched_tokens=16, max_model_len=32)
    r = _req(0, list(range(10)))
    sched.add_request(r)
    sched.update(sched.schedule(), {})
    assert kv.pool.num_free_blocks < 8
    sched.abort_request("r0")
    assert r.finish_reason is FinishReason.ABORT and r.status is RequestStatus.FINISHED
    assert kv.pool.num_free_blocks == 8


def test_input_batch_keeps_rows_and_block_tables_in_sync():
    batch = InputBatch(max_num_reqs=4, max_blocks_per_req=8)
    reqs = {f"r{i}": _req(i, [1] * 5) for i in range(3)}
    for i, r in enumerate(reqs.values()):
        r.block_ids = [10 * i, 10 * i + 1]
    batch.update(reqs)
    batch.swap_states(0, 2)
    assert batch.req_ids == ["r2", "r1", "r0"]
    reqs["r1"].block_ids.append(99)
    del reqs["r2"]
    batch.update(reqs)
    for row, rid in enumerate(batch.req_ids):
        n = len(reqs[rid].block_ids)
        assert batch.block_table[row, :n].tolist() == reqs[rid].block_ids
    assert cdiv(5, 4) == 2


def test_sampling_params_reject_bad_values():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])


# ---------------------------------------------------------------------- n > 1: forks


@pytest.mark.parametrize("prompt_len, prefix_caching", [
    (11, True),   # 10 tokens taken from sequence 0: blocks 0-1 shared, block 2 copied
    (9, True),    # 8 tokens: blocks 0-1 shared, no partly filled block to copy
    (11, False),  # the same without prefix caching: forks do not depend on it
    (1, True),    # a one-token prompt: nothing to take, each computes it
], ids=["partial", "block-boundary", "no-prefix-caching", "one-token"])
def test_sequences_fork_from_sequence_0_sharing_full_blocks(prompt_len, prefix_caching):
    bs, n = 4, 3
    kv = KVCacheManager(num_blocks=32, block_size=bs, enable_prefix_caching=prefix_caching)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_model_len=64)
    req = _req(0, list(range(100, 100 + prompt_len)), max_tokens=5, n=n)
    sched.add_request(req)
    seqs = req.group
    assert [s.req_id for s in seqs] == ["r0", "r0#1", "r0#2"] and [s.index for s in seqs] == [0, 1, 2]
    taken = prompt_len - 1
    full, partial = divmod(taken, bs)
    if taken:  # sequence 0 computes the prompt but its last token; the others wait for it
        out = _step(sched)
        assert out.num_scheduled_tokens == {"r0": taken}
        assert len(sched.waiting) == n - 1
    out = _step(sched)  # all n compute the last prompt token and sample
    assert out.num_scheduled_tokens == {s.req_id: 1 if taken else prompt_len for s in seqs}
    shared = seqs[0].block_ids[:full]
    for s in seqs:
        assert s.block_ids[:full] == shared and len(s.output_token_ids) == 1
    assert all(kv.pool.ref_cnt[b] == n for b in shared)
    tails = [s.block_ids[full] for s in seqs]
    assert len(set(tails)) == n and all(kv.pool.ref_cnt[b] == 1 for b in tails)
    # copy on write: each fork copies sequence 0's partly filled block into its own
    want = [(tails[0], t) for t in tails[1:]] if partial else []
    assert out.block_copies == want
    _pool_is_consistent(kv, seqs)
    while sched.has_unfinished():
        _step(sched)
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert all(len(s.output_token_ids) == 5 for s in seqs)
    if prefix_caching and full:  # the shared blocks stay findable in the prefix cache
        assert all(h in kv.pool.cached for h in seqs[0].block_hashes[:full])


def test_aborting_a_request_ends_all_its_sequences_and_frees_every_block():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_model_len=64)
    req = _req(0, list(range(10)), max_tokens=20, n=4)
    sched.add_request(req)
    for _ in range(3):
        _step(sched)
    assert kv.pool.num_free_blocks < 32 and len(sched.running) == 4
    assert len(sched.abort_request("r0")) == 4
    assert all(s.finish_reason is FinishReason.ABORT for s in req.group)
    assert kv.pool.num_free_blocks == 32 and not sched.has_unfinished()
    assert sched.abort_request("r0") == []  # finished: nothing left to abort


def test_a_fork_waits_while_sequence_0_is_preempted_and_forks_after_its_recompute():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_model_len=64)
    req = _req(0, list(range(10)), max_tokens=3, n=2)
    sched.add_request(req)
    out = sched.schedule()  # sequence 0 computes 9 tokens ...
    sched._preempt_newest(out)  # ... and is preempted before they are done
    sched.update(out, {})
    child = req.group[1]
    assert child.parent is req and req.status is RequestStatus.WAITING
    out = _step(sched)
    assert out.num_scheduled_tokens == {"r0": 9}  # sequence 0 again, the fork still waits
    _step(sched)
    assert child.parent is None and child.block_ids[:2] == req.block_ids[:2]
    while sched.has_unfinished():
        _step(sched)
    assert kv.pool.num_free_blocks == 32


def test_a_sequence_whose_sequence_0_ended_first_computes_its_prompt():
    """With one running slot the fork cannot run beside sequence 0: once that finishes,
    the other sequence computes its prompt itself (prefix-cache hits)."""
    kv = KVCacheManager(num_blocks=32, block_size=4)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_model_len=64, max_num_seqs=1)
    req = _req(0, list(range(10)), max_tokens=2, n=2)
    sched.add_request(req)
    while not req.is_finished:
        _step(sched)
    child = req.group[1]
    assert child.parent is None and child.status is RequestStatus.WAITING
    out = _step(sched)
    assert out.num_scheduled_tokens == {"r0#1": 2} and child.num_prefix_hit_tokens == 8
    while sched.has_unfinished():
        _step(sched)
    assert len(child.output_token_ids) == 2 and kv.pool.num_free_blocks == 32


# ---------------------------------------------------------------------- shared prefixes


@pytest.mark.parametrize("budget", [64, 5], ids=["one-step-prefill", "chunked-prefill"])
def test_requests_sharing_a_prefix_wait_for_it_and_take_it_as_hits(budget):
    """Four requests with a 12-token (3-block) common prefix arrive together: the first
    computes the prefix, the others wait until its blocks are cached and then share
    them; an unrelated request that arrives after them is not held up."""
    bs = 4
    kv = KVCacheManager(num_blocks=64, block_size=bs)
    sched = Scheduler(kv, max_num_batched_tokens=budget, max_model_len=64)
    prefix = list(range(100, 112))
    reqs = [_req(i, prefix + [i, i + 50], max_tokens=10) for i in range(4)]
    other = _req(9, [7] * 14, max_tokens=3)
    for r in reqs + [other]:
        sched.add_request(r)
    out = sched.schedule()
    assert "r1" not in out.num_scheduled_tokens  # held: r0 computes its prefix now
    if budget == 64:
        assert set(out.num_scheduled_tokens) == {"r0", "r9"}  # the unrelated one runs
    sched.update(out, {})
    while any(r.status is RequestStatus.WAITING for r in reqs):
        _step(sched)
    # each waiter was admitted once the whole prefix was cached, and took it as hits
    assert [r.num_prefix_hit_tokens for r in reqs] == [0, 12, 12, 12]
    assert all(r.status is RequestStatus.RUNNING for r in reqs)
    shared = reqs[0].block_ids[:3]
    assert all(r.block_ids[:3] == shared for r in reqs)
    assert all(kv.pool.ref_cnt[b] == 4 for b in shared)
    while sched.has_unfinished():
        _step(sched)
    assert kv.pool.num_free_blocks == 64


@pytest.mark.parametrize("how", ["abort", "preempt"])
def test_a_waiter_is_not_held_by_a_request_that_stopped_computing_its_prefix(how):
    """r0 computes a 12-token prefix in 5-token chunks; r1 shares it and waits. Aborted
    after its first chunk, r0 holds r1 no more: r1 runs next, with the block r0 cached.
    Preempted, r0 goes back to the queue's head and computes the prefix again, r1 waits
    for it again and still takes the whole prefix as hits: no stall either way."""
    kv = KVCacheManager(num_blocks=64, block_size=4)
    sched = Scheduler(kv, max_num_batched_tokens=5, max_model_len=64)
    first, waiter = _req(0, list(range(12)) + [1, 2]), _req(1, list(range(12)) + [3, 4])
    sched.add_request(first)
    sched.add_request(waiter)
    assert list(_step(sched).num_scheduled_tokens) == ["r0"]
    if how == "abort":
        sched.abort_request("r0")
        out = _step(sched)
        assert out.num_scheduled_tokens == {"r1": 5} and waiter.num_prefix_hit_tokens == 4
    else:
        out = sched.schedule()
        sched._preempt_newest(out)
        sched.update(out, {})
        assert first.status is RequestStatus.WAITING
        for _ in range(50):
            if waiter.status is RequestStatus.RUNNING:
                break
            assert "r1" not in _step(sched).num_scheduled_tokens or first.num_cached_blocks == 3
        assert waiter.num_prefix_hit_tokens == 12
    for _ in range(50):
        if not sched.has_unfinished():
            break
        _step(sched)
    assert waiter.is_finished and kv.pool.num_free_blocks == 64


@pytest.fixture(scope="module")
def smollm2():
    return LLM(model="smollm2", batch_invariant=True, max_model_len=256,
               kv_cache_memory="12MiB")


@needs_smollm2
@pytest.mark.parametrize("count", [2, 4])
def test_a_burst_with_one_system_prompt_computes_it_once(smollm2, count):
    """``count`` chats with one ~110-token system prompt, submitted together: the first
    computes it, the others wait one step and take its blocks as prefix hits; the answers
    are those of the same chats run one by one afterwards (greedy, batch-invariant
    engine: the same tokens however a prompt's KV was computed)."""
    engine = smollm2.engine
    pool = engine.kv.pool
    system = (f"You are a careful assistant for bakery number {count}. You answer questions "
              "about bread, opening hours, prices and allergies in one or two short "
              "sentences, and you never invent products the bakery does not sell. The "
              "bakery opens at seven, closes at six, bakes sourdough, rye and spelt loaves, "
              "croissants and fruit tarts, and marks every allergen on its price labels.")
    questions = ["Do you sell rye bread?", "When do you open?", "Is there gluten-free cake?",
                 "How much is a baguette?"][:count]
    prompts = [engine.inputs.chat([{"role": "system", "content": system},
                                   {"role": "user", "content": q}]) for q in questions]
    common = 0
    while all(p[common] == prompts[0][common] for p in prompts):
        common += 1
    full = common // engine.kv.block_size
    assert full >= 5
    sp = SamplingParams(temperature=0, max_tokens=8)
    reqs = [engine.add_request(p, sp) for p in prompts]
    engine.step()
    assert [r.status for r in reqs] == [RequestStatus.RUNNING] + [RequestStatus.WAITING] * (count - 1)
    engine.step()
    assert all(r.status is RequestStatus.RUNNING for r in reqs)
    assert all(r.block_ids[:full] == reqs[0].block_ids[:full] for r in reqs)
    assert all(pool.ref_cnt[b] == count for b in reqs[0].block_ids[:full])
    assert reqs[0].num_prefix_hit_tokens == 0
    assert all(r.num_prefix_hit_tokens == full * engine.kv.block_size for r in reqs[1:])
    while engine.has_unfinished():
        engine.step()
    assert pool.num_free_blocks == pool.num_blocks
    assert [r.output_token_ids for r in reqs] == \
        [smollm2.generate(p, sp)[0].token_ids for p in prompts]
