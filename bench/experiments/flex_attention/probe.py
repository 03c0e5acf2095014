import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # flex_paged
import torch
from flex_paged import DecodeFlexMeta, flex_decode, mark_static_dims

torch.set_num_threads(2)
NB = int(sys.argv[1]); BS=16
kv0 = torch.randn(2, 2, NB*BS, 2, 64)
kv = {'':kv0, '1':(kv0[0], kv0[1]), '2':(kv0[0,1], kv0[1,1])}[os.environ.get('SPLIT','')]
B, ctx = 1, 1024
bt = torch.randperm(NB)[:64].view(1, 64); sl = torch.full((1,), ctx)
m = DecodeFlexMeta.build(bt, sl, BS, NB, "rows", max_rows=64)
mark_static_dims(kv, m.kv_idx, m.full_idx, fixed=(m.tab, m.seq_lens))
f = torch.compile(flex_decode, dynamic=True, fullgraph=True)
q = torch.randn(B, 14, 64)
f(q, kv, 1, m.kv_num, m.kv_idx, m.full_num, m.full_idx, m.tab, m.seq_lens, BS, "rows")
from parity import reference_decode

out=f(q, kv, 1, m.kv_num, m.kv_idx, m.full_num, m.full_idx, m.tab, m.seq_lens, BS, 'rows')
print('err', (out-reference_decode(q, kv0, 1, bt, sl)).abs().max().item())
t=time.perf_counter()
for _ in range(10): f(q, kv, 1, m.kv_num, m.kv_idx, m.full_num, m.full_idx, m.tab, m.seq_lens, BS, "rows")
print(NB, (time.perf_counter()-t)/10*1e3, "ms")
