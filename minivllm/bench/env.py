# Generated from solutions/05_benchmark.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The machine a benchmark runs on: what it is, and what else runs on it.

Built in notebook 05_benchmark. A result is only worth what is written next to it:
``environment()`` records the device, the CPU and its features, dtype, library versions,
model shape and git commit;
``Monitor`` samples, while a run lasts, the engine's peak memory and the CPU that *other*
processes used. On a 2-core machine a neighbour compiling something halves the numbers,
so every record carries ``load.busy`` and the table flags it. It also takes the machine's
memory read rate just before and just after the run (``memory_read_gbs``): a VM's memory
can be half as fast one minute as the next, with nothing else running inside it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import socket
import subprocess
import threading
import time
from pathlib import Path

import psutil

from minivllm.config import (
    NATIVE_BF16_FLAGS,
    cpu_flags,
    isa_caps,
    parse_cpuinfo,
    read_cpuinfo,
    release_freed_memory,
)

BUSY_CPU_PERCENT = 10.0  # other processes using more of the machine than this: invalid run
MEMORY_PROBE_BYTES = 256 * 2**20  # far beyond any CPU's caches: the read comes from memory


def memory_read_gbs(nbytes: int = MEMORY_PROBE_BYTES, repeats: int = 3) -> float:
    """How fast this machine reads memory right now, in GB/s: the best of ``repeats`` sums
    over a float32 buffer of ``nbytes``, on torch's threads.

    Not a constant on a VM. On the 2-core AMD EPYC of issue 30 it reads ~50–60 GB/s for a
    while, then ~30–35 (at times ~17) for seconds to minutes, with nothing else running
    inside the VM (its neighbours share the host's memory). A one-row decode step streams
    every weight once, so its time follows that state, whichever engine runs it; with the
    rate before and after each level in its record, two engines' levels can be compared
    knowing the state each one ran in."""
    import torch

    buffer = torch.ones(max(nbytes // 4, 1), dtype=torch.float32)  # written: resident
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    rate = buffer.numel() * 4 / max(best, 1e-9) / 1e9
    del buffer
    # Where earlier frees left a large enough hole in the heap (an in-process engine after its
    # warm-up), malloc placed the buffer there instead of in a mapping of its own, and freeing
    # it keeps its pages resident: the process's RSS, and so an in-process engine's recorded
    # peak, would grow by the probe. malloc_trim hands them back.
    release_freed_memory()
    return rate


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for p in processes:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


class Monitor:
    """While a run lasts: the peak memory of the engine and the CPU used by *others*.

    A thread samples every ``interval`` seconds the RSS of the engine process
    (``memory_pid``; with ``memory_kind="rss_tree"`` summed over its child processes too),
    or the GPU memory in use on the device when
    ``memory_kind="cuda_device_used"`` (for servers in other processes). At the end,
    ``other_cpu_percent`` is the machine's busy CPU time minus that of this benchmark's
    process tree (``root_pid`` and its descendants), as a percentage of all cores. Engines
    of the same benchmark that wait their turn (``idle_pids``, ``--interleave``) are not
    excluded: if they use the CPU while another engine runs, that is the others' load.
    Before the run starts and after it ends (outside its time and its memory samples), it
    takes ``memory_read_gbs`` of ``memory_probe_bytes`` (0: not at all).
    """

    def __init__(self, memory_pid: int | None, root_pid: int | None = None,
                 memory_kind: str | None = "rss", interval: float = 0.1,
                 idle_pids: tuple[int, ...] = (),
                 memory_probe_bytes: int = MEMORY_PROBE_BYTES) -> None:
        self.memory_pid, self.memory_kind, self.interval = memory_pid, memory_kind, interval
        self.memory_probe_bytes = memory_probe_bytes
        self.memory_read_gbs: list[float] = []  # [before, after] the run
        self.root_pid = root_pid or os.getpid()
        self.idle_pids = idle_pids  # engines of ours that wait meanwhile: their CPU is others'
        self.peak_memory_bytes: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_loop, daemon=True)

    def _memory(self) -> int | None:
        if self.memory_kind == "cuda_device_used":
            import torch

            free, total = torch.cuda.mem_get_info()
            return total - free
        if self.memory_kind == "rss" and self.memory_pid is not None:
            with contextlib.suppress(psutil.Error):
                return psutil.Process(self.memory_pid).memory_info().rss
        if self.memory_kind == "rss_tree" and self.memory_pid is not None:
            # a server of several processes (vLLM's front end and engine core): the sum of
            # their RSS, an upper bound (a library mapped by two of them counts twice)
            total = 0
            for p in _tree(self.memory_pid):
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
            return total or None
        return None

    def _our_cpu_seconds(self) -> float:
        """CPU time of this benchmark's process tree, less the engines waiting their turn."""
        idle = {p.pid for pid in self.idle_pids for p in _tree(pid)}
        return _cpu_seconds([p for p in _tree(self.root_pid) if p.pid not in idle])

    def _sample(self) -> None:
        value = self._memory()
        if value is not None:
            self.peak_memory_bytes = max(self.peak_memory_bytes or 0, value)

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def _probe_memory(self) -> None:
        if self.memory_probe_bytes:
            self.memory_read_gbs.append(memory_read_gbs(self.memory_probe_bytes))

    def __enter__(self) -> Monitor:  # noqa: PYI034 (typing.Self needs 3.11)
        self._probe_memory()
        self.loadavg_start = os.getloadavg()
        self._t0, self._sys0 = time.monotonic(), psutil.cpu_times()
        self._ours0 = self._our_cpu_seconds()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        wall, sys1 = time.monotonic() - self._t0, psutil.cpu_times()

        def busy(t) -> float:  # guest time is already inside user time
            return sum(getattr(t, k, 0.0) for k in
                       ("user", "nice", "system", "irq", "softirq", "steal"))

        others = busy(sys1) - busy(self._sys0) - (self._our_cpu_seconds() - self._ours0)
        cores = psutil.cpu_count() or 1
        self.other_cpu_percent = max(0.0, 100.0 * others / (wall * cores)) if wall > 0 else 0.0
        self.loadavg_end = os.getloadavg()
        self._probe_memory()

    def load(self) -> dict:
        """What the record stores about the machine's load during the run."""
        return {"loadavg_start": [round(x, 2) for x in self.loadavg_start],
                "loadavg_end": [round(x, 2) for x in self.loadavg_end],
                "other_cpu_percent": round(self.other_cpu_percent, 1),
                "busy": self.other_cpu_percent > BUSY_CPU_PERCENT,
                "memory_read_gbs": [round(x, 1) for x in self.memory_read_gbs]}


def model_summary(path: str | Path) -> dict:
    """The shape of a checkpoint (from config.json) and its parameter count (from the
    safetensors headers, without loading a tensor)."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    keys = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "vocab_size", "tie_word_embeddings")
    summary = {k: config.get(k) for k in keys}
    with contextlib.suppress(Exception):
        from safetensors import safe_open

        count = 0
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    shape = f.get_slice(name).get_shape()
                    count += math.prod(shape)
        summary["num_params"] = count
    return summary


def regular_vocab_size(path: str | Path) -> int:
    """Token ids below the first added (special) token: what random prompts draw from."""
    path, size = Path(path), 151643
    with contextlib.suppress(OSError, ValueError, KeyError):
        size = json.loads((path / "config.json").read_text())["vocab_size"]
    with contextlib.suppress(OSError, ValueError, KeyError):
        added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
        size = min([size, *(t["id"] for t in added)])
    return size


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[2]  # the repository
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                             timeout=10, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


# The ISA extensions that decide which dtype is fast on a CPU: float32 runs on AVX2/AVX-512
# FMAs everywhere, bfloat16 matmuls run natively only with AVX512-BF16 or AMX (elsewhere
# they are converted to float32 and back, slower than float32 itself).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16")  # last 3: Arm
# (avx_vnni tells a Zen 5 or a recent Intel core from a Zen 4, whose records look alike else)
BF16_FLAGS = NATIVE_BF16_FLAGS  # the rule dtype="auto" follows, so the record says what it saw


def cpu_features(cpuinfo: str | None = None) -> dict:
    """The CPU's model name and generation, which of ``CPU_FLAGS`` it has, and whether it
    executes bf16 natively: this machine's (the flags ``dtype="auto"`` reads,
    ``config.cpu_flags``), or those ``cpuinfo`` text describes (``config.parse_cpuinfo``,
    the same parser)."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    info = parse_cpuinfo(text)
    flags = cpu_flags() if cpuinfo is None else info.flags
    return {"model_name": info.name or platform.processor() or platform.machine(),
            "generation": info.generation,  # a VM's "AMD EPYC": a Zen 4 or a Zen 5?
            "flags": [f for f in CPU_FLAGS if f in flags],
            "native_bf16": any(f in flags for f in BF16_FLAGS)}


def device_name(device: str) -> str:
    """The GPU's name, or the CPU's model and core count."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"{cpu_features()['model_name']} ({psutil.cpu_count()} CPUs)"


def environment(model: str, device: str, dtype: str) -> dict:
    """Everything a result depends on besides the engine's own options. ``dtype`` is what the
    run asked for; each engine then records the dtype it actually ran."""
    import torch

    # dirty = code changed since the commit; the results files this run appends to do not count
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".",
                  ":(exclude)bench/results")
    return {"device": device, "device_name": device_name(device), "cpu": cpu_features(),
            "dtype": dtype, "dtype_requested": dtype,
            "torch": torch.__version__, "transformers": _version("transformers"),
            "vllm": _version("vllm"), "python": platform.python_version(),
            "hostname": socket.gethostname(), "cpu_count": psutil.cpu_count(),
            # an AMX machine told to behave like an AVX2 one says so (config.ISA_CAP_VARIABLES)
            "isa_caps": isa_caps(), "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads(), "model": str(model),
            "model_shape": model_summary(model), "git_commit": _git("rev-parse", "HEAD"),
            "git_dirty": bool(status) if status is not None else None}


def machine_line(env: dict) -> str:
    """``CPU: Intel Xeon (2 CPUs); bf16 native (avx512_bf16, amx_bf16)``: what the table's
    numbers ran on, and whether bf16 is fast there."""
    cpu = env.get("cpu") or {}
    bf16 = [f for f in cpu.get("flags", []) if f in BF16_FLAGS]
    native = f"bf16 native ({', '.join(bf16)})" if cpu.get("native_bf16") else \
        f"bf16 not native ({', '.join(cpu.get('flags', [])[:3]) or 'no vector flags found'})"
    gpu = f"; GPU: {env['device_name']}" if str(env.get("device", "")).startswith("cuda") else ""
    caps = env.get("isa_caps") or {}
    capped = "; capped: " + ", ".join(f"{k}={v}" for k, v in caps.items()) if caps else ""
    generation = f", {cpu['generation']}" if cpu.get("generation") else ""
    return (f"CPU: {cpu.get('model_name', '?')} ({env.get('cpu_count', '?')} CPUs{generation}, "
            f"{env.get('torch_threads', '?')} torch threads); {native}{capped}{gpu}")
