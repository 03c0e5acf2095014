"""The compiled decode step with its small-batch bf16 linears computed as ``W @ x^T``, against
the default ``F.linear``, alternated in one process. A measurement of an idea we did not adopt.

    python bench/experiments/weight_major_ab.py [--model M] [--rows 32,8] [--pad-to 0] [--pairs 12]

The idea: ``F.linear(x, W)`` on a CPU hands oneDNN the weight as its *second* operand, which
its bf16 kernels re-lay-out on every call (VNNI blocks), so a decode step reads every weight
about twice. ``torch.mm(W, x.t())`` makes the weight the *first* operand, read as stored, and
re-lays-out only the few rows of ``x``. In a microbenchmark over one model's worth of
weights (24 layers and the lm_head of the 0.5B shape) that is 0.63-0.88x the time at most
row counts from 2 to 64 on this AMX Xeon (some counts between 17 and 32 win only when padded
to 40 rows), and 0.74-0.84x at 16-32 rows with oneDNN capped below AMX
(``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``, the path of an AVX512-BF16 CPU such as Zen 4/5). This tool asks the question that
decides: is the *compiled decode step* faster? Side B swaps the model's linears (a copy, same
weights) for ones that call ``W @ x^T`` through a custom op for 2-64 rows (``--pad-to N``
pads 17..N-1 rows to N first), compiles it over the same KV pool, and alternates the two
steps A B B A ..., so the machine's drift falls on both. Needs a bf16 model on a CPU.
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.nn.functional as F
from matvec_ab import alternate  # bench/experiments/ is on the path of a script run from it
from torch import nn

from minivllm import LLM
from minivllm.compile import CompiledDecoder, DecodeInputs, SingleRowLinear

PAD_TO = 0  # set from --pad-to before anything is compiled


@torch.library.custom_op("minivllm_tools::weight_major_linear", mutates_args=())
def weight_major_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(M, K) rows, (N, K) weight -> (M, N), as (W @ x^T)^T for M <= 64, else F.linear."""
    rows = x.shape[0]
    if rows > 64:
        return F.linear(x, weight, bias)
    if 16 < rows < PAD_TO:  # AMX: oneDNN's blocking for 17-32 columns is slow
        x = torch.cat([x, x.new_zeros(PAD_TO - rows, x.shape[1])])
    out = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias.unsqueeze(1), weight, x.t())
    return out[:, :rows].t().contiguous()  # (M, N)


@weight_major_linear.register_fake
def _weight_major_shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("minivllm_tools::weight_times_rows", mutates_args=())
def weight_times_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(M, K) rows, (N, K) weight -> W @ x^T, (N, M), left transposed for the graph to fuse."""
    return torch.mm(weight, x.t())


@weight_times_rows.register_fake
def _weight_times_rows_shape(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(weight.shape[0], x.shape[0])


class WeightMajorLinear(SingleRowLinear):
    """One row: torch.mv (as the default); 2-64 bf16 rows: ``weight_major_linear``."""

    transpose_in_graph = False  # --transpose-in-graph: the (N, M) product, transposed outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] > 1 and x.dtype == torch.bfloat16 and not x.is_cuda:
            if self.transpose_in_graph:  # every batch of a dynamic graph is <= 64 rows here
                out = weight_times_rows(x, self.weight).t()  # (M, N) view: consumers fuse it
                return (out if self.bias is None else out + self.bias).contiguous()
            return weight_major_linear(x, self.weight, self.bias)
        return super().forward(x)


def main() -> None:
    global PAD_TO
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="checkpoints/qwen2.5-0.5b-random")
    p.add_argument("--rows", default="32,8", help="comma-separated decode batch sizes")
    p.add_argument("--context", type=int, default=160, help="context tokens per row")
    p.add_argument("--pad-to", type=int, default=0, help="pad 17..N-1 rows to N (0: never)")
    p.add_argument("--pairs", type=int, default=12, help="timed steps of each side")
    p.add_argument("--transpose-in-graph", action="store_true",
                   help="the op returns W @ x^T and the graph transposes it (no padding)")
    args = p.parse_args()
    PAD_TO = args.pad_to
    WeightMajorLinear.transpose_in_graph = args.transpose_in_graph

    llm = LLM(args.model, dtype="bfloat16")  # side A: the default compiled step
    engine = llm.engine
    plain = engine.runner.decoder
    if plain is None or plain.matvec_linears == 0:
        raise SystemExit("this needs the compiled decode step of a bf16 model on a CPU")
    model = copy.deepcopy(engine.runner.model)  # side B: the same weights, linears swapped
    for module in model.modules():
        if type(module) in (nn.Linear, SingleRowLinear):
            module.__class__ = WeightMajorLinear
    weight_major = CompiledDecoder(model, engine.runner.pool.kv, engine.config.block_size,
                                   engine.num_blocks, engine.device)
    print(f"compiled side B in {weight_major.warmup(engine.model_config.vocab_size):.0f} s")
    blocks = -(-args.context // engine.config.block_size)
    for rows in (int(r) for r in args.rows.split(",")):
        tables = [[row * blocks + i for i in range(blocks)] for row in range(rows)]
        batch = DecodeInputs([5 + row for row in range(rows)], [args.context] * rows, tables)
        sides = {"F.linear": plain, "W @ x^T": weight_major}
        with torch.inference_mode():
            a, b = plain.logits(batch), weight_major.logits(batch)
            print(f"rows={rows}: max |logits A - B| {float((a - b).abs().max()):.3g} (bf16 sums "
                  "in another order)")
            times = alternate(sides, lambda side, batch=batch: side.logits(batch), args.pairs)
        ratios = [b / a for a, b in zip(times["F.linear"], times["W @ x^T"])]
        print(f"rows={rows} pad_to={args.pad_to} transpose_in_graph={args.transpose_in_graph}: "
              f"F.linear {statistics.median(times['F.linear']) * 1e3:.1f} ms, "
              f"W @ x^T {statistics.median(times['W @ x^T']) * 1e3:.1f} ms per step; B/A per pair: "
              f"median {statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})", flush=True)


if __name__ == "__main__":
    main()
