"""Milestone 6: batched attention over the paged pool (minivllm/attention.py,
notebook 06_batched_attention).

The batched backend must give the loop backend's results — per layer, to float tolerance,
and end to end, token for token against transformers — on steps that mix prefill chunks
(some following cached tokens) and decodes of very different context lengths.
"""

from __future__ import annotations

import random

import pytest
import torch
from hf_oracle import hf_greedy

from minivllm import LLM, SamplingParams
from minivllm.attention import BatchedAttention, build_group
from minivllm.config import ATTENTION_BACKENDS, resolve_qualname
from minivllm.kv_cache import AttentionMetadata, KVCachePool, PagedAttention
from minivllm.model import causal_attention


def _mixed_step(seed: int, block_size: int):
    """A step with decodes (context 1..70), a fresh prefill and a chunk after cached tokens."""
    rng = random.Random(seed)
    num_computed = [0, 0, 37, 5, 69, 12]  # tokens already cached per sequence
    num_new = [1, 23, 1, 9, 1, 1]  # a 1-token prompt, a prefill, decodes, a chunk after 5 cached
    num_blocks = 256
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered, non-contiguous block tables
    tables = []
    for c, n in zip(num_computed, num_new):
        need = -(-(c + n) // block_size)
        tables.append([free.pop() for _ in range(need)])
    return num_computed, num_new, tables, num_blocks


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_batched_equals_loop_and_reference_on_a_mixed_step(block_size):
    torch.manual_seed(block_size)
    num_computed, num_new, tables, _ = _mixed_step(block_size, block_size)
    n_heads, n_kv, dim = 8, 2, 16
    num_blocks = max(max(t) for t in tables) + 1
    pools = [KVCachePool(1, num_blocks, block_size, n_kv, dim) for _ in range(2)]
    # the cached part of each context, written in advance, identical in both pools
    history = [(torch.randn(c + n, n_kv, dim), torch.randn(c + n, n_kv, dim))
               for c, n in zip(num_computed, num_new)]
    prior = AttentionMetadata.build(tables, [0] * len(tables), num_computed, block_size)
    if prior.slot_mapping.numel():
        k_prior = torch.cat([k[:c] for (k, _), c in zip(history, num_computed)])
        v_prior = torch.cat([v[:c] for (_, v), c in zip(history, num_computed)])
        for pool in pools:
            pool.write(0, prior.slot_mapping, k_prior, v_prior)
    md = AttentionMetadata.build(tables, num_computed, num_new, block_size)
    q = torch.randn(sum(num_new), n_heads, dim)
    k = torch.cat([k[c:] for (k, _), c in zip(history, num_computed)])
    v = torch.cat([v[c:] for (_, v), c in zip(history, num_computed)])
    out_loop = PagedAttention(pools[0], md)(0, q, k, v)
    out_batched = BatchedAttention(pools[1], md)(0, q, k, v)
    assert torch.allclose(out_batched, out_loop, atol=1e-5)
    for b, ((kh, vh), c, n) in enumerate(zip(history, num_computed, num_new)):
        start = md.query_start_loc[b]
        expected = causal_attention(q[start:start + n], kh, vh)
        assert torch.allclose(out_batched[start:start + n], expected, atol=1e-5), f"sequence {b}"


def test_mask_is_causal_with_an_offset_for_chunks_after_cached_tokens():
    """SDPA's is_causal is top-left aligned: a 3-token chunk after 5 cached tokens must let
    its first query see keys 0..5, not just key 0."""
    md = AttentionMetadata.build([[0, 1]], [5], [3], block_size=4)
    group = build_group(md, [0], torch.device("cpu"))
    mask = group.mask[0, 0]  # (Q, K)
    assert mask.tolist() == [[j <= 5 + i for j in range(8)] for i in range(3)]


def test_backends_are_selectable():
    """Each backend name resolves to its class (notebook 02's loop, notebook 06's batched)."""
    assert resolve_qualname(ATTENTION_BACKENDS["batched"]) is BatchedAttention
    assert resolve_qualname(ATTENTION_BACKENDS["loop"]) is PagedAttention
    with pytest.raises(ValueError):
        LLM(attention_backend="nonsense")


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_batched_engine_matches_transformers(random_engine_model, block_size):
    """Mixed steps end to end: chunked prefills next to decodes of very different lengths,
    with preemption, through the batched backend."""
    rng = random.Random(block_size)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.choice([1, 2, 7, 30, 61]))]
               for _ in range(12)]
    llm = LLM(str(random_engine_model), block_size=block_size, num_blocks=160 // block_size + 2,
              max_model_len=96, max_num_seqs=5, max_num_batched_tokens=20,
              attention_backend="batched")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.outputs[0].token_ids == hf_greedy(random_engine_model, prompt, 14), f"prompt {i}"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("n_heads,n_kv", [(14, 2), (8, 4), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_decode_equals_attend_group(n_heads, n_kv, dtype):
    """Guards: a decode group whose query heads are regrouped in the wrong order (tiled
    instead of each kv head's neighbours), or whose mask stops broadcasting over them."""
    from minivllm.attention import attend_decode, attend_group

    torch.manual_seed(n_heads + n_kv)
    rows, keys_len, dim = 5, 48, 16
    lengths = torch.tensor([1, 7, 48, 30, 17])  # ragged contexts, one of a single key
    mask = (torch.arange(keys_len) < lengths[:, None]).view(rows, 1, 1, keys_len)
    q = torch.randn(rows, 1, n_heads, dim, dtype=dtype)
    keys, values = (torch.randn(rows, n_kv, keys_len, dim, dtype=dtype) for _ in range(2))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(attend_decode(q, keys, values, mask).float(),
                          attend_group(q, keys, values, mask).float(), atol=tol, rtol=tol)


def test_batched_attention_sends_decode_groups_to_attend_decode(monkeypatch):
    """Guards: the decode group of a mixed step left on the one-item-per-query-head path (a
    tenth of the speed on a CPU), or a prefill chunk sent to the one-query path."""
    from minivllm import attention

    calls = []
    real = attention.attend_decode
    monkeypatch.setattr(attention, "attend_decode",
                        lambda q, *rest: calls.append(q.shape[1]) or real(q, *rest))
    num_computed, num_new, tables, num_blocks = _mixed_step(0, 4)
    pool = KVCachePool(1, num_blocks, 4, 2, 16)
    md = AttentionMetadata.build(tables, num_computed, num_new, 4)
    q, k, v = torch.randn(sum(num_new), 8, 16), torch.randn(sum(num_new), 2, 16), torch.randn(sum(num_new), 2, 16)
    BatchedAttention(pool, md)(0, q, k, v)
    assert calls == [1]  # the one decode group (4 rows); the prefill group took attend_group


def test_fresh_prompts_attend_over_their_own_keys_without_reading_the_pool(monkeypatch):
    """Guards: a step of fresh prompts (nothing cached) that still gathers its keys from the
    pool and builds a mask, or whose shortcut lets a padded key or a later token through."""
    from minivllm import attention

    gathers = []
    real = attention.gather_blocks
    monkeypatch.setattr(attention, "gather_blocks",
                        lambda *args: gathers.append(1) or real(*args))
    torch.manual_seed(0)
    lengths, block_size = [23, 9, 40], 4
    tables = [list(range(start, start + -(-n // block_size))) for start, n in
              zip((0, 10, 20), lengths)]
    pool = KVCachePool(1, 40, block_size, 2, 16)
    md = AttentionMetadata.build(tables, [0, 0, 0], lengths, block_size)
    q = torch.randn(sum(lengths), 8, 16)
    k, v = torch.randn(sum(lengths), 2, 16), torch.randn(sum(lengths), 2, 16)
    out = BatchedAttention(pool, md)(0, q, k, v)
    assert gathers == []
    for b, n in enumerate(lengths):
        rows = slice(md.query_start_loc[b], md.query_start_loc[b] + n)
        assert torch.allclose(out[rows], causal_attention(q[rows], k[rows], v[rows]), atol=1e-5)
    assert torch.equal(pool.keys(0)[md.slot_mapping], k)  # the pool still holds them
    # the same prompts one step later, a chunk each after their cached tokens: gathered
    md_next = AttentionMetadata.build(tables, [n - 2 for n in lengths], [2, 2, 2], block_size)
    BatchedAttention(pool, md_next)(0, q[:6], k[:6], v[:6])
    assert gathers == [1, 1]  # keys and values of the one chunk group


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompt_over_several_query_blocks_equals_one_causal_call(dtype):
    """A fresh prompt longer than FRESH_QUERY_BLOCK (three blocks, the last a partial one):
    stacked heads and per-block masks give what one ``is_causal`` SDPA call gives; the masks
    are built once and reused (the dict a step keeps for its layers)."""
    from minivllm import attention

    torch.manual_seed(0)
    block = attention.FRESH_QUERY_BLOCK
    t = 2 * block + 37
    q, k, v = (torch.randn(t, h, 64, dtype=dtype) for h in (14, 2, 2))
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    masks: dict = {}
    got = attention.attend_fresh(q, k, v, masks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tol), (got.float() - want.float()).abs().max()
    assert sorted(masks) == [(37, t, 7, dtype), (block, block, 7, dtype), (block, 2 * block, 7, dtype)]
    assert masks[(37, t, 7, dtype)].shape == (7 * 37, t)
    kept = dict(masks)
    attention.attend_fresh(q, k, v, masks)  # the next layer: the same tensors, none rebuilt
    assert all(masks[key] is kept[key] for key in kept) and len(masks) == 3


def test_fresh_prompt_past_the_block_limit_takes_one_causal_call():
    """Past FRESH_BLOCKS_MAX_TOKENS no block masks are built (they would grow with the
    square of the length): one ``is_causal`` call, the same numbers."""
    from minivllm import attention

    torch.manual_seed(0)
    t = attention.FRESH_BLOCKS_MAX_TOKENS + 1
    q, k, v = (torch.randn(t, h, 16) for h in (4, 2, 2))
    masks: dict = {}
    got = attention.attend_fresh(q, k, v, masks)
    assert masks == {}
    assert torch.allclose(got, causal_attention(q, k, v), atol=1e-5)
