"""Parity of the FlexAttention paged backend vs gather_blocks + attend_group (fp32, CPU)."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parent))  # flex_paged
import torch
from flex_paged import (
    DecodeFlexMeta,
    PrefillFlexMeta,
    create_block_mask_decode,
    flex_decode,
    flex_prefill,
    mark_static_dims,
)

from minivllm.attention import attend_group, gather_blocks

torch.set_num_threads(2)
H, NKV, D, BS, L = 14, 2, 64, 16, 2
NUM_BLOCKS = 4096
MAXB = 64


def random_case(B, gen, ctx_lo=32, ctx_hi=1024, share_prefix=False):
    seq_lens = torch.randint(ctx_lo, ctx_hi + 1, (B,), generator=gen)
    need = [(-(-int(s) // BS)) for s in seq_lens]
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()  # shuffled physical blocks
    tables, p = [], 0
    for n in need:
        tables.append(perm[p:p + n]); p += n
    if share_prefix and B > 1:  # prefix caching: seq 1 shares seq 0's first 2 blocks
        k = min(2, len(tables[0]) - 1, len(tables[1]) - 1)
        tables[1][:k] = tables[0][:k]
    NB = max(need)
    bt = torch.tensor([t + [0] * (NB - len(t)) for t in tables])  # padded with block 0
    return seq_lens, tables, bt


def reference_decode(q, kv, layer, bt, seq_lens):
    key_pos = torch.arange(bt.shape[1] * BS)
    mask = (key_pos < seq_lens.unsqueeze(1)).view(len(seq_lens), 1, 1, -1)
    keys = gather_blocks(kv[0, layer], bt, BS)
    values = gather_blocks(kv[1, layer], bt, BS)
    return attend_group(q.unsqueeze(1), keys, values, mask).squeeze(1)


def main():
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, L, NUM_BLOCKS * BS, NKV, D, generator=gen)
    # per-layer K and V as separate graph inputs: no pool copy, correct offsets (see _layer_kv)
    kvl = [(kv[0, l], kv[1, l]) for l in range(L)]
    results = []
    for layout in ("rows", "batch"):
        fn = torch.compile(flex_decode, dynamic=True, fullgraph=True)
        t0 = time.perf_counter()
        for B in (1, 8, 32):
            for trial in range(3):
                seq_lens, tables, bt = random_case(B, gen, share_prefix=(trial == 2))
                q = torch.randn(B, H, D, generator=gen)
                layer = trial % L
                m = DecodeFlexMeta.build(bt, seq_lens, BS, NUM_BLOCKS, layout, max_rows=MAXB)
                mark_static_dims(kvl[layer], m.kv_idx, m.full_idx, fixed=(m.tab, m.seq_lens))
                out = fn(q, kvl[layer], layer, m.kv_num, m.kv_idx, m.full_num, m.full_idx, m.tab, m.seq_lens,
                         BS, layout)
                ref = reference_decode(q, kv, layer, bt, seq_lens)
                err = (out - ref).abs().max().item()
                results.append(("decode", layout, B, trial, err))
                print(f"decode layout={layout} B={B:2d} trial={trial} ctx={seq_lens.min().item()}..{seq_lens.max().item()} "
                      f"max|diff|={err:.2e}", flush=True)
        print(f"  [{layout}] total time incl. compile {time.perf_counter() - t0:.1f}s", flush=True)

    # create_block_mask reference BlockMask should equal ours (dense view)
    seq_lens, tables, bt = random_case(8, gen)
    bm = create_block_mask_decode(bt, seq_lens, BS, NUM_BLOCKS)
    m = DecodeFlexMeta.build(bt, seq_lens, BS, NUM_BLOCKS, "rows")
    ours = BlockMask.from_kv_blocks(m.kv_num, m.kv_idx, m.full_num, m.full_idx, BLOCK_SIZE=(1, BS),
                                    seq_lengths=(8, NUM_BLOCKS * BS))
    same = torch.equal(bm.to_dense(), ours.to_dense())
    print("create_block_mask dense == from_kv_blocks dense:", same)
    cb_full = torch.equal(bm.full_kv_num_blocks, ours.full_kv_num_blocks)
    print("  full-block counts equal:", cb_full)

    # prefill: ragged chunks with cached prefixes
    fnp = torch.compile(flex_prefill, dynamic=True, fullgraph=True)
    for q_block in (16, 32, 64):
        for trial in range(3):
            B = 4
            seq_lens, tables, bt = random_case(B, gen, 40, 600, share_prefix=(trial == 2))
            num_new = [int(torch.randint(1, int(s) + 1, (1,), generator=gen)) for s in seq_lens]
            if trial == 1:
                num_new = [int(s) for s in seq_lens]  # full prompts
            num_comp = [int(s) - n for s, n in zip(seq_lens, num_new)]
            m = PrefillFlexMeta.build(tables, num_comp, num_new, BS, NUM_BLOCKS, q_block,
                                      max_tokens=4096, max_rows=MAXB)
            mark_static_dims(kvl[layer], m.kv_idx, m.full_idx, fixed=(m.tab, m.seq_of_q, m.pos_of_q))
            T = sum(num_new)
            q = torch.randn(m.T_pad, H, D, generator=gen)
            layer = trial % L
            out = fnp(q, kvl[layer], layer, m.kv_num, m.kv_idx, m.full_num, m.full_idx, m.tab, m.seq_of_q,
                      m.pos_of_q, BS, q_block)
            err, start = 0.0, 0
            for b in range(B):
                n = num_new[b]
                qb = q[start:start + n].unsqueeze(0)  # (1, n, H, D)
                tb = bt[b:b + 1]
                keys = gather_blocks(kv[0, layer], tb, BS)
                values = gather_blocks(kv[1, layer], tb, BS)
                key_pos = torch.arange(tb.shape[1] * BS)
                qpos = torch.arange(num_comp[b], num_comp[b] + n)
                mask = (key_pos.view(1, -1) <= qpos.view(-1, 1)).view(1, 1, n, -1)
                ref = attend_group(qb, keys, values, mask)[0]
                err = max(err, (out[start:start + n] - ref).abs().max().item())
                start += n
            pad_ok = bool(torch.isfinite(out[T:]).all()) if m.T_pad > T else True
            print(f"prefill q_block={q_block} trial={trial} T={T} new={num_new} max|diff|={err:.2e} "
                  f"padding rows finite={pad_ok}", flush=True)


if __name__ == "__main__":
    from torch.nn.attention.flex_attention import BlockMask
    main()
