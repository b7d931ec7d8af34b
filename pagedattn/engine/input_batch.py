"""The persistent input batch: one row per scheduled request, kept across steps.

Rows survive from step to step (a decoding request keeps its row and its block-table
row); only requests that leave are removed, and new ones fill the gaps. The attention
builder's reorder (decodes first, see ``pagedattn.paging.reorder_batch_decodes_first``)
moves rows with :meth:`InputBatch.swap_states`.
"""

from __future__ import annotations

import numpy as np

from pagedattn.engine.request import Request


class InputBatch:
    def __init__(self, max_num_reqs: int, max_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.req_ids: list[str] = []
        self.requests: list[Request] = []
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        """Entries of each block-table row that mirror the request's block_ids."""

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def update(self, scheduled: dict[str, Request]) -> None:
        """Make the rows exactly the scheduled requests: drop the others (the last row
        fills each gap), append new ones, then sync the block-table rows."""
        row = 0
        while row < len(self.req_ids):
            if self.req_ids[row] in scheduled:
                row += 1
                continue
            last = len(self.req_ids) - 1
            if row != last:
                self.swap_states(row, last)
            self.req_ids.pop()
            self.requests.pop()
            self.num_blocks[last] = 0
        present = set(self.req_ids)
        for req_id, req in scheduled.items():
            if req_id not in present:
                if len(self.req_ids) == self.max_num_reqs:
                    raise RuntimeError(f"input batch is full ({self.max_num_reqs} rows)")
                self.req_ids.append(req_id)
                self.requests.append(req)
                self.num_blocks[len(self.req_ids) - 1] = 0
        for r, req in enumerate(self.requests):
            have, want = int(self.num_blocks[r]), len(req.block_ids)
            if want < have or (have and self.block_table[r, 0] != req.block_ids[0]):
                have = 0  # the request was preempted and got new blocks
            if want > have:
                self.block_table[r, have:want] = req.block_ids[have:want]
            self.num_blocks[r] = want

    def swap_states(self, i: int, j: int) -> None:
        self.req_ids[i], self.req_ids[j] = self.req_ids[j], self.req_ids[i]
        self.requests[i], self.requests[j] = self.requests[j], self.requests[i]
        self.block_table[[i, j]] = self.block_table[[j, i]]
        self.num_blocks[[i, j]] = self.num_blocks[[j, i]]
