"""The KV blocks of the sliding-window layers: a second block pool whose blocks are returned
once they leave every future query's window.

A request holds one entry per logical block in both groups (same length as its full-attention
block list); a sliding-window entry is None once the block has left the window (or was never
needed, below a prefix hit). Position p attends to keys k > p - window, so when a step's first
query position is `first`, every block below `out_of_window(first)` is dead for this step and
all later ones. Steps already in flight may still read such a block; it is safe to hand it to
another request anyway, because every worker runs steps in order: the new owner writes it in a
later step, after the in-flight reads on that stage (each stage owns its layers' KV). The
workers apply the same rule to their block tables, pointing dead entries at a null block.

| invariant                                              | checked by                  |
|--------------------------------------------------------|-----------------------------|
| entries below `num_dead[req]` are None                 | `check_invariants`          |
| a block's ref_cnt == the entries that hold it          | `check_invariants`          |
| a prefix hit of k blocks holds the blocks of the       |                             |
| window before position k x block_size, cached          | `prefix_hit`                |
"""

from __future__ import annotations

from vserve.core.block_pool import BlockPool, KVCacheBlock

NO_BLOCK = -1  # block id sent to the workers for a dead entry


def out_of_window(first_pos: int, window: int, block_size: int) -> int:
    """Logical blocks wholly before the window of a query at `first_pos` (and any later)."""
    return max(0, (first_pos - window + 1) // block_size)


def local_block_cap(
    window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, depth: int
) -> int:
    """Sliding-window blocks the engine can hold at once: each running request its window and
    a block of slack, plus the new tokens of the `depth` steps in flight."""
    per_seq = -(-(window - 1) // block_size) + 2
    return max_num_seqs * per_seq + depth * -(-max_num_batched_tokens // block_size)


class SlidingWindowGroup:
    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self.block_size = block_size
        self.window = window
        self.req_blocks: dict[str, list[KVCacheBlock | None]] = {}
        self.num_dead: dict[str, int] = {}

    def first_live(self, first_pos: int) -> int:
        return out_of_window(first_pos, self.window, self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [NO_BLOCK if b is None else b.block_id for b in self.req_blocks.get(request_id, ())]

    # -- prefix hits -----------------------------------------------------------------------------
    def prefix_hit(self, hashes: list[bytes], num_blocks: int) -> list[KVCacheBlock | None] | None:
        """Entries for a hit of `num_blocks` blocks, or None when a block of the window before
        it is not cached here."""
        live = self.first_live(num_blocks * self.block_size)
        entries: list[KVCacheBlock | None] = [None] * live
        for block_hash in hashes[live:num_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                return None
            entries.append(block)
        return entries

    # -- allocation ------------------------------------------------------------------------------
    def release_dead(self, request_id: str, first_pos: int) -> None:
        """Return the request's blocks that no query from `first_pos` on can see."""
        blocks = self.req_blocks.get(request_id)
        if not blocks:
            return
        start, end = self.num_dead.get(request_id, 0), min(self.first_live(first_pos), len(blocks))
        if end <= start:
            return
        dead = [b for b in blocks[start:end] if b is not None]
        blocks[start:end] = [None] * (end - start)
        self.num_dead[request_id] = end
        self.pool.free_blocks(dead[::-1])

    def can_allocate(self, num_new: int, hit: list[KVCacheBlock | None]) -> bool:
        num_free_hits = sum(1 for b in hit if b is not None and b.ref_cnt == 0)
        return num_new + num_free_hits <= self.pool.num_free_blocks

    def allocate(self, request_id: str, num_new: int, hit: list[KVCacheBlock | None]) -> list[int]:
        """Append the hit's entries and `num_new` fresh blocks; returns their ids."""
        held = self.req_blocks.setdefault(request_id, [])
        if hit:
            self.pool.touch([b for b in hit if b is not None])
            if not held:
                self.num_dead[request_id] = sum(1 for b in hit if b is None)
        added = list(hit) + (self.pool.get_new_blocks(num_new) if num_new > 0 else [])
        held.extend(added)
        return [NO_BLOCK if b is None else b.block_id for b in added]

    def cache_block(self, request_id: str, index: int, block_hash: bytes) -> None:
        block = self.req_blocks[request_id][index]
        if block is not None:
            self.pool.cache_block(block, block_hash)

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, [])
        self.num_dead.pop(request_id, None)
        self.pool.free_blocks([b for b in reversed(blocks) if b is not None])

    def drop_if_empty(self, request_id: str) -> None:
        if not self.req_blocks.get(request_id, True):
            del self.req_blocks[request_id]
            self.num_dead.pop(request_id, None)

    # -- checks ----------------------------------------------------------------------------------
    def check_invariants(self, full_blocks: dict[str, list[KVCacheBlock]]) -> None:
        self.pool.check_invariants()
        assert set(self.req_blocks) == set(full_blocks), (set(self.req_blocks), set(full_blocks))
        held: dict[int, int] = {}
        for req_id, blocks in self.req_blocks.items():
            assert len(blocks) == len(full_blocks[req_id]), req_id
            assert all(b is None for b in blocks[: self.num_dead.get(req_id, 0)]), req_id
            for b in blocks:
                if b is not None:
                    held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == held.get(b.block_id, 0), (b, held.get(b.block_id))
