"""One linear of the 0.5B shape, by route: what each way of calling oneDNN costs (issue 30).

For every linear of Qwen2.5-0.5B (merged q/k/v, o, merged gate/up, down, lm_head) and every
row count (``--rows``: a decode step's batch, or a prefill chunk), times, alternating the
routes round by round in one process:

* ``F.linear``: what the engine calls today (ATen's ``addmm``/``mm``: oneDNN through the
  public path, the weight in its plain layout, reordered per call as oneDNN sees fit);
* ``mkldnn packed``: the weight reordered once into oneDNN's blocked layout for this row
  count (``torch.ops.mkldnn._reorder_linear_weight``), then
  ``torch.ops.mkldnn._linear_pointwise``: what inductor's ``freezing`` pass emits;
* ``vllm onednn_mm``: vLLM's own CPU linear (``create_onednn_mm`` once, ``onednn_mm`` per
  call), when ``vllm`` imports (run with ``bench/peers/vllm/.venv/bin/python``);
* ``compiled``, with ``--compiled``: ``torch.compile`` of the linear with inductor's
  ``freezing`` on and, separately, ``max_autotune`` with the C++ GEMM template.

Prints ms per call (the median of ``--rounds``) and each route's ratio to ``F.linear``.

    bench/peers/vllm/.venv/bin/python bench/experiments/linear_routes.py --rows 1,8,32,2048
    python bench/experiments/linear_routes.py --rows 8 --compiled

Run it alone: on 2 cores anything else running changes the answer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name: (in_features, out_features) of Qwen2.5-0.5B, merged as the engine merges
    "qkv_proj": (896, 1152),
    "o_proj": (896, 896),
    "gate_up_proj": (896, 9728),
    "down_proj": (4864, 896),
    "lm_head": (896, 151936),
}


def _time(fn, x: torch.Tensor, reps: int) -> float:
    fn(x)
    started = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - started) / reps * 1e3


def routes_for(weight: torch.Tensor, bias: torch.Tensor | None, rows: int,
               compiled: bool) -> dict:
    """name -> callable(x) for one weight (out, in) and a batch of ``rows``."""
    routes = {"F.linear": lambda x: F.linear(x, weight, bias)}
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        routes["mkldnn packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(
            x, packed, bias, "none", [], "")
    try:
        from vllm import _custom_ops as ops

        handler = ops.create_onednn_mm(weight.t(), 32)
        routes["vllm onednn_mm"] = lambda x: ops.onednn_mm(handler, x, bias)
    except Exception as exc:  # noqa: BLE001 -- vLLM absent (our venv) or its ops not built
        routes.setdefault("_skipped", f"vllm onednn_mm: {type(exc).__name__}: {exc}")
    if compiled:
        import torch._inductor.config as inductor_config

        module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        module.weight.data, module = weight, module.requires_grad_(False).eval()
        with inductor_config.patch(freezing=True):
            frozen = torch.compile(module)
            with torch.no_grad():
                started = time.perf_counter()
                frozen(torch.zeros(rows, weight.shape[1], dtype=weight.dtype))
                routes["_compile_s freezing"] = time.perf_counter() - started
        routes["compiled freezing"] = frozen
        with inductor_config.patch(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN"):
            tuned = torch.compile(lambda x: F.linear(x, weight, bias), dynamic=False)
            started = time.perf_counter()
            tuned(torch.zeros(rows, weight.shape[1], dtype=weight.dtype))
            routes["_compile_s max-autotune CPP"] = time.perf_counter() - started
        routes["compiled max-autotune CPP"] = tuned
    return routes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,32,2048")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget-ms", type=float, default=150.0, help="time per route per round")
    p.add_argument("--compiled", action="store_true", help="also the torch.compile routes")
    p.add_argument("--json", help="append the results as one JSON line to this file")
    args = p.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, python {sys.executable}")
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}, load {os.getloadavg()}")
    results = []
    with torch.inference_mode():
        for name in args.shapes.split(","):
            k, n = SHAPES[name]
            weight = torch.randn(n, k, dtype=dtype) * 0.02
            bias = torch.randn(n, dtype=dtype) * 0.02 if name == "qkv_proj" else None
            for rows in map(int, args.rows.split(",")):
                routes = routes_for(weight, bias, rows, args.compiled)
                extras = {r: routes.pop(r) for r in list(routes) if r.startswith("_")}
                x = torch.randn(rows, k, dtype=dtype)
                want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
                for fn in routes.values():  # same answer, or the timing means nothing
                    torch.testing.assert_close(fn(x).float(), want, atol=0.05, rtol=0.05)
                reps = {r: max(1, int(args.budget_ms / max(_time(fn, x, 1), 1e-3)))
                        for r, fn in routes.items()}
                samples = {r: [] for r in routes}
                order = list(routes)
                for i in range(args.rounds):  # A B C, C B A, ...: drift hits every route alike
                    for r in order if i % 2 == 0 else order[::-1]:
                        samples[r].append(_time(routes[r], x, reps[r]))
                ms = {r: statistics.median(v) for r, v in samples.items()}
                base = ms["F.linear"]
                line = "  ".join(f"{r} {v:.3f} ms ({base / v:.2f}x)" for r, v in ms.items())
                print(f"{name:>12} {k}x{n} rows {rows:>4}: {line}", flush=True)
                for r, v in extras.items():
                    print(f"{'':>18} {r}: {v if isinstance(v, str) else f'{v:.1f} s'}")
                results.append({"shape": name, "k": k, "n": n, "rows": rows, "ms": ms,
                                **{r: v for r, v in extras.items()}})
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps({"experiment": "linear_routes", "dtype": args.dtype,
                                "torch": torch.__version__, "results": results}) + "\n")


if __name__ == "__main__":
    main()
