"""Per-request KV block tables on top of the block pool, and prefix caching.

Prefix caching keys every full block by a chained hash: hash(parent hash, the block's token
ids, salt). A request's blocks are registered in the cache only up to its *settled* tokens
(computed or in flight, and with ids known), so a hit never points at a position whose token
is still a placeholder. With prefix caching off, requests that carry a `cache_salt` (the
`n > 1` siblings of one prompt) still share their prompt blocks with each other.
"""

from __future__ import annotations

import hashlib
from array import array

from vserve.core.block_pool import BlockPool, KVCacheBlock
from vserve.core.request import Request


def hash_block(parent: bytes, token_ids: list[int], salt: str | None) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    if salt:
        digest.update(salt.encode())
    return digest.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def uses_cache(self, request: Request) -> bool:
        return self.enable_prefix_caching or request.cache_salt is not None

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    # -- prefix lookup ---------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks; at least one token is left to compute."""
        if not self.uses_cache(request) or request.sampling_params.prompt_logprobs is not None:
            return [], 0   # (prompt logprobs need every prompt position computed, as in vLLM)
        max_hit_tokens = request.num_tokens - 1
        hits: list[KVCacheBlock] = []
        for block_hash in self._hashes_upto(request, max_hit_tokens):
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    # -- allocation ------------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_total_tokens: int,
        computed_blocks: list[KVCacheBlock] = (),
    ) -> list[int] | None:
        """Make the request hold enough blocks for `num_total_tokens` positions.

        Returns the ids of the blocks added (hits first), or None when the pool is short; on
        None nothing changed."""
        held = self.req_blocks.setdefault(request.request_id, [])
        num_required = -(-num_total_tokens // self.block_size)
        num_new = num_required - len(held) - len(computed_blocks)
        num_free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if max(num_new, 0) + num_free_hits > self.pool.num_free_blocks:
            if not held:
                del self.req_blocks[request.request_id]
            return None
        self.pool.touch(list(computed_blocks))
        added = list(computed_blocks) + (self.pool.get_new_blocks(num_new) if num_new > 0 else [])
        if computed_blocks:
            self.num_cached_blocks[request.request_id] = len(held) + len(computed_blocks)
        held.extend(added)
        return [b.block_id for b in added]

    def cache_blocks(self, request: Request, num_settled_tokens: int) -> None:
        """Register the request's full blocks among its first `num_settled_tokens` tokens."""
        if not self.uses_cache(request):
            return
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        start = self.num_cached_blocks.get(request.request_id, 0)
        if min(num_settled_tokens, request.num_tokens) // self.block_size <= start:
            return   # no new full block (most calls: a decode step fills one token)
        hashes = self._hashes_upto(request, num_settled_tokens)
        end = min(len(hashes), len(blocks))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _hashes_upto(self, request: Request, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among the first `num_tokens` known tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        num_full = min(num_tokens, request.num_tokens) // bs
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else b""
            hashes.append(hash_block(parent, request.all_token_ids[i * bs:(i + 1) * bs],
                                     request.cache_salt))
        return hashes[:num_full]

    def check_invariants(self, live_request_ids: set[str]) -> None:
        self.pool.check_invariants()
        assert set(self.req_blocks) <= live_request_ids, set(self.req_blocks) - live_request_ids
        held = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == held.get(b.block_id, 0), (b, held.get(b.block_id))
