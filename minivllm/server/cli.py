# Generated from solutions/04_openai_server.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""``python -m minivllm.serve``: the command line, logging, uvicorn and its signals.

Built in notebook 04_openai_server. Every engine flag takes its default from
``EngineConfig()`` (the one home of the engine's defaults), every limit from
``ServerOptions()``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

import uvicorn

from minivllm.config import ATTENTION_BACKENDS, MATVEC_KERNELS, EngineConfig
from minivllm.engine import LLMEngine
from minivllm.server.app import build_app
from minivllm.server.engine_thread import AsyncEngine
from minivllm.server.faults import hold_while, inject_faults
from minivllm.server.guard import DrainingServer, ServerOptions

logger = logging.getLogger("minivllm.server")
TINY_MODEL_NAME = "minivllm-tiny"  # the served name of the bundled tiny model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m minivllm.serve",
                                description="OpenAI-compatible server for a Qwen2/Qwen3 model")
    p.add_argument("--model", help="checkpoint directory or hub id (default: the bundled tiny "
                                   "model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", help="name(s) clients use (default: "
                   f"--model as given, or {TINY_MODEL_NAME!r} for the bundled model)")
    engine = EngineConfig()  # the one home of the engine's defaults: no flag restates one
    p.add_argument("--dtype", default=engine.dtype,
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="'auto': bf16 where the CPU does it natively and it pays, see the log")
    p.add_argument("--device", default=engine.device)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=engine.tensor_parallel_size,
                   help="processes (one GPU each on CUDA) to split the model across")
    p.add_argument("--block-size", type=int, default=engine.block_size)
    p.add_argument("--num-blocks", type=int, default=engine.num_blocks)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=engine.kv_cache_memory_bytes)
    p.add_argument("--kv-cache-memory", type=float, help="CPU KV-cache budget in GiB")
    p.add_argument("--gpu-memory-utilization", type=float, default=engine.gpu_memory_utilization)
    p.add_argument("--max-num-seqs", type=int, default=engine.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=engine.max_num_batched_tokens,
                   help="most tokens in one step (default: 512 on a CPU, 2048 on a GPU)")
    p.add_argument("--step-overhead-tokens", type=int, default=engine.step_overhead_tokens,
                   help="a step's fixed cost in tokens, weighed when packing prompts into one "
                        "step (default: 16 on a CPU; 0 on a GPU: always pack)")
    p.add_argument("--max-model-len", type=int, default=engine.max_model_len)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=engine.enable_prefix_caching)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="the same as --no-enable-prefix-caching")
    p.add_argument("--attention-backend", default=engine.attention_backend,
                   choices=list(ATTENTION_BACKENDS))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=engine.compile,
                   help="compile the decode step (default: $MINIVLLM_COMPILE, on)")
    p.add_argument("--compile-in-background", action=argparse.BooleanOptionalAction,
                   default=engine.compile_in_background,
                   help="answer at once, running steps eagerly while the decode step compiles, "
                        "and swap the compiled step in between two steps (notebook 07); "
                        "--no-compile-in-background compiles before serving")
    p.add_argument("--compile-flat-steps", action=argparse.BooleanOptionalAction,
                   default=engine.compile_flat_steps,
                   help="with --compile: prefill and mixed steps run each layer compiled "
                        "around its attention call (notebook 07)")
    p.add_argument("--compile-cpp-wrapper", action=argparse.BooleanOptionalAction,
                   default=engine.compile_cpp_wrapper,
                   help="with --compile on a CPU: the decode step's graphs call their kernels "
                        "from inductor's C++ wrapper, not from Python (~1 ms a step here; the "
                        "first compile on an empty inductor cache takes minutes longer; "
                        "notebook 07)")
    p.add_argument("--single-row-matvec", action=argparse.BooleanOptionalAction,
                   default=engine.single_row_matvec,
                   help="a compiled CPU decode of one row runs its linears as a "
                        "matrix-vector kernel (without AMX the packed linears keep their "
                        "plain weights for it: +0.67 GiB on the 0.5B model in bf16, +1.33 "
                        "GiB in float32, +0.67 where its numbers are bf16 ones, held in bf16, "
                        "the embedding too)")
    p.add_argument("--few-rows-loop", action=argparse.BooleanOptionalAction,
                   default=engine.few_rows_loop,
                   help="with --single-row-matvec, a compiled CPU decode of 2-8 rows in float32 "
                        "(2 rows in bf16) runs every row through that loop too (2 rows, 3-4 "
                        "padded to 4, 5-8 to 8): three more graphs to compile, one in bf16 "
                        "(notebook 07)")
    p.add_argument("--matvec-kernel", default=engine.matvec_kernel,
                   choices=["auto", *MATVEC_KERNELS],
                   help="that kernel: torch.mv, inductor's own loop, or auto: by the CPU "
                        "(torch.mv with AMX, inductor's loop without; notebook 07)")
    p.add_argument("--merge-projections", action=argparse.BooleanOptionalAction,
                   default=engine.merge_projections,
                   help="q/k/v as one matmul and gate/up as one (notebook 07)")
    p.add_argument("--pack-linear-weights", action=argparse.BooleanOptionalAction,
                   default=engine.pack_linear_weights,
                   help="a bf16 or float32 model on a CPU: each linear's weight reordered "
                        "once into oneDNN's layout, as vLLM does (notebook 07)")
    p.add_argument("--seed", type=int, default=engine.seed)
    p.add_argument("--speculative-config", default=engine.speculative_config,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (Milestone 8)')
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    limits = ServerOptions()
    p.add_argument("--api-key", default=os.environ.get("MINIVLLM_API_KEY") or None,
                   help="require 'Authorization: Bearer <key>' on /v1/* (default: "
                        "$MINIVLLM_API_KEY; none)")
    p.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes)
    p.add_argument("--max-n", type=int, default=limits.max_n)
    p.add_argument("--max-prompts-per-request", type=int, default=limits.max_prompts_per_request)
    p.add_argument("--max-waiting-requests", type=int, help="503 for new requests while this "
                   "many wait for the running batch (default: unbounded)")
    p.add_argument("--drain-timeout", type=float, default=limits.drain_timeout,
                   help="seconds SIGTERM waits for requests in flight")
    p.add_argument("--disable-log-requests", action="store_true",
                   default=not limits.log_requests, help="no info line per finished request")
    return p.parse_args(argv)


def server_options(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                         max_n=args.max_n, max_prompts_per_request=args.max_prompts_per_request,
                         drain_timeout=args.drain_timeout,
                         log_requests=not args.disable_log_requests)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    kv_bytes = args.kv_cache_memory_bytes
    if args.kv_cache_memory is not None:
        kv_bytes = int(args.kv_cache_memory * 1024**3)
    options = {
        "dtype": args.dtype, "device": args.device, "block_size": args.block_size,
        "num_blocks": args.num_blocks, "kv_cache_memory_bytes": kv_bytes,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "step_overhead_tokens": args.step_overhead_tokens,
        "max_model_len": args.max_model_len, "enable_prefix_caching": args.enable_prefix_caching,
        "attention_backend": args.attention_backend, "compile": args.compile,
        "compile_in_background": args.compile_in_background, "seed": args.seed,
        "compile_flat_steps": args.compile_flat_steps,
        "compile_cpp_wrapper": args.compile_cpp_wrapper,
        "single_row_matvec": args.single_row_matvec, "matvec_kernel": args.matvec_kernel,
        "few_rows_loop": args.few_rows_loop,
        "merge_projections": args.merge_projections,
        "pack_linear_weights": args.pack_linear_weights,
        "speculative_config": args.speculative_config,
        "tensor_parallel_size": args.tensor_parallel_size}
    return EngineConfig(**({"model": args.model} if args.model else {}), **options)


def main(argv: list[str] | None = None) -> int:
    """Load the model, serve until Ctrl-C / SIGTERM, exit 0."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), datefmt="%H:%M:%S",
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    names = args.served_model_name or [args.model or TINY_MODEL_NAME]
    config = engine_config(args)
    engine = AsyncEngine(lambda: LLMEngine(config), args.max_waiting_requests)
    engine.start()  # loads (and warms up) the model in the thread that will step it
    if os.environ.get("MINIVLLM_FAULT_INJECT"):  # tests only: see inject_faults
        for spec in os.environ["MINIVLLM_FAULT_INJECT"].split(","):  # point:marker,...
            inject_faults(engine.engine, spec)
    if os.environ.get("MINIVLLM_TEST_HOLD_FILE"):  # tests only: see hold_while
        hold_while(engine.engine, os.environ["MINIVLLM_TEST_HOLD_FILE"])
    app = build_app(engine, names, f"minivllm serving {names[0]} on http://{args.host}:{args.port}",
                    server_options(args))
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port,
                                           log_level=args.log_level, timeout_graceful_shutdown=5),
                            app.state.guard)
    # uvicorn re-raises the signal that stopped it once it is done; with these handlers in
    # place that re-raise is a no-op, so Ctrl-C and SIGTERM end the process with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 0
