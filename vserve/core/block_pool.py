"""The pool of KV-cache blocks: reference counts, the free queue and the prefix-cache index.

A block is *free* when no request holds it (ref_cnt == 0). Free blocks sit in an LRU queue;
a free block may still carry a hash (its content is a cached prefix) until it is evicted,
which happens when the pool hands it out again. Allocation takes from the front of the queue;
a freed block with a hash goes to the back (least recently freed cached prefixes are evicted
first), one without goes to the front: it holds nothing worth keeping and its memory is
already committed, so it is reused before a block no step has written (the CPU cache commits
pages on first write). A prefix-cache hit on a free block takes it out of the queue.

| invariant                                   | checked by `check_invariants` |
|---------------------------------------------|-------------------------------|
| every block is either in the free queue     |                               |
| (ref_cnt == 0) or held (ref_cnt > 0)        | yes                           |
| a hash maps to one block and that block's   |                               |
| `block_hash` is that hash                   | yes                           |
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self._cached: dict[bytes, KVCacheBlock] = {}

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    # -- allocation ------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference from each block; pass them tail first so that the tail of a
        sequence (least likely to be shared) is evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} freed more often than taken")
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    self._evict(block)
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        if block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # the same content already lives in another block; keep that one
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible while no block is held."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = None

    # -- checks ----------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        for block in self.blocks:
            in_free = block.block_id in self._free
            assert block.ref_cnt >= 0, block
            assert in_free == (block.ref_cnt == 0), block
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) is block, block
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash
        assert len(self._free) + sum(b.ref_cnt > 0 for b in self.blocks) == self.num_blocks
