"""Milestone 2: the paged KV cache (minivllm/kv_cache.py, notebook 02_paged_kv_cache).

Greedy output through the paged pool must equal Milestone 1 and transformers token for
token, whatever the block size; the allocator must never leak, double-free or share wrongly;
prefix caching must save work without changing a single token.
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_oracle import hf_greedy

from minivllm import LLM, SamplingParams
from minivllm.kv_cache import (
    AttentionMetadata,
    BlockManager,
    KVCachePool,
    PagedAttention,
    bytes_per_block,
    check_pool_fits,
    num_blocks_for_budget,
    slot_mapping,
    slot_of,
)
from minivllm.model import greedy_generate, load_model

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _prompts(seed: int, block_size: int, vocab: int, count: int = 6) -> list[list[int]]:
    """Prompt lengths that end exactly on, just before and just after block boundaries."""
    rng = random.Random(seed)
    lengths = [1, block_size, block_size + 1, 2 * block_size - 1, 2 * block_size, 37][:count]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_paged_greedy_matches_transformers_and_m1(random_engine_model, block_size):
    """Guards the slot arithmetic: an off-by-one in `p // block_size` or `p % block_size`
    shows up only for prompts that end on or off a block boundary."""
    llm = LLM(str(random_engine_model), block_size=block_size, num_blocks=4096 // block_size,
              max_model_len=256, attention_backend="loop")
    model = load_model(random_engine_model)
    prompts = _prompts(block_size, block_size, 512)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, **GREEDY))
    for prompt, out in zip(prompts, outs):
        expected = hf_greedy(random_engine_model, prompt, 12)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert greedy_generate(model, prompt, 12) == expected
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


def test_bundled_model_paged_parity(tiny_model):
    """The bundled trained model through the pool, block size 16, with real text prompts."""
    llm = LLM(str(tiny_model), block_size=16, num_blocks=256, max_model_len=1024)
    prompts = ["import os\n", "def fibonacci(n):\n    ", "class Stack:\n    def __init__(self"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, **GREEDY))
    tok = llm.get_tokenizer()
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_model, tok.encode(prompt), 24)


# ----------------------------------------------------------------------------- allocator


def test_slot_mapping_follows_the_block_table():
    table = [7, 2, 5]
    assert slot_of(table, 0, 4) == 28 and slot_of(table, 5, 4) == 9 and slot_of(table, 11, 4) == 23
    assert slot_mapping(table, 3, 6, 4) == [31, 8, 9]


def test_every_block_returns_and_double_free_is_refused():
    bm = BlockManager(num_blocks=10, block_size=4)
    table, cached = bm.allocate(list(range(10)))
    assert len(table) == 3 and cached == 0 and bm.num_free_blocks == 7
    bm.grow(table, 13)
    assert len(table) == 4 and bm.num_free_blocks == 6
    saved = list(table)
    bm.free_blocks(table)
    assert table == [] and bm.num_free_blocks == 10
    with pytest.raises(RuntimeError, match="double free"):
        bm.free_blocks(saved)


def test_shared_prefix_blocks_are_reference_counted():
    bm = BlockManager(num_blocks=10, block_size=4)
    tokens = list(range(100, 110))
    a, _ = bm.allocate(tokens)
    hashes: list[int] = []
    bm.cache_full_blocks(tokens, a, hashes, num_computed_tokens=10)
    b, cached = bm.allocate(tokens + [1, 2])
    assert cached == 8 and b[:2] == a[:2] and b[2] != a[2]
    assert [bm.blocks[i].ref_count for i in a[:2]] == [2, 2]
    bm.free_blocks(a)
    assert [bm.blocks[i].ref_count for i in b[:2]] == [1, 1]
    bm.free_blocks(b)
    assert bm.num_free_blocks == 10 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_only_computed_blocks_are_registered():
    """A block registered before its keys/values are written would let a sequence admitted
    in the same step read garbage."""
    bm = BlockManager(num_blocks=10, block_size=4)
    tokens = list(range(12))
    table, _ = bm.allocate(tokens)
    hashes: list[int] = []
    bm.cache_full_blocks(tokens, table, hashes, num_computed_tokens=5)  # one block computed
    assert len(bm.cached) == 1
    assert bm.match_prefix(tokens) == table[:1]


def test_cached_blocks_are_evicted_least_recently_used_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = [1, 2, 3], [4, 5, 6]
    for tokens in (old, new):
        table, _ = bm.allocate(tokens)
        bm.cache_full_blocks(tokens, table, [], num_computed_tokens=3)
        bm.free_blocks(table)
    assert bm.match_prefix(old) and bm.match_prefix(new)
    bm.allocate([9, 9, 9])  # needs 2 blocks: the 2 uncached ones are taken first
    assert bm.match_prefix(old) and bm.match_prefix(new)
    bm.allocate([8, 8])  # needs 1 more: evicts the least recently used cached block
    assert not bm.match_prefix(old) and bm.match_prefix(new)


def test_hash_collision_cannot_produce_a_wrong_hit():
    """Every block hashes to the same value: hits must still be verified token by token and
    by their parent block, so no sequence is ever handed another prefix's keys/values."""
    bm = BlockManager(num_blocks=16, block_size=4, hash_fn=lambda parent, tokens: 0)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    table, _ = bm.allocate(a)
    bm.cache_full_blocks(a, table, [], num_computed_tokens=9)
    assert bm.match_prefix([10, 11, 12, 13, 5, 6, 7, 8, 9]) == []  # different first block
    assert bm.match_prefix([1, 2, 3, 5, 5, 6, 7, 8, 9]) == []
    assert bm.match_prefix(a) == table[:1]  # the one entry the colliding dict could keep


def test_collisions_do_not_change_engine_output(random_engine_model):
    llm = LLM(str(random_engine_model), block_size=4, num_blocks=256, max_model_len=256)
    llm.engine.block_manager.hash_fn = lambda parent, tokens: 0
    rng = random.Random(5)
    shared = [rng.randrange(3, 512) for _ in range(8)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(5)] for _ in range(3)]
    prompts.append([rng.randrange(3, 512) for _ in range(8)] + prompts[0][8:])
    for prompt in prompts:  # one at a time so later prompts can hit earlier blocks
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=8, **GREEDY))
        assert out[0].outputs[0].token_ids == hf_greedy(random_engine_model, prompt, 8)


def test_prefix_hit_computes_fewer_tokens_and_changes_nothing(random_engine_model):
    rng = random.Random(3)
    system = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 512) for _ in range(6)] for _ in range(3)]
    params = SamplingParams(max_tokens=10, **GREEDY)
    results = {}
    for caching in (True, False):
        llm = LLM(str(random_engine_model), block_size=8, num_blocks=128, max_model_len=256,
                  enable_prefix_caching=caching)
        outs = [llm.generate({"prompt_token_ids": p}, params)[0] for p in prompts]
        results[caching] = ([o.outputs[0].token_ids for o in outs], llm.engine.stats)
    (cached_out, cached_stats), (plain_out, plain_stats) = results[True], results[False]
    assert cached_out == plain_out
    assert cached_stats.num_prefix_cached_tokens == 2 * 40  # 5 full blocks of the system prompt
    assert cached_stats.num_prompt_tokens_computed == plain_stats.num_prompt_tokens_computed - 80


# ----------------------------------------------------------------------------- pool and attention


def test_pool_sizing_and_refusal():
    per_block = bytes_per_block(num_layers=24, block_size=16, num_kv_heads=2, head_dim=64,
                                dtype=torch.bfloat16)
    assert per_block == 2 * 24 * 16 * 2 * 64 * 2
    assert num_blocks_for_budget(10 * per_block + 5, per_block) == 10
    check_pool_fits(num_blocks=4, block_size=16, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len is 65"):
        check_pool_fits(num_blocks=4, block_size=16, max_model_len=65)


def test_engine_refuses_a_pool_too_small_for_one_sequence(random_engine_model):
    with pytest.raises(ValueError, match="single sequence could not fit"):
        LLM(str(random_engine_model), block_size=16, num_blocks=2, max_model_len=64)


def test_engine_sizes_the_pool_from_a_byte_budget(random_engine_model):
    llm = LLM(str(random_engine_model), block_size=16, max_model_len=128,
              kv_cache_memory_bytes=1 << 20)
    mc = llm.engine.model_config
    per_block = bytes_per_block(mc.num_hidden_layers, 16, mc.num_key_value_heads, mc.head_dim,
                                torch.float32)
    assert llm.engine.num_blocks == min((1 << 20) // per_block, 64 * 128 // 16)


def test_paged_attention_equals_contiguous_attention():
    """Write k/v for two sequences through scattered block tables, then attend: the result
    must equal attention over the same keys laid out contiguously."""
    from minivllm.model import causal_attention

    torch.manual_seed(0)
    pool = KVCachePool(num_layers=1, num_blocks=12, block_size=4, num_kv_heads=2, head_dim=8)
    tables, lens = [[9, 2, 6], [0, 11]], [10, 7]
    q = torch.randn(sum(lens), 4, 8)
    k, v = torch.randn(sum(lens), 2, 8), torch.randn(sum(lens), 2, 8)
    md = AttentionMetadata.build(tables, [0, 0], lens, block_size=4)
    out = PagedAttention(pool, md)(0, q, k, v)
    assert torch.allclose(out[:10], causal_attention(q[:10], k[:10], v[:10]), atol=1e-6)
    assert torch.allclose(out[10:], causal_attention(q[10:], k[10:], v[10:]), atol=1e-6)


def test_pool_memory_is_committed_only_where_written():
    """Guards: a 2 GiB pool costing 2 GiB of RSS at start-up (torch.zeros touches every
    page) although the server holds a handful of blocks; and the lazily mapped pool reading
    anything but zeros (padded reads must never meet NaN garbage)."""
    import gc

    import psutil

    gc.collect()
    process = psutil.Process()
    before = process.memory_info().rss
    pool = KVCachePool(num_layers=4, num_blocks=16384, block_size=16, num_kv_heads=2,
                       head_dim=64, dtype=torch.float32)  # 1 GiB
    assert pool.kv.numel() * 4 == 1 << 30
    assert process.memory_info().rss - before < 64 * 1024**2
    slots = torch.arange(32)  # two blocks of one layer
    k = torch.randn(32, 2, 64)
    pool.write(0, slots, k, -k)
    got_k, got_v = pool.gather(0, slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    assert process.memory_info().rss - before < 64 * 1024**2
    assert not pool.keys(1)[:4096].any()  # never written: zeros
