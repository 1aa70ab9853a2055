"""KV cache manager: the page pool, reference counts and the prefix cache.

A request's pages are listed in `request.page_ids` (its page table; per group below). Pages are handed out
one at a time as a request grows and returned when it finishes, is aborted or preempted.

Prefix caching: once a page is full, it gets a hash chained from its parent page's hash and
its token ids (the first page's parent is its request's `prefix_root`: its LoRA adapter). A new
request reuses the longest run of cached pages that matches its prompt. A hash hit is confirmed
against the page's stored token ids and its parent page (id and generation; the root for the
first), so a hash collision can never hand out another prompt's KV. Freed pages keep their
contents and hash until the pool needs them: the least recently freed page is evicted first
(pages that were never cached go first).

Sharing and copy-on-write: pages are reference counted. Prefix-cache hits share full pages
(a shared system prompt, the `n` samples of one prompt); `fork` shares a whole page table,
partial last page included, with a new request (a beam branching off). Full pages are never
written again, so sharing them is free; a shared page that is still being filled is copied
when a request is about to write into it (`allocate_slots` queues the copy, the engine runs
`take_pending_copies` before the step), so the last holder writes in place and no copy is
made for sequences that never write there.

Swapping: with a host pool (`num_swap_pages` > 0), a preempted request's pages can be saved
to host slots (`swap_out`) instead of being recomputed, and restored into fresh pages when it
resumes (`swap_in`). This class only does the bookkeeping; the runner copies the data.

Groups and sliding windows: a model whose layers see only the last `window` tokens needs no
page that lies wholly before its request's next query minus the window. Each *group* of
layers has its own pool of pages and, in every request, its own page table
(`Request.page_tables[g]`); a group with a window hands those pages back as the request
moves on (`Request.num_released_pages[g]` of them, always a prefix of its table: their ids
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


def hash_page_tokens(parent, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


def prefix_root(request: Request) -> tuple | None:
    """What a request's first page hangs from: nothing, or its LoRA adapter and the version of
    its weights (the same tokens under two adapters have different KV, so their pages are never
    shared)."""
    return None if request.lora is None else ("lora", request.lora.lora_int_id, request.lora.version)


@dataclasses.dataclass(slots=True)
class Page:
    page_id: int
    ref_cnt: int = 0
    page_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    parent: tuple | None = None  # (parent page id, its generation) when cached; page 0's `prefix_root`
    generation: int = 0  # bumped every time the page is (re)cached
    stale: bool = False  # held through a weight update: never cached until it is freed and reused


class PageGroup:
    """One group's pool of pages, and the page table `request.page_tables[index]` of each
    request that indexes it (see the module doc). `window` > 0: the group's layers see only
    the last `window` tokens, and pages wholly before that are released as requests move on."""

    def __init__(self, index: int, num_pages: int, page_size: int, window: int = 0):
        self.index = index
        self.num_pages = num_pages
        self.page_size = page_size
        self.window = window
        self.pages = [Page(i) for i in range(num_pages)]
        # Free pages in eviction order (front = evicted first); values unused.
        self.free_pages: collections.OrderedDict[int, None] = collections.OrderedDict(
            (i, None) for i in range(num_pages)
        )
        self.cached: dict[int, list[int]] = {}  # hash -> page ids with that hash
        self.pending_copies: dict[int, int] = {}  # copy-on-write not yet run: dst page -> src page

    def table(self, request: Request) -> list[int]:
        return request.page_tables[self.index]

    def held(self, request: Request) -> list[int]:
        """The pages of the request's table it holds (those not released)."""
        return request.page_tables[self.index][request.num_released_pages[self.index] :]

    def first_needed(self, num_computed_tokens: int) -> int:
        """The first page a query from position `num_computed_tokens` on still reads."""
        if not self.window:
            return 0
        return max(num_computed_tokens - self.window + 1, 0) // self.page_size

    def _lookup(self, page_hash: int, token_ids: tuple[int, ...], parent: tuple[int, int] | None) -> int | None:
        for page_id in self.cached.get(page_hash, ()):
            page = self.pages[page_id]
            if page.token_ids == token_ids and page.parent == parent:
                return page_id
        return None

    def lookup(self, request: Request, max_pages: int) -> list[int]:
        """The longest run (at most `max_pages`) of this group's cached pages that matches the
        request's tokens from the start, each confirmed against its parent."""
        tokens = request.all_token_ids
        hits, parent = [], prefix_root(request)
        for i in range(max_pages):
            page_id = self._lookup(
                request.page_hashes[i], tuple(tokens[i * self.page_size : (i + 1) * self.page_size]), parent
            )
            if page_id is None:
                break
            hits.append(page_id)
            parent = (page_id, self.pages[page_id].generation)
        return hits

    def cache_full_pages(self, request: Request) -> None:
        """Register the request's newly computed full pages in the prefix cache."""
        table = self.table(request)
        num_full = min(request.num_computed_tokens // self.page_size, len(table))
        # Cached pages form a prefix of the table (hits and forks share prefixes), so only the
        # pages after the last cached one need looking at: O(new pages) per step, not O(table).
        start, released = num_full, request.num_released_pages[self.index]
        while start > released and self.pages[table[start - 1]].page_hash is None:
            start -= 1
        tokens = None
        for i in range(start, num_full):
            page = self.pages[table[i]]
            if page.stale:
                return  # computed (in part) under weights since replaced: it and its children stay private
            if tokens is None:
                tokens = request.all_token_ids
            parent_page = self.pages[table[i - 1]] if i else None
            if parent_page is not None and parent_page.page_hash != request.page_hashes[i - 1]:
                return  # a released parent page already reused: its children cannot be confirmed
            page.page_hash = request.page_hashes[i]
            page.token_ids = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
            page.parent = (parent_page.page_id, parent_page.generation) if parent_page else prefix_root(request)
            page.generation += 1
            self.cached.setdefault(page.page_hash, []).append(page.page_id)

    def _evict(self, page: Page) -> None:
        if page.page_hash is None:
            return
        ids = self.cached[page.page_hash]
        ids.remove(page.page_id)
        if not ids:
            del self.cached[page.page_hash]
        page.page_hash = page.token_ids = page.parent = None

    # ----- allocation -----
    def release(self, request: Request) -> None:
        """Hand back the pages the request's next query no longer reads (before its window)."""
        table, released = self.table(request), request.num_released_pages[self.index]
        upto = min(self.first_needed(request.num_computed_tokens), len(table))
        if upto > released:
            self._free_pages(table[released:upto])
            request.num_released_pages[self.index] = upto

    def _plan(self, request: Request, num_new_tokens: int, computed_pages) -> tuple[int, int, list[int]]:
        """(pages to add, the first cached page to take, indexes of shared pages to copy) for
        `allocate`; the cached pages before the window of the first query are not taken."""
        table, bs = self.table(request), self.page_size
        total = len(computed_pages) * bs if computed_pages else request.num_computed_tokens
        need = -(-(total + num_new_tokens) // bs) - len(table) - len(computed_pages)
        first_written = request.num_computed_tokens // bs
        shared = [i for i in range(first_written, len(table)) if num_new_tokens and self.pages[table[i]].ref_cnt > 1]
        return max(need, 0), min(self.first_needed(total), len(computed_pages)), shared

    def shortfall(self, request: Request, num_new_tokens: int, computed_pages=()) -> int:
        """Pages `allocate` would lack (0 when it can run)."""
        need, take_from, shared = self._plan(request, num_new_tokens, computed_pages)
        reuse_free = sum(1 for b in computed_pages[take_from:] if self.pages[b].ref_cnt == 0)
        return max(need + len(shared) + reuse_free - len(self.free_pages), 0)

    def allocate(self, request: Request, num_new_tokens: int, computed_pages=()) -> int:
        """Pages for `num_new_tokens` more tokens (after `shortfall` said 0): the cached
        `computed_pages` of an admission first, a private copy of a shared page the new tokens
        are written into (copy-on-write, queued in `pending_copies`), then fresh pages.
        Returns how many pages were copied."""
        need, take_from, shared = self._plan(request, num_new_tokens, computed_pages)
        table = self.table(request)
        for i, page_id in enumerate(computed_pages):
            page = self.pages[page_id]
            if i >= take_from:
                if page.ref_cnt == 0:
                    del self.free_pages[page_id]
                page.ref_cnt += 1
            table.append(page_id)
        if computed_pages:
            request.num_released_pages[self.index] = take_from
        copies, first_written = 0, request.num_computed_tokens // self.page_size
        for i in shared:
            src = table[i]
            self.pages[src].ref_cnt -= 1
            table[i] = self._pop_free_page()
            if i == first_written and request.num_computed_tokens % self.page_size:
                # The source may itself be a copy queued this step: read from its origin.
                self.pending_copies[table[i]] = self.pending_copies.get(src, src)
                copies += 1
        for _ in range(need):
            table.append(self._pop_free_page())
        return copies

    def _pop_free_page(self) -> int:
        page_id, _ = self.free_pages.popitem(last=False)
        page = self.pages[page_id]
        self._evict(page)
        page.ref_cnt, page.stale = 1, False
        return page_id

    def fork(self, parent: Request, child: Request) -> None:
        for page_id in self.held(parent):
            self.pages[page_id].ref_cnt += 1
        child.page_tables[self.index] = list(self.table(parent))
        child.num_released_pages[self.index] = parent.num_released_pages[self.index]

    def trim(self, request: Request, keep: int) -> None:
        table = self.table(request)
        self._free_pages(table[max(keep, request.num_released_pages[self.index]) :])
        del table[keep:]

    def take_pending_copies(self) -> tuple[list[int], list[int]]:
        dst = list(self.pending_copies)
        src = [self.pending_copies[d] for d in dst]
        self.pending_copies.clear()
        return src, dst

    def free(self, request: Request) -> None:
        self._free_pages(self.held(request))
        request.page_tables[self.index] = []
        request.num_released_pages[self.index] = 0

    def _free_pages(self, page_ids: list[int]) -> None:
        """Cached pages go to the back of the eviction order (the tail of a sequence first
        out), uncached ones to the front."""
        for page_id in reversed(page_ids):
            page = self.pages[page_id]
            page.ref_cnt -= 1
            if page.ref_cnt == 0:
                self.free_pages[page_id] = None
                self.pending_copies.pop(page_id, None)  # a copy into a page nobody holds
                if page.page_hash is None:
                    self.free_pages.move_to_end(page_id, last=False)

    def reset_prefix_cache(self, held: bool = False) -> None:
        """Forget the cached free pages; with `held` (after a weight update) also the pages
        requests still hold, which are then never cached again until freed and reused."""
        for page in self.pages:
            if page.ref_cnt == 0:
                self._evict(page)
            elif held:
                self._evict(page)
                page.stale = True


class KVCacheManager:
    """The request-level view over the groups (one, or two for a model that mixes windowed
    and global layers): every operation is done in each group, and an allocation happens in
    all of them or in none. `num_pages` and `windows` are per group (an int: one group)."""

    def __init__(
        self,
        num_pages: int | Sequence[int],
        page_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_swap_pages: int = 0,
        windows: Sequence[int] = (0,),
    ):
        sizes = [num_pages] * len(windows) if isinstance(num_pages, int) else list(num_pages)
        if len(sizes) != len(windows):
            raise ValueError(f"{len(sizes)} pool sizes for {len(windows)} KV cache groups")
        self.groups = [PageGroup(g, n, page_size, w) for g, (n, w) in enumerate(zip(sizes, windows))]
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_swap_pages = num_swap_pages
        self.free_swap_slots: list[int] = list(range(num_swap_pages - 1, -1, -1))
        self.prefix_queries = 0  # prompt tokens looked up (once per admission)
        self.prefix_hits = 0  # prompt tokens found cached
        self.num_copies = 0  # pages copied on write, ever
        self.num_swapped_out = 0  # pages swapped out to the host, ever

    # ----- accounting -----
    @property
    def num_pages(self) -> int:
        """Group 0's pages: the bound on what requests can hold at once (a window group's
        requests hold fewer)."""
        return self.groups[0].num_pages

    @property
    def num_free_pages(self) -> int:
        """Free pages of the group that has fewest."""
        return min(len(g.free_pages) for g in self.groups)

    @property
    def num_used_pages(self) -> int:
        return sum(g.num_pages - len(g.free_pages) for g in self.groups)

    @property
    def usage(self) -> float:
        """The fullest group's share of pages in use."""
        return max((g.num_pages - len(g.free_pages)) / g.num_pages for g in self.groups)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def check_fits(self, num_tokens: int, max_chunk: int) -> None:
        """Raise if a sequence of `num_tokens`, computed in chunks of at most `max_chunk`
        tokens, needs more pages than a group has (it would preempt itself forever)."""
        for g in self.groups:
            need = self.pages_needed(num_tokens)
            if g.window:  # the window before a chunk's first query, the chunk, one page of misalignment
                need = min(need, self.pages_needed(g.window - 1 + max_chunk) + 1)
            if need > g.num_pages:
                raise ValueError(
                    f"prompt + max_tokens needs {need} KV pages but the pool only has "
                    f"{g.num_pages}; lower max_tokens or raise kv_cache_memory"
                )

    def request_usage(self, request: Request) -> tuple[int, int]:
        """(pages the request holds, how many of them other requests also hold)."""
        held = [(g, b) for g in self.groups for b in g.held(request)]
        return len(held), sum(1 for g, b in held if g.pages[b].ref_cnt > 1)

    def _with_groups(self, request: Request) -> None:
        """Give the request a page table in every group (a new Request has group 0's)."""
        while len(request.page_tables) < len(self.groups):
            request.page_tables.append([])
            request.num_released_pages.append(0)

    # ----- prefix cache -----
    def _update_hashes(self, request: Request) -> None:
        """Extend `request.page_hashes` over every full page of its known tokens."""
        tokens = request.prompt_token_ids
        num_full = request.num_tokens // self.page_size
        bs = self.page_size
        while len(request.page_hashes) < num_full:
            i = len(request.page_hashes)
            if (i + 1) * bs > len(tokens):
                tokens = request.all_token_ids
            parent = request.page_hashes[-1] if request.page_hashes else prefix_root(request)
            request.page_hashes.append(hash_page_tokens(parent, tuple(tokens[i * bs : (i + 1) * bs])))

    def get_computed_pages(self, request: Request) -> list[list[int]]:
        """Per group, the cached pages of the longest prompt prefix every group has cached
        (the last prompt token is always left to compute, so its logits exist)."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.groups]
        self._update_hashes(request)
        max_pages = (request.num_tokens - 1) // self.page_size
        hits = []
        for g in self.groups:
            hits.append(g.lookup(request, max_pages))
            max_pages = len(hits[-1])
        return [h[:max_pages] for h in hits]

    def cache_full_pages(self, request: Request) -> None:
        """Register the request's newly computed full pages in the prefix cache."""
        if self.enable_prefix_caching:
            self._update_hashes(request)
            for g in self.groups:
                g.cache_full_pages(request)

    # ----- allocation -----
    def allocate_slots(self, request: Request, num_new_tokens: int, computed_pages: list[list[int]] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after `request.num_computed_tokens`
        (plus `computed_pages` from `get_computed_pages`, for a request being admitted),
        after releasing the pages that slid out of each window. A shared page the new tokens
        would be written into is replaced by a private copy (copy-on-write).
        Returns False, changing nothing else, when a pool cannot supply the pages."""
        self._with_groups(request)
        admitting = not request.page_ids
        computed = list(computed_pages) or [[] for _ in self.groups]
        for g in self.groups:
            g.release(request)
        if any(g.shortfall(request, num_new_tokens, c) for g, c in zip(self.groups, computed)):
            return False
        for g, c in zip(self.groups, computed):
            self.num_copies += g.allocate(request, num_new_tokens, c)
        if admitting and self.enable_prefix_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(computed[0]) * self.page_size
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's pages and computed state (a beam branching off): every
        page is shared (ref counted) until one of them writes into it."""
        self._with_groups(child)
        for g in self.groups:
            g.fork(parent, child)
        child.page_hashes = list(parent.page_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's pages past the first `num_tokens` tokens (those that held
        rejected drafts), as `free` frees a whole table."""
        for g in self.groups:
            g.trim(request, self.pages_needed(num_tokens))

    def take_pending_copies(self) -> list[tuple[list[int], list[int]]]:
        """Per group, the queued copy-on-write copies as (src pages, dst pages); run them
        before the step."""
        return [g.take_pending_copies() for g in self.groups]

    def free(self, request: Request) -> None:
        """Return a request's pages."""
        for g in self.groups:
            g.free(request)

    def reset_prefix_cache(self, held: bool = False) -> None:
        """Forget every cached page nobody holds; with `held`, every cached page (see PageGroup)."""
        for g in self.groups:
            g.reset_prefix_cache(held)

    # ----- swapping (one group without a window; see the module doc) -----
    def can_swap_out(self, request: Request) -> bool:
        g = self.groups[0]
        return len(self.groups) == 1 and not g.window and 0 < len(request.page_ids) <= len(self.free_swap_slots)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Give the request host slots for its pages and free the pages; returns the
        (page, slot) copies to run before the pages are reused (i.e. before the next step)."""
        pairs = [(page_id, self.free_swap_slots.pop()) for page_id in request.page_ids]
        request.swap_slots = [slot for _, slot in pairs]
        self.num_swapped_out += len(pairs)
        self.free(request)
        return pairs

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Fresh pages for a swapped-out request's saved ones plus room for `num_new_tokens`;
        returns the (slot, page) copies to run before the step, or None (changing nothing)
        when the pool cannot supply them."""
        g = self.groups[0]
        need = self.pages_needed(request.num_computed_tokens + num_new_tokens)
        if need > len(g.free_pages):
            return None
        request.page_ids = [g._pop_free_page() for _ in range(need)]
        pairs = list(zip(request.swap_slots, request.page_ids))
        self.free_swap(request)
        return pairs

    def free_swap(self, request: Request) -> None:
        self.free_swap_slots += reversed(request.swap_slots)
        request.swap_slots = []
