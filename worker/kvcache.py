"""Paged KV block pool with a prefix cache (pure bookkeeping: no asyncio, no HTTP, no clock).

The pool holds ``num_blocks`` blocks of ``block_size`` token slots. A request's prompt is cut into
blocks; every *full* block gets a chained hash::

    h1 = xxh3_64(ROOT || len(namespace) || namespace || token_ids(block 1))
    hk = xxh3_64(h(k-1) || token_ids(block k))

so a block hash identifies the whole prefix up to and including that block, and requests in
different namespaces (``cache_salt``, tenant) never share a block. This mirrors vLLM's V1 scheme
(parent hash + token ids + extra keys on the first block) with xxh3-64.

Block states:

* **free**: no content, on the free list;
* **referenced**: in the block table of at least one running request (``ref_count > 0``); never
  evicted;
* **cached**: a full block with a registered hash and ``ref_count == 0``; reusable by a later
  request with the same prefix, and evictable (see *Eviction* below).

When a request's new full blocks become reusable by other requests is the cache's
:class:`Reuse` rule. ``SCHEDULED`` is vLLM's: it caches a block when the scheduler gives the
engine its tokens to compute (in the same step, other requests of that batch may reuse it, as
the step writes every token's K/V before any attention reads it), so a request that reuses a
block still being computed gets it, and its first token comes after that computation
(:attr:`Allocation.awaits`; the engine calls :meth:`PrefixCache.started` and
:meth:`PrefixCache.computed`). ``COMPUTED`` makes them reusable only once the request's prefill
is done (a request arriving before computes them again); ``ADMITTED`` from its admission on,
whether the engine has begun it or not, which the torch engine's in-order prefills make exact.
A partial last block is private to its request and goes back to the free list on release.

Eviction only removes cached (unreferenced) blocks, by **priority class** first, then LRU. A block
is tagged :class:`Priority` ``CONVERSATION`` (the default, lowest), ``DOCUMENT`` or ``SYSTEM``
(highest): under pressure all cached conversation blocks go before any document block, and those
before any system block; within a class the least recently released goes first. A request tags
its prompt with one class, and may mark its leading ``system_tokens`` tokens (the chat's system
messages) as ``SYSTEM``; a block counts as system only when it lies entirely inside them. A block
shared by several requests keeps the highest class any of them gave it (until it is evicted).
With no tags at all every block is ``CONVERSATION`` and eviction is plain LRU.

When a request releases its blocks they enter their class's LRU queue tail-first, so among blocks
released together the deepest ones go first and the leading part of a chain survives longest. If a
middle block is evicted while its descendants are still cached, the descendants become unreachable:
:meth:`PrefixCache.lookup` walks the chain from the first block and stops at the first missing hash,
so it never reports a prefix whose blocks are not all present. (An unreachable block stays evictable
and can become reachable again if its parent is recomputed, which is correct because its hash covers
the whole prefix.)

Every operation costs O(blocks of the request) plus O(1) per evicted block.

A request may also *reserve* extra private slots after its prompt (``reserve_tokens``, for the
tokens a real engine decodes); they are part of ``Allocation.block_ids``, never hashed, and freed on
release. The torch engine keeps K/V for block ``i`` at index ``i`` of its pool tensor; a cluster
simulator can drive the same class with synthetic token ids.

Namespaces are also remembered per block, so :meth:`PrefixCache.flush` can empty one tenant's
cache (or all of it) after a model or tokenizer upgrade.

A :class:`CacheListener` (``PrefixCache.listener``) hears every change of what is cached, in
order: blocks stored (with their parent, token ids and namespace), blocks removed, everything
cleared. The worker's KV-event publisher (:mod:`worker.kv_events`) is one.
"""

from __future__ import annotations

import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Protocol

import xxhash

_ROOT = b"kvcache-root-v1"


class Priority(IntEnum):
    """Eviction class of a cached block: lower values are evicted first."""

    CONVERSATION = 0
    DOCUMENT = 1
    SYSTEM = 2

    @classmethod
    def parse(cls, name: str) -> Priority:
        """``"system"`` / ``"document"`` / ``"conversation"`` (case-insensitive)."""
        try:
            return cls[name.upper()]
        except KeyError:
            choices = ", ".join(p.name.lower() for p in cls)
            raise ValueError(f"unknown cache priority {name!r}; choose one of: {choices}") from None


class Reuse(StrEnum):
    """When a request's newly allocated full blocks may be reused by other requests."""

    SCHEDULED = "scheduled"  # once the engine begins them; a reuser's first token waits
    COMPUTED = "computed"  # once the request's prefill is done
    ADMITTED = "admitted"  # from the request's admission on


class CacheListener(Protocol):
    """Hears what the cache stores and drops (see :mod:`worker.kv_events`)."""

    def stored(
        self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int], namespace: str
    ) -> None:
        """Blocks ``hashes`` (consecutive, after ``parent``; None: the first block of a prompt)
        now hold ``tokens`` (``block_size`` per block)."""
        ...

    def removed(self, hashes: Sequence[int]) -> None: ...

    def cleared(self) -> None: ...


class CacheFullError(RuntimeError):
    """Not enough free or evictable blocks: the rest are referenced by running requests."""


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}q", *tokens)


def block_hashes(tokens: Sequence[int], block_size: int, namespace: str = "") -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` (a trailing partial block has none)."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    hashes: list[int] = []
    ns = namespace.encode("utf-8", "surrogatepass")
    parent: bytes = _ROOT + struct.pack("<I", len(ns)) + ns
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = xxhash.xxh3_64_intdigest(parent + _token_bytes(tokens[start : start + block_size]))
        hashes.append(h)
        parent = struct.pack("<Q", h)
    return hashes


@dataclass(frozen=True)
class Allocation:
    """The block table of one admitted request.

    ``block_ids[:matched_blocks]`` were reused from the cache; the rest were freshly allocated
    (``new_blocks`` of them, the last prompt block possibly partial, followed by the private
    blocks reserved for ``reserved_tokens`` more tokens).
    """

    request_id: str
    num_tokens: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    matched_blocks: int
    matched_tokens: int
    new_blocks: int
    reserved_tokens: int = 0
    # Under Reuse.SCHEDULED: the requests still computing some of the matched blocks (the
    # engine gives this one its first token only after their computation).
    awaits: tuple[str, ...] = ()

    @property
    def uncached_tokens(self) -> int:
        return self.num_tokens - self.matched_tokens


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the pool; see :class:`PrefixCache` for the definitions."""

    num_blocks: int
    block_size: int
    free_blocks: int
    referenced_blocks: int
    cached_blocks: int
    used_blocks: int
    usage: float
    occupancy: float
    queries_tokens: int
    hit_tokens: int
    evicted_blocks: int
    running_requests: int


class PrefixCache:
    """Paged block pool with prefix reuse, reference counts and LRU eviction.

    Metrics definitions:

    * ``used_blocks``: blocks that are referenced or hold cached content (``num_blocks - free``);
    * ``usage()``: ``referenced_blocks / num_blocks``, the fraction of blocks held by running
      requests. This is what vLLM reports as ``kv_cache_usage_perc`` (its free queue includes
      cached-but-unreferenced blocks), so it measures load, not how full the cache is;
    * ``occupancy()``: ``used_blocks / num_blocks``, how full the cache is (tends to 1.0);
    * ``queries_tokens`` / ``hit_tokens``: prompt tokens looked up / found cached by
      :meth:`allocate` (vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``).
      :meth:`lookup` does not count.
    """

    def __init__(
        self, num_blocks: int, block_size: int, clock: Callable[[], float] = time.monotonic,
        reuse: Reuse | str = Reuse.ADMITTED,
    ) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reuse = Reuse(reuse)  # when a request's new blocks may be reused by others
        # Block -> the request that computes it, until its prefill is done (SCHEDULED and
        # COMPUTED): others may not reuse it, unless the engine began that request under
        # SCHEDULED (``_begun``), and then they wait for it.
        self._pending: dict[int, str] = {}
        self._begun: set[str] = set()  # requests whose pending blocks are reusable
        # With a listener: per request, the runs of its new blocks (start, end), to announce
        # once others may reuse them.
        self._unannounced: dict[str, tuple[list[int], Sequence[int], str,
                                           list[tuple[int, int]]]] = {}
        # Per request, the blocks it computes for content another request is still computing
        # (whose block holds the hash, pending): (hashes, tokens, namespace, [(index, block)]).
        # Whichever of the two is computed first is the one cached (:meth:`computed`).
        self._shadows: dict[str, tuple[list[int], Sequence[int], str,
                                       list[tuple[int, int]]]] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._block_of: dict[int, int] = {}
        self._namespace_of: list[str | None] = [None] * num_blocks
        self._priority = [Priority.CONVERSATION] * num_blocks
        # Cached, unreferenced blocks, one LRU queue per priority class;
        # first = least recently released = next victim of its class.
        self._evictable: tuple[OrderedDict[int, None], ...] = tuple(
            OrderedDict() for _ in Priority
        )
        self._num_evictable = 0
        self._clock = clock
        self._released_at = [0.0] * num_blocks  # when a cached block was last released
        self._requests: dict[str, Allocation] = {}
        self.queries_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0
        self.listener: CacheListener | None = None
        self._muted = False  # flush(): one "cleared" instead of a removal per block

    # -- queries ---------------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks a prompt of ``num_tokens`` occupies (the last one may be partial)."""
        return -(-num_tokens // self.block_size)

    def hashes(self, tokens: Sequence[int], namespace: str = "") -> list[int]:
        return block_hashes(tokens, self.block_size, namespace)

    def _match(self, hashes: Sequence[int]) -> list[int]:
        matched: list[int] = []
        pending, block_of = self._pending, self._block_of
        if not pending:
            for h in hashes:
                block = block_of.get(h)
                if block is None:
                    break
                matched.append(block)
            return matched
        begun = self._begun
        for h in hashes:
            block = block_of.get(h)
            if block is None:
                break
            owner = pending.get(block)
            if owner is not None and owner not in begun:
                break
            matched.append(block)
        return matched

    def computing(self, request_id: str) -> bool:
        """Whether others reuse blocks ``request_id`` is still computing (``Reuse.SCHEDULED``:
        the engine began it, its prefill is not done); they wait for it."""
        return request_id in self._begun

    def lookup(self, tokens: Sequence[int], namespace: str = "") -> int:
        """Leading tokens of ``tokens`` that are cached (whole blocks only). No state change."""
        return len(self._match(self.hashes(tokens, namespace))) * self.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def cached_blocks(self) -> int:
        """Blocks with cached content and no running request (evictable)."""
        return self._num_evictable

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def referenced_blocks(self) -> int:
        return self.num_blocks - len(self._free) - self._num_evictable

    def usage(self) -> float:
        return self.referenced_blocks / self.num_blocks

    def occupancy(self) -> float:
        return self.used_blocks / self.num_blocks

    def priority_of(self, block: int) -> Priority:
        return self._priority[block]

    def cached_blocks_by_priority(self) -> dict[str, int]:
        return {p.name.lower(): len(self._evictable[p]) for p in Priority}

    def allocation(self, request_id: str) -> Allocation | None:
        return self._requests.get(request_id)

    def stats(self) -> CacheStats:
        return CacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            free_blocks=self.free_blocks,
            referenced_blocks=self.referenced_blocks,
            cached_blocks=self.cached_blocks,
            used_blocks=self.used_blocks,
            usage=self.usage(),
            occupancy=self.occupancy(),
            queries_tokens=self.queries_tokens,
            hit_tokens=self.hit_tokens,
            evicted_blocks=self.evicted_blocks,
            running_requests=len(self._requests),
        )

    # -- mutations -------------------------------------------------------------------------

    def allocate(
        self,
        request_id: str,
        tokens: Sequence[int],
        namespace: str = "",
        *,
        priority: Priority = Priority.CONVERSATION,
        system_tokens: int = 0,
        reserve_tokens: int = 0,
    ) -> Allocation:
        """Give ``request_id`` a block table for ``tokens``, reusing the longest cached prefix.

        ``priority`` tags the prompt's blocks, except the blocks lying entirely within the first
        ``system_tokens`` tokens, which are tagged :attr:`Priority.SYSTEM`. ``reserve_tokens``
        adds private slots after the prompt (for decoded tokens).

        Raises :class:`CacheFullError` (and changes nothing) when the missing blocks cannot be
        found among free and evictable blocks, and ``ValueError`` for a duplicate request id.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if reserve_tokens < 0:
            raise ValueError("reserve_tokens must be >= 0")
        hashes = self.hashes(tokens, namespace)
        matched = self._match(hashes)
        total = self.blocks_needed(len(tokens) + reserve_tokens)
        needed = total - len(matched)
        # Matched blocks that are evictable now will be referenced, so they do not count.
        reusable_evictable = sum(1 for b in matched if self._ref[b] == 0)
        available = len(self._free) + self._num_evictable - reusable_evictable
        if needed > available:
            raise CacheFullError(
                f"request {request_id!r} needs {needed} new blocks, {available} available "
                f"({self.referenced_blocks} of {self.num_blocks} referenced)"
            )
        system_blocks = min(system_tokens, len(tokens)) // self.block_size
        for i, block in enumerate(matched):
            if self._ref[block] == 0:
                self._unlist(block)
            self._ref[block] += 1
            tag = Priority.SYSTEM if i < system_blocks else priority
            self._priority[block] = max(self._priority[block], tag)
        pending = self._pending
        awaits = tuple(dict.fromkeys(
            pending[b] for b in matched if b in pending)) if pending else ()
        deferred = self.reuse is not Reuse.ADMITTED
        fresh: list[int] = []
        runs: list[tuple[int, int]] = []  # the runs of newly stored blocks (start, end)
        shadows: list[tuple[int, int]] = []  # (index, block) computed beside a pending one
        run_start = len(matched)
        for i in range(len(matched), total):
            block = self._take_block()
            self._ref[block] = 1
            self._priority[block] = Priority.SYSTEM if i < system_blocks else priority
            if i < len(hashes) and not self._register(block, hashes[i], namespace):
                runs.append((run_start, i))
                run_start = i + 1
                if self._block_of.get(hashes[i]) in pending:
                    shadows.append((i, block))
            elif deferred and i < len(hashes):
                self._pending[block] = request_id
            fresh.append(block)
        runs.append((run_start, len(hashes)))
        if shadows:
            self._shadows[request_id] = (hashes, tokens, namespace, shadows)
        if deferred and self.listener is not None:
            self._unannounced[request_id] = (hashes, tokens, namespace, runs)
        else:
            for start, end in runs:
                self._announce(hashes, tokens, namespace, start, end)
        matched_tokens = len(matched) * self.block_size
        self.queries_tokens += len(tokens)
        self.hit_tokens += matched_tokens
        alloc = Allocation(
            request_id=request_id,
            num_tokens=len(tokens),
            block_ids=tuple(matched + fresh),
            block_hashes=tuple(hashes),
            matched_blocks=len(matched),
            matched_tokens=matched_tokens,
            new_blocks=len(fresh),
            reserved_tokens=reserve_tokens,
            awaits=awaits,
        )
        self._requests[request_id] = alloc
        return alloc

    def _announce(
        self, hashes: Sequence[int], tokens: Sequence[int], namespace: str, start: int, end: int
    ) -> None:
        """Tell the listener that blocks ``start:end`` of a prompt were stored."""
        if self.listener is None or end <= start:
            return
        size = self.block_size
        parent = hashes[start - 1] if start > 0 else None
        self.listener.stored(hashes[start:end], parent, tokens[start * size : end * size],
                             namespace)

    def started(self, request_id: str) -> None:
        """The engine began computing the request's new blocks (vLLM: scheduled them). Under
        ``Reuse.SCHEDULED`` others may reuse them from now on, waiting for their computation
        (:attr:`Allocation.awaits`); under the other rules nothing changes. Idempotent."""
        if self.reuse is not Reuse.SCHEDULED:
            return
        alloc = self._requests.get(request_id)
        if alloc is None:
            return
        self._begun.add(request_id)
        self._announce_new(request_id, alloc)
        if (shadowed := self._shadows.pop(request_id, None)) is not None:
            for block in self._take_over(request_id, *shadowed):
                self._pending[block] = request_id

    def computed(self, request_id: str) -> None:
        """The request's prefill is done: the blocks it added may be reused by others without
        waiting (under ``Reuse.COMPUTED``, from now on: a request arriving before computed
        them again)."""
        alloc = self._requests.get(request_id)
        if alloc is None:
            return
        self._announce_new(request_id, alloc)
        self._begun.discard(request_id)
        if pending := self._pending:
            for block in alloc.block_ids:
                if pending.get(block) == request_id:
                    del pending[block]
        if (shadowed := self._shadows.pop(request_id, None)) is not None:
            self._take_over(request_id, *shadowed)

    def _announce_new(self, request_id: str, alloc: Allocation) -> None:
        """Announce the request's new blocks, once (not those another copy took over)."""
        if (unannounced := self._unannounced.pop(request_id, None)) is not None:
            hashes, tokens, namespace, runs = unannounced
            ids = alloc.block_ids
            self._announce_each(hashes, tokens, namespace, [
                i for start, end in runs for i in range(start, end)
                if self._hash_of[ids[i]] is not None])

    def _take_over(self, request_id: str, hashes: list[int], tokens: Sequence[int],
                   namespace: str, shadows: list[tuple[int, int]]) -> list[int]:
        """Request ``request_id``'s prefill is done, and it computed some blocks beside those
        of another request still computing the same content (``shadows``): its own are
        cached now, and the other request's become private, as an engine caches whichever
        copy of a block is computed first (otherwise, behind a long or low-priority prefill,
        every request sharing its prefix would compute it again until that one is done).
        Under ``Reuse.SCHEDULED`` the copy the engine began first is the cached one. Returns
        the blocks taken over."""
        taken: list[int] = []
        blocks: list[int] = []
        for i, block in shadows:
            h = hashes[i]
            current = self._block_of.get(h)
            owner = self._pending.get(current) if current is not None else None
            if current is not None and (owner is None or owner in self._begun):
                continue  # the other copy was computed (or begun) first: it stays cached
            if current is not None:  # the other request's, still pending: private now
                del self._pending[current]
                self._hash_of[current] = None
                self._namespace_of[current] = None
            self._block_of[h] = block
            self._hash_of[block] = h
            self._namespace_of[block] = namespace
            taken.append(i)
            blocks.append(block)
        self._announce_each(hashes, tokens, namespace, taken)
        return blocks

    def _announce_each(self, hashes: Sequence[int], tokens: Sequence[int], namespace: str,
                       indices: Sequence[int]) -> None:
        """Tell the listener that blocks ``indices`` (ascending) of a prompt were stored, in
        runs of consecutive blocks."""
        start = 0
        for j, i in enumerate(indices):
            if j + 1 == len(indices) or indices[j + 1] != i + 1:
                self._announce(hashes, tokens, namespace, indices[start], i + 1)
                start = j + 1

    def release(self, request_id: str) -> None:
        """Drop the request's references. Full blocks stay cached; partial ones are freed, and
        so are blocks others could not reuse yet (a request ended before the engine began
        them, under ``Reuse.SCHEDULED``, or before its prefill was done, under ``COMPUTED``)."""
        if request_id in self._begun:
            self.computed(request_id)  # begun: the engine's step completes its blocks
        alloc = self._requests.pop(request_id, None)
        if alloc is None:
            raise KeyError(request_id)
        self._unannounced.pop(request_id, None)
        self._shadows.pop(request_id, None)
        if self._pending:
            for block in alloc.block_ids:
                if self._pending.get(block) == request_id:
                    del self._pending[block]
                    self._unregister(block, announced=False)
        now = self._clock()
        # Deepest block first so that it is evicted before its ancestors.
        for block in reversed(alloc.block_ids):
            self._ref[block] -= 1
            if self._ref[block] > 0:
                continue
            if self._hash_of[block] is None:
                self._free.append(block)
            else:
                self._evictable[self._priority[block]][block] = None
                self._num_evictable += 1
                self._released_at[block] = now

    def discard(self, block_hash: int) -> bool:
        """Drop one cached, unreferenced block by hash (a priority-eviction or KV-event hook).

        Returns False when no such block is cached or a running request references it. Its
        descendants stay cached but become unreachable until it is recomputed.
        """
        block = self._block_of.get(block_hash)
        if block is None or self._ref[block] > 0:
            return False
        self._unlist(block)
        self._unregister(block)
        self._free.append(block)
        self.evicted_blocks += 1
        return True

    def expire(self, max_age_s: float) -> int:
        """Drop cached, unreferenced blocks no request has used for ``max_age_s`` seconds
        (a cache TTL); returns how many. Each eviction queue is in release order, so this
        stops at the first block of a queue that is young enough."""
        cutoff = self._clock() - max_age_s
        dropped = 0
        for queue in self._evictable:
            while queue:
                block = next(iter(queue))
                if self._released_at[block] > cutoff:
                    break
                h = self._hash_of[block]
                if h is None or not self.discard(h):  # never: queued blocks are cached
                    break
                dropped += 1
        return dropped

    def clear(self) -> None:
        """Drop all cached (unreferenced) content; referenced blocks are untouched."""
        while self._num_evictable:
            self._evict_one()

    def flush(self, namespace: str | None = None) -> int:
        """Forget all cached content (of one ``namespace``, or of every namespace).

        Unreferenced blocks are freed at once; blocks of running requests lose their hash, so
        nobody else can match them and they are freed when their requests finish. Returns the
        number of blocks whose content was dropped. Use after a model or tokenizer upgrade.
        """
        if namespace is None and self.listener is not None:
            self.listener.cleared()
            self._muted = True
        try:
            return self._flush(namespace)
        finally:
            self._muted = False

    def zero_counters(self) -> None:
        """Set the counters (``queries_tokens``, ``hit_tokens``, ``evicted_blocks``) back to
        zero, as a fresh process starts them."""
        self.queries_tokens = self.hit_tokens = self.evicted_blocks = 0

    def _flush(self, namespace: str | None) -> int:
        dropped = 0
        for block in range(self.num_blocks):
            if self._hash_of[block] is None:
                continue
            if namespace is not None and self._namespace_of[block] != namespace:
                continue
            if self._ref[block] == 0:
                self._unlist(block)
                self._free.append(block)
            self._unregister(block)
            dropped += 1
        return dropped

    def forget(self, request_id: str) -> None:
        """Unregister the blocks a running request computes itself (their content is invalid,
        e.g. its prefill failed), so that no later request matches them."""
        alloc = self._requests.get(request_id)
        if alloc is None:
            raise KeyError(request_id)
        for block in alloc.block_ids[alloc.matched_blocks :]:
            if self._hash_of[block] is not None:
                self._unregister(block)

    # -- internals -------------------------------------------------------------------------

    def _take_block(self) -> int:
        if not self._free:
            self._evict_one()
        return self._free.popleft()

    def _evict_one(self) -> None:
        queue = next(q for q in self._evictable if q)  # lowest priority class first
        block, _ = queue.popitem(last=False)
        self._num_evictable -= 1
        self._unregister(block)
        self._free.append(block)
        self.evicted_blocks += 1

    def _unlist(self, block: int) -> None:
        """Take a cached block out of its eviction queue."""
        del self._evictable[self._priority[block]][block]
        self._num_evictable -= 1

    def _unregister(self, block: int, announced: bool = True) -> None:
        """Forget ``block``'s hash; ``announced``: the listener was told it was stored, and
        is told it was removed."""
        self._pending.pop(block, None)
        h = self._hash_of[block]
        if h is not None and self._block_of.get(h) == block:
            del self._block_of[h]
            if announced and self.listener is not None and not self._muted:
                self.listener.removed((h,))
        self._hash_of[block] = None
        self._namespace_of[block] = None
        self._priority[block] = Priority.CONVERSATION

    def _register(self, block: int, h: int, namespace: str) -> bool:
        """Register ``block`` under ``h``; False when it stays private (see below)."""
        old = self._block_of.get(h)
        if old is not None:
            if self._ref[old] > 0:
                # Same content held by a running request (only possible on a hash collision
                # or an unreachable duplicate); keep the new block private.
                return False
            # An unreachable cached copy (its parent was evicted): replace it.
            self._unlist(old)
            self._unregister(old)
            self._free.append(old)
        self._block_of[h] = block
        self._hash_of[block] = h
        self._namespace_of[block] = namespace
        return True
