"""The FlexAttention experiment of Milestone 6 (bench/experiments/flex_attention/): reading the
paged pool in place must give the gather + SDPA backend's answer, so that its timings compare
like with like. Small pools and batches: each layout compiles once (a few seconds)."""

from __future__ import annotations

from pathlib import Path

import torch
from notebook_helpers import load_module

from minivllm.attention import attend_group, gather_blocks

EXPERIMENT = Path(__file__).resolve().parent.parent / "bench" / "experiments" / "flex_attention"
H, NKV, D, BS, NUM_BLOCKS, MAX_ROWS = 14, 2, 64, 16, 96, 8


def _flex_paged():
    return load_module(EXPERIMENT / "flex_paged.py", "flex_paged")


def _reference(q, keys_cache, values_cache, tables, seq_lens):
    key_pos = torch.arange(tables.shape[1] * BS)
    mask = (key_pos < seq_lens.unsqueeze(1)).view(len(seq_lens), 1, 1, -1)
    keys = gather_blocks(keys_cache, tables, BS)
    values = gather_blocks(values_cache, tables, BS)
    return attend_group(q.unsqueeze(1), keys, values, mask).squeeze(1)


def test_flex_decode_over_the_pool_matches_gather_and_sdpa():
    flex = _flex_paged()
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 2, NUM_BLOCKS * BS, NKV, D, generator=gen)
    for layout in ("rows", "batch"):
        decode = torch.compile(flex.flex_decode, dynamic=True, fullgraph=True)
        for batch, layer in ((3, 1), (5, 0)):
            seq_lens = torch.randint(1, 200, (batch,), generator=gen)
            need = [-(-int(s) // BS) for s in seq_lens]
            perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()  # shuffled blocks
            tables, start = [], 0
            for n in need:
                tables.append(perm[start:start + n])
                start += n
            tables[1][:1] = tables[0][:1]  # prefix caching: a shared first block
            width = max(need)
            bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
            q = torch.randn(batch, H, D, generator=gen)
            per_layer = (kv[0, layer], kv[1, layer])  # see flex_paged._layer_kv: no pool copy
            meta = flex.DecodeFlexMeta.build(bt, seq_lens, BS, NUM_BLOCKS, layout,
                                             max_rows=MAX_ROWS)
            flex.mark_static_dims(per_layer, meta.kv_idx, meta.full_idx,
                                  fixed=(meta.tab, meta.seq_lens))
            out = decode(q, per_layer, layer, meta.kv_num, meta.kv_idx, meta.full_num,
                         meta.full_idx, meta.tab, meta.seq_lens, BS, layout)
            expected = _reference(q, kv[0, layer], kv[1, layer], bt, seq_lens)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
