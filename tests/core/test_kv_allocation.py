"""Per-step block allocation: a request gains a block exactly when its tokens cross a block
boundary; between boundaries a step adds nothing and takes nothing from the pool."""

from __future__ import annotations

from vserve.core.kv_cache_manager import KVCacheManager
from vserve.core.request import Request
from vserve.sampling_params import SamplingParams


def test_a_block_is_added_only_when_the_tokens_cross_a_boundary():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    req = Request("r", [5, 6, 7], SamplingParams(max_tokens=32))
    (first,) = kv.allocate_slots(req, 3)
    assert len(first) == 1
    for total in range(4, 30):
        free = kv.pool.num_free_blocks
        (added,) = kv.allocate_slots(req, total)
        crosses = total % 4 == 1
        assert len(added) == int(crosses), total
        assert kv.pool.num_free_blocks == free - int(crosses)
        assert len(kv.block_ids("r")[0]) == -(-total // 4)
    kv.free(req)
    assert kv.pool.num_free_blocks == 16


def test_a_request_short_of_blocks_gets_none_and_keeps_what_it_held():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    req = Request("r", list(range(8)), SamplingParams(max_tokens=8))
    (ids,) = kv.allocate_slots(req, 8)
    assert len(ids) == 2
    assert kv.allocate_slots(req, 8) == ([],)  # held blocks cover it
    assert kv.allocate_slots(req, 9) is None  # the pool is empty
    assert kv.block_ids("r") == (ids,)
