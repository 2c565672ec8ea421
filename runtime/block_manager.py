"""Fixed-size pages of the KV pools: allocation, reference counts and sharing of identical full-page prefixes.

One block table per request addresses every pool the backend holds (main K/V, the indexer's key cache and each
MTP module's caches), so one manager serves them all. A page is shared only once it is full and will never be
written again; its identity is a digest chained over the pages before it, so equal digests mean equal contents.
Pages freed with a digest stay findable until the allocator needs them (least recently freed first), which lets
a later request, or a preempted one coming back, reuse them without recomputation.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def page_digest(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Identity of a full page: the page's token ids chained onto its parent page's digest.

    SHA-256 rather than Python's ``hash``: a collision would silently give a request another prompt's cache.
    """
    h = hashlib.sha256(parent or b"")
    h.update(array("q", tokens).tobytes())
    return h.digest()


class OutOfPages(Exception):
    """Not enough free pages; the scheduler answers by waiting or preempting, never by failing a request."""


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refs = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))  # head = reused first
        self._digest_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Pages allocatable now (cached-but-unreferenced pages included: they are evicted on demand)."""
        return len(self._free)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def lookup(self, digests: Sequence[bytes]) -> list[int]:
        """The cached pages for the longest run of leading digests that are all cached."""
        hits = []
        if self.enable_prefix_caching:
            for d in digests:
                page = self._page_of.get(d)
                if page is None:
                    break
                hits.append(page)
        return hits

    # ------------------------------------------------------------------ changes
    def acquire(self, pages: Sequence[int]) -> None:
        """Take a reference on cached pages found by ``lookup`` (reviving them if they were free)."""
        for p in pages:
            if self._refs[p] == 0:
                del self._free[p]
            self._refs[p] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = []
        for _ in range(n):
            p, _ = self._free.popitem(last=False)
            d = self._digest_of.pop(p, None)
            if d is not None:
                del self._page_of[d]
            self._refs[p] = 1
            pages.append(p)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference per page. Later pages are queued for reuse first: a shared prefix's head outlives
        its tail, which is the part least likely to be asked for again."""
        for p in reversed(pages):
            if self._refs[p] <= 0:
                raise RuntimeError(f"page {p} released more often than it was taken")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free[p] = None

    def register(self, page: int, digest: bytes) -> None:
        """Publish a full, final page under its digest. If an identical page is already published (two
        requests computed the same prefix at once) the first one stays the shared copy."""
        if not self.enable_prefix_caching or digest in self._page_of or page in self._digest_of:
            return
        self._digest_of[page] = digest
        self._page_of[digest] = page
