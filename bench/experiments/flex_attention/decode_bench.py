"""Per-layer decode attention time on CPU: gather+SDPA (eager / compiled) vs FlexAttention.

Interleaved: every rep runs each backend once in turn (A, B, C, D, A, B, ...); each sample is
the mean over an inner loop of calls; we report median (and min / max) over the reps.
Per-step costs (mask / BlockMask index build, shared by the 24 layers) are timed separately.
Compile time: first call per backend per shape, in a fresh inductor cache dir.
"""
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
from flex_paged import DecodeFlexMeta, create_block_mask_decode, flex_decode, mark_static_dims

from minivllm.attention import attend_group, gather_blocks

torch.set_num_threads(int(os.environ.get("THREADS", 2)))
H, NKV, D, BS, L = 14, 2, 64, 16, 2
NUM_BLOCKS = int(os.environ.get("NUM_BLOCKS", 4096))
MAXB = 64
REPS = int(os.environ.get("REPS", 9))
LAYER = 1


def gather_sdpa(q, kv, layer: int, bt, mask):
    keys = gather_blocks(kv[0, layer], bt, BS)
    values = gather_blocks(kv[1, layer], bt, BS)
    return attend_group(q.unsqueeze(1), keys, values, mask).squeeze(1)


def decode_mask(bt, seq_lens):
    key_pos = torch.arange(bt.shape[1] * BS)
    return (key_pos < seq_lens.unsqueeze(1)).view(len(seq_lens), 1, 1, -1)


def make_case(B, ctx, gen):
    seq_lens = torch.full((B,), ctx)
    nb = -(-ctx // BS)
    perm = torch.randperm(NUM_BLOCKS, generator=gen)[:B * nb]
    bt = perm.view(B, nb)
    return seq_lens, bt


def timeit(fn, inner):
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def main():
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, L, NUM_BLOCKS * BS, NKV, D, generator=gen)
    # per-layer K and V as separate graph inputs: no pool copy, correct offsets (see _layer_kv)
    kvl = [(kv[0, l], kv[1, l]) for l in range(L)]
    compiled_gather = torch.compile(gather_sdpa, dynamic=True)
    flex_rows = torch.compile(flex_decode, dynamic=True, fullgraph=True)
    flex_batch = torch.compile(flex_decode, dynamic=True, fullgraph=True)
    configs = [(32, 96), (32, 1024), (1, 1024), (1, 4096)]
    if os.environ.get("CONFIGS"):
        configs = [tuple(map(int, c.split("x"))) for c in os.environ["CONFIGS"].split(",")]
    rows = []
    for B, ctx in configs:
        seq_lens, bt = make_case(B, ctx, gen)
        q = torch.randn(B, H, D, generator=gen)
        mask = decode_mask(bt, seq_lens)
        mr = DecodeFlexMeta.build(bt, seq_lens, BS, NUM_BLOCKS, "rows", max_rows=MAXB)
        mb = DecodeFlexMeta.build(bt, seq_lens, BS, NUM_BLOCKS, "batch", max_rows=MAXB)
        for m in (mr, mb):
            mark_static_dims(kvl[LAYER], m.kv_idx, m.full_idx, fixed=(m.tab, m.seq_lens))
        backends = {
            "a_gather_eager": lambda: gather_sdpa(q, kv, LAYER, bt, mask),
            "b_gather_compiled": lambda: compiled_gather(q, kv, LAYER, bt, mask),
            "c_flex_rows": lambda: flex_rows(q, kvl[LAYER], LAYER, mr.kv_num, mr.kv_idx, mr.full_num, mr.full_idx,
                                             mr.tab, mr.seq_lens, BS, "rows"),
            "c_flex_batch": lambda: flex_batch(q, kvl[LAYER], LAYER, mb.kv_num, mb.kv_idx, mb.full_num, mb.full_idx,
                                               mb.tab, mb.seq_lens, BS, "batch"),
        }
        per_step = {
            "step_mask_gather": lambda: decode_mask(bt, seq_lens),
            "step_flexmeta_build": lambda: DecodeFlexMeta.build(bt, seq_lens, BS, NUM_BLOCKS, "rows",
                                                                max_rows=MAXB),
        }
        if B * NUM_BLOCKS * BS <= 32 * 65536:
            per_step["step_create_block_mask"] = lambda: create_block_mask_decode(bt, seq_lens, BS, NUM_BLOCKS)
        first = {}
        ref = backends["a_gather_eager"]()
        for name, fn in {**backends, **per_step}.items():
            t0 = time.perf_counter()
            out = fn()
            first[name] = time.perf_counter() - t0
            if name in backends:
                err = (out - ref).abs().max().item()
                assert err < 1e-4, (name, err)
            for _ in range(2):
                fn()  # warm-up
        # inner loop size: about 20 ms per sample
        inner = {name: max(1, int(0.02 / max(timeit(fn, 2), 1e-6))) for name, fn in {**backends, **per_step}.items()}
        samples = {name: [] for name in {**backends, **per_step}}
        for _ in range(REPS):
            for name, fn in {**backends, **per_step}.items():
                samples[name].append(timeit(fn, inner[name]))
        for name in samples:
            s = sorted(samples[name])
            rows.append((B, ctx, name, statistics.median(s), s[0], s[-1], first[name]))
            print(f"B={B:2d} ctx={ctx:4d} {name:24s} median {statistics.median(s) * 1e3:8.3f} ms "
                  f"(min {s[0] * 1e3:.3f}, max {s[-1] * 1e3:.3f})  first call {first[name]:.2f}s "
                  f"inner={inner[name]}", flush=True)
    # other layers: per-layer K/V tensors differ only in storage offset; recompile?
    from torch._dynamo.utils import counters
    before = dict(counters["stats"])
    for l in range(L):
        flex_rows(q, kvl[l], l, mr.kv_num, mr.kv_idx, mr.full_num, mr.full_idx, mr.tab, mr.seq_lens, BS, "rows")
    print("dynamo stats before/after calling other layers:", before, dict(counters["stats"]))
    print("frames compiled per fn:", {k: v for k, v in counters["frames"].items()})
    print("load average after:", os.getloadavg())


if __name__ == "__main__":
    main()
