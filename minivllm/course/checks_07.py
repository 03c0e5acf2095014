"""Graders for notebook 07_compiled_decode (Milestone 7: the compiled decode step).

Each ``check_*`` takes the learner's function or class (the one defined in the notebook) and
runs it *eagerly* — nothing here calls ``torch.compile``: a function that is right eagerly is
right compiled, and the notebook's own cells show the compiled version agreeing. References
are earlier milestones' code that the learner's export does not overwrite:

* 7.1 ``decode_slots``: ``minivllm.kv_cache.slot_of``, row by row;
* 7.2 ``DecodeAttention``: Milestone 2's per-sequence loop backend
  (``minivllm.kv_cache.PagedAttention``) on a copy of the same pool; the padding of
  ``CompiledDecoder.logits``: the padded tensors written out here, seen by a stand-in for the
  compiled function that records what it is given;
* 7.3 ``sample_logits``: Milestone 3's ``minivllm.sampling.Sampler`` with per-row seeded
  generators, so that both sides race against exactly the same exponential noise.

Each prints one ``passed(...)`` line or raises an ``AssertionError`` that says what differs;
a stub's ``NotImplementedError`` becomes an ``AssertionError`` saying "not implemented yet".
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from .grading import assert_close, assert_equal, call_learner, passed, require


def _scattered_tables(seq_lens: list[int], block_size: int, num_blocks: int, seed: int,
                      width: int | None = None, pad: int = 0) -> list[list[int]]:
    """Shuffled (non-contiguous) block tables holding ``seq_lens`` tokens, each padded with
    ``pad`` to ``width`` blocks when given."""
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
    return [t + [pad] * ((width or len(t)) - len(t)) for t in tables]


# ----------------------------------------------------------------------------- 7.1 slots

SLOTS_HINT = ("the new token of row b sits at position p = positions[b]; its slot is "
              "block_tables[b, p // block_size] * block_size + p % block_size — pick each row's "
              "block with gather (or advanced indexing with a row index), not block_tables[:, ...]")


def check_decode_slots(decode_slots) -> None:
    """Exercise 7.1: slots computed on the device equal ``slot_of`` row by row, at block
    boundaries, for block sizes 1, 4 and 16, with tables padded past each row's blocks."""
    from minivllm.kv_cache import slot_of

    what = "Exercise 7.1 (decode_slots)"
    cases = 0
    for block_size, seq_lens in ((4, [1, 4, 5, 8, 9, 13]), (16, [1, 16, 17, 33, 47, 100, 2]),
                                 (1, [1, 2, 7])):
        width = max(-(-n // block_size) for n in seq_lens) + 1  # one spare column of padding
        tables = _scattered_tables(seq_lens, block_size, 64 * 16, seed=block_size, width=width,
                                   pad=999)
        positions = [n - 1 for n in seq_lens]
        got = call_learner(what, decode_slots, torch.tensor(tables), torch.tensor(positions),
                           block_size, hint=SLOTS_HINT)
        require(isinstance(got, torch.Tensor), what,
                f"expected a tensor of shape ({len(seq_lens)},), got {type(got).__name__}")
        require(tuple(got.shape) == (len(seq_lens),), what,
                f"shape {tuple(got.shape)}, expected ({len(seq_lens)},): one slot per row",
                SLOTS_HINT)
        expected = [slot_of(t, p, block_size) for t, p in zip(tables, positions)]
        assert_equal(got, expected, what=f"{what}, block_size={block_size}, positions "
                     f"{positions}", hint=SLOTS_HINT)
        cases += len(seq_lens)
    passed("7.1 (decode_slots)", f"{cases} rows at 3 block sizes equal slot_of, "
           "block boundaries included")


# ----------------------------------------------------------------------------- 7.2 attention

MASK_HINT = ("row b's context holds seq_lens[b] tokens, at key positions 0 .. seq_lens[b] - 1 "
             "(the new token included, it was just written): mask = key_pos < seq_lens[b], "
             "shaped (B, 1, 1, K) so it broadcasts over heads and the single query")


def _decode_case(num_layers=2, block_size=4, num_kv_heads=2, n_heads=4, head_dim=8,
                 seq_lens=(1, 4, 5, 11, 16), num_pad=3, seed=0):
    """A pool filled with random values (stale garbage past every context), a ragged decode
    batch over scattered tables, and ``num_pad`` padding rows on the scratch block."""
    from minivllm.kv_cache import KVCachePool

    g = torch.Generator().manual_seed(seed)
    num_blocks = 24
    scratch = num_blocks  # one block past the block manager's range
    pool = KVCachePool(num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim,
                       torch.float32, torch.device("cpu"))
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=g))
    width = max(-(-n // block_size) for n in seq_lens) + 1
    tables = _scattered_tables(list(seq_lens), block_size, num_blocks, seed, width, scratch)
    tables += [[scratch] * width] * num_pad
    lens = list(seq_lens) + [1] * num_pad
    rows = len(lens)
    q = torch.randn(num_layers, rows, n_heads, head_dim, generator=g)
    k = torch.randn(num_layers, rows, num_kv_heads, head_dim, generator=g)
    v = torch.randn(num_layers, rows, num_kv_heads, head_dim, generator=g)
    return SimpleNamespace(pool=pool, tables=tables, seq_lens=lens, real=len(seq_lens),
                           block_size=block_size, scratch=scratch, q=q, k=k, v=v,
                           num_layers=num_layers)


def _reference_attention(case):
    """Milestone 2's loop backend on a copy of the pool, for the real rows only."""
    from minivllm.kv_cache import AttentionMetadata, KVCachePool, PagedAttention

    _, num_layers, num_slots, num_kv_heads, head_dim = case.pool.kv.shape
    ref = KVCachePool(num_layers, num_slots // case.block_size, case.block_size, num_kv_heads,
                      head_dim)
    ref.kv.copy_(case.pool.kv)
    n = case.real
    tables = [[b for b in t if b != case.scratch] for t in case.tables[:n]]
    md = AttentionMetadata.build(tables, [s - 1 for s in case.seq_lens[:n]], [1] * n,
                                 case.block_size)
    attn = PagedAttention(ref, md)
    outs = [attn(layer, case.q[layer, :n], case.k[layer, :n], case.v[layer, :n])
            for layer in range(case.num_layers)]
    return outs, ref.kv


def check_decode_attention(DecodeAttention) -> None:
    """Exercise 7.2: paged decode attention from tensors equals the Milestone 2 loop backend
    on a ragged batch whose tables are padded with the scratch block, plus padding rows."""
    from minivllm.kv_cache import slot_of

    what = "Exercise 7.2 (DecodeAttention)"
    for seed, block_size in ((0, 4), (1, 16)):
        case = _decode_case(block_size=block_size, seed=seed,
                            seq_lens=(1, 4, 5, 11, 16) if block_size == 4 else (1, 16, 17, 40))
        expected, expected_kv = _reference_attention(case)
        slots = torch.tensor([slot_of(t, n - 1, block_size)
                              for t, n in zip(case.tables, case.seq_lens)])
        kv = case.pool.kv
        attn = call_learner(what, DecodeAttention, kv, slots, torch.tensor(case.tables),
                            torch.tensor(case.seq_lens), block_size, hint=MASK_HINT)
        mask = getattr(attn, "mask", None)
        rows, keys = len(case.seq_lens), len(case.tables[0]) * block_size
        require(isinstance(mask, torch.Tensor) and mask.dtype == torch.bool, what,
                f"self.mask should be a bool tensor, got {type(mask).__name__}"
                + (f" of dtype {mask.dtype}" if isinstance(mask, torch.Tensor) else ""),
                MASK_HINT)
        require(tuple(mask.shape) == (rows, 1, 1, keys), what,
                f"self.mask has shape {tuple(mask.shape)}, expected {(rows, 1, 1, keys)} "
                "(rows, heads, queries, keys)", MASK_HINT)
        want = [[j < n for j in range(keys)] for n in case.seq_lens]
        assert_equal(mask.view(rows, keys).tolist(), want,
                     what=f"{what}: self.mask (rows = sequences, True = may attend), "
                          f"seq_lens {case.seq_lens}", hint=MASK_HINT)
        for layer in range(case.num_layers):
            out = call_learner(what, attn, layer, case.q[layer], case.k[layer], case.v[layer],
                               hint=MASK_HINT)
            require(isinstance(out, torch.Tensor) and out.shape == case.q[layer].shape, what,
                    f"layer {layer}: expected output of shape {tuple(case.q[layer].shape)}")
            require(bool(out.isfinite().all()), what,
                    f"layer {layer}: non-finite outputs in rows "
                    f"{sorted({int(r) for r in (~out.isfinite()).nonzero()[:, 0]})} (a row "
                    "whose keys are all masked gives NaN)", MASK_HINT)
            assert_close(out[:case.real], expected[layer], atol=1e-5, rtol=1e-4,
                         what=f"{what}: layer {layer} output of the real rows vs the loop "
                              f"backend (block_size {block_size})", hint=MASK_HINT)
        real_slots = slice(0, case.scratch * block_size)  # the scratch block may differ
        assert_close(kv[:, :, real_slots], expected_kv[:, :, real_slots],
                     what=f"{what}: the pool outside the scratch block after the step",
                     hint="write k and v at self.slots (one slot per row), nothing else")
    passed("7.2 (DecodeAttention)", "mask and outputs equal the Milestone 2 loop backend on 2 "
           "ragged batches with scratch-block padding rows; the pool is written only at the "
           "new tokens' slots")


PAD_HINT = ("pad the batch to bucket(rows) rows and every table to bucket(widest table) "
            "blocks; padding — extra table columns and whole extra rows — points at "
            "self.scratch_block; padding rows have seq_len 1 (one valid key, no NaN); return "
            "only the first `rows` rows of the logits")


def _bucket(n: int, on_cuda: bool, minimum: int = 2) -> int:
    n = max(n, minimum)
    return 1 << (n - 1).bit_length() if on_cuda else n


def check_bucket_padding(CompiledDecoder, DecodeInputs) -> None:
    """Exercise 7.2: ``CompiledDecoder.logits`` pads rows and tables into their buckets with
    the scratch block, hands int64 tensors to the compiled function and drops padding rows.
    The compiled function is replaced by a recorder, so nothing is compiled here."""
    what = "Exercise 7.2 (CompiledDecoder.logits padding)"
    scratch, block_size = 40, 4
    for on_cuda in (False, True):
        for seq_lens in ([5], [1, 9, 3], [13, 2, 7, 4, 8]):
            decoder = CompiledDecoder.__new__(CompiledDecoder)  # no torch.compile
            decoder.model, decoder.kv, decoder.block_size = None, None, block_size
            decoder.scratch_block, decoder.device, decoder.on_cuda = scratch, torch.device("cpu"), on_cuda
            decoder.compile_seconds, decoder.min_rows = 0.0, 2 if on_cuda else 1
            seen = {}

            def recorder(model, kv, input_ids, seq_lens_t, block_tables, bs, seen=seen):
                seen.update(input_ids=input_ids, seq_lens=seq_lens_t, tables=block_tables, bs=bs)
                rows = torch.arange(input_ids.shape[0], dtype=torch.float32)
                return torch.stack([input_ids.float(), seq_lens_t.float(), rows], dim=-1)

            decoder._logits = recorder
            tables = _scattered_tables(seq_lens, block_size, scratch, seed=len(seq_lens))
            ids = [100 + i for i in range(len(seq_lens))]
            where = f"{len(seq_lens)} row(s), on_cuda={on_cuda}"
            out = call_learner(what, decoder.logits, DecodeInputs(ids, list(seq_lens), tables),
                               hint=PAD_HINT)
            require("tables" in seen, what, f"{where}: self._logits was never called", PAD_HINT)
            rows = _bucket(len(seq_lens), on_cuda, 2 if on_cuda else 1)  # CPU: 1 stays 1
            width = _bucket(max(map(len, tables)), on_cuda)
            for name in ("input_ids", "seq_lens", "tables"):
                t = seen[name]
                require(isinstance(t, torch.Tensor) and t.dtype == torch.long, what,
                        f"{where}: {name} should be an int64 tensor, got "
                        f"{getattr(t, 'dtype', type(t).__name__)}", PAD_HINT)
            want_tables = [t + [scratch] * (width - len(t)) for t in tables]
            want_tables += [[scratch] * width] * (rows - len(seq_lens))
            assert_equal(seen["tables"], want_tables,
                         what=f"{what}: block tables passed to the compiled step ({where}; "
                              f"bucket {rows} rows x {width} blocks, scratch block {scratch})",
                         hint=PAD_HINT)
            assert_equal(seen["seq_lens"], list(seq_lens) + [1] * (rows - len(seq_lens)),
                         what=f"{what}: seq_lens passed to the compiled step ({where})",
                         hint=PAD_HINT)
            assert_equal(seen["input_ids"][:len(ids)], ids,
                         what=f"{what}: input_ids of the real rows ({where})", hint=PAD_HINT)
            require(seen["bs"] == block_size, what, f"{where}: block_size {seen['bs']!r} "
                    f"passed, expected {block_size}")
            require(isinstance(out, torch.Tensor) and out.shape[0] == len(seq_lens), what,
                    f"{where}: returned {tuple(getattr(out, 'shape', ()))} rows of logits, "
                    f"expected the {len(seq_lens)} real rows only", PAD_HINT)
            assert_equal(out[:, 2], list(range(len(seq_lens))),
                         what=f"{what}: which padded rows were returned ({where})",
                         hint=PAD_HINT)
    passed("7.2 (CompiledDecoder.logits padding)", "rows and tables padded into CPU and CUDA "
           "buckets with the scratch block, padding rows have seq_len 1, only real rows return")


# ----------------------------------------------------------------------------- 7.3 sampling

SAMPLE_HINT = ("greedy rows (temperature 0) take argmax of the raw logits; the others divide by "
               "the temperature (clamped away from 0), apply top-k, top-p, min-p in that order "
               "when use_filters, softmax, then notebook 03's inverse_cdf(probs, u)")


def _generators(seeds: list[int]) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def _column(params: list, field: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([getattr(p, field) for p in params], dtype=dtype)


def check_sample_logits(sample_logits) -> None:
    """Exercise 7.3: tokens equal Milestone 3's Sampler on the same seeded uniforms, for
    batches mixing greedy, plain-temperature and filtered rows."""
    from minivllm.sampling import Sampler, SamplingParams, uniform_draws

    what = "Exercise 7.3 (sample_logits)"
    vocab = 48
    batches = {
        "greedy + plain temperature (use_filters=False)": [
            SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.5), SamplingParams(temperature=2.5),
            SamplingParams(temperature=0.0)],
        "greedy + top-k / top-p / min-p rows (use_filters=True)": [
            SamplingParams(temperature=0.0, top_k=3), SamplingParams(temperature=0.7, top_k=5),
            SamplingParams(temperature=1.3, top_p=0.6), SamplingParams(temperature=0.9, min_p=0.2),
            SamplingParams(temperature=1.0), SamplingParams(temperature=2.0, top_k=8, top_p=0.8,
                                                            min_p=0.05)],
    }
    rows_checked = 0
    for name, params in batches.items():
        use_filters = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params)
        for trial in range(12):
            g = torch.Generator().manual_seed(trial)
            logits = torch.randn(len(params), vocab, generator=g) * 3
            for row, p in enumerate(params):  # greedy rows: a runner-up a hair below the top,
                if p.temperature == 0.0:  # so that sampling them at a tiny temperature is seen
                    top, second = logits[row].topk(2).indices.tolist()
                    logits[row, second] = logits[row, top] - 1e-5
            seeds = [1000 * trial + row for row in range(len(params))]
            u = uniform_draws(len(params), _generators(seeds))
            expected = Sampler()(logits.clone(), params, _generators(seeds)).token_ids
            got = call_learner(what, sample_logits, logits.clone(),
                               _column(params, "temperature", torch.float32),
                               _column(params, "top_k", torch.long),
                               _column(params, "top_p", torch.float32),
                               _column(params, "min_p", torch.float32), u.clone(), use_filters,
                               hint=SAMPLE_HINT)
            require(isinstance(got, torch.Tensor) and got.shape == (len(params),), what,
                    f"expected ({len(params)},) token ids, got "
                    f"{tuple(getattr(got, 'shape', ())) or type(got).__name__}", SAMPLE_HINT)
            detail = ", ".join(f"row {r}: T={p.temperature} k={p.top_k} p={p.top_p} "
                               f"min_p={p.min_p}" for r, p in enumerate(params))
            assert_equal(got, expected, what=f"{what}: {name}, trial {trial} ({detail})",
                         hint=SAMPLE_HINT)
            rows_checked += len(params)
    passed("7.3 (sample_logits)", f"{rows_checked} rows equal Milestone 3's Sampler on the same "
           "seeded uniforms (greedy, temperature, top-k, top-p, min-p)")
