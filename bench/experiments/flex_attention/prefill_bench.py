"""Per-layer prefill attention on CPU: BatchedAttention's padded gather+SDPA vs flex_prefill."""
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="flexbench_"))
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parent))  # flex_paged
import statistics
import time

import torch
from flex_paged import PrefillFlexMeta, flex_prefill, mark_static_dims

from minivllm.attention import attend_group, build_group, gather_blocks
from minivllm.kv_cache import AttentionMetadata

torch.set_num_threads(2)
H, NKV, D, BS, L = 14, 2, 64, 16, 2
NUM_BLOCKS = 4096
LAYER = 1
REPS = int(os.environ.get("REPS", 7))


def gather_sdpa_prefill(q, k_cache, v_cache, rows, valid, tables, mask):
    keys = gather_blocks(k_cache, tables, BS)
    values = gather_blocks(v_cache, tables, BS)
    o = attend_group(q[rows], keys, values, mask)
    out = torch.zeros_like(q)
    out[rows[valid]] = o[valid]
    return out


def main():
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, L, NUM_BLOCKS * BS, NKV, D, generator=gen)
    kl = (kv[0, LAYER], kv[1, LAYER])
    cg = torch.compile(gather_sdpa_prefill, dynamic=True)
    cf = {qb: torch.compile(flex_prefill, dynamic=True, fullgraph=True) for qb in (32, 64)}
    cases = {  # name: (num_computed, num_new)
        "4 prompts x 512 new": ([0] * 4, [512] * 4),
        "1 chunk 256 after 768 cached": ([768], [256]),
        "ragged: 3 chunks (64,300,700) + cached": ([0, 200, 100], [64, 300, 700]),
    }
    perm = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    for name, (comp, new) in cases.items():
        tables, p = [], 0
        for c, n in zip(comp, new):
            nb = -(-(c + n) // BS)
            tables.append(perm[p:p + nb]); p += nb
        md = AttentionMetadata.build(tables, comp, new, BS)
        T = sum(new)
        g = build_group(md, list(range(len(new))), torch.device("cpu"))
        q = torch.randn(T, H, D, generator=gen)
        metas = {qb: PrefillFlexMeta.build(tables, comp, new, BS, NUM_BLOCKS, qb, max_tokens=4096, max_rows=64)
                 for qb in (32, 64)}
        qpads = {qb: torch.cat([q, q.new_zeros(metas[qb].T_pad - T, H, D)]) for qb in (32, 64)}
        for m in metas.values():
            mark_static_dims(kl, m.kv_idx, m.full_idx, fixed=(m.tab, m.seq_of_q, m.pos_of_q))

        def flex(qb):
            m = metas[qb]
            return lambda: cf[qb](qpads[qb], kl, LAYER, m.kv_num, m.kv_idx, m.full_num, m.full_idx, m.tab,
                                  m.seq_of_q, m.pos_of_q, BS, qb)[:T]

        fns = {
            "gather_eager": lambda: gather_sdpa_prefill(q, *kl, g.rows, g.valid, g.block_tables, g.mask),
            "gather_compiled": lambda: cg(q, *kl, g.rows, g.valid, g.block_tables, g.mask),
            "flex_q32": flex(32),
            "flex_q64": flex(64),
            "step_build_group": lambda: build_group(md, list(range(len(new))), torch.device("cpu")),
            "step_flexmeta_q64": lambda: PrefillFlexMeta.build(tables, comp, new, BS, NUM_BLOCKS, 64,
                                                               max_tokens=4096, max_rows=64),
        }
        ref = fns["gather_eager"]()
        first = {}
        for k, fn in fns.items():
            t0 = time.perf_counter(); out = fn(); first[k] = time.perf_counter() - t0
            if not k.startswith("step"):
                assert (out - ref).abs().max().item() < 1e-4, k
            fn()
        samples = {k: [] for k in fns}
        for _ in range(REPS):
            for k, fn in fns.items():
                t0 = time.perf_counter(); fn(); samples[k].append(time.perf_counter() - t0)
        for k, s in samples.items():
            s = sorted(s)
            print(f"{name:40s} {k:18s} median {statistics.median(s) * 1e3:8.2f} ms (min {s[0] * 1e3:.2f}, "
                  f"max {s[-1] * 1e3:.2f}) first call {first[k]:.2f}s", flush=True)


if __name__ == "__main__":
    main()
