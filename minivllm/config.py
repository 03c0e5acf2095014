# Generated from solutions/01_forward_pass.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""Configuration: what the checkpoint says (`ModelConfig`) and how to run it (`EngineConfig`).

Built in notebook 01_forward_pass.

A Hugging Face checkpoint directory carries its architecture in ``config.json``. We parse it
once into a frozen `ModelConfig` holding only the fields a Qwen2/Qwen3 decoder needs, and
fail loudly (naming the file and the key) on anything we do not support, instead of
silently computing a different model. `EngineConfig` holds the serving knobs the later
milestones use (KV-cache size, batch limits, attention backend); it is validated once.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch

from minivllm import TINY_MODEL as _TINY_MODEL  # the bundled checkpoint (the default)

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Qwen2 / Qwen3 decoder, parsed from ``config.json``."""

    model_type: str  # "qwen2" or "qwen3"
    vocab_size: int  # rows of the embedding table and of lm_head
    hidden_size: int  # width of the residual stream
    intermediate_size: int  # width of the MLP's hidden layer
    num_hidden_layers: int  # number of decoder layers
    num_attention_heads: int  # query heads per layer
    num_key_value_heads: int  # key/value heads per layer (GQA: fewer than query heads)
    head_dim: int  # width of one head (explicit in Qwen3; hidden_size // heads in Qwen2)
    rms_norm_eps: float  # epsilon inside every RMSNorm
    rope_theta: float  # RoPE base frequency
    max_position_embeddings: int  # longest context the model was trained for
    tie_word_embeddings: bool  # lm_head shares its weight with embed_tokens
    attention_bias: bool  # q/k/v projections carry a bias (always in Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    torch_dtype: str = "float32"  # dtype the checkpoint was saved in

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> ModelConfig:
        """Parse a config.json dictionary; `source` names the file in error messages."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: unsupported model_type {model_type!r}; "
                f"minivllm supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )

        def req(key: str):
            if key not in d or d[key] is None:
                raise ValueError(f"{source}: missing required key {key!r}")
            return d[key]

        if d.get("use_sliding_window"):
            raise ValueError(f"{source}: sliding-window attention is not supported")
        hidden, n_heads = int(req("hidden_size")), int(req("num_attention_heads"))
        qwen3 = model_type == "qwen3"
        return cls(
            model_type=model_type,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_hidden_layers=int(req("num_hidden_layers")),
            num_attention_heads=n_heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(d.get("head_dim") or hidden // n_heads),
            rms_norm_eps=float(req("rms_norm_eps")),
            rope_theta=_read_rope_theta(d, source),
            max_position_embeddings=int(req("max_position_embeddings")),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 configs do not carry `attention_bias`: Qwen2 always has q/k/v biases.
            attention_bias=bool(d.get("attention_bias", False)) if qwen3 else True,
            qk_norm=qwen3,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
        )

    @property
    def num_parameters(self) -> int:
        """Parameters of the decoder (embeddings, layers, norms, an untied lm_head)."""
        h, q, kv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        attention = h * (q + 2 * kv) * self.head_dim + q * self.head_dim * h
        attention += (q + 2 * kv) * self.head_dim if self.attention_bias else 0
        attention += h if self.attention_bias and self.qk_norm else 0  # Qwen3 biases o_proj too
        attention += 2 * self.head_dim if self.qk_norm else 0
        layer = attention + 3 * h * self.intermediate_size + 2 * h
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_hidden_layers * layer + h + lm_head

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Read ``<model_dir>/config.json``."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json in the checkpoint directory")
        return cls.from_dict(json.loads(path.read_text()), source=str(path))


def _read_rope_theta(d: dict, source: str) -> float:
    """RoPE base: top-level `rope_theta` (older configs) or `rope_parameters` (newer ones).

    Only plain ("default") RoPE is implemented; scaled variants (yarn, linear, dynamic...)
    change the frequencies, so computing them as plain RoPE would be silently wrong.
    """
    params = d.get("rope_parameters") or {}
    for scaling in (d.get("rope_scaling"), params):
        kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
        if kind != "default":
            raise ValueError(f"{source}: unsupported RoPE scaling type {kind!r}; only plain RoPE")
    theta = d.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ValueError(f"{source}: missing required key 'rope_theta'")
    return float(theta)


def read_eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """End-of-sequence ids: generation_config.json's `eos_token_id`, else config.json's."""
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ()


def resolve_model_path(model: str | Path) -> Path:
    """A local checkpoint directory as is; otherwise a hub id resolved via the HF cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt"]
    # Hub errors (not cached, not found, offline, invalid id) are OSError or ValueError.
    try:
        try:  # the cache first: no network round trip when the model is already here
            return Path(
                snapshot_download(str(model), allow_patterns=patterns, local_files_only=True)
            )
        except OSError:
            return Path(snapshot_download(str(model), allow_patterns=patterns))
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"{model!r} is neither a local checkpoint directory nor a hub id available in "
            f"the Hugging Face cache or for download ({type(e).__name__}: {e})"
        ) from None


def resolve_device(name: str) -> torch.device:
    """Device "auto" -> cuda when available, else cpu; anything else as torch spells it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def read_cpuinfo() -> str:
    """This CPU's description: /proc/cpuinfo, else ``lscpu`` (both write ``model name: ...``
    and ``flags: ...`` lines; Arm writes ``Features``), else "" (not Linux)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        pass
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                              check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


class CpuInfo(NamedTuple):
    """What /proc/cpuinfo (or lscpu) says of the first CPU."""

    name: str | None  # "model name": a VM's is often only "AMD EPYC"
    flags: frozenset[str]  # instruction-set extensions, as Linux names them
    generation: str | None  # x86: "family 25 model 17 stepping 1" (a Zen 4, not a Zen 5)


def parse_cpuinfo(cpuinfo: str) -> CpuInfo:
    """The first processor's ``CpuInfo`` from /proc/cpuinfo or lscpu text; the one parser
    that both dtype="auto" and the benchmark's record of the machine read."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower().replace("features", "flags")  # Arm says "Features"
        if key in ("model name", "flags", "cpu family", "model", "stepping"):
            fields.setdefault(key, value.strip())  # the first processor's line
    generation = None
    if "cpu family" in fields and "model" in fields:
        generation = f"family {fields['cpu family']} model {fields['model']}"
        if "stepping" in fields:
            generation += f" stepping {fields['stepping']}"
    return CpuInfo(fields.get("model name"), frozenset(fields.get("flags", "").split()),
                   generation)


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this CPU, as Linux names them in /proc/cpuinfo."""
    flags = parse_cpuinfo(read_cpuinfo()).flags
    if flags:
        return flags
    # not Linux: ask the probes torch itself uses to pick its kernels
    probes = {"avx2": "_is_avx2_supported", "avx512f": "_is_avx512_supported",
              "avx512_bf16": "_is_avx512_bf16_supported", "amx_tile": "_is_amx_tile_supported"}
    return frozenset(flag for flag, probe in probes.items()
                     if getattr(torch.cpu, probe, lambda: False)())


def release_freed_memory() -> None:
    """Hand the memory glibc keeps after frees back to the system (``malloc_trim(0)``).
    Freed tensors of a few MiB each stay in its heap otherwise, and the process looks larger
    than what it holds: notebook 07 calls it after moving weights, notebook 05's memory probe
    after its buffer, notebook 04's server once it has been idle for a second. Nothing where
    libc has no such call (not glibc)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # bf16 dot products / tiles in hardware
# EngineConfig.attention_backend: each name's class, by qualified name (resolve_qualname):
# notebook 02's per-sequence loop, or notebook 06's batched call per layer
ATTENTION_BACKENDS = {"loop": "minivllm.kv_cache:PagedAttention",
                      "batched": "minivllm.attention:BatchedAttention"}
MATVEC_KERNELS = ("mv", "inductor")  # EngineConfig.matvec_kernel: one of these, or "auto" (M7)
# Environment variables that keep a process below its CPU's instruction set, read once when
# each library loads: ATen's own kernels and inductor's generated C++ (ATEN_CPU_CAPABILITY),
# oneDNN, which runs the bf16 matmuls (ONEDNN_MAX_CPU_ISA), and MKL, which runs the float32
# ones (MKL_ENABLE_INSTRUCTIONS). With all three at AVX2, an AMX machine behaves like an
# AVX2-only one for every kernel torch picks (the memory and caches stay its own); but see
# docs/decisions.md (issue 15) before capping ATen: torch 2.13's compile warm-up crashed.
ISA_CAP_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
# the values of the first two below the bf16 instructions (MKL's cap touches float32 only)
_BELOW_NATIVE_BF16 = {
    "ATEN_CPU_CAPABILITY": {"default", "avx2"},
    "ONEDNN_MAX_CPU_ISA": {"sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2", "avx512_core",
                           "avx512_core_vnni"},
}


def isa_caps() -> dict[str, str]:
    """The instruction-set caps this process was started with, e.g.
    ``{"ONEDNN_MAX_CPU_ISA": "AVX2"}``; empty when every library may use the whole CPU."""
    return {name: os.environ[name] for name in ISA_CAP_VARIABLES if os.environ.get(name)}


def bf16_capped_by() -> list[str]:
    """The caps (``NAME=value``) that keep this process from the CPU's bf16 instructions."""
    return [f"{name}={value}" for name, value in isa_caps().items()
            if value.lower() in _BELOW_NATIVE_BF16.get(name, ())]


# Below this many parameters a one-user decode step is bound by per-op overhead, not by
# streaming the weights, and bf16 only adds conversions: on an AMX CPU the 4 M-parameter
# bundled model decodes one request 0.77x as fast in bf16 as in fp32, while 32 requests of
# the 494 M-parameter Qwen2.5-0.5B shape run 2.2x faster (docs/decisions.md).
BF16_MIN_PARAMETERS = 100_000_000


def auto_dtype(device: torch.device | str, model_config: ModelConfig) -> tuple[torch.dtype, str]:
    """What dtype "auto" means for this model on this device, and why (for the start-up log).

    On a GPU: the checkpoint's own dtype. On a CPU: bf16 only where it is faster — a bf16
    checkpoint, a CPU that executes bf16 in hardware (AVX512-BF16 or AMX), and a model large
    enough that reading the weights dominates a step; float32 otherwise (and float32 is also
    what the parity tests pin, since it matches `transformers` token for token).
    """
    saved = model_config.torch_dtype
    if torch.device(device).type != "cpu":
        return _DTYPES.get(saved, torch.float32), f"the checkpoint's dtype ({saved}) on a GPU"
    if saved != "bfloat16":
        return torch.float32, f"the checkpoint is saved in {saved}"
    native = [flag for flag in NATIVE_BF16_FLAGS if flag in cpu_flags()]
    if not native:
        return torch.float32, "this CPU has no native bf16 (no avx512_bf16 or amx_bf16 flag)"
    if capped := bf16_capped_by():
        return torch.float32, (f"this CPU has native bf16 ({', '.join(native)}) but the "
                               f"process is capped below it ({', '.join(capped)})")
    n = model_config.num_parameters
    if n < BF16_MIN_PARAMETERS:
        return torch.float32, (f"{n / 1e6:.0f} M parameters: too small for bf16 to pay "
                               f"(< {BF16_MIN_PARAMETERS / 1e6:.0f} M)")
    return torch.bfloat16, f"a bf16 checkpoint on a CPU with native bf16 ({', '.join(native)})"


def resolve_dtype(name: str, device: torch.device | str, model_config: ModelConfig) -> torch.dtype:
    """Dtype "auto" -> `auto_dtype`'s choice; anything else as named."""
    if name == "auto":
        return auto_dtype(device, model_config)[0]
    return _DTYPES[name]


@dataclass(frozen=True)
class EngineConfig:
    """How to run a model: the knobs of the engine, validated once."""

    model: str = field(default=_TINY_MODEL)  # checkpoint directory or hub id
    dtype: str = "auto"  # "auto" (see auto_dtype: bf16 where the CPU does it natively), ...
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
    block_size: int = 16  # tokens per KV-cache block
    num_blocks: int | None = None  # KV-cache blocks; None -> sized from the memory budget
    kv_cache_memory_bytes: int = 2 * 1024**3  # KV budget on a CPU (a GPU sizes by the next)
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory the engine may use
    max_num_seqs: int = 64  # most sequences running in one step
    max_num_batched_tokens: int | None = None  # most tokens in one step; None -> by device
    step_overhead_tokens: int | None = None  # M3: a step's fixed cost, for packing prompts; None -> by device
    max_model_len: int | None = None  # longest prompt+output; None -> the model's limit
    enable_prefix_caching: bool = True  # share KV blocks between identical prompt prefixes
    attention_backend: str = "batched"  # "batched" (one call per layer, M6) or "loop" (M2)
    compile: bool | None = None  # compile the decode step (M7); None -> $MINIVLLM_COMPILE, on
    compile_in_background: bool = True  # M7: serve eagerly until the compiled step is built
    compile_flat_steps: bool = True  # M7: prefill and mixed steps compiled around attention too
    compile_cpp_wrapper: bool = True  # M7: a compiled CPU decode step calls its kernels from C++
    single_row_matvec: bool = True  # M7: a compiled CPU step of one row: a matvec kernel
    few_rows_loop: bool = True  # M7: float32 steps of 2-8 rows (bf16: 2) take the one-row loop too
    matvec_kernel: str = "auto"  # M7: which one: "auto" (by the CPU), "mv" or "inductor"
    merge_projections: bool = True  # M7: q/k/v as one matmul, gate/up as one (as vLLM does)
    pack_linear_weights: bool = True  # M7: CPU linears' weights in oneDNN's layout (as vLLM)
    seed: int = 0  # default seed for sampling
    speculative_config: dict | str | None = None  # M8: {"method": "ngram", ...} or its JSON
    tensor_parallel_size: int = 1  # processes (GPUs) the model is split across (M9)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {list(_DTYPES)}, got {self.dtype!r}")
        positive = ("block_size", "max_num_seqs", "tensor_parallel_size")
        optional_positive = ("num_blocks", "kv_cache_memory_bytes", "max_model_len",
                             "max_num_batched_tokens")
        for name in positive + optional_positive:
            value = getattr(self, name)
            if (value is not None or name in positive) and (
                not isinstance(value, int) or value <= 0
            ):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        overhead = self.step_overhead_tokens
        if overhead is not None and (not isinstance(overhead, int) or overhead < 0):
            raise ValueError("step_overhead_tokens must be a non-negative integer (0: prompts "
                             f"always pack), got {overhead!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {tuple(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.matvec_kernel not in ("auto", *MATVEC_KERNELS):
            raise ValueError(f"matvec_kernel must be 'auto' or one of {MATVEC_KERNELS}, "
                             f"got {self.matvec_kernel!r}")

    def with_device_defaults(self, device: torch.device | str) -> EngineConfig:
        """This config with the defaults that depend on the device filled in; the engine
        calls it once, with the device it resolved (vLLM too picks some defaults by platform)."""
        filled = {}
        if self.max_num_batched_tokens is None:
            filled["max_num_batched_tokens"] = default_max_num_batched_tokens(device)
        if self.step_overhead_tokens is None:
            filled["step_overhead_tokens"] = default_step_overhead_tokens(device)
        return replace(self, **filled) if filled else self


def default_max_num_batched_tokens(device: torch.device | str) -> int:
    """A step's token budget when none is given: 2048 on a GPU, 512 on a CPU.

    A step with a prefill chunk lasts as long as the chunk takes, and every decoding sequence
    waits that long for its next token. A GPU prefills 2048 tokens of a 0.5B model in
    milliseconds; two CPU cores take over a second (bf16 on a Zen 4; ~10 s in float32 on an
    AVX2-only Zen 3), so a CPU step holds 512 (~0.3 s there, 2.4 s on the Zen 3).
    Prompts then finish their prefill a chunk at a time instead of all together at the end of
    a wave, which shortens time to first token, and throughput is unchanged: the linears
    run as fast per token at 512 rows as at 2048 (docs/decisions.md, issue 30)."""
    return 512 if torch.device(device).type == "cpu" else 2048


def default_step_overhead_tokens(device: torch.device | str) -> int:
    """What a step costs beyond its tokens, in tokens of prefill, when none is given: 16 on a
    CPU; 0 on a GPU, where it means "don't weigh: prompts pack up to the token budget".

    The scheduler uses it to decide whether waiting prompts share a step (notebook 03,
    *Packing prompts*). On a GPU a step of a 0.5B model costs about the same for 1 token as
    for 2048, so prompts always pack. On two CPU cores a step's time grows with its tokens
    from ~16 on (float32 here: 41 ms for 1 token, 143 for 16, 641 for 128, 2442 for 512, ~4.5
    ms a token past ~65 ms: about 16 tokens' worth), so two prompts in one step both wait for
    the two (docs/decisions.md, issue 30, twenty-fourth part)."""
    return 16 if torch.device(device).type == "cpu" else 0


def resolve_qualname(qualname: str):
    """``"package.module:name"`` -> that object, imported now (vLLM's
    ``resolve_obj_by_qualname``): how the engine reaches a later milestone's code only when
    a configuration asks for it, so that no module imports one of a later notebook."""
    module, _, name = qualname.partition(":")
    return getattr(importlib.import_module(module), name)
