"""Per-request KV block tables on top of the block pool, and prefix caching.

Prefix caching keys every full block by a chained hash: hash(parent hash, the block's token
ids, salt). A request's blocks are registered in the cache only up to its *settled* tokens
(computed or in flight, and with ids known), so a hit never points at a position whose token
is still a placeholder. With prefix caching off, requests that carry a `cache_salt` (the
`n > 1` siblings of one prompt) still share their prompt blocks with each other.

Models with sliding-window layers get a second group for those layers
(`vserve.core.sliding_window`): its blocks are returned once they leave the window, and a
prefix hit must also find the window before it cached there. Block ids go to the workers as
one list per group: `(full,)` or `(full, sliding_window)`.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from vserve.core.block_pool import BlockPool, KVCacheBlock
from vserve.core.request import Request
from vserve.core.sliding_window import SlidingWindowGroup

BlockIds = tuple[list[int], ...]  # one list per KV group


def hash_block(parent: bytes, token_ids: list[int], salt: str | None) -> bytes:
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    if salt:
        digest.update(salt.encode())
    return digest.digest()


@dataclass
class PrefixHit:
    full: list[KVCacheBlock] = field(default_factory=list)
    local: list[KVCacheBlock | None] = field(default_factory=list)  # sliding-window group


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        sliding_window: int | None = None,
        num_local_blocks: int = 0,
    ) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=True)
        self.local = (
            SlidingWindowGroup(num_local_blocks, block_size, sliding_window)
            if sliding_window is not None
            else None
        )
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def pools(self) -> list[BlockPool]:
        return [self.pool] if self.local is None else [self.pool, self.local.pool]

    @property
    def usage(self) -> float:
        return max(p.usage for p in self.pools)

    def uses_cache(self, request: Request) -> bool:
        return self.enable_prefix_caching or request.cache_salt is not None

    def block_ids(self, request_id: str) -> BlockIds:
        full = [b.block_id for b in self.req_blocks.get(request_id, ())]
        return (full,) if self.local is None else (full, self.local.block_ids(request_id))

    # -- prefix lookup ---------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[PrefixHit, int]:
        """Longest cached prefix of full blocks; at least one token is left to compute."""
        sp = request.sampling_params
        if not self.uses_cache(request) or sp.prompt_logprobs is not None or sp.pooling == "mean":
            return PrefixHit(), 0  # (these need every prompt position computed)
        max_hit_tokens = request.num_tokens - 1
        hashes = self._hashes_upto(request, max_hit_tokens)
        hits: list[KVCacheBlock] = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if self.local is None:
            return PrefixHit(hits), len(hits) * self.block_size
        for num in range(len(hits), 0, -1):  # the longest hit whose window is cached too
            local = self.local.prefix_hit(hashes, num)
            if local is not None:
                return PrefixHit(hits[:num], local), num * self.block_size
        return PrefixHit(), 0

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    # -- allocation ------------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_total_tokens: int,
        hit: PrefixHit | None = None,
    ) -> BlockIds | None:
        """Make the request hold enough blocks for `num_total_tokens` positions.

        Returns the ids of the blocks added (hits first), or None when a pool is short; on
        None nothing changed, except that sliding-window blocks which left the window of the
        request's next query are returned (they are dead either way)."""
        req_id = request.request_id
        if hit is None and self.local is None:  # most steps: the blocks held suffice
            held = self.req_blocks.get(req_id)
            if held is not None and num_total_tokens <= len(held) * self.block_size:
                return ([],)
        hit = hit or PrefixHit()
        held = self.req_blocks.setdefault(req_id, [])
        num_required = -(-num_total_tokens // self.block_size)
        num_new = max(0, num_required - len(held) - len(hit.full))
        num_free_hits = sum(b.ref_cnt == 0 for b in hit.full) if hit.full else 0
        local = self.local
        if local is not None:
            first_pos = request.num_computed_tokens + len(hit.full) * self.block_size
            local.release_dead(req_id, first_pos)
        if num_new + num_free_hits > self.pool.num_free_blocks or (
            local is not None and not local.can_allocate(num_new, hit.local)
        ):
            if not held:
                del self.req_blocks[req_id]
            return None
        self.pool.touch(list(hit.full))
        added = list(hit.full) + (self.pool.get_new_blocks(num_new) if num_new > 0 else [])
        if hit.full:
            self.num_cached_blocks[req_id] = len(held) + len(hit.full)
        held.extend(added)
        ids = [b.block_id for b in added]
        return (ids,) if local is None else (ids, local.allocate(req_id, num_new, hit.local))

    def cache_blocks(self, request: Request) -> None:
        """Register the request's full blocks among its settled tokens: min(C, N), those
        computed (or being computed) whose ids are known."""
        start = self.num_cached_blocks.get(request.request_id, 0)
        boundary = (start + 1) * self.block_size  # the settled tokens that fill another block
        if request.num_computed_tokens < boundary or len(request.all_token_ids) < boundary:
            return  # no new full block (most calls: a decode step fills one token)
        if not self.uses_cache(request):
            return
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        hashes = self._hashes_upto(request, request.num_computed_tokens)
        end = min(len(hashes), len(blocks))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], hashes[i])
            if self.local is not None:
                self.local.cache_block(request.request_id, i, hashes[i])
        self.num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))
        if self.local is not None:
            self.local.free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        if any(p.num_used_blocks for p in self.pools):
            return False
        return all(p.reset_prefix_cache() for p in self.pools)

    def _hashes_upto(self, request: Request, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among the first `num_tokens` known tokens."""
        hashes = request.block_hashes
        bs = self.block_size
        num_full = min(num_tokens, request.num_tokens) // bs
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else b""
            hashes.append(
                hash_block(parent, request.all_token_ids[i * bs : (i + 1) * bs], request.cache_salt)
            )
        return hashes[:num_full]

    def check_invariants(self, live_request_ids: set[str]) -> None:
        self.pool.check_invariants()
        assert set(self.req_blocks) <= live_request_ids, set(self.req_blocks) - live_request_ids
        held: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == held.get(b.block_id, 0), (b, held.get(b.block_id))
        if self.local is not None:
            self.local.check_invariants(self.req_blocks)
