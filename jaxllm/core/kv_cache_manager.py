"""KV cache manager: the page pool, reference counts and the prefix cache.

A request's pages are listed in `request.block_ids` (its block table). Pages are handed out
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
"""

from __future__ import annotations

import collections
import dataclasses

from jaxllm.core.request import Request


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...], extra_key=None) -> int:
    return hash((parent_hash, token_ids, extra_key))


@dataclasses.dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None
    parent: tuple[int, int] | None = None   # (parent block id, its generation) when cached
    generation: int = 0                     # bumped every time the page is (re)cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True,
                 num_swap_blocks: int = 0):
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        self.free_swap_slots: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free pages in eviction order (front = evicted first); values unused.
        self.free_blocks: collections.OrderedDict[int, None] = collections.OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, list[int]] = {}   # hash -> block ids with that hash
        self.prefix_queries = 0                  # prompt tokens looked up (once per admission)
        self.prefix_hits = 0                     # prompt tokens found cached
        self.pending_copies: dict[int, int] = {}  # copy-on-write not yet run: dst page -> src page
        self.num_copies = 0                      # pages copied on write, ever
        self.num_swapped_out = 0                 # pages swapped out to the host, ever

    # ----- accounting -----
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def request_usage(self, request: Request) -> tuple[int, int]:
        """(pages in the request's block table, how many of them other requests also hold)."""
        shared = sum(1 for b in request.block_ids if self.blocks[b].ref_cnt > 1)
        return len(request.block_ids), shared

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
            request.block_hashes.append(hash_block_tokens(parent, tuple(tokens[i * bs:(i + 1) * bs])))

    def _lookup(self, block_hash: int, token_ids: tuple[int, ...], parent: tuple[int, int] | None) -> int | None:
        for block_id in self.cached.get(block_hash, ()):
            block = self.blocks[block_id]
            if block.token_ids == token_ids and block.parent == parent:
                return block_id
        return None

    def get_computed_blocks(self, request: Request) -> list[int]:
        """The longest run of cached pages matching the prompt (the last prompt token is
        always left to compute, so its logits exist)."""
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        tokens = request.all_token_ids
        hits, parent = [], None
        for i in range(max_blocks):
            block_id = self._lookup(request.block_hashes[i], tuple(tokens[i * self.block_size:(i + 1) * self.block_size]), parent)
            if block_id is None:
                break
            hits.append(block_id)
            parent = (block_id, self.blocks[block_id].generation)
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly computed full pages in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        # Cached pages form a prefix of the table (hits and forks share prefixes), so only the
        # pages after the last cached one need looking at: O(new pages) per step, not O(table).
        start = num_full
        while start > 0 and self.blocks[request.block_ids[start - 1]].block_hash is None:
            start -= 1
        tokens = None
        for i in range(start, num_full):
            block = self.blocks[request.block_ids[i]]
            if tokens is None:
                tokens = request.all_token_ids
            parent_block = self.blocks[request.block_ids[i - 1]] if i else None
            block.block_hash = request.block_hashes[i]
            block.token_ids = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
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
    def allocate_slots(self, request: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after `request.num_computed_tokens`
        (plus `computed_blocks` from the prefix cache, for a request being admitted).
        A shared page the new tokens would be written into is replaced by a private copy
        (copy-on-write, queued in `pending_copies`).
        Returns False, changing nothing, when the pool cannot supply the pages."""
        admitting = not request.block_ids
        reuse_free = sum(1 for b in computed_blocks if self.blocks[b].ref_cnt == 0)
        total = len(computed_blocks) * self.block_size if computed_blocks else request.num_computed_tokens
        need = self.blocks_needed(total + num_new_tokens) - len(request.block_ids) - len(computed_blocks)
        first_written = request.num_computed_tokens // self.block_size
        shared = [i for i in range(first_written, len(request.block_ids))
                  if num_new_tokens and self.blocks[request.block_ids[i]].ref_cnt > 1]
        if max(need, 0) + len(shared) > self.num_free_blocks - reuse_free:
            return False
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self.free_blocks[block_id]
            block.ref_cnt += 1
            request.block_ids.append(block_id)
        for i in shared:
            src = request.block_ids[i]
            self.blocks[src].ref_cnt -= 1
            request.block_ids[i] = self._pop_free_block()
            if i == first_written and request.num_computed_tokens % self.block_size:
                # The source may itself be a copy queued this step: read from its origin.
                self.pending_copies[request.block_ids[i]] = self.pending_copies.get(src, src)
                self.num_copies += 1
        for _ in range(max(need, 0)):
            request.block_ids.append(self._pop_free_block())
        if admitting and self.enable_prefix_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(computed_blocks) * self.block_size
        return True

    def _pop_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        self._evict(block)
        block.ref_cnt = 1
        return block_id

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` the parent's pages and computed state (a beam branching off): every
        page is shared (ref counted) until one of them writes into it."""
        for block_id in parent.block_ids:
            self.blocks[block_id].ref_cnt += 1
        child.block_ids = list(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed_tokens = parent.num_computed_tokens

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's pages past the first `num_tokens` tokens (those that held
        rejected drafts), as `free` frees a whole table."""
        keep = self.blocks_needed(num_tokens)
        self._free_pages(request.block_ids[keep:])
        del request.block_ids[keep:]

    def take_pending_copies(self) -> tuple[list[int], list[int]]:
        """The queued copy-on-write copies as (src pages, dst pages); run them before the step."""
        dst = list(self.pending_copies)
        src = [self.pending_copies[d] for d in dst]
        self.pending_copies.clear()
        return src, dst

    def free(self, request: Request) -> None:
        """Return a request's pages. Cached pages go to the back of the eviction order (the
        tail of a sequence first out), uncached ones to the front."""
        self._free_pages(request.block_ids)
        request.block_ids = []

    def _free_pages(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_blocks[block_id] = None
                self.pending_copies.pop(block_id, None)   # a copy into a page nobody holds
                if block.block_hash is None:
                    self.free_blocks.move_to_end(block_id, last=False)

    # ----- swapping -----
    def can_swap_out(self, request: Request) -> bool:
        return 0 < len(request.block_ids) <= len(self.free_swap_slots)

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
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        if need > self.num_free_blocks:
            return None
        request.block_ids = [self._pop_free_block() for _ in range(need)]
        pairs = list(zip(request.swap_slots, request.block_ids))
        self.free_swap(request)
        return pairs

    def free_swap(self, request: Request) -> None:
        self.free_swap_slots += reversed(request.swap_slots)
        request.swap_slots = []

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)
