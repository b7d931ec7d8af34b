"""The KV block pool: reference-counted blocks, prefix caching, LRU eviction.

A block holds ``block_size`` consecutive tokens of one request. A *full* block of known
tokens gets a SHA-256 digest of its token ids chained with the digest of the block before
it, so equal digests mean equal whole prefixes. (Python's 64-bit ``hash`` of the token
tuple would do in the common case, but a collision would silently serve another prompt's
KV; a cryptographic digest makes that practically impossible.) Freed blocks keep their hash and stay findable
until they are handed out again: the free list is ordered least recently freed first,
so the oldest cached content is evicted first.

:class:`KVCacheManager` is the scheduler's view: it gives a request the blocks for its
next tokens (reusing cached prefix blocks), caches its blocks as they fill, frees them,
and forks the sequences of a request with ``n > 1`` from its first one (:meth:`fork`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from pagedattn.checks import require_int
from pagedattn.engine.request import Request
from pagedattn.paging import cdiv


BlockHash = bytes


def hash_block(parent_hash: BlockHash | None, token_ids: list[int] | tuple[int, ...]) -> BlockHash:
    """Digest of one full block: its tokens and, through the parent's digest, the whole
    prefix. The same tokens give the same digest in every process."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockPool:
    """``num_blocks`` blocks with reference counts and a prefix-cache index."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        require_int("num_blocks", num_blocks, 1)
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self.cached: dict[BlockHash, int] = {}
        """hash -> block id, for full blocks whose content is still in the cache."""
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        """ref-count-0 blocks, eviction order first."""
        self.num_hits = 0
        self.num_queries = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def lookup(self, block_hashes: list[BlockHash], max_blocks: int) -> list[int]:
        """Blocks of the longest cached prefix of ``block_hashes`` (at most ``max_blocks``)."""
        hits: list[int] = []
        if self.enable_prefix_caching:
            for h in block_hashes[:max_blocks]:
                block = self.cached.get(h)
                if block is None:
                    break
                hits.append(block)
            self.num_queries += min(len(block_hashes), max_blocks)
            self.num_hits += len(hits)
        return hits

    def num_revivable(self, block_ids: list[int]) -> int:
        """How many of ``block_ids`` sit in the free list (taking them shrinks it)."""
        return sum(1 for b in block_ids if self.ref_cnt[b] == 0)

    def take(self, block_ids: list[int]) -> None:
        """Add a reference to each of ``block_ids`` (cached blocks being reused)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free[b]
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, evicting the oldest cached content first."""
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} blocks with {len(self.free)} free")
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free list.
        Callers pass a request's blocks last-first, so its tail is evicted before its
        (more shareable) head."""
        for b in block_ids:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"block {b} released more often than taken")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free[b] = None

    def register(self, block_id: int, block_hash: BlockHash) -> None:
        """Make a full block findable by its hash (first writer wins on duplicates)."""
        if not self.enable_prefix_caching or block_hash in self.cached:
            return
        self.cached[block_hash] = block_id
        self.block_hash[block_id] = block_hash


class KVCacheManager:
    """Block bookkeeping of requests on top of a :class:`BlockPool`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def block_hashes(self, req: Request) -> list[BlockHash]:
        """``req.block_hashes``, extended over every full block of its known tokens."""
        bs = self.block_size
        for i in range(len(req.block_hashes), req.num_tokens // bs):
            parent = req.block_hashes[-1] if req.block_hashes else None
            req.block_hashes.append(hash_block(parent, req.token_ids(i * bs, (i + 1) * bs)))
        return req.block_hashes

    def max_hit_blocks(self, req: Request) -> int:
        """How many leading blocks of ``req`` the prefix cache may serve: its full blocks
        but the one holding its last token, whose logits must be computed."""
        return (req.num_tokens - 1) // self.block_size

    def computed_blocks(self, req: Request) -> list[int]:
        """Cached blocks for a request that has nothing computed yet. At least one token
        is left to compute, since the last one's logits are needed."""
        if not self.pool.enable_prefix_caching or req.num_computed_tokens:
            return []
        return self.pool.lookup(self.block_hashes(req), self.max_hit_blocks(req))

    def fork(self, child: Request, parent: Request, copies: list[tuple[int, int]]) -> bool:
        """Give ``child``, a sequence of ``parent``'s request with nothing computed, the KV
        of their prompt but its last token, from ``parent``, which has computed at least
        that much; ``child`` then computes the last prompt token itself (its own logits).

        The full blocks are shared (one more reference each). The partly filled block
        (if any) is copied on write: ``child`` gets a fresh block and ``(parent's block,
        fresh block)`` is appended to ``copies``; the caller copies its KV, all layers,
        before the step that writes into it. Slots of the parent's block past the prompt
        may hold its own later tokens by then: the child writes those positions before
        it reads them. Without a partly filled block the fresh block takes the last
        prompt token. Either way the child ends with the blocks of its whole prompt:
        one block from the free list, False if there is none.

        Worked example, ``block_size=4``, a 10-token prompt: the child takes 9 tokens'
        KV: blocks 0-1 (tokens 0-7) shared, block 2 (token 8, 1 of 4 slots filled)
        copied; it computes token 9 into its copy."""
        if not self.pool.num_free_blocks:
            return False
        full, partial = divmod(child.num_prompt_tokens - 1, self.block_size)
        shared = parent.block_ids[:full]
        self.pool.take(shared)
        own = self.pool.allocate(1)[0]
        if partial:
            copies.append((parent.block_ids[full], own))
        child.block_ids = shared + [own]
        child.num_computed_tokens = child.num_prompt_tokens - 1
        cached = min(full, parent.num_cached_blocks)  # registered by the parent already
        child.block_hashes = parent.block_hashes[:cached]
        child.num_cached_blocks = cached
        return True

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       hit_blocks: list[int] | None = None) -> bool:
        """Reserve blocks for ``num_new_tokens`` more tokens of ``req`` (after taking
        ``hit_blocks``, cached blocks of its prefix, as computed). False = not enough."""
        hit_blocks = hit_blocks or []
        total = req.num_computed_tokens + len(hit_blocks) * self.block_size + num_new_tokens
        need = cdiv(total, self.block_size) - len(req.block_ids) - len(hit_blocks)
        if need + self.pool.num_revivable(hit_blocks) > self.pool.num_free_blocks:
            return False
        if hit_blocks:
            self.pool.take(hit_blocks)
            req.block_ids.extend(hit_blocks)
            req.num_computed_tokens += len(hit_blocks) * self.block_size
            req.num_prefix_hit_tokens += len(hit_blocks) * self.block_size
            req.num_cached_blocks = len(req.block_ids)
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the blocks that the last step filled with computed tokens."""
        if not self.pool.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        if num_full <= req.num_cached_blocks:
            return
        self.block_hashes(req)
        for i in range(req.num_cached_blocks, num_full):
            self.pool.register(req.block_ids[i], req.block_hashes[i])
        req.num_cached_blocks = num_full

    def free(self, req: Request) -> None:
        self.pool.release(list(reversed(req.block_ids)))
        req.block_ids = []
        req.num_cached_blocks = 0
