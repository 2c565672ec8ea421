"""Page allocation, reference counts and the prefix cache of the runtime's block manager."""

import pytest

from m3export.runtime.block_manager import BlockManager, OutOfPages, page_digest


def test_allocate_release_and_refcounts():
    bm = BlockManager(4, page_size=8)
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.num_free == 1
    with pytest.raises(OutOfPages):
        bm.allocate(2)
    bm.acquire(a[:1])
    assert bm.refcount(a[0]) == 2
    bm.release(a)
    assert bm.num_free == 3 and bm.refcount(a[0]) == 1
    bm.release(a[:1])
    assert bm.num_free == 4
    with pytest.raises(RuntimeError, match="released more often"):
        bm.release(a[:1])


def test_digest_chains_over_parents():
    first = page_digest(None, [1, 2, 3, 4])
    assert page_digest(first, [5, 6]) != page_digest(page_digest(None, [9, 9, 9, 9]), [5, 6])
    assert page_digest(first, [5, 6]) == page_digest(page_digest(None, [1, 2, 3, 4]), [5, 6])


def test_prefix_cache_lookup_revive_and_eviction():
    bm = BlockManager(3, page_size=2)
    pages = bm.allocate(2)
    d0 = page_digest(None, [1, 2])
    d1 = page_digest(d0, [3, 4])
    bm.register(pages[0], d0)
    bm.register(pages[1], d1)
    assert bm.lookup([d0, d1, b"missing"]) == pages
    assert bm.lookup([d1]) == [pages[1]]  # a lookup is by exact digest; callers pass the chain from the start
    bm.release(pages)  # free, but still findable
    assert bm.num_free == 3 and bm.lookup([d0, d1]) == pages
    bm.acquire(pages[:1])  # revived: no longer free
    assert bm.num_free == 2 and bm.refcount(pages[0]) == 1
    # the never-used page goes first, then the freed tail page (pages[1]), whose digest is forgotten on reuse
    got = bm.allocate(2)
    assert pages[1] in got and bm.lookup([d0, d1]) == [pages[0]]


def test_register_keeps_first_copy_and_respects_switch():
    bm = BlockManager(4, page_size=2)
    a, b = bm.allocate(2)
    d = page_digest(None, [7, 7])
    bm.register(a, d)
    bm.register(b, d)
    assert bm.lookup([d]) == [a]
    off = BlockManager(2, page_size=2, enable_prefix_caching=False)
    p = off.allocate(1)[0]
    off.register(p, d)
    assert off.lookup([d]) == []
