# Generated from solutions/02_paged_kv_cache.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""Paged KV cache: a shared pool of fixed-size blocks, block tables, and prefix caching.

Built in notebook 02_paged_kv_cache. Instead of one slab of ``max_model_len`` slots per
sequence (mostly empty), keys and values live in one preallocated pool cut into blocks of
``block_size`` token slots. A sequence owns a *block table*: the list of block ids that
hold its tokens, in order. Token position ``p`` of a sequence lives in pool slot

    slot = block_table[p // block_size] * block_size + p % block_size

Prefix caching: once a block is full and its keys/values are computed, it is named by a
chained hash of its tokens (the hash of the parent block and this block's token ids).
A later request whose prompt starts with the same tokens finds those blocks by hash,
shares them by reference count, and skips computing them. Blocks of finished sequences
stay cached until the pool needs room; then the least recently used one is evicted.
A hit is always verified against the stored token ids and parent block, so even a hash
collision cannot hand a sequence someone else's keys and values.
"""

from __future__ import annotations

import math
import mmap
from collections import OrderedDict
from dataclasses import dataclass

import torch

from minivllm.model import causal_attention

# ----------------------------------------------------------------------------- the pool


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose CPU memory the OS commits only where it is written.

    ``torch.zeros`` writes every byte up front, so a 2 GiB pool would be 2 GiB of resident
    memory before the first request. An anonymous memory map reads as zeros and the kernel
    backs a page only on its first write: resident memory follows the blocks ever written.
    With prefix caching a freed block keeps its cached prefix and a never-used block is
    handed out before it (``BlockManager``), so a long run of distinct prompts makes the
    whole budget resident in the end, as a pool written up front is from the start. GPU
    memory is reserved whole either way.
    """
    numel = math.prod(shape)
    if device.type != "cpu" or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, numel * torch.empty((), dtype=dtype).element_size())
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)  # keeps buffer alive


class KVCachePool:
    """One preallocated tensor of keys and values for every layer of a model.

    ``kv[0, layer]`` holds the keys and ``kv[1, layer]`` the values of that layer as
    ``(num_blocks * block_size, n_kv_heads, head_dim)`` — a flat array of token slots.
    It reads as zeros, so that a padded read never meets NaN garbage; on a CPU its memory
    is committed page by page as blocks are first written (`lazy_zeros`).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (2, num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.kv = lazy_zeros(shape, dtype, torch.device(device))

    def keys(self, layer: int) -> torch.Tensor:
        return self.kv[0, layer]  # (num_slots, n_kv, D)

    def values(self, layer: int) -> torch.Tensor:
        return self.kv[1, layer]  # (num_slots, n_kv, D)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens' k, v (T, n_kv, D) into their slots (T,)."""
        self.keys(layer).index_copy_(0, slot_mapping, k)
        self.values(layer).index_copy_(0, slot_mapping, v)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the keys and values of the given slots: (N,) -> 2 × (N, n_kv, D)."""
        return self.keys(layer)[slots], self.values(layer)[slots]


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """Memory of one block across all layers: keys and values."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """How many blocks a byte budget buys."""
    return max(0, budget_bytes // block_bytes)


def check_pool_fits(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """Refuse a pool in which one sequence of ``max_model_len`` tokens cannot fit."""
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache pool holds {num_blocks} blocks x {block_size} tokens = "
            f"{num_blocks * block_size} tokens, but max_model_len is {max_model_len}: a single "
            "sequence could not fit. Give more KV memory / num_blocks or a smaller max_model_len."
        )


# ----------------------------------------------------------------------------- slot mapping


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The pool slot of token ``position`` of a sequence with this block table."""
    return block_table[position // block_size] * block_size + position % block_size


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Slots of positions ``start .. end-1`` of one sequence."""
    return [slot_of(block_table, p, block_size) for p in range(start, end)]


# ----------------------------------------------------------------------------- allocator


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained block hash: a block's name depends on every token before it."""
    return hash((parent_hash, token_ids))


@dataclass
class Block:
    """Bookkeeping for one block of the pool (the keys and values live in KVCachePool)."""

    block_id: int
    ref_count: int = 0  # sequences using it
    hash: int | None = None  # set once full, computed and registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the tokens it holds, to verify prefix hits
    parent: tuple[int, int] | None = None  # (block id, epoch) of the block before it
    epoch: int = 0  # bumped each time the block is reused for new contents


class BlockManager:
    """Free list, reference counts and prefix cache over ``num_blocks`` blocks.

    ``free`` holds every block with ref_count 0, oldest first: plain free blocks at the
    front, cached (evictable) ones behind them in least-recently-used order. Taking a
    block pops the front, evicting its cached contents if it had any.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn=hash_block):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or evictable)."""
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    # -- prefix cache lookups

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``token_ids``, in full blocks.

        At most ``(len - 1) // block_size`` blocks match, so at least one token is always
        left to compute: the last prompt token must run through the model to give logits.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent_hash, parent = None, None
        for i in range((len(token_ids) - 1) // self.block_size):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = self.hash_fn(parent_hash, tokens)
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tokens or block.parent != parent:
                break  # a hash collision: never hand out someone else's keys and values
            hits.append(block_id)
            parent_hash, parent = h, (block_id, block.epoch)
        return hits

    # -- allocation

    def can_allocate(self, token_ids: list[int], lookup: bool = True) -> bool:
        """Whether blocks for all of ``token_ids`` can be had now (counting prefix hits;
        ``lookup=False`` asks for fresh blocks only)."""
        hits = self.match_prefix(token_ids) if lookup else []
        needed = self.blocks_needed(len(token_ids)) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # hits on the free list
        return needed <= self.num_free_blocks - revived

    def allocate(self, token_ids: list[int], lookup: bool = True) -> tuple[list[int], int]:
        """Blocks for all of ``token_ids``; returns (block_table, num_cached_tokens).

        ``lookup=False`` skips the prefix cache (a request that needs every prompt
        position's logits, for prompt logprobs, must compute them all).
        """
        hits = self.match_prefix(token_ids) if lookup else []
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
        table = list(hits)
        self.grow(table, len(token_ids))
        return table, len(hits) * self.block_size

    def can_grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Whether the table can be extended to hold ``num_tokens`` tokens."""
        return self.blocks_needed(num_tokens) - len(block_table) <= self.num_free_blocks

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Append fresh blocks to ``block_table`` until it holds ``num_tokens`` tokens."""
        while len(block_table) * self.block_size < num_tokens:
            block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        if not self.free:
            raise RuntimeError("KV cache pool exhausted: no free block (check can_allocate first)")
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict its cached contents
            del self.cached[block.hash]
        block.hash, block.token_ids, block.parent = None, (), None
        block.epoch += 1
        block.ref_count = 1
        return block_id

    def free_blocks(self, block_table: list[int]) -> None:
        """Drop one reference to each block; unreferenced blocks go back to the pool.

        Cached blocks stay findable (evictable, most recently used last); uncached ones go
        to the front so they are reused first. The tail is released first so that the
        start of a prompt — the part most likely to be shared — is evicted last.
        """
        for block_id in reversed(block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:
                    self.free.move_to_end(block_id, last=False)
        block_table.clear()

    def cache_full_blocks(self, token_ids: list[int], block_table: list[int],
                          block_hashes: list[int], num_computed_tokens: int) -> None:
        """Register the full blocks whose keys and values are now computed.

        Call after each forward pass. ``block_hashes`` holds the hashes of the sequence's
        already registered blocks and is extended in place. Only *computed* blocks are
        registered, so a sequence admitted in the same step can never hit a block whose
        keys and values are not written yet.
        """
        if not self.enable_prefix_caching:
            return
        for i in range(len(block_hashes), num_computed_tokens // self.block_size):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent_hash = block_hashes[-1] if block_hashes else None
            h = self.hash_fn(parent_hash, tokens)
            block_hashes.append(h)
            block = self.blocks[block_table[i]]
            if block.hash is not None or h in self.cached:
                continue  # already cached (a prefix hit), or the same contents elsewhere
            parent_id = block_table[i - 1] if i > 0 else None
            block.hash, block.token_ids = h, tokens
            block.parent = None if parent_id is None else (parent_id, self.blocks[parent_id].epoch)
            self.cached[h] = block.block_id

    def forget_exclusive(self, block_table: list[int]) -> list[int]:
        """The blocks of ``block_table`` that no other sequence holds, dropped from the prefix
        cache (their keys and values may be bad: a request whose logits were NaN failed)."""
        own = [b for b in block_table if self.blocks[b].ref_count == 1]
        for block_id in own:
            block = self.blocks[block_id]
            if block.hash is not None and self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids, block.parent = None, (), None
        return own


# ----------------------------------------------------------------------------- attention


@dataclass
class AttentionMetadata:
    """What attention needs to know about one step's flat batch of B sequences.

    The step's T new tokens are the concatenation of each sequence's new tokens;
    sequence b owns rows ``query_start_loc[b] : query_start_loc[b+1]`` and, after this step,
    has ``seq_lens[b]`` tokens in context (cached + new).
    """

    slot_mapping: torch.Tensor  # (T,) int64: where each new token's k/v is written
    query_start_loc: list[int]  # (B+1,) offsets of each sequence's new tokens
    seq_lens: list[int]  # (B,) tokens in context after this step
    block_tables: list[list[int]]  # (B, *) each sequence's blocks
    block_size: int
    # what padded block-table entries point at (Milestone 6 pads tables into rectangles):
    # the engine passes a block that no sequence owns, so its slots never hold NaN
    pad_block: int = 0

    @classmethod
    def build(cls, block_tables: list[list[int]], num_computed: list[int], num_new: list[int],
              block_size: int, device: str | torch.device = "cpu",
              pad_block: int = 0) -> AttentionMetadata:
        """Metadata for sequences that have ``num_computed`` tokens cached and ``num_new`` new."""
        query_start_loc, slots = [0], []
        for table, start, n in zip(block_tables, num_computed, num_new):
            query_start_loc.append(query_start_loc[-1] + n)
            slots.extend(slot_mapping(table, start, start + n, block_size))
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=query_start_loc,
            seq_lens=[c + n for c, n in zip(num_computed, num_new)],
            block_tables=block_tables,
            block_size=block_size,
            pad_block=pad_block,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


class PagedAttention:
    """The Milestone 2 attention function: write k/v into the pool, then loop over sequences.

    For each sequence it gathers the whole context through the block table and runs
    ``causal_attention``. Simple and correct; Milestone 6 replaces the Python loop.
    """

    def __init__(self, pool: KVCachePool, metadata: AttentionMetadata):
        self.pool = pool
        self.metadata = metadata
        device = metadata.slot_mapping.device
        self.context_slots = [  # (seq_len,) pool slots of every context token, once per step
            torch.tensor(slot_mapping(table, 0, n, metadata.block_size), device=device)
            for table, n in zip(metadata.block_tables, metadata.seq_lens)]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        md = self.metadata
        self.pool.write(layer_idx, md.slot_mapping, k, v)
        out = torch.empty_like(q)  # (T, n_heads, D)
        for b, slots in enumerate(self.context_slots):
            start, end = md.query_start_loc[b], md.query_start_loc[b + 1]
            k_ctx, v_ctx = self.pool.gather(layer_idx, slots)  # (seq_len, n_kv, D)
            out[start:end] = causal_attention(q[start:end], k_ctx, v_ctx)
        return out


def measure_cuda_kv_budget(model: torch.nn.Module, num_tokens: int, utilization: float) -> int:
    """Bytes left for the KV pool on CUDA, measured the way vLLM does.

    Run one warm-up forward pass of the largest step (``num_tokens`` tokens, attention
    without a cache), read the peak memory it needed, and give the pool what is left of
    ``utilization`` × the device's memory after the weights and that peak.
    """
    device = next(model.parameters()).device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    with torch.inference_mode():
        hidden = model(input_ids, positions, lambda layer, q, k, v: causal_attention(q, k, v))
        model.compute_logits(hidden[-1:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = total - free - torch.cuda.memory_reserved(device)  # other processes, CUDA context
    budget = int(total * utilization) - peak - max(0, non_torch)
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache: the model's peak is "
                         f"{peak / 2**30:.2f} GiB of {total / 2**30:.2f} GiB at "
                         f"gpu_memory_utilization={utilization}")
    return budget
