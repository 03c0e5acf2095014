"""The 0.5B lm_head (151936 x 896, bf16) at a decode step's rows, by route (issue 30, ninth part).

At 8 rows the packed oneDNN lm_head reads its 0.27 GB at ~22 GB/s, where inductor's one-row
loop reads it at ~40: is there a multi-row route that streams it faster? Routes, alternated
round by round in one process (run it alone):

* ``packed``: the engine's route, one weight packed for oneDNN (``_linear_pointwise``);
* ``packed, N chunks of C``: the weight split along its outputs into packed pieces of C rows
  (a gate/up-sized piece streams at ~40 GB/s), the outputs concatenated;
* ``inductor loop, rows inner``: ``(w[:, None, :] * x[None]).sum(-1)`` compiled, so that
  inductor's loop takes each weight row once and every batch row against it.

    python bench/experiments/lm_head_routes.py --rows 1,2,4,8,16,32
"""

from __future__ import annotations

import argparse
import statistics

import torch
from one_row_routes import median_ms

VOCAB, HIDDEN = 151936, 896


def rows_inner(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(B, K) rows times the (N, K) weight -> (B, N), the loop over N outside the rows."""
    return (w.unsqueeze(1) * x.unsqueeze(0)).sum(-1).t()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--chunks", default="32768,9728,4096")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    weight = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16) * 0.02
    pack = lambda w: torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 32)
    linear = lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
    whole = pack(weight)
    torch._dynamo.config.recompile_limit = 64  # a graph per row count
    loop = torch.compile(rows_inner, dynamic=False)
    pieces = {int(c): [pack(w) for w in weight.split(int(c))] for c in args.chunks.split(",")}
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, HIDDEN, dtype=torch.bfloat16)
            routes = {"packed": lambda x=x: linear(x, whole)}
            for c, ps in pieces.items():
                routes[f"packed, {len(ps)} chunks of {c}"] = (
                    lambda x=x, ps=ps: torch.cat([linear(x, p) for p in ps], -1))
            if rows > 1:
                routes["inductor loop, rows inner"] = lambda x=x: loop(x, weight)
            expected = routes["packed"]().float()
            for name, route in routes.items():
                diff = float((route().float() - expected).abs().max())
                assert diff < 0.05, (name, diff)  # the same product, summed in another order
            times = {name: [] for name in routes}
            for _ in range(args.rounds):
                for name, route in routes.items():
                    times[name].append(median_ms(route))
            print(f"{rows} row(s): " + ", ".join(
                f"{name} {statistics.median(ms):.2f} ms" for name, ms in times.items()), flush=True)


if __name__ == "__main__":
    main()
