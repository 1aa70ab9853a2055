"""KV cache manager: the page pool, reference counts and the prefix cache.

A request's pages are listed in `request.block_ids` (its block table; per group below). Pages are handed out
one at a time as a request grows and returned when it finishes, is aborted or preempted.

Prefix caching: once a page is full, it gets a hash chained from its parent page's hash and
its token ids (plus `extra_key`, e.g. a future adapter id). A new request reuses the longest
run of cached pages that matches its prompt. A hash hit is confirmed against the page's
stored token ids and its parent page (id and generation), so a hash collision can never hand
out another prompt's KV. Freed pages keep their contents and hash until the pool needs them:
the least recently freed page is evicted first (pages that were never cached go first).

Sharing and copy-on-write: pages are reference counted. Prefix-cache hits share full pages
(a shared system prompt, the `n` samples of one prompt); `fork` shares a whole block table,
partial last page included, with a new request (a beam branching off). Full pages are never
written again, so sharing them is free; a shared page that is still being filled is copied
when a request is about to write into it (`allocate_slots` queues the copy, the engine runs
`take_pending_copies` before the step), so the last holder writes in place and no copy is
made for sequences that never write there.

Swapping: with a host pool (`num_swap_blocks` > 0), a preempted request's pages can be saved
to host slots (`swap_out`) instead of being recomputed, and restored into fresh pages when it
resumes (`swap_in`). This class only does the bookkeeping; the runner copies the data.

Groups and sliding windows: a model whose layers see only the last `window` tokens needs no
page that lies wholly before its request's next query minus the window. Each *group* of
layers has its own pool of pages and, in every request, its own block table
(`Request.block_tables[g]`); a group with a window hands those pages back as the request
moves on (`Request.num_released_blocks[g]` of them, always a prefix of its table: their ids
stay in the table, unread, so the parent chain of later pages stays known). One group serves
most models (window 0: nothing released; or every layer windowed, as Mistral v0.1). A model
that mixes windowed and global layers (Gemma 3) has two: group 0 for the global layers,
group 1 for the windowed ones, so its long requests hold window-sized KV in the windowed
layers. Released pages keep their hash until evicted, so prefix hits still find them; a hit
in every group is needed for a page to count as cached. Swapping is for windowless models:
a request of a model with a window is recomputed when preempted.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from jaxllm.core.request import Request


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...], extra_key=None) -> int:
    return hash((parent_hash, token_ids, extra_key))


@dataclasses.dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    parent: tuple[int, int] | None = None  # (parent block id, its generation) when cached
    generation: int = 0  # bumped every time the page is (re)cached


class PageGroup:
    """One group's pool of pages, and the block table `request.block_tables[index]` of each
    request that indexes it (see the module doc). `window` > 0: the group's layers see only
    the last `window` tokens, and pages wholly before that are released as requests move on."""

    def __init__(self, index: int, num_blocks: int, block_size: int, window: int = 0):
        self.index = index
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free pages in eviction order (front = evicted first); values unused.
        self.free_blocks: collections.OrderedDict[int, None] = collections.OrderedDict(
            (i, None) for i in range(num_blocks)
        )
        self.cached: dict[int, list[int]] = {}  # hash -> block ids with that hash
        self.pending_copies: dict[int, int] = {}  # copy-on-write not yet run: dst page -> src page

    def table(self, request: Request) -> list[int]:
        return request.block_tables[self.index]

    def held(self, request: Request) -> list[int]:
        """The pages of the request's table it holds (those not released)."""
        return request.block_tables[self.index][request.num_released_blocks[self.index] :]

    def first_needed(self, num_computed_tokens: int) -> int:
        """The first page a query from position `num_computed_tokens` on still reads."""
        if not self.window:
            return 0
        return max(num_computed_tokens - self.window + 1, 0) // self.block_size

    def _lookup(self, block_hash: int, token_ids: tuple[int, ...], parent: tuple[int, int] | None) -> int | None:
        for block_id in self.cached.get(block_hash, ()):
            block = self.blocks[block_id]
            if block.token_ids == token_ids and block.parent == parent:
                return block_id
        return None

    def lookup(self, request: Request, max_blocks: int) -> list[int]:
        """The longest run (at most `max_blocks`) of this group's cached pages that matches the
        request's tokens from the start, each confirmed against its parent."""
        tokens = request.all_token_ids
        hits, parent = [], None
        for i in range(max_blocks):
            block_id = self._lookup(
                request.block_hashes[i], tuple(tokens[i * self.block_size : (i + 1) * self.block_size]), parent
            )
            if block_id is None:
                break
            hits.append(block_id)
            parent = (block_id, self.blocks[block_id].generation)
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly computed full pages in the prefix cache."""
        table = self.table(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        # Cached pages form a prefix of the table (hits and forks share prefixes), so only the
        # pages after the last cached one need looking at: O(new pages) per step, not O(table).
        start, released = num_full, request.num_released_blocks[self.index]
        while start > released and self.blocks[table[start - 1]].block_hash is None:
            start -= 1
        tokens = None
        for i in range(start, num_full):
            block = self.blocks[table[i]]
            if tokens is None:
                tokens = request.all_token_ids
            parent_block = self.blocks[table[i - 1]] if i else None
            if parent_block is not None and parent_block.block_hash != request.block_hashes[i - 1]:
                return  # a released parent page already reused: its children cannot be confirmed
            block.block_hash = request.block_hashes[i]
            block.token_ids = tuple(tokens[i * self.block_size : (i + 1) * self.block_size])
            block.parent = (parent_block.block_id, parent_block.generation) if parent_block else None
            block.generation += 1
            self.cached.setdefault(block.block_hash, []).append(block.block_id)

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        ids = self.cached[block.block_hash]
        ids.remove(block.block_id)
        if not ids:
            del self.cached[block.block_hash]
        block.block_hash = block.token_ids = block.parent = None

    # ----- allocation -----
    def release(self, request: Request) -> None:
        """Hand back the pages the request's next query no longer reads (before its window)."""
        table, released = self.table(request), request.num_released_blocks[self.index]
        upto = min(self.first_needed(request.num_computed_tokens), len(table))
        if upto > released:
            self._free_pages(table[released:upto])
            request.num_released_blocks[self.index] = upto

    def _plan(self, request: Request, num_new_tokens: int, computed_blocks) -> tuple[int, int, list[int]]:
        """(pages to add, the first cached page to take, indexes of shared pages to copy) for
        `allocate`; the cached pages before the window of the first query are not taken."""
        table, bs = self.table(request), self.block_size
        total = len(computed_blocks) * bs if computed_blocks else request.num_computed_tokens
        need = -(-(total + num_new_tokens) // bs) - len(table) - len(computed_blocks)
        first_written = request.num_computed_tokens // bs
        shared = [i for i in range(first_written, len(table)) if num_new_tokens and self.blocks[table[i]].ref_cnt > 1]
        return max(need, 0), min(self.first_needed(total), len(computed_blocks)), shared

    def shortfall(self, request: Request, num_new_tokens: int, computed_blocks=()) -> int:
        """Pages `allocate` would lack (0 when it can run)."""
        need, take_from, shared = self._plan(request, num_new_tokens, computed_blocks)
        reuse_free = sum(1 for b in computed_blocks[take_from:] if self.blocks[b].ref_cnt == 0)
        return max(need + len(shared) + reuse_free - len(self.free_blocks), 0)

    def allocate(self, request: Request, num_new_tokens: int, computed_blocks=()) -> int:
        """Pages for `num_new_tokens` more tokens (after `shortfall` said 0): the cached
        `computed_blocks` of an admission first, a private copy of a shared page the new tokens
        are written into (copy-on-write, queued in `pending_copies`), then fresh pages.
        Returns how many pages were copied."""
        need, take_from, shared = self._plan(request, num_new_tokens, computed_blocks)
        table = self.table(request)
        for i, block_id in enumerate(computed_blocks):
            block = self.blocks[block_id]
            if i >= take_from:
                if block.ref_cnt == 0:
                    del self.free_blocks[block_id]
                block.ref_cnt += 1
            table.append(block_id)
        if computed_blocks:
            request.num_released_blocks[self.index] = take_from
        copies, first_written = 0, request.num_computed_tokens // self.block_size
        for i in shared:
            src = table[i]
            self.blocks[src].ref_cnt -= 1
            table[i] = self._pop_free_block()
            if i == first_written and request.num_computed_tokens % self.block_size:
                # The source may itself be a copy queued this step: read from its origin.
                self.pending_copies[table[i]] = self.pending_copies.get(src, src)
                copies += 1
        for _ in range(need):
            table.append(self._pop_free_block())
        return copies

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        self._evict(block)
        block.ref_cnt = 1
        return block_id

    def fork(self, parent: Request, child: Request) -> None:
        for block_id in self.held(parent):
            self.blocks[block_id].ref_cnt += 1
        child.block_tables[self.index] = list(self.table(parent))
        child.num_released_blocks[self.index] = parent.num_released_blocks[self.index]

    def trim(self, request: Request, keep: int) -> None:
        table = self.table(request)
        self._free_pages(table[max(keep, request.num_released_blocks[self.index]) :])
        del table[keep:]

    def take_pending_copies(self) -> tuple[list[int], list[int]]:
        dst = list(self.pending_copies)
        src = [self.pending_copies[d] for d in dst]
        self.pending_copies.clear()
        return src, dst

    def free(self, request: Request) -> None:
        self._free_pages(self.held(request))
        request.block_tables[self.index] = []
        request.num_released_blocks[self.index] = 0

    def _free_pages(self, block_ids: list[int]) -> None:
        """Cached pages go to the back of the eviction order (the tail of a sequence first
        out), uncached ones to the front."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_blocks[block_id] = None
                self.pending_copies.pop(block_id, None)  # a copy into a page nobody holds
                if block.block_hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)


class KVCacheManager:
    """The request-level view over the groups (one, or two for a model that mixes windowed
    and global layers): every operation is done in each group, and an allocation happens in
    all of them or in none. `num_blocks` and `windows` are per group (an int: one group)."""

    def __init__(
        self,
        num_blocks: int | Sequence[int],
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_swap_blocks: int = 0,
        windows: Sequence[int] = (0,),
    ):
        sizes = [num_blocks] * len(windows) if isinstance(num_blocks, int) else list(num_blocks)
        if len(sizes) != len(windows):
            raise ValueError(f"{len(sizes)} pool sizes for {len(windows)} KV cache groups")
        self.groups = [PageGroup(g, n, block_size, w) for g, (n, w) in enumerate(zip(sizes, windows))]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_swap_blocks = num_swap_blocks
        self.free_swap_slots: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self.prefix_queries = 0  # prompt tokens looked up (once per admission)
        self.prefix_hits = 0  # prompt tokens found cached
        self.num_copies = 0  # pages copied on write, ever
        self.num_swapped_out = 0  # pages swapped out to the host, ever

    # ----- accounting -----
    @property
    def num_blocks(self) -> int:
        """Group 0's pages: the bound on what requests can hold at once (a window group's
        requests hold fewer)."""
        return self.groups[0].num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free pages of the group that has fewest."""
        return min(len(g.free_blocks) for g in self.groups)

    @property
    def num_used_blocks(self) -> int:
        return sum(g.num_blocks - len(g.free_blocks) for g in self.groups)

    @property
    def usage(self) -> float:
        """The fullest group's share of pages in use."""
        return max((g.num_blocks - len(g.free_blocks)) / g.num_blocks for g in self.groups)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_fits(self, num_tokens: int, max_chunk: int) -> None:
        """Raise if a sequence of `num_tokens`, computed in chunks of at most `max_chunk`
        tokens, needs more pages than a group has (it would preempt itself forever)."""
        for g in self.groups:
            need = self.blocks_needed(num_tokens)
            if g.window:  # the window before a chunk's first query, the chunk, one page of misalignment
                need = min(need, self.blocks_needed(g.window - 1 + max_chunk) + 1)
            if need > g.num_blocks:
                raise ValueError(
                    f"prompt + max_tokens needs {need} KV pages but the pool only has "
                    f"{g.num_blocks}; lower max_tokens or raise kv_cache_memory"
                )

    def request_usage(self, request: Request) -> tuple[int, int]:
        """(pages the request holds, how many of them other requests also hold)."""
        held = [(g, b) for g in self.groups for b in g.held(request)]
        return len(held), sum(1 for g, b in held if g.blocks[b].ref_cnt > 1)

    def _with_groups(self, request: Request) -> None:
        """Give the request a block table in every group (a new Request has group 0's)."""
        while len(request.block_tables) < len(self.groups):
            request.block_tables.append([])
            request.num_released_blocks.append(0)

    # ----- prefix cache -----
    def _update_hashes(self, request: Request) -> None:
        """Extend `request.block_hashes` over every full page of its known tokens."""
        tokens = request.prompt_token_ids
        num_full = request.num_tokens // self.block_size
        bs = self.block_size
        while len(request.block_hashes) < num_full:
            i = len(request.block_hashes)
            if (i + 1) * bs > len(tokens):
                tokens = request.all_token_ids
            parent = request.block_hashes[-1] if request.block_hashes else None
            request.block_hashes.append(hash_block_tokens(parent, tuple(tokens[i * bs : (i + 1) * bs])))

    def get_computed_blocks(self, request: Request) -> list[list[int]]:
        """Per group, the cached pages of the longest prompt prefix every group has cached
        (the last prompt token is always left to compute, so its logits exist)."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups]
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for g in self.groups:
            hits.append(g.lookup(request, max_blocks))
            max_blocks = len(hits[-1])
        return [h[:max_blocks] for h in hits]

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly computed full pages in the prefix cache."""
        if self.enable_prefix_caching:
            self._update_hashes(request)
            for g in self.groups:
                g.cache_full_blocks(request)

    # ----- allocation -----
    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[list[int]] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after `request.num_computed_tokens`
        (plus `computed_blocks` from `get_computed_blocks`, for a request being admitted),
        after releasing the pages that slid out of each window. A shared page the new tokens
        would be written into is replaced by a private copy (copy-on-write).
        Returns False, changing nothing else, when a pool cannot supply the pages."""
        self._with_groups(request)
        admitting = not request.block_ids
        computed = list(computed_blocks) or [[] for _ in self.groups]
        for g in self.groups:
            g.release(request)
        if any(g.shortfall(request, num_new_tokens, c) for g, c in zip(self.groups, computed)):
            return False
        for g, c in zip(self.groups, computed):
            self.num_copies += g.allocate(request, num_new_tokens, c)
        if admitting and self.enable_prefix_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(computed[0]) * self.block_size
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's pages and computed state (a beam branching off): every
        page is shared (ref counted) until one of them writes into it."""
        self._with_groups(child)
        for g in self.groups:
            g.fork(parent, child)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's pages past the first `num_tokens` tokens (those that held
        rejected drafts), as `free` frees a whole table."""
        for g in self.groups:
            g.trim(request, self.blocks_needed(num_tokens))

    def take_pending_copies(self) -> list[tuple[list[int], list[int]]]:
        """Per group, the queued copy-on-write copies as (src pages, dst pages); run them
        before the step."""
        return [g.take_pending_copies() for g in self.groups]

    def free(self, request: Request) -> None:
        """Return a request's pages."""
        for g in self.groups:
            g.free(request)

    def reset_prefix_cache(self) -> None:
        for g in self.groups:
            g.reset_prefix_cache()

    # ----- swapping (one group without a window; see the module doc) -----
    def can_swap_out(self, request: Request) -> bool:
        g = self.groups[0]
        return len(self.groups) == 1 and not g.window and 0 < len(request.block_ids) <= len(self.free_swap_slots)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Give the request host slots for its pages and free the pages; returns the
        (page, slot) copies to run before the pages are reused (i.e. before the next step)."""
        pairs = [(block_id, self.free_swap_slots.pop()) for block_id in request.block_ids]
        request.swap_slots = [slot for _, slot in pairs]
        self.num_swapped_out += len(pairs)
        self.free(request)
        return pairs

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Fresh pages for a swapped-out request's saved ones plus room for `num_new_tokens`;
        returns the (slot, page) copies to run before the step, or None (changing nothing)
        when the pool cannot supply them."""
        g = self.groups[0]
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        if need > len(g.free_blocks):
            return None
        request.block_ids = [g._pop_free_block() for _ in range(need)]
        pairs = list(zip(request.swap_slots, request.block_ids))
        self.free_swap(request)
        return pairs

    def free_swap(self, request: Request) -> None:
        self.free_swap_slots += reversed(request.swap_slots)
        request.swap_slots = []
