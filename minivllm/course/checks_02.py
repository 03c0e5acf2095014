"""Graders for notebook 02_paged_kv_cache (Milestone 2: the paged KV cache).

Each ``check_*`` takes the learner's function or class (the one defined in the notebook),
runs hand-computed cases and invariants, compares with the reference behaviour where there
is one (``minivllm.model.causal_attention`` over contiguous keys for paged attention), and
prints one ``passed(...)`` line, or raises an ``AssertionError`` that says what differs.
A stub's ``NotImplementedError`` propagates unchanged, so the learner sees which exercise
is still open; any other exception from the learner's code becomes an ``AssertionError``.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from .grading import assert_close, assert_equal, passed


def _call(what: str, fn, *args, hint: str | None = None, **kwargs) -> Any:
    """Call the learner's code; turn an unexpected exception into an AssertionError."""
    try:
        return fn(*args, **kwargs)
    except (NotImplementedError, AssertionError):
        raise
    except Exception as err:
        text = f"{what}: raised {type(err).__name__}: {err}"
        if hint:
            text += f"\n  hint: {hint}"
        raise AssertionError(text) from err


def _raises(what: str, error: type[Exception], fn, *args, hint: str | None = None) -> None:
    """Check that ``fn(*args)`` raises ``error``."""
    try:
        fn(*args)
    except NotImplementedError:
        raise
    except error:
        return
    except Exception as err:
        raise AssertionError(f"{what}: raised {type(err).__name__}: {err}, expected "
                             f"{error.__name__}" + (f"\n  hint: {hint}" if hint else "")) from err
    raise AssertionError(f"{what}: no {error.__name__} was raised"
                         + (f"\n  hint: {hint}" if hint else ""))


# ----------------------------------------------------------------------------- 2.1 slot mapping

SLOT_HINT = ("position p lives in block block_table[p // block_size] at offset "
             "p % block_size: slot = block_table[p // block_size] * block_size + p % block_size")


def check_slot_mapping(slot_of, slot_mapping) -> None:
    """Exercise 2.1: hand-computed slots, then the defining property on random tables."""
    table = [7, 2, 5]
    for position, want in [(1, 29), (0, 28), (3, 31), (4, 8), (5, 9), (11, 23)]:
        got = _call(f"slot_of({table}, {position}, 4)", slot_of, table, position, 4,
                    hint=SLOT_HINT)
        assert_equal(got, want, what=f"slot_of({table}, position={position}, block_size=4)",
                     hint=SLOT_HINT)
    rng = random.Random(0)
    for block_size in (1, 3, 16):
        blocks = rng.sample(range(64), 6)
        for position in range(6 * block_size):
            slot = _call("slot_of", slot_of, blocks, position, block_size, hint=SLOT_HINT)
            where = f"slot_of({blocks}, {position}, block_size={block_size})"
            assert_equal(divmod(slot, block_size),
                         (blocks[position // block_size], position % block_size),
                         what=f"{where} as (block id, offset)", hint=SLOT_HINT)
    got = _call("slot_mapping([7, 2, 5], 3, 6, 4)", slot_mapping, table, 3, 6, 4)
    assert isinstance(got, list), f"slot_mapping must return a list, got {type(got).__name__}"
    assert_equal(got, [31, 8, 9], what="slot_mapping([7, 2, 5], start=3, end=6, block_size=4)",
                 hint="positions start .. end-1 (end excluded), one slot each")
    assert_equal(_call("slot_mapping", slot_mapping, table, 5, 5, 4), [],
                 what="slot_mapping(..., start=5, end=5) (no positions)")
    assert_equal(_call("slot_mapping", slot_mapping, [3], 0, 1, 1), [3],
                 what="slot_mapping([3], 0, 1, block_size=1)")
    passed("Exercise 2.1 (slot_of, slot_mapping)",
           "hand-computed slots and block/offset on random tables for block sizes 1, 3, 16")


# ----------------------------------------------------------------------------- 2.2 allocator


def check_allocator(BlockManager) -> None:
    """Exercise 2.2: ``_take_free_block`` and ``free_blocks`` — every block comes back, ref
    counts under sharing, double free, eviction order (uncached first, then LRU, tail first)."""
    # Prefix caching off: match_prefix returns [] before its exercise region.
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    table, cached = _call("allocate(10 tokens)", bm.allocate, list(range(10)))
    assert_equal(table, [0, 1, 2], what="allocate(10 tokens) on a fresh pool of 8 blocks",
                 hint="ceil(10 / 4) = 3 blocks, taken from the front of self.free "
                      "(popitem(last=False))")
    assert_equal(cached, 0, what="num_cached_tokens with prefix caching off")
    assert_equal(bm.num_free_blocks, 5, what="num_free_blocks after taking 3 of 8")
    assert_equal([bm.blocks[b].ref_count for b in table], [1, 1, 1],
                 what="ref counts of freshly taken blocks", hint="a taken block has one user")
    assert_equal([bm.blocks[b].epoch for b in table], [1, 1, 1],
                 what="epochs of blocks taken once",
                 hint="bump block.epoch each time a block is taken for new contents")
    _call("grow(table, 13)", bm.grow, table, 13)
    assert_equal(len(table), 4, what="len(table) after grow(table, 13)")
    saved = list(table)
    _call("free_blocks(table)", bm.free_blocks, table)
    assert_equal(table, [], what="the block table after free_blocks", hint="clear it in place")
    assert_equal(bm.num_free_blocks, 8, what="num_free_blocks after freeing everything")
    assert_equal([b.ref_count for b in bm.blocks], [0] * 8, what="ref counts after free")
    _raises("free_blocks of an already freed table (double free)", RuntimeError,
            bm.free_blocks, list(saved),
            hint="a block whose ref_count is already 0 must raise RuntimeError('double free ...')")

    # Two sequences share two blocks (as after a prefix hit): the first free keeps them.
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    a, _ = _call("allocate(8 tokens)", bm.allocate, list(range(8)))
    b = list(a)
    for block_id in b:
        bm.blocks[block_id].ref_count += 1  # the second user
    _call("free_blocks(a)", bm.free_blocks, a)
    assert_equal([bm.blocks[i].ref_count for i in b], [1, 1],
                 what="ref counts of shared blocks after one of two users frees them",
                 hint="decrement ref_count; a block returns to the pool only at 0")
    assert_equal(bm.num_free_blocks, 4, what="num_free_blocks while b still holds 2 blocks",
                 hint="a block that is still referenced must not go back on the free list")
    _call("free_blocks(b)", bm.free_blocks, b)
    assert_equal(bm.num_free_blocks, 6, what="num_free_blocks after both users freed")

    # Eviction: uncached blocks are reused first, then cached ones least recently used first.
    bm = BlockManager(num_blocks=4, block_size=2)
    owners = {}
    for tokens in ([1, 2, 3], [4, 5, 6]):
        t, _ = _call(f"allocate({tokens})", bm.allocate, tokens)
        bm.cache_full_blocks(tokens, t, [], num_computed_tokens=3)  # registers t[0]
        owners[tuple(tokens)] = t[0]
        _call("free_blocks", bm.free_blocks, t)
    old, new = owners[(1, 2, 3)], owners[(4, 5, 6)]
    assert_equal(bm.num_free_blocks, 4, what="num_free_blocks after two finished sequences")
    got, _ = _call("allocate([9, 9, 9])", bm.allocate, [9, 9, 9])
    assert old not in got and new not in got, (
        f"allocate([9, 9, 9]) took blocks {got}, evicting cached block(s) while uncached free "
        f"blocks were available (cached: {old}, {new})\n  hint: free_blocks puts an uncached "
        "block at the front of self.free (move_to_end(last=False)); cached ones at the end")
    assert_equal(sorted(bm.cached.values()), sorted([old, new]),
                 what="cached block ids after taking only uncached blocks")
    got, _ = _call("allocate([8, 8])", bm.allocate, [8, 8])
    assert_equal(got, [old], what="the block evicted when only cached blocks are free",
                 hint="evict the least recently used cached block (the front of self.free)")
    assert_equal(list(bm.cached.values()), [new], what="cached block ids after the eviction",
                 hint="taking a cached block must delete its entry from self.cached")
    evicted = bm.blocks[old]
    assert (evicted.hash, evicted.token_ids, evicted.parent) == (None, (), None), (
        f"an evicted block must forget its contents: hash={evicted.hash}, "
        f"token_ids={evicted.token_ids}, parent={evicted.parent}")
    assert_equal(evicted.epoch, 2, what="epoch of a block taken twice")
    assert_equal(evicted.ref_count, 1, what="ref_count of a block just taken")
    _raises("taking a block from an exhausted pool", RuntimeError, bm.allocate, [7, 7, 7],
            hint="raise RuntimeError when self.free is empty")

    # Tail first: the start of a prompt (most likely shared) must be evicted last.
    bm = BlockManager(num_blocks=3, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6]
    t, _ = _call("allocate(6 tokens)", bm.allocate, tokens)
    bm.cache_full_blocks(tokens, t, [], num_computed_tokens=6)
    head = list(t)
    _call("free_blocks", bm.free_blocks, t)
    got, _ = _call("allocate([7, 7])", bm.allocate, [7, 7])
    assert_equal(got, [head[2]], what="the first block evicted after freeing a 3-block table",
                 hint="release the table tail first (reversed), so its first block is the "
                      "most recently used and is evicted last")
    passed("Exercise 2.2 (allocator)", "all blocks return, double free refused, ref counts "
           "under sharing, uncached first, then LRU, tail first")


# ----------------------------------------------------------------------------- 2.3 prefix match


def check_match_prefix(BlockManager) -> None:
    """Exercise 2.3: ``match_prefix`` finds full cached blocks, at most (len-1)//block_size
    of them, and verifies each hit (tokens and parent block) so collisions cannot lie."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a = list(range(100, 110))  # 10 tokens: 2 full blocks + 2
    assert_equal(_call("match_prefix on an empty cache", bm.match_prefix, a), [],
                 what="match_prefix on an empty cache")
    table, _ = bm.allocate(a)
    bm.cache_full_blocks(a, table, [], num_computed_tokens=10)
    cases = [(a, 2), (a[:9], 2), (a[:8], 1), (a[:5], 1), (a[:4], 0), (a[:1], 0),
             (a + [1, 2, 3, 4, 5], 2), (a[:4] + [0] * 6, 1), ([0] + a[1:], 0)]
    for tokens, n in cases:
        got = _call(f"match_prefix({len(tokens)} tokens)", bm.match_prefix, tokens)
        assert_equal(got, table[:n], what=f"match_prefix of {len(tokens)} tokens "
                     f"{'sharing the cached prefix' if tokens[0] == 100 else 'from another prompt'}",
                     hint="full blocks only, at most (len - 1) // block_size of them (the last "
                          "prompt token must run through the model), stop at the first miss")
    b, cached = bm.allocate(a[:8] + [7, 7, 7])
    assert_equal((b[:2], cached), (table[:2], 8),
                 what="allocate() of a prompt sharing 2 cached blocks: (shared blocks, cached "
                      "tokens)", hint="match_prefix returns block ids (self.cached maps hash -> id)")
    assert_equal([bm.blocks[i].ref_count for i in table[:2]], [2, 2],
                 what="ref counts of prefix blocks shared by two sequences")
    off = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    assert_equal(off.match_prefix(a), [], what="match_prefix with prefix caching off")

    # Every hash collides: a hit must be verified against the block's stored tokens.
    bm = BlockManager(num_blocks=16, block_size=4, hash_fn=lambda parent, tokens: 0)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    table, _ = bm.allocate(a)
    bm.cache_full_blocks(a, table, [], num_computed_tokens=9)
    got = _call("match_prefix under a colliding hash", bm.match_prefix,
                [10, 11, 12, 13, 5, 6, 7, 8, 9])
    assert_equal(got, [], what="match_prefix of a different first block whose hash collides",
                 hint="compare block.token_ids with the tokens looked up: a hash is a name, "
                      "not a proof")
    assert_equal(bm.match_prefix(a), table[:1],
                 what="match_prefix of the cached prompt under a colliding hash")

    # A hash that ignores the parent: the same 4 tokens after a different first block must
    # not hit, because their keys/values were computed in another context.
    bm = BlockManager(num_blocks=16, block_size=4, hash_fn=lambda parent, tokens: hash(tokens))
    first = [1, 2, 3, 4, 5, 6, 7, 8, 0]
    other = [9, 9, 9, 9, 5, 6, 7, 8, 0]
    for tokens in (first, other):
        t, _ = bm.allocate(tokens)
        bm.cache_full_blocks(tokens, t, [], num_computed_tokens=9)
        if tokens is other:
            other_table = t
    got = _call("match_prefix with a parent-blind hash", bm.match_prefix, other)
    assert_equal(got, other_table[:1],
                 what="match_prefix of [9,9,9,9, 5,6,7,8, 0] when (5,6,7,8) is cached after "
                      "(1,2,3,4)", hint="check block.parent == (previous hit's block id, its "
                                        "epoch): same tokens after a different prefix differ")
    passed("Exercise 2.3 (match_prefix)", "full blocks only, at most (len-1)//block_size, "
           "hits verified by tokens and parent under forced collisions")


# ----------------------------------------------------------------------------- 2.4 attention


def check_paged_attention(PagedAttention, KVCachePool=None, AttentionMetadata=None) -> None:
    """Exercise 2.4: paged attention over scattered block tables, in two steps (a chunked
    prefill, then chunks and a decode token after cached keys), must equal
    ``causal_attention`` over the same keys laid out contiguously, and must store k/v."""
    from minivllm import kv_cache
    from minivllm.model import causal_attention

    KVCachePool = KVCachePool or kv_cache.KVCachePool
    AttentionMetadata = AttentionMetadata or kv_cache.AttentionMetadata
    gen = torch.Generator().manual_seed(2)
    block_size, n_heads, n_kv, dim, layer = 4, 4, 2, 8, 1
    pool = KVCachePool(num_layers=2, num_blocks=16, block_size=block_size, num_kv_heads=n_kv,
                       head_dim=dim)
    tables = [[9, 2, 6], [0, 11], [14, 3]]
    lens = [10, 8, 5]
    k_all = [torch.randn(n, n_kv, dim, generator=gen) for n in lens]
    v_all = [torch.randn(n, n_kv, dim, generator=gen) for n in lens]
    q_all = [torch.randn(n, n_heads, dim, generator=gen) for n in lens]
    done = [0, 0, 0]
    for step, new in enumerate(([6, 7, 1], [4, 1, 4])):
        md = AttentionMetadata.build(tables, list(done), new, block_size)
        rows = [slice(c, c + n) for c, n in zip(done, new)]
        q = torch.cat([qs[r] for qs, r in zip(q_all, rows)])
        k = torch.cat([ks[r] for ks, r in zip(k_all, rows)])
        v = torch.cat([vs[r] for vs, r in zip(v_all, rows)])
        out = _call(f"PagedAttention(pool, metadata)(layer={layer}, q, k, v)",
                    PagedAttention(pool, md), layer, q, k, v)
        what = ("the first step (prefill chunks from an empty cache)" if step == 0 else
                "the second step (new tokens after cached ones: a chunk and a decode token)")
        start = 0
        for i, (c, n) in enumerate(zip(done, new)):
            want = causal_attention(q_all[i][c:c + n], k_all[i][:c + n], v_all[i][:c + n])
            assert_close(out[start:start + n] if isinstance(out, torch.Tensor) else out, want,
                         what=f"attention output of sequence {i} ({c} cached + {n} new tokens) "
                              f"in {what}", atol=1e-5,
                         hint="write k, v into their slots first, then for each sequence gather "
                              "its whole context (self.context_slots[b]) and call causal_attention "
                              "on its rows query_start_loc[b]:query_start_loc[b+1] (queries are "
                              "the last rows: bottom-right causal mask)")
            start += n
        done = [c + n for c, n in zip(done, new)]
    slots = [torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(n)])
             for t, n in zip(tables, lens)]
    for i, s in enumerate(slots):
        assert_close(pool.keys(layer)[s], k_all[i], what=f"keys of sequence {i} in the pool",
                     hint="self.pool.write(layer_idx, md.slot_mapping, k, v) before attending")
        assert_close(pool.values(layer)[s], v_all[i], what=f"values of sequence {i} in the pool")
    assert_close(pool.keys(0), torch.zeros_like(pool.keys(0)),
                 what="layer 0 of the pool (only layer 1 was called)",
                 hint="write into layer layer_idx")
    passed("Exercise 2.4 (PagedAttention)", "equals causal_attention over contiguous keys for "
           "chunked prefill and decode after cached tokens, and stores k/v in their slots")
