"""Graders for notebook 06_batched_attention (Milestone 6: batched attention).

Each ``check_*`` takes the learner's function or class (the one defined in the notebook) and
compares it with a reference that does not use the code under test: masks and gathers written
out element by element, attention computed by hand in float64, the Milestone 2 loop backend
(``minivllm.kv_cache.PagedAttention``), ``minivllm.model.causal_attention`` per sequence, and
``transformers`` greedy decoding end to end. The steps are ragged on purpose: decodes with very
different context lengths next to prefill chunks that follow cached tokens, over scattered
block tables. Each prints one ``passed(...)`` line or raises an ``AssertionError`` that says
what differs; a stub's ``NotImplementedError`` becomes an ``AssertionError`` saying
"not implemented yet".
"""

from __future__ import annotations

import math
import random

import torch

from .grading import assert_close, assert_equal, call_learner, passed, require


def ragged_step(num_computed: list[int], num_new: list[int], block_size: int, seed: int,
                num_blocks: int = 256):
    """Scattered (shuffled, non-contiguous) block tables for sequences that have
    ``num_computed`` tokens cached and ``num_new`` new ones; returns (tables, metadata)."""
    from minivllm.kv_cache import AttentionMetadata

    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))]
              for c, n in zip(num_computed, num_new)]
    return tables, AttentionMetadata.build(tables, num_computed, num_new, block_size)


# ----------------------------------------------------------------------------- 6.1 the mask

MASK_HINT = ("query i of sequence b sits at absolute position seq_lens[b] - q_lens[b] + i and "
             "may see every key at a position <= its own (bottom-right aligned causal mask); "
             "a padded query (i >= q_lens[b]) sees key 0 only")


def _expected_mask(md, members: list[int], max_q: int, num_keys: int) -> list[list[list[bool]]]:
    """The (B, Q, K) mask, element by element."""
    out = []
    for b in members:
        q_len = md.query_start_loc[b + 1] - md.query_start_loc[b]
        first = md.seq_lens[b] - q_len  # absolute position of the first new token
        out.append([[j <= first + i if i < q_len else j == 0 for j in range(num_keys)]
                    for i in range(max_q)])
    return out


def check_build_group(build_group) -> None:
    """Exercise 6.1: the padded rows, block tables, valid flags and the offset-causal mask of
    a decode group and a prefill group, element by element."""
    what = "Exercise 6.1 (build_group)"
    block_size = 4
    # seq 0: decode at position 13; seq 1: 3-token chunk after 5 cached; seq 2: decode at 2;
    # seq 3: a fresh 6-token prompt; seq 4: a 2-token chunk after 9 cached.
    num_computed, num_new = [13, 5, 2, 0, 9], [1, 3, 1, 6, 2]
    tables, md = ragged_step(num_computed, num_new, block_size, seed=6)
    for members, name in (([0, 2], "decodes"), ([1, 3, 4], "prefill chunks"),
                          ([4, 1], "prefill chunks in another order"), ([2], "one decode")):
        where = f"{what}, group of {name} (sequences {members})"
        g = call_learner(where, build_group, md, members, torch.device("cpu"))
        q_lens = [num_new[b] for b in members]
        max_q, max_blocks = max(q_lens), max(len(tables[b]) for b in members)
        num_keys = max_blocks * block_size
        for field in ("rows", "valid", "block_tables", "mask"):
            require(isinstance(getattr(g, field, None), torch.Tensor), where,
                    f"group.{field} is {type(getattr(g, field, None)).__name__}, not a tensor",
                    "return AttentionGroup(rows, valid, tables, mask)")
        assert_equal(tuple(g.mask.shape), (len(members), 1, max_q, num_keys),
                     what=f"{where}: mask shape (B, 1, Q, K)",
                     hint="K = (longest block table) * block_size; the 1 broadcasts over heads")
        require(g.mask.dtype == torch.bool, where, f"mask dtype {g.mask.dtype}, expected "
                "torch.bool (True = may attend)",
                "SDPA reads a float mask as an additive bias, a bool mask as keep/drop")
        assert_equal(g.valid, [[i < n for i in range(max_q)] for n in q_lens],
                     what=f"{where}: valid (B, Q)", hint="query i of a row is real when i < q_len")
        starts = [md.query_start_loc[b] for b in members]
        assert_equal(g.rows[g.valid], [s + i for s, n in zip(starts, q_lens) for i in range(n)],
                     what=f"{where}: rows of the real queries")
        assert_equal(g.block_tables, [tables[b] + [0] * (max_blocks - len(tables[b]))
                                      for b in members],
                     what=f"{where}: block tables padded with block 0")
        expected = _expected_mask(md, members, max_q, num_keys)
        got = g.mask[:, 0].tolist()
        for r, b in enumerate(members):
            for i in range(max_q):
                if got[r][i] != expected[r][i]:
                    seen = [j for j, m in enumerate(got[r][i]) if m]
                    want = [j for j, m in enumerate(expected[r][i]) if m]
                    kind = ("padded query" if i >= num_new[b] else
                            f"query {i} of {num_new[b]} new after {num_computed[b]} cached")
                    raise AssertionError(
                        f"{where}: sequence {b}, {kind}: may see keys {_ranges(seen)}, "
                        f"expected {_ranges(want)}\n  hint: {MASK_HINT}")
    passed(what, "rows, valid, padded tables and the offset-causal mask (padded queries see "
           "key 0) for decode and prefill groups")


def _ranges(keys: list[int]) -> str:
    """[0, 1, 2, 5] -> '0..2, 5' (or 'none')."""
    if not keys:
        return "none"
    parts, start = [], keys[0]
    for prev, cur in zip(keys, keys[1:] + [None]):
        if cur != prev + 1:
            parts.append(f"{start}" if start == prev else f"{start}..{prev}")
            start = cur
    return ", ".join(parts)


# ----------------------------------------------------------------------------- 6.2 the gather


def check_gather_blocks(gather_blocks) -> None:
    """Exercise 6.2: whole-block gather over scattered tables equals the token-by-token read
    ``cache[table[p // bs] * bs + p % bs]``, in the (B, n_kv, K, D) layout."""
    what = "Exercise 6.2 (gather_blocks)"
    gen = torch.Generator().manual_seed(62)
    n_kv, dim = 3, 5  # distinct sizes, so a transposed layout cannot pass by accident
    for block_size, tables in ((4, [[7, 2, 5], [0, 9, 3]]), (1, [[3, 1, 4, 0], [2, 2, 5, 9]]),
                               (16, [[1, 0], [3, 2]]), (4, [[6]])):
        num_blocks = max(max(t) for t in tables) + 1
        cache = torch.randn(num_blocks * block_size, n_kv, dim, generator=gen)
        before = cache.clone()
        where = f"{what}, block_size={block_size}, tables {tables}"
        got = call_learner(where, gather_blocks, cache, torch.tensor(tables), block_size)
        num_keys = len(tables[0]) * block_size
        expected = torch.stack([
            torch.stack([cache[t[p // block_size] * block_size + p % block_size]
                         for p in range(num_keys)]) for t in tables])  # (B, K, n_kv, D)
        assert_close(got, expected.transpose(1, 2), what=f"{where}: keys (B, n_kv, K, D)", atol=0,
                     rtol=0, hint="view the cache as (num_blocks, block_size, n_kv, D), index it "
                     "with the tables (B, NB) -> (B, NB, bs, n_kv, D), merge NB and bs in that "
                     "order (key p = block p // bs, offset p % bs), then put heads before keys")
        require(torch.equal(cache, before), where, "the cache was modified")
    passed(what, "equals the token-by-token slot read for block sizes 1, 4, 16 on scattered "
           "tables")


# ----------------------------------------------------------------------------- 6.3 attention


def _manual_attention(q, keys, values, mask):
    """float64 softmax(q k^T / sqrt(D) + mask) v; query head h reads kv head h // n_rep."""
    B, Q, H, D = q.shape
    n_rep = H // keys.shape[1]
    out = torch.zeros(B, Q, H, D, dtype=torch.float64)
    for h in range(H):
        k = keys[:, h // n_rep].double()  # (B, K, D)
        v = values[:, h // n_rep].double()
        scores = q[:, :, h].double() @ k.transpose(1, 2) / math.sqrt(D)  # (B, Q, K)
        scores = scores.masked_fill(~mask[:, 0], float("-inf"))
        out[:, :, h] = scores.softmax(-1) @ v
    return out


def check_attend_group(attend_group) -> None:
    """Exercise 6.3: grouped-query SDPA under a boolean mask equals attention computed by hand
    (query head h reads kv head h // n_rep), in the (B, Q, H, D) layout."""
    what = "Exercise 6.3 (attend_group)"
    gen = torch.Generator().manual_seed(63)
    for B, Q, H, n_kv, K, D in ((3, 1, 8, 2, 12, 4), (2, 5, 6, 3, 16, 8), (2, 3, 4, 4, 8, 4)):
        q = torch.randn(B, Q, H, D, generator=gen)
        keys = torch.randn(B, n_kv, K, D, generator=gen)
        values = torch.randn(B, n_kv, K, D, generator=gen)
        mask = torch.rand(B, 1, Q, K, generator=gen) < 0.5
        mask[..., 0] = True  # every row sees at least one key
        where = f"{what}, B={B} Q={Q} heads={H} kv heads={n_kv} K={K}"
        got = call_learner(where, attend_group, q, keys, values, mask)
        assert_close(got, _manual_attention(q, keys, values, mask).float(),
                     what=f"{where}: output (B, Q, H, D)", atol=1e-5,
                     hint="query head h reads kv head h // n_rep (repeat_interleave on the head "
                     "dim, not repeat/tile); SDPA wants (B, H, Q, D): transpose q in and the "
                     "output back; pass the boolean mask as attn_mask, no is_causal")
    passed(what, "GQA with n_rep 4, 2, 1 under random boolean masks equals attention by hand")


# ----------------------------------------------------------------------------- the backend


def check_batched_attention(BatchedAttention) -> None:
    """The whole backend on two ragged mixed steps (block sizes 1, 3, 16): outputs equal the
    loop backend and ``causal_attention`` per sequence, and the pool holds the new k/v."""
    from minivllm.kv_cache import AttentionMetadata, KVCachePool, PagedAttention
    from minivllm.model import causal_attention

    what = "Exercises 6.1-6.3 together (BatchedAttention)"
    gen = torch.Generator().manual_seed(6)
    n_heads, n_kv, dim, layer = 8, 2, 16, 1
    # step 1: fresh prompts (a 1-token one and four longer, the 169-token one over two
    # blocks of 128 queries), step 2: decodes of contexts 10..170 next to chunks of 3 and 8
    # tokens after 1 and 9 cached tokens (padded in one group) and a fresh prompt.
    steps = [([0, 0, 0, 0, 0], [1, 9, 37, 5, 169]), ([1, 9, 37, 5, 169], [3, 1, 1, 8, 1])]
    lens = [sum(n[b] for _, n in steps) for b in range(5)] + [11]
    steps[1] = (steps[1][0] + [0], steps[1][1] + [11])
    for block_size in (1, 3, 16):
        rng = random.Random(block_size)
        free = list(range(300 // block_size + 10))
        rng.shuffle(free)
        tables = [[free.pop() for _ in range(-(-n // block_size))] for n in lens]
        num_blocks = max(max(t) for t in tables) + 1
        pools = [KVCachePool(2, num_blocks, block_size, n_kv, dim) for _ in range(2)]
        ks = [torch.randn(n, n_kv, dim, generator=gen) for n in lens]
        vs = [torch.randn(n, n_kv, dim, generator=gen) for n in lens]
        qs = [torch.randn(n, n_heads, dim, generator=gen) for n in lens]
        for step, (done, new) in enumerate(steps):
            members = list(range(len(done)))
            md = AttentionMetadata.build([tables[b] for b in members], done, new, block_size)
            q, k, v = (torch.cat([xs[b][c:c + n] for b, c, n in zip(members, done, new)])
                       for xs in (qs, ks, vs))
            where = f"{what}, block_size={block_size}, step {step + 1} " + (
                "(fresh prompts)" if step == 0 else "(decodes of contexts 10..170, chunks "
                "of 3 and 8 after 1 and 9 cached tokens, a fresh prompt)")
            backend = call_learner(f"{where}: BatchedAttention(pool, metadata)", BatchedAttention,
                                   pools[0], md)
            got = call_learner(f"{where}: calling it", backend, layer, q, k.clone(), v.clone())
            want = PagedAttention(pools[1], md)(layer, q, k, v)
            assert_close(got, want, what=f"{where}: output vs the loop backend", atol=1e-5,
                         hint="run every exercise's check first; scatter each group's valid "
                         "outputs back to their rows (out[g.rows[g.valid]] = o[g.valid])")
            for b, c, n in zip(members, done, new):
                start = md.query_start_loc[b]
                assert_close(got[start:start + n],
                             causal_attention(qs[b][c:c + n], ks[b][:c + n], vs[b][:c + n]),
                             what=f"{where}: sequence {b} ({c} cached + {n} new) vs "
                             "causal_attention", atol=1e-5)
        assert_close(pools[0].kv, pools[1].kv, what=f"{what}, block_size={block_size}: the "
                     "KV pool after both steps", hint="write k, v into the pool first "
                     "(self.pool.write(layer_idx, slot_mapping, k, v))")
    passed(what, "equals the loop backend and causal_attention on ragged mixed steps for "
           "block sizes 1, 3, 16; the pool holds the same k/v")


def check_engine_parity(BatchedAttention, model: str,
                        lengths: tuple[int, ...] = (1, 90, 7, 45, 3, 130, 20)) -> dict:
    """The milestone's check: ``LLM`` running on the learner's ``BatchedAttention`` with
    prompts of very different ``lengths`` and a small token budget (prefill chunks run next
    to decodes) equals ``transformers`` greedy token for token; every block comes back.
    Returns the engine's stats and how many steps mixed chunks with decodes."""
    from minivllm import LLM, SamplingParams

    from .checks_03 import hf_greedy

    what = "Milestone 6 parity (LLM on your BatchedAttention vs transformers greedy)"
    label = "Exercises 6.1-6.3 end to end (LLM on your BatchedAttention)"
    llm = LLM(str(model), block_size=4, num_blocks=64, max_model_len=160, max_num_seqs=6,
              max_num_batched_tokens=24, attention_backend="batched", compile=False,
              dtype="float32")  # the parity dtype
    engine = llm.engine
    seen = {"steps": 0, "mixed": 0}

    def backend(pool, md):  # the learner's class, counting steps that mix chunks and decodes
        q_lens = [md.query_start_loc[b + 1] - md.query_start_loc[b] for b in range(md.num_seqs)]
        seen["steps"] += 1
        seen["mixed"] += 1 in q_lens and any(n > 1 for n in q_lens)
        return BatchedAttention(pool, md)

    engine.runner.attention_cls = backend
    vocab = min(engine.model_config.vocab_size, 1000)
    rng = random.Random(60)
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = call_learner(what, llm.generate, [{"prompt_token_ids": p} for p in prompts], params)
    require(seen["mixed"] > 0, what, "no step mixed prefill chunks with decodes")
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert_equal(out.outputs[0].token_ids, hf_greedy(str(model), prompt, 8),
                     what=f"{what}: prompt {i} ({len(prompt)} tokens)")
    bm = engine.block_manager
    require(bm.num_free_blocks == engine.num_blocks, what,
            f"{bm.num_free_blocks} of {engine.num_blocks} blocks free at the end")
    passed(label, f"{len(prompts)} prompts of {min(lengths)}..{max(lengths)} tokens equal "
           "transformers greedy; "
           f"{seen['mixed']} of {seen['steps']} steps mixed prefill chunks with decodes")
    return {"steps": seen["steps"], "mixed_steps": seen["mixed"], "stats": engine.stats}
