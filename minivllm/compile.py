# Generated from solutions/07_compiled_decode.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The compiled decode step: embedding through sampling as one compiled function.

Built in notebook 07_compiled_decode. After Milestone 6 a decode step of a small model is
dominated not by arithmetic but by overhead: hundreds of small eager PyTorch ops, each a
Python call and a kernel launch, plus Python that builds slot mappings and masks per
sequence. Here the whole per-token pipeline is a pure function of a few tensors:

    input_ids (B,), seq_lens (B,), block_tables (B, NB)
      ─▶ positions = seq_lens - 1, slots from the block tables      (on the device)
      ─▶ model forward with paged decode attention                  (one graph)
      ─▶ logits ─▶ temperature / top-k / top-p / min-p ─▶ inverse-CDF draw

and ``torch.compile`` turns it into fused kernels (inductor C++ on CPU, Triton on CUDA), with
dynamic shapes so that a new batch size or context length does not recompile. On CUDA the
graph is also captured as CUDA graphs (``mode="reduce-overhead"``) for bucketed batch sizes
and block counts: inputs are padded up to the bucket, so each bucket replays one graph.

Padding rows (to reach a bucket, or at least 2 rows so that dynamo never specialises on a
batch of 1) point at a *scratch block* the block manager never hands out: their writes land
there and their outputs are dropped.

A step that holds a prompt chunk (a prefill, or decodes beside a chunk) is a flat batch of T
tokens whose attention needs notebook 06's groups and masks, built in Python per step. There
each layer is compiled *around* its attention call (``CompiledFlatStep``): the norms,
projections, RoPE and MLP as two graphs with T symbolic, shared by every layer, and notebook
06's attention eagerly between them.

The engine reaches all of it through ``CompiledRunner``, the ``ModelRunner`` variant that
``EngineConfig`` selects (``minivllm.engine.RUNNER_VARIANTS["compiled"]``): it merges the
projections when it loads the model and, for a bf16 model on a CPU, packs the linears'
weights into oneDNN's layout once (``PackedLinear``, as vLLM's CPU backend does), runs
every pure-decode step through the compiled graph and every other step through the flat
step's graphs (a platform where compiling fails takes notebook 03's eager path).
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.symbolic_shapes import statically_known_true

from minivllm.attention import attend_decode, gather_blocks
from minivllm.config import MATVEC_KERNELS, cpu_flags, release_freed_memory
from minivllm.kv_cache import AttentionMetadata
from minivllm.model import MLP, Attention, AttentionFn, apply_rope, rope_cos_sin
from minivllm.runner import ModelRunner, num_prompt_tokens
from minivllm.sampling import (
    GREEDY_EPS,
    Sampler,
    SamplerOutput,
    SamplingParams,
    greedy_tokens,
    inverse_cdf,
    mask_min_p,
    mask_top_k,
    mask_top_p,
    process_logits,
    uniform_draws,
)
from minivllm.scheduler import RunnerOutput, SchedulerOutput, Sequence

logger = logging.getLogger("minivllm.compile")


def compile_enabled_by_default() -> bool:
    """``MINIVLLM_COMPILE=0`` switches compilation off everywhere (it is on by default)."""
    return os.environ.get("MINIVLLM_COMPILE", "1").lower() not in ("0", "false", "no", "off")


def decode_slots(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool slot of each row's new token, on the device: (B, NB), (B,) -> (B,)."""
    block = block_tables.gather(1, (positions // block_size).unsqueeze(1)).squeeze(1)
    return block * block_size + positions % block_size


@torch.library.custom_op("minivllm::write_kv", mutates_args=("kv",))
def write_kv(kv: torch.Tensor, layer_idx: int, slots: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """One step's keys and values (B, n_kv, D) into layer ``layer_idx`` of the pool
    (2, L, num_slots, n_kv, D) at ``slots`` (B,), in place, as one opaque op.

    Why opaque on CUDA: inductor tries several launch configurations of a new Triton kernel
    and, so that the trials leave no trace, first saves every buffer the kernel writes: a
    clone on the GPU, or, where that would raise the peak, a copy in pinned host memory. A
    kernel that wrote into the pool would save the whole pool, and a pool sized to the GPU's
    memory fits neither (on an H200 beside a 124 GiB pool the 0.5B model's compile asked for
    124 GiB of pinned host memory, failed with "CUDA error: out of memory", and the engine
    fell back to eager). Inductor calls a custom op as is, never tuning it."""
    kv[0, layer_idx].index_copy_(0, slots, k)
    kv[1, layer_idx].index_copy_(0, slots, v)


@write_kv.register_fake
def _write_kv_shape(kv, layer_idx, slots, k, v) -> None:
    return None


class DecodeAttention:
    """Paged attention for one new token per row, built from tensors only (no Python lists)."""

    def __init__(self, kv: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, block_size: int, opaque_write: bool | None = None):
        self.kv = kv  # (2, L, num_slots, n_kv, D): the whole pool
        # write_kv on CUDA; on a CPU inductor fuses the write into its C++ loop, and nothing
        # is tuned or cloned (a test sets it to check the op on a CPU too)
        self.opaque_write = kv.is_cuda if opaque_write is None else opaque_write
        self.slots = slots  # (B,)
        self.block_tables = block_tables  # (B, NB)
        self.block_size = block_size
        key_pos = torch.arange(block_tables.shape[1] * block_size, device=slots.device)
        self.mask = (key_pos < seq_lens.unsqueeze(1)).view(seq_lens.shape[0], 1, 1, -1)  # (B,1,1,K)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.opaque_write:
            write_kv(self.kv, layer_idx, self.slots, k, v)
        else:
            # Write through the pool tensor itself, not a per-layer view of it: compiled, an
            # in-place write into a *view* of a graph input becomes a copy of the whole pool.
            layer = torch.full_like(self.slots, layer_idx)
            self.kv.index_put_((torch.zeros_like(self.slots), layer, self.slots), k)
            self.kv.index_put_((torch.ones_like(self.slots), layer, self.slots), v)
        keys_cache, values_cache = self.kv[0, layer_idx], self.kv[1, layer_idx]
        keys = gather_blocks(keys_cache, self.block_tables, self.block_size)  # (B, n_kv, K, D)
        values = gather_blocks(values_cache, self.block_tables, self.block_size)
        return attend_decode(q.unsqueeze(1), keys, values, self.mask).squeeze(1)  # (B, H, D)


def decode_logits(model: torch.nn.Module, kv: torch.Tensor, input_ids: torch.Tensor,
                  seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """One decode step of the model: (B,) tokens with (B,) context lengths -> (B, V) logits."""
    positions = seq_lens - 1  # the new token's position
    slots = decode_slots(block_tables, positions, block_size)
    attn = DecodeAttention(kv, slots, block_tables, seq_lens, block_size)
    hidden = model(input_ids, positions, attn)  # (B, hidden)
    return model.compute_logits(hidden)  # (B, V) float32


def sample_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, u: torch.Tensor,
                  use_filters: bool) -> torch.Tensor:
    """Batched sampling with the (B,) uniforms drawn outside (so per-request seeds work):
    (B, V) logits -> (B,) token ids."""
    greedy = greedy_tokens(logits)  # notebook 03's argmax
    scaled = logits / temperature.clamp(min=GREEDY_EPS).unsqueeze(-1)
    if use_filters:
        scaled = mask_min_p(mask_top_p(mask_top_k(scaled, top_k), top_p), min_p)
    sampled = inverse_cdf(scaled.softmax(dim=-1), u)  # notebook 03's draw
    return torch.where(temperature < GREEDY_EPS, greedy, sampled)


@dataclass
class DecodeInputs:
    """Host-side description of a decode batch (what CompiledRunner hands over)."""

    input_ids: list[int]
    seq_lens: list[int]  # context length including the new token
    block_tables: list[list[int]]


def bucket(n: int, on_cuda: bool, minimum: int = 2) -> int:
    """Rows/blocks to pad to: at least ``minimum`` (2 avoids dynamo's 0/1 specialisation);
    powers of two on CUDA."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length() if on_cuda else n


def _dynamic(t: torch.Tensor, *dims: int) -> torch.Tensor:
    """Tell dynamo these sizes vary from call to call, so it never specialises on them."""
    for dim in dims:
        torch._dynamo.mark_dynamic(t, dim)
    return t


@torch.library.custom_op("minivllm::matvec", mutates_args=())
def matvec(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(1, K) row times the (N, K) weight -> (1, N), through torch.mv.

    A custom op, so that inductor calls it as it is: it would lower ``torch.mv`` to a loop
    of its own or to ``mm``, both slower for one bf16 row on a CPU."""
    return torch.mv(weight, x[0]).unsqueeze(0)


@matvec.register_fake
def _matvec_shape(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(1, weight.shape[0])  # what the compiler needs: shape, dtype, device


@torch.library.custom_op("minivllm::materialise", mutates_args=())
def materialise(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied by an op inductor cannot see into, so that ``x`` is computed into a
    buffer of its own before the next kernel reads it.

    Inductor inlines the producer of a matvec's input into the matvec's loop over the
    weight's rows: the lm_head's loop would recompute the final RMSNorm for every one of
    its 151,936 rows (9.7 ms against 6.5 ms with the input ready, on a Zen 4), the down
    projection's would recompute SiLU(gate) * up. The copy costs one row."""
    return x.clone()


@materialise.register_fake
def _materialise_shape(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def bf16_pairs_as_float32(lanes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 lanes holding two bf16 numbers each -> (the even ones, the odd ones) as float32.

    A bf16 number is the top half of a float32. Little-endian, lane i holds element 2i in its
    low 16 bits and element 2i + 1 in its high 16 bits: shifted left by 16, the lane *is*
    element 2i as a float32; with its low 16 bits cleared, it is element 2i + 1. One integer
    op each, where converting a bf16 vector to float32 takes a widening shuffle and a shift."""
    return (lanes << 16).view(torch.float32), (lanes & -65536).view(torch.float32)


# float32 numbers in one vector register (AVX-512: 16, AVX2 and others: 8): loop_matvec's
# partial sums a row. Measured with 8 on AVX2; 16 on AVX-512 is the same shape, unmeasured.
FLOAT32_LANES = 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8
PLAIN_LOOP_DTYPES = (torch.bfloat16, torch.float32)  # weights loop_matvec has a loop of its own for
# bf16 numbers a float32 row's loop reads per step from a weight held in bf16 (a float32 model
# whose weights are bf16 numbers: narrow_plain_weights): one vector register of them, two of
# float32 once widened. Measured with 16 on AVX2; 32 on AVX-512 is the same shape, unmeasured.
BF16_WEIGHT_LANES = 2 * FLOAT32_LANES
# A float32 decode step of up to this many rows reads its linears' plain weights through
# inductor's loop, one loop a row fused into one pass over each weight, which reads and widens
# each weight once for all rows; at 16 rows oneDNN's packed kernel is the faster (issue 30,
# twenty-second, twenty-third and twenty-eighth parts)
LOOP_MAX_ROWS = 8
# The row counts of CompiledDecoder's few-rows graphs, by the model's dtype. float32: 2 rows as
# they are, 3-4 padded to 4, 5-8 to 8 (a 2-row step padded to 4 took 65.5 ms, unpadded 47.5, on
# a Zen 3: one_row_routes.py --parts few). bf16: 2 rows only. On a Zen 4 (avx512_bf16) oneDNN's
# bf16 kernel took a 2-row step 1.2-1.5x as long as a 4-row one, and the loop 0.64-0.71x the
# packed step at 2 rows, but 1.03x at 3 and 1.7x at 8: bf16 products are cheap for oneDNN there
# (vdpbf16ps), not for the loop
FEW_ROWS_BUCKETS = {torch.float32: (2, 4, LOOP_MAX_ROWS), torch.bfloat16: (2,)}
# Up to this many rows the loop over a bf16 weight keeps BF16_WEIGHT_LANES partial sums a row
# (two AVX2 registers), beyond it FLOAT32_LANES (one): AVX2's sixteen vector registers then hold
# all eight rows' sums. On a Zen 2 the lm_head's loop took 22.7 ms for 8 rows with one register
# a row, 26.7 with two; a one-row step with one register 1.17x the time of two
WIDE_SUMS_MAX_ROWS = 4


def loop_matvec(x: torch.Tensor, weight: torch.Tensor,
                bf16_lanes: int = BF16_WEIGHT_LANES) -> torch.Tensor:
    """(1, K) row times the (N, K) weight -> (1, N), written for inductor to lower to its own
    loop over the weight's rows, on the row materialised first. A bf16 weight (K even) is
    read as int32 lanes, two numbers each (``bf16_pairs_as_float32``), and the products
    summed in float32. A float32 weight (K a multiple of ``FLOAT32_LANES``) is summed as that
    many partial sums a row, then their total: inductor's loop over the weight is the one it
    writes for ``torch.mv``, yet on an AVX2 Zen 3 it streamed the 0.5B model's float32 weights
    1.2x faster so while memory was fast, 1.03-1.1x while slow (issue 30's seventeenth part).
    A bf16 weight beside a float32 row (a float32 model's weight held in bf16 by
    ``narrow_plain_weights``) is widened to float32 as it is read, ``bf16_lanes`` partial
    sums a row (fewer where many rows' loops share the registers: ``WIDE_SUMS_MAX_ROWS``): half
    the bytes of the float32 weight, the same numbers. Any other weight is
    ``torch.mv``. Compiled only."""
    row = materialise(x)[0]  # (K,)
    n, k = weight.shape
    if weight.dtype == torch.bfloat16 and row.dtype == torch.float32:
        if k % bf16_lanes:
            return torch.mv(weight.float(), row).unsqueeze(0)
        products = (weight.view(n, -1, bf16_lanes).float()  # (N, K/L, L) float32
                    * row.view(-1, bf16_lanes))
        return products.sum(1).sum(-1).unsqueeze(0)  # (N, L) partial sums -> (1, N)
    if weight.dtype == torch.float32 and k % FLOAT32_LANES == 0:
        products = weight.view(n, -1, FLOAT32_LANES) * row.view(-1, FLOAT32_LANES)  # (N, K/L, L)
        return products.sum(1).sum(-1).unsqueeze(0)  # (N, L) partial sums -> (1, N)
    if weight.dtype != torch.bfloat16 or k % 2 or sys.byteorder != "little":
        return torch.mv(weight, row).unsqueeze(0)
    w_even, w_odd = bf16_pairs_as_float32(weight.view(torch.int32))  # (N, K/2) each
    x_even, x_odd = bf16_pairs_as_float32(row.view(torch.int32))  # (K/2,) each
    return (w_even * x_even + w_odd * x_odd).sum(-1).to(weight.dtype).unsqueeze(0)  # (1, N)


def choose_matvec_kernel(requested: str = "auto",
                         flags: frozenset[str] | None = None) -> tuple[str, str]:
    """The kernel for one bf16 row on this CPU, and why: ``"mv"`` (torch.mv, kept whole by
    the ``matvec`` custom op) or ``"inductor"`` (torch.mv left to inductor, which writes its
    own loop for it). Measured on the 0.5B model's lm_head: an AMX Xeon reads the weight at
    ~20 GiB/s through torch.mv and ~11 through inductor's loop; a Zen 5 (avx512_bf16, no
    AMX) at ~12 through torch.mv and ~30 through inductor's loop. So AMX decides. A packed
    float32 model follows the same choice (``CompiledRunner.keep_plain_weights``): on an
    AVX2-only Zen 3 its 97 linears took 42 ms through ``loop_matvec`` against 59 through
    oneDNN's packed kernel at one row (fast memory; 76 against 82 in a slow state)."""
    if requested != "auto":  # EngineConfig checked it; use_matvec_for_single_rows does too
        return requested, "as configured (matvec_kernel)"
    flags = cpu_flags() if flags is None else flags
    if "amx_bf16" in flags:
        return "mv", "this CPU has AMX (amx_bf16): torch.mv streams a bf16 weight fastest there"
    return "inductor", ("this CPU has no AMX: inductor's own loop streams a bf16 weight "
                        "fastest there")


class SingleRowLinear(nn.Linear):
    """``nn.Linear`` whose one-row bf16 CPU inputs take a matrix-vector kernel: ``matvec``
    (torch.mv, whole) or, with ``kernel = "inductor"``, ``loop_matvec`` (torch.mv in the graph
    for inductor to lower to its own loop; eagerly, that kernel is ``F.linear``: eager
    torch.mv is the slower of the two on the CPUs where inductor's loop wins)."""

    kernel = "mv"  # set per module by use_matvec_for_single_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.bfloat16 and not x.is_cuda:
            if self.kernel == "mv":  # eagerly torch.mv itself: see PackedLinear.forward
                out = (matvec(x, self.weight) if torch.compiler.is_compiling()
                       else torch.mv(self.weight, x[0]).unsqueeze(0))  # (1, out_features)
            elif torch.compiler.is_compiling():
                out = loop_matvec(x, self.weight)  # (1, out_features): inductor's loop
            else:
                return F.linear(x, self.weight, self.bias)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


def use_matvec_for_single_rows(model: nn.Module, kernel: str = "mv") -> int:
    """Turn every ``nn.Linear`` of a bf16 CPU model into a ``SingleRowLinear`` taking
    ``kernel`` for one row, in place (the class only: same weights, same state dict). Returns
    how many were turned; 0 for float32 or CUDA models, which keep ``F.linear``."""
    if kernel not in MATVEC_KERNELS:
        raise ValueError(f"kernel must be one of {MATVEC_KERNELS}, got {kernel!r}")
    weight = next(model.parameters())
    if weight.dtype != torch.bfloat16 or weight.is_cuda:
        return 0
    linears = [m for m in model.modules() if type(m) in (nn.Linear, SingleRowLinear)]
    for module in linears:
        module.__class__ = SingleRowLinear
        module.kernel = kernel
    return len(linears)


class MergedLinear(nn.Module):
    """Linears that read the same input, as one matmul: their weights stacked along the output
    dimension, the one output split back into the parts (views, no copy).

    vLLM loads q/k/v this way (``QKVParallelLinear``) and gate/up (``MergedColumnParallelLinear``).
    The stacked weight is a plain ``nn.Linear``, so ``use_matvec_for_single_rows`` still finds it."""

    def __init__(self, parts: list[nn.Linear]) -> None:
        super().__init__()
        biased = {p.bias is not None for p in parts}
        if len(biased) != 1 or len({p.in_features for p in parts}) != 1:
            raise ValueError("merged linears need one input size and a bias on all or none")
        self.sizes = [p.out_features for p in parts]
        weight = torch.cat([p.weight for p in parts])  # (sum of the parts' outputs, in)
        self.linear = nn.Linear(weight.shape[1], weight.shape[0], bias=biased.pop(), device="meta")
        self.linear.weight = nn.Parameter(weight, requires_grad=False)
        if self.linear.bias is not None:
            self.linear.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)  # (T, out_i) for each part


class MergedQKVAttention(Attention):
    """``Attention`` whose q, k and v come from one matmul."""

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qkv_proj(x)  # (T, Hq*D), (T, Hkv*D), (T, Hkv*D)


class MergedMLP(MLP):
    """SwiGLU whose gate and up come from one matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)  # (T, intermediate) each
        return self.down_proj(F.silu(gate) * up)


def merge_projections(model: nn.Module) -> int:
    """Merge each layer's q/k/v and gate/up linears in place (the class swapped, the old
    weights freed). Returns how many matmuls a forward pass no longer makes: 3 per layer,
    0 for a model whose parts are not ``nn.Linear`` (tensor-parallel shards) or already merged."""
    saved, merged_weights = 0, set()
    for module in list(model.modules()):
        if type(module) is Attention:
            names, merged_name, merged_cls = ("q_proj", "k_proj", "v_proj"), "qkv_proj", MergedQKVAttention
        elif type(module) is MLP:
            names, merged_name, merged_cls = ("gate_proj", "up_proj"), "gate_up_proj", MergedMLP
        else:
            continue
        parts = [getattr(module, name) for name in names]
        if not all(isinstance(p, nn.Linear) for p in parts):
            continue
        merged = MergedLinear(parts)
        setattr(module, merged_name, merged)
        merged_weights.update(id(p) for p in merged.parameters())
        for name in names:
            delattr(module, name)  # the separate weights go: merging costs no memory
        module.__class__ = merged_cls
        saved += len(names) - 1
    if saved:
        # A bf16 checkpoint loaded in bf16 stays a memory map of the file: the pages that
        # torch.cat read would stay resident (RSS) while any other weight keeps the file
        # mapped. Copying the rest out unmaps it, so the model holds its weights once.
        for p in model.parameters():
            if id(p) not in merged_weights:
                p.data = p.data.clone()
    return saved


_PACKED_WEIGHTS: dict[int, torch.Tensor] = {}  # PackedLinear.handle -> its packed weight
_next_handle = itertools.count()


@torch.library.custom_op("minivllm::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, handle: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """(..., K) rows times the weight packed under ``handle`` -> (..., N), through oneDNN.

    A custom op taking an index: the packed weight is an opaque ``torch._mkldnn`` tensor
    that dynamo cannot trace, and inductor's own lowering of ``_linear_pointwise`` accepts
    only weights frozen into the graph. The index is a 0-d tensor, not an int: dynamo would
    bake an int into the graph as a constant, and a graph of one layer (``CompiledFlatStep``)
    could then not serve the next. ``tolist()`` reads it without letting go of the GIL:
    ``int(handle)`` does (it is ``item()``), and in the server a step would then wait on the
    HTTP thread once per linear."""
    return _packed_matmul(x, handle.tolist(), bias)


def _packed_matmul(x: torch.Tensor, handle: int, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED_WEIGHTS[handle], bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x, handle, out_features, bias):
    return x.new_empty(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """A bf16 or float32 CPU ``nn.Linear`` whose weight was reordered once into oneDNN's
    blocked layout (vLLM's CPU linears do the same). The plain weight is gone (a tied one, the
    lm_head's, stays with the module it is shared with) unless ``keep_plain_weight``: then
    ``weight`` keeps it, and a compiled one-row step reads it through inductor's loop
    (``loop_matvec``), which streams a bf16 or float32 weight faster than oneDNN on CPUs
    without AMX; so does each row of a graph whose row count is a constant of at most
    ``LOOP_MAX_ROWS`` (``CompiledDecoder``'s few-rows graph). A float32 one may later become
    a bf16 copy of itself, the same numbers (``narrow_plain_weights``)."""

    ROWS_HINT = 32  # the batch oneDNN blocks the layout for; measured: it changes little

    def __init__(self, linear: nn.Linear, keep_plain_weight: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.element_size = linear.weight.element_size()  # 2 in bf16, 4 in float32
        self.bias = linear.bias
        self.register_parameter("weight", linear.weight if keep_plain_weight else None)
        self.handle = next(_next_handle)
        _PACKED_WEIGHTS[self.handle] = torch.ops.mkldnn._reorder_linear_weight(
            linear.weight.detach(), self.ROWS_HINT)
        weakref.finalize(self, _PACKED_WEIGHTS.pop, self.handle, None)  # freed with the module
        # the same index as a buffer: an input of a compiled graph, not a constant of it
        self.register_buffer("handle_tensor", torch.tensor(self.handle), persistent=False)

    @property
    def packed_bytes(self) -> int:
        return self.in_features * self.out_features * self.element_size  # the same bytes, reordered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            rows = x.shape[0] if x.dim() == 2 else None
            # a static row count alone (a symbolic one is never compared: that would guard it)
            if (self.weight is not None and rows is not None
                    and statically_known_true(rows <= LOOP_MAX_ROWS)):
                # One row, or a few-rows graph's (CompiledDecoder): inductor's loop over the
                # plain weight for each row; it fuses the rows' loops into one pass over it
                if rows == 1:
                    out = loop_matvec(x, self.weight)  # (1, out)
                else:  # fewer sums a row where many rows' sums share the vector registers
                    # (a float32 row over a bf16 copy; a bf16 row's pairs loop takes no lanes)
                    lanes = BF16_WEIGHT_LANES if rows <= WIDE_SUMS_MAX_ROWS else FLOAT32_LANES
                    out = torch.cat([loop_matvec(x[i:i + 1], self.weight, lanes)
                                     for i in range(rows)])  # (rows, out)
                return out if self.bias is None else out + self.bias  # (rows, out)
            # (..., out): one opaque kernel for inductor
            return packed_linear(x, self.handle_tensor, self.out_features, self.bias)
        # Eagerly, the op itself: a custom op's first eager call imports torch._dynamo, and
        # that import racing the compile thread's own fails (a circular import, half done).
        return _packed_matmul(x, self.handle, self.bias)

    def extra_repr(self) -> str:
        plain = ", plain weight for one row" if self.weight is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, packed{plain}"


def can_pack_linear_weights(model: nn.Module) -> bool:
    """Whether ``pack_linear_weights`` applies: a float32 model on a CPU with oneDNN, or a bf16
    one where oneDNN does bf16. (float32 too: on an AMD CPU ``F.linear`` in float32 is MKL's,
    2-3.5x slower at decode sizes than oneDNN on the packed weight.)"""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16
                                             and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_linear_weights(model: nn.Module, keep_plain_weights: bool = False,
                        each: Callable[[PackedLinear], object] | None = None) -> int:
    """Swap every ``nn.Linear`` of a bf16 or float32 CPU model (merged ones too) for a
    ``PackedLinear``, in place, each keeping its plain weight too with ``keep_plain_weights``
    (for the one-row loop: the linears' bytes once more, bar a tied lm_head's), and handing
    it to ``each`` once it is in place (``CompiledRunner`` narrows its plain weight there, so
    float32 weights go one at a time, not all at the end). Returns how many; 0 where
    ``can_pack_linear_weights`` says no."""
    if not can_pack_linear_weights(model):
        return 0
    # (parent, name) pairs, not the linears: a list of them would keep every plain weight
    # alive until the last one is packed
    places = [(parent, name) for parent in model.modules()
              for name, child in parent.named_children()
              if type(child) in (nn.Linear, SingleRowLinear)]
    for parent, name in places:
        packed = PackedLinear(getattr(parent, name), keep_plain_weights)
        setattr(parent, name, packed)  # the plain linear goes (its weight with it, unless kept)
        if each is not None:
            each(packed)
    return len(places)


HUGE_PAGE_BYTES = 2 * 1024**2  # a transparent huge page on x86-64 (and arm64 with 4 KiB pages)


def transparent_huge_pages() -> bool:
    """Whether this kernel backs a mapping that asks for it (``madvise``) with huge pages."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()  # e.g. "always [madvise] never"
    except OSError:  # not Linux, or no THP in this kernel
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and "[never]" not in mode


def move_to_huge_pages(tensors: list[torch.Tensor]) -> int:
    """Copy CPU ``tensors`` (each once, however often listed) into one anonymous mapping
    advised for transparent huge pages, and point them at their copies (``.data``: the same
    objects and numbers, new memory). Returns the bytes moved: 0 without THP."""
    unique = list({id(t): t for t in tensors}.values())
    if not unique or not transparent_huge_pages():
        return 0
    nbytes = [t.numel() * t.element_size() for t in unique]
    starts = [0]
    for n in nbytes[:-1]:
        starts.append(starts[-1] + -(-n // 64) * 64)  # each copy 64-byte aligned
    arena = mmap.mmap(-1, starts[-1] + nbytes[-1] + HUGE_PAGE_BYTES,
                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(arena, dtype=torch.uint8)  # holds the mapping while in use
    base = -memory.data_ptr() % HUGE_PAGE_BYTES  # the first copy starts on a huge page
    for t, start, n in zip(unique, starts, nbytes):
        copy = memory[base + start:base + start + n].view(t.dtype).view(t.shape)
        copy.copy_(t.data)
        t.data = copy
        # notebook 01's config.py: the old copy's pages back to the system now, not after
        # the last (glibc keeps a freed buffer of a few MiB in its heap), so that the old
        # copies and the new ones are never all resident at once
        release_freed_memory()
    return sum(nbytes)


def holds_only_bf16_numbers(weight: torch.Tensor) -> bool:
    """Whether every number of a float32 ``weight`` is a bf16 number too: a bf16 number is
    the top half of a float32, so its low 16 bits are zero. Checked a slice at a time (no
    full-size temporary)."""
    bits = weight.detach().reshape(-1).view(torch.int32)
    return not any(torch.any(piece & 0xFFFF) for piece in bits.split(2**22))


def narrow_plain_weights(modules: list[nn.Module]) -> int:
    """Hold in bf16 each float32 plain weight of ``modules`` (the packed linears' copies for
    the one-row loop) whose numbers are all bf16 numbers, as every weight of a checkpoint
    saved in bf16 is (Qwen's are): the same numbers in half the bytes, which ``loop_matvec``
    widens to float32 as it reads them. A weight shared with another module (the tied lm_head
    is the embedding) is copied, not changed: the embedding stays float32. Returns the bytes
    of the bf16 copies."""
    narrowed = 0
    for module in modules:
        weight = module.weight
        if (weight is None or weight.dtype != torch.float32 or weight.device.type != "cpu"
                or weight.shape[-1] % BF16_WEIGHT_LANES or not holds_only_bf16_numbers(weight)):
            continue
        module.weight = nn.Parameter(weight.detach().to(torch.bfloat16), requires_grad=False)
        narrowed += module.weight.numel() * 2
    if narrowed:  # a bf16 model, or float32 numbers: nothing was freed
        release_freed_memory()  # the float32 copies nothing else holds
    return narrowed


class WideningEmbedding(nn.Module):
    """A float32 model's embedding table held in bf16, where every number of it is a bf16
    number (``narrow_embedding``): each row looked up is widened back to float32, the very
    numbers the float32 table held, from half its bytes."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight  # (vocab, hidden) bf16

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight).float()  # (T,) -> (T, hidden) float32

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}, held in bf16, read as float32"


def narrow_embedding(model: nn.Module) -> int:
    """Swap a float32 CPU model's embedding for a ``WideningEmbedding`` over a bf16 copy of
    its table, where every number of it is a bf16 number. A tied lm_head that was packed
    keeping its plain weight for the one-row loop (``PackedLinear``) reads that same copy
    (``loop_matvec`` widens it): one bf16 table where there were a float32 one and a bf16 copy
    (``narrow_plain_weights`` alone copies a shared weight). A tied lm_head that still
    multiplies the float32 table itself (an unpacked ``nn.Linear``) needs it: then nothing
    changes. Returns the bytes of the bf16 table (0: left alone)."""
    embedding, head = model.model.embed_tokens, model.lm_head
    weight = embedding.weight
    if (type(embedding) is not nn.Embedding or weight.dtype != torch.float32
            or weight.device.type != "cpu" or weight.shape[-1] % BF16_WEIGHT_LANES):
        return 0
    tied = head.weight is weight
    if (tied and not isinstance(head, PackedLinear)) or not holds_only_bf16_numbers(weight):
        return 0
    table = nn.Parameter(weight.detach().to(torch.bfloat16), requires_grad=False)
    model.model.embed_tokens = WideningEmbedding(table)
    if tied:
        head.weight = table  # (vocab, hidden) bf16: the one-row loop's plain weight
    del embedding, weight
    release_freed_memory()  # the float32 table, nothing holds it now
    return table.numel() * 2


def guards_on_inputs(entries: list) -> list[bool]:
    """``torch.compile``'s ``guard_filter_fn``: keep dynamo's guards on the function's inputs
    (tensors' dtype, device, shape and strides; which sizes are symbolic; ints) and on the
    global state (grad and inference mode, default device), drop the ones on ``nn.Module``s,
    their parameters and on globals. Safe only where the model and the functions it calls
    never change after the warm-up and each compile keeps its graphs to itself
    (``compile_guarding_inputs``)."""
    return [not (entry.is_global or entry.orig_guard.source.is_unspecialized_nn_module())
            for entry in entries]


def compile_guarding_inputs(fn: Callable, dynamic: bool = True, mode: str | None = None,
                            cpp_wrapper: bool = False) -> Callable:
    """``torch.compile(fn, dynamic=..., mode=...)`` that checks only the inputs' guards
    (``guards_on_inputs``) before each call, its graphs kept apart from any other compile of
    ``fn`` in this process (``isolate_recompiles``: another engine, another model).

    ``cpp_wrapper``: each graph calls its kernels from C++ (inductor's ``cpp_wrapper``) instead
    of from a Python function, one call of a few microseconds per kernel fewer, with the GIL
    released in between. Its C++ is built as two files (``cpp_wrapper_build_separate``): the
    kernels at -O3, and at -O1 the function that calls them, thousands of lines of calls. On
    a Zen 2 the 0.5B shape's graphs took 585 s to build on an empty inductor cache this way,
    847 s as one file each at -O3 (and the 8-row graph's calls in Python), for steps of the
    same time. From a warm cache: seconds.

    On a CPU gcc may fuse a multiplication and the addition that takes its product into one
    FMA instruction (``-ffp-contract=fast``; inductor's default is off): the one-row loop's
    products and partial sums (``loop_matvec``) in half the instructions. On a Zen 2 decode
    steps of 1, 2 and 4 rows took 0.97, 0.95 and 0.92x the time; the logits moved by ~2e-6."""
    from torch._inductor import list_mode_options  # imported on first use, as torch.compile does

    # torch.compile takes a mode or options, not both: the options the mode stands for, and ours
    options = {**list_mode_options(mode or "default", dynamic), "guard_filter_fn": guards_on_inputs}
    options["cpp.enable_floating_point_contract_flag"] = "fast"
    if cpp_wrapper:
        options["cpp_wrapper"] = True
        options["cpp_wrapper_build_separate"] = True  # the calls at -O1, the kernels at -O3
    return torch.compile(fn, dynamic=dynamic, options=options, isolate_recompiles=True)


def before_attention(layer: nn.Module, x: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder layer up to its attention call: x (T, hidden) -> q (T, Hq, D), k, v (T, Hkv, D)."""
    attn, t = layer.self_attn, x.shape[0]
    q, k, v = attn.project_qkv(layer.input_layernorm(x))
    q = q.view(t, attn.n_heads, attn.head_dim)
    k = k.view(t, attn.n_kv_heads, attn.head_dim)
    v = v.view(t, attn.n_kv_heads, attn.head_dim)
    if hasattr(attn, "q_norm"):  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def after_attention(layer: nn.Module, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """The rest of the layer: x (T, hidden), attention's output (T, Hq, D) -> x (T, hidden)."""
    x = x + layer.self_attn.o_proj(attn_out.flatten(1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def flat_hidden(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionFn, before: Callable = before_attention,
                after: Callable = after_attention,
                rows: torch.Tensor | None = None) -> torch.Tensor:
    """The model's forward, each layer as ``before`` -> ``attn`` -> ``after``: (T,) -> (T,
    hidden), or (R, hidden) for ``rows`` (R,) alone.

    Given ``rows`` (the step's logits rows), the last layer runs past its attention for
    those rows only: every row's keys and values, all that later tokens read, are in the
    pool once its attention has run, and the other rows' outputs would feed nothing but the
    final norm and the lm_head. Its out projection and MLP are ~4 % of a 24-layer model's
    weights, multiplied by every row of a prompt chunk (llama.cpp skips them the same way)."""
    x = model.model.embed_tokens(input_ids)  # (T, hidden)
    cos, sin = rope_cos_sin(positions, model.config.head_dim, model.config.rope_theta)
    *layers, last = model.model.layers
    for layer in layers:
        q, k, v = before(layer, x, cos, sin)
        x = after(layer, x, attn(layer.self_attn.layer_idx, q, k, v))
    q, k, v = before(last, x, cos, sin)
    out = attn(last.self_attn.layer_idx, q, k, v)  # (T, Hq, D); the pool holds every row's k/v
    if rows is not None:
        if rows.numel() == 0:  # no logits wanted: a prompt's chunk before its last
            return x.new_empty(0, x.shape[-1])
        x, out = x[rows], out[rows]  # (R, hidden), (R, Hq, D)
    return model.model.norm(after(last, x, out))


def final_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The lm_head on a step's logits rows: (R, hidden) -> (R, V) float32, for
    ``CompiledFlatStep.logits`` to compile."""
    return model.compute_logits(hidden)


class CompiledFlatStep:
    """Any step's flat batch (prompt chunks, decodes, or both: T new tokens) through the model
    with the two halves of every layer compiled (``flat_hidden``); attention stays eager. On
    a CPU one row's logits are compiled too (``logits``)."""

    def __init__(self, model: nn.Module, attention: Callable[[AttentionMetadata], AttentionFn]):
        self.model = model
        self.attention = attention  # a step's metadata -> its attention function (notebook 06)
        self._before = compile_guarding_inputs(before_attention)
        self._after = compile_guarding_inputs(after_attention)
        on_cpu = next(model.parameters()).device.type == "cpu"
        self._one_row_logits = compile_guarding_inputs(final_logits) if on_cpu else None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, hidden) -> (R, V) float32. One row on a CPU through its compiled graph, whose
        lm_head reads the plain weight through the one-row loop as the decode step's does (a
        packed lm_head that kept one; otherwise the same kernel as eagerly); any other
        number of rows eagerly: oneDNN's packed matmul either way."""
        if self._one_row_logits is None or hidden.shape[0] != 1:
            return self.model.compute_logits(hidden)
        return self._one_row_logits(self.model, hidden)  # (1, V)

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        """(T,) ids and positions, T >= 2 -> (T, hidden), or (R, hidden) for ``rows``,
        writing the step's k/v through attn."""
        return flat_hidden(self.model, input_ids, positions, attn, self._before, self._after,
                           rows)

    @torch.inference_mode()  # the engine steps in inference mode: compile for that mode
    def warmup(self, block_size: int, scratch_block: int, device: torch.device) -> float:
        """Compile both graphs: one new token beside a 10-token chunk (T = 11, a size no other
        dimension has), every k/v written into the scratch block; then the last layer's
        ``after`` for one row, a graph of its own (dynamo specialises a size of 1), and that
        row's logits: a lone prompt's step wants one row's logits."""
        start = time.perf_counter()
        table = [scratch_block] * -(-10 // block_size)  # every block of both: the scratch block
        metadata = AttentionMetadata.build([table, table], [0, 0], [1, 10], block_size, device,
                                           pad_block=scratch_block)
        positions = torch.tensor([0, *range(10)], device=device)
        for rows in ([0, 10], [10]):  # two rows (the symbolic graph), then one
            hidden = self.hidden(torch.zeros(11, dtype=torch.long, device=device), positions,
                                 self.attention(metadata), torch.tensor(rows, device=device))
        self.logits(hidden)  # (1, hidden): the one-row logits graph
        seconds = time.perf_counter() - start
        logger.info("compile warm-up: the flat step (prefill and mixed batches): %.1f s", seconds)
        return seconds


class CompiledDecoder:
    """Owns the compiled decode functions and pads batches into their buckets; given the
    runner's attention (``flat_attention``), the compiled flat step for every other step too."""

    def __init__(self, model: torch.nn.Module, kv: torch.Tensor, block_size: int,
                 scratch_block: int, device: torch.device, single_row_matvec: bool = True,
                 matvec_kernel: str = "auto",
                 flat_attention: Callable[[AttentionMetadata], AttentionFn] | None = None,
                 cpp_wrapper: bool = True, few_rows_loop: bool = True):
        self.model, self.kv, self.block_size = model, kv, block_size
        self.flat = CompiledFlatStep(model, flat_attention) if flat_attention else None
        self.scratch_block = scratch_block
        self.device = device
        self.on_cuda = device.type == "cuda"
        # One bf16 row on a CPU: the model's linears take a matvec kernel (SingleRowLinear)
        kernel, why = choose_matvec_kernel(matvec_kernel)
        self.matvec_linears = use_matvec_for_single_rows(model, kernel) if single_row_matvec else 0
        self.matvec_kernel = kernel if self.matvec_linears else None
        if self.matvec_linears:
            logger.info("one-row bf16 steps: %d linears take %s (%s)", self.matvec_linears,
                        "torch.mv" if kernel == "mv" else "inductor's own matvec loop", why)
        # Packed linears that kept their plain weight (CompiledRunner, on a CPU without AMX)
        self.plain_weight_linears = sum(isinstance(m, PackedLinear) and m.weight is not None
                                        for m in model.modules())
        if self.plain_weight_linears:
            logger.info("one-row steps: %d packed linears read their plain weight through "
                        "inductor's own matvec loop (%s)", self.plain_weight_linears, why)
        # A CPU batch of 1 is not padded to 2 rows: a 2-row matmul leaves the matrix-vector
        # path (the 0.5B lm_head: 82 ms for 2 rows vs 34 ms for 1), so batch 1 gets its own
        # specialised graph, compiled in the warm-up. CUDA graphs keep buckets of >= 2.
        self.min_rows = 2 if self.on_cuda else 1
        mode = "reduce-overhead" if self.on_cuda else None  # CUDA graphs on CUDA
        if self.on_cuda:
            # The graph writes k/v into the pool, an input. CUDA graph trees replay only graphs
            # whose mutated inputs keep their address (parameters, buffers); any other mutated
            # input makes them skip the CUDA graph. The pool never moves, so say so (guard=False:
            # no guard on the pool's identity; each engine compiles graphs of its own anyway).
            torch._dynamo.mark_static_address(kv, guard=False)
        # The pool's K/V axis, layers, KV heads and head size never change: constants of every
        # graph. Left to dynamic=True they are symbols, and dynamo's duck sizing gave the K/V
        # axis (2) and a first block table of width 2 one symbol, so the next width compiled
        # the one-row graph again (on a Zen 2: 110 s of a cold start, 12 s of a warm one). Its
        # block count stays dynamic: engines with other pool sizes share inductor's cached code.
        for dim in (0, 1, 3, 4):  # (2, L, num_slots, n_kv, D)
            torch._dynamo.mark_static(kv, dim)
        # On a CPU the decode graphs call their ~300 kernels from C++ (``cpp_wrapper``): ~1 ms
        # of a 25-38 ms one-row step here. Not the flat step's 48 small graphs a step, where the
        # C++ entry cost more than it saved; not CUDA, where the graphs replay as CUDA graphs.
        self.cpp_wrapper = cpp_wrapper and not self.on_cuda
        self._logits = compile_guarding_inputs(decode_logits, mode=mode,
                                               cpp_wrapper=self.cpp_wrapper)
        # A float32 batch of 2..LOOP_MAX_ROWS rows (bf16: 2) where the packed linears kept
        # their plain weights: padded to the next of its FEW_ROWS_BUCKETS, through a graph of that
        # row count, static, so that each row takes the one-row loop (PackedLinear): at a few
        # rows oneDNN's kernel runs far below its rate, and the loop reads each weight once for
        # all rows.
        self.few_rows_buckets = (FEW_ROWS_BUCKETS.get(kv.dtype, ()) if few_rows_loop
                                 and self.plain_weight_linears and not self.on_cuda else ())
        if self.few_rows_buckets:
            self._many_rows = self._logits
            # one graph per bucket: its inputs' row dimension marked static
            # (_few_or_many_rows), the rest dynamic
            self._few_rows = compile_guarding_inputs(decode_logits, cpp_wrapper=self.cpp_wrapper)
            self._logits = self._few_or_many_rows
        self._sample = torch.compile(sample_logits, dynamic=True)
        self.compile_seconds = 0.0

    def logits(self, batch: DecodeInputs) -> torch.Tensor:
        """(B, V) logits for the real rows of the batch."""
        rows = len(batch.input_ids)
        padded_rows = bucket(rows, self.on_cuda, self.min_rows)
        width = bucket(max(len(t) for t in batch.block_tables), self.on_cuda)
        scratch = self.scratch_block
        tables = [t + [scratch] * (width - len(t)) for t in batch.block_tables]
        tables += [[scratch] * width] * (padded_rows - rows)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)
        if self.on_cuda:  # a new step: the last step's outputs (in the graphs' pool) are done
            torch.compiler.cudagraph_mark_step_begin()
        logits = self._logits(self.model, self.kv, as_tensor(batch.input_ids + [0] * (padded_rows - rows)),
                              as_tensor(batch.seq_lens + [1] * (padded_rows - rows)),
                              as_tensor(tables), self.block_size)
        return logits[:rows]

    def _few_or_many_rows(self, model: nn.Module, kv: torch.Tensor, input_ids: torch.Tensor,
                          seq_lens: torch.Tensor, block_tables: torch.Tensor,
                          block_size: int) -> torch.Tensor:
        """``decode_logits`` compiled: 2..LOOP_MAX_ROWS rows padded to the next of
        ``few_rows_buckets`` (padding rows as ``logits`` pads: the scratch block, a seq_len of
        1) through that bucket's few-rows graph, any other count through the other graphs.
        (B,) ids, (B,) lens, (B, NB) tables -> (B, V)."""
        rows = input_ids.shape[0]
        padded = next((b for b in self.few_rows_buckets if rows <= b), None)
        if rows == 1 or padded is None:
            return self._many_rows(model, kv, input_ids, seq_lens, block_tables, block_size)
        pad = padded - rows
        inputs = (F.pad(input_ids, (0, pad)), F.pad(seq_lens, (0, pad), value=1),
                  torch.cat([block_tables, block_tables.new_full((pad, block_tables.shape[1]),
                                                                 self.scratch_block)]))
        for t in inputs:  # the row count a constant of the graph: PackedLinear's loop per row
            torch._dynamo.mark_static(t, 0)
        return self._few_rows(model, kv, *inputs, block_size)[:rows]

    def sample(self, logits: torch.Tensor, params: list, u: torch.Tensor) -> torch.Tensor:
        """Tokens for (B, V) logits with (B,) uniforms drawn by the caller."""
        rows = len(params)
        pad = bucket(rows, self.on_cuda, self.min_rows) - rows  # padded rows: greedy, dropped
        if pad:
            logits = torch.cat([logits, logits.new_zeros(pad, logits.shape[1])])
            u = torch.cat([u, u.new_zeros(pad)])

        def column(values: list, dtype: torch.dtype, fill) -> torch.Tensor:
            return _dynamic(torch.tensor(values + [fill] * pad, dtype=dtype, device=self.device), 0)

        use_filters = any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in params)
        tokens = self._sample(_dynamic(logits, 0),
                              column([p.temperature for p in params], torch.float32, 0.0),
                              column([p.top_k for p in params], torch.long, 0),
                              column([p.top_p for p in params], torch.float32, 1.0),
                              column([p.min_p for p in params], torch.float32, 0.0),
                              _dynamic(u, 0), use_filters)
        return tokens[:rows]

    @torch.inference_mode()  # the engine decodes in inference mode: compile for that mode
    def warmup(self, vocab_size: int) -> float:
        """Compile every graph up front: batch 1 (its own graph on CPU) at two table widths,
        each few-rows graph (``few_rows_buckets``) likewise, then two larger batch shapes, which
        make the sizes dynamic; then the flat step's two."""
        from torch._dynamo.utils import counters  # dynamo is loaded by now (torch.compile)

        start = time.perf_counter()
        # (rows, table width, what the log calls it): each few-rows bucket takes the row
        # counts above the bucket below it
        shapes = [(1, width, "1") for width in (2, 3)] if self.min_rows == 1 else []
        below = (1, *self.few_rows_buckets)
        for low, rows in zip(below, self.few_rows_buckets):
            what = f"{rows}" if low + 1 == rows else f"{low + 1}-{rows} (padded to {rows})"
            shapes += [(rows, width, what) for width in (2, 3)]
        many = below[-1] + 1
        shapes += [(many, 2, f"{many}+ (dynamic)"), (many + 1, 3, f"{many}+ (dynamic)")]
        for rows, width, what in shapes:
            shape_start, graphs_before = time.perf_counter(), counters["stats"]["unique_graphs"]
            batch = DecodeInputs([0] * rows, [1] * rows, [[self.scratch_block] * width] * rows)
            logits = self.logits(batch)
            u = torch.full((rows,), 0.5, dtype=torch.float64, device=self.device)
            for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=5)):
                self.sample(logits, [params] * rows, u)
            if self.on_cuda:
                torch.cuda.synchronize(self.device)
            # the second width of a batch compiles nothing: the table width is dynamic
            logger.info("compile warm-up: batch %s, block table %d: %.1f s, %d new graphs", what,
                        width, time.perf_counter() - shape_start,
                        counters["stats"]["unique_graphs"] - graphs_before)
        if self.flat is not None:
            self.flat.warmup(self.block_size, self.scratch_block, self.device)
        self.compile_seconds = time.perf_counter() - start
        logger.info("compiled the decode step in %.1f s (inductor's cache: %s)",
                    self.compile_seconds, _inductor_cache_dir())
        return self.compile_seconds


def _inductor_cache_dir() -> str:
    """Where inductor keeps compiled kernels between runs (a second start reuses them)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except Exception:  # noqa: BLE001 -- private API: the log line only
        return "unknown"


def _warn_eager(exc: Exception) -> None:
    warnings.warn(f"torch.compile is unavailable here ({type(exc).__name__}: {exc}); "
                  "running the decode step eagerly (set MINIVLLM_COMPILE=0 to skip trying)",
                  RuntimeWarning, stacklevel=3)


def try_compile(model: torch.nn.Module, kv: torch.Tensor, block_size: int, scratch_block: int,
                device: torch.device, vocab_size: int, single_row_matvec: bool = True,
                matvec_kernel: str = "auto",
                flat_attention: Callable[[AttentionMetadata], AttentionFn] | None = None,
                cpp_wrapper: bool = True, few_rows_loop: bool = True) -> CompiledDecoder | None:
    """A warmed-up CompiledDecoder, or None (with one clear warning) where compiling fails."""
    try:
        decoder = CompiledDecoder(model, kv, block_size, scratch_block, device, single_row_matvec,
                                  matvec_kernel, flat_attention, cpp_wrapper, few_rows_loop)
        decoder.warmup(vocab_size)
        return decoder
    except Exception as exc:  # noqa: BLE001 (any failure to compile means: run eager)
        _warn_eager(exc)
        return None


class BackgroundWarmup:
    """A CompiledDecoder's warm-up in a thread of its own, so that the engine serves eagerly
    while inductor compiles, and takes the compiled step between two steps once it is built.

    ``build`` makes the CompiledDecoder in the thread too (``torch.compile`` imports dynamo,
    1.5 s here), after the runner switched the linears to ``SingleRowLinear`` itself, before
    serving: so the thread only wraps, traces and compiles. The one change it makes that
    the eager steps see is ``CompiledRunner``'s packing of the weights (``PackedLinear``),
    which computes what the plain linears did. Its warm-up batches write into the scratch block alone, which no sequence
    ever holds. What it raises is kept in ``error``, for the runner to report.

    While it runs, the interpreter switches threads every ``switch_interval_s`` instead of
    every 5 ms. Every eager PyTorch op lets go of the GIL and must win it back, and dynamo's
    tracing is Python that never lets go on its own: at 5 ms per hand-over, a 16-token
    request on the bundled model took 13.9 s beside a busy Python thread instead of 0.09 s
    alone; at 0.2 ms it took 0.30 s (docs/decisions.md, issue 31)."""

    switch_interval_s = 0.0002

    def __init__(self, build: Callable[[], CompiledDecoder], vocab_size: int) -> None:
        self.decoder: CompiledDecoder | None = None  # once built
        self.error: Exception | None = None
        self.started = time.perf_counter()
        self._default_switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self.switch_interval_s, self._default_switch_interval))
        self._thread = threading.Thread(target=self._run, args=(build, vocab_size),
                                        name="minivllm-compile", daemon=True)
        self._thread.start()

    def _run(self, build: Callable[[], CompiledDecoder], vocab_size: int) -> None:
        try:
            decoder = build()
            decoder.warmup(vocab_size)
            self.decoder = decoder
        except Exception as exc:  # noqa: BLE001 -- reported by the runner, which stays eager
            self.error = exc
        finally:
            sys.setswitchinterval(self._default_switch_interval)

    def done(self, timeout: float | None = 0.0) -> bool:
        """Whether the warm-up has ended (waiting up to ``timeout`` s; None: until it has)."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


class CompiledRunner(ModelRunner):
    """``ModelRunner`` with merged projections and the compiled decode step (notebook 07):
    ``EngineConfig.compile`` / ``merge_projections`` select it (``engine.RUNNER_VARIANTS``).

    With ``EngineConfig.compile_in_background`` (the default) the runner is ready as soon as
    the weights and the pool are: it runs every step eagerly while a ``BackgroundWarmup``
    compiles, and ``decoder`` becomes the compiled step between two steps once it is built.

    ``EngineConfig.pack_linear_weights`` packs a CPU model's linears for oneDNN
    (``pack_linear_weights``, ~2 s for the 0.5B model here): in that thread too when it
    compiles in the background, else before the first step. A packed linear computes what
    the plain one did, so eager steps meanwhile may run with some linears packed. Where the
    compiled one-row step reads inductor's loop (no AMX), the plain weights stay beside the
    packed ones (``keep_plain_weights``), moved into huge pages (``move_to_huge_pages``).

    ``EngineConfig.compile_flat_steps`` compiles the flat step too (``CompiledFlatStep``),
    with the decode step and swapped in with it: every step that is not a pure decode runs
    its layers through it (``hidden_states``), attention eagerly between the two halves."""

    def __init__(self, config, *args) -> None:
        super().__init__(config, *args)  # loads (and merges) the model, sizes the pool
        use_compile = compile_enabled_by_default() if config.compile is None else config.compile
        self._decoder: CompiledDecoder | None = None  # None: every step runs eagerly
        self._warmup: BackgroundWarmup | None = None  # the compile under way, if any
        self.compile_seconds = 0.0  # the warm-up's own time
        self.compiled_after_s: float | None = None  # from the start of compiling to the swap
        self.eager_steps_while_compiling = 0
        one_row_kernel = choose_matvec_kernel(config.matvec_kernel)[0]
        # Packing keeps the plain weights too where a compiled one-row step reads them through
        # inductor's loop (CPUs without AMX): the linears' bytes twice, 0.67 GiB more on 0.5B
        # in bf16, 1.33 GiB in float32 (0.67 where they are bf16 numbers: the tied lm_head's
        # is then the embedding's own bf16 table; narrow_embedding, narrow_plain_weights)
        self.keep_plain_weights = bool(use_compile and config.single_row_matvec
                                       and one_row_kernel == "inductor"
                                       and next(self.model.parameters()).dtype in PLAIN_LOOP_DTYPES)
        self.huge_page_bytes = 0  # of those weights, moved into huge pages (prepare_weights)
        self.narrowed_bytes = 0  # of float32 weights held in bf16 (narrow_embedding and
        # narrow_plain_weights: the embedding's table, the plain weights kept for one row)
        if use_compile and config.compile_in_background:
            if config.single_row_matvec:  # now, before serving, not in the thread
                use_matvec_for_single_rows(self.model, one_row_kernel)
            self._warmup = BackgroundWarmup(self._pack_then_build, self.model_config.vocab_size)
            logger.info("compiling the decode step in the background; steps run eagerly "
                        "until it is built")
            return
        self.prepare_weights()
        if use_compile:
            self._decoder = try_compile(self.model, self.pool.kv, config.block_size,
                                        self.num_blocks, self.device,
                                        self.model_config.vocab_size,
                                        single_row_matvec=config.single_row_matvec,
                                        matvec_kernel=config.matvec_kernel,
                                        flat_attention=self._flat_attention(),
                                        cpp_wrapper=config.compile_cpp_wrapper,
                                        few_rows_loop=config.few_rows_loop)
            if self._decoder is not None:
                self.compile_seconds = self.compiled_after_s = self._decoder.compile_seconds

    def pack_weights(self) -> int:
        """Pack the linears' weights for oneDNN when configured (and a bf16 CPU model). A
        plain weight kept for the one-row loop is narrowed as soon as its linear is packed
        (``narrow_plain_weights``): the float32 weights then go one at a time, and the
        start-up high-water mark is lower by their bytes. A tied lm_head's waits for
        ``narrow_embedding``, which gives it the embedding's own bf16 table."""
        if not self.config.pack_linear_weights:
            return 0
        started = time.perf_counter()
        table = self.model.model.embed_tokens.weight  # a tied lm_head's plain weight

        def narrow(module: PackedLinear) -> None:
            if module.weight is not None and module.weight is not table:
                self.narrowed_bytes += narrow_plain_weights([module])

        if packed := pack_linear_weights(self.model, self.keep_plain_weights,
                                         narrow if self.keep_plain_weights else None):
            gib = sum(m.packed_bytes for m in self.model.modules() if isinstance(m, PackedLinear))
            logger.info("packed %d linears' weights for oneDNN: %.2f GiB in %.1f s%s", packed,
                        gib / 2**30, time.perf_counter() - started,
                        " (their plain weights kept for one-row steps)"
                        if self.keep_plain_weights else "")
        return packed

    def prepare_weights(self) -> None:
        """``pack_weights``; then a float32 embedding of bf16 numbers into bf16
        (``narrow_embedding``); where a compiled one-row step streams the plain weights
        through inductor's loop (``keep_plain_weights``), float32 ones that hold only bf16
        numbers into bf16 too (``narrow_plain_weights``), and all of them into huge pages."""
        self.narrowed_bytes = 0
        self.pack_weights()  # narrows the kept plain weights as it packs them
        # before the rest: a tied lm_head takes the embedding's table, not a copy of its own
        self.narrowed_bytes += narrow_embedding(self.model)
        if self.keep_plain_weights:  # what packing left (a tied lm_head's, the embedding kept)
            packed = [m for m in self.model.modules() if isinstance(m, PackedLinear)]
            self.narrowed_bytes += narrow_plain_weights(packed)
        if self.narrowed_bytes:
            logger.info("float32 weights held as bf16 (they are all bf16 numbers), read as "
                        "float32: %.2f GiB", self.narrowed_bytes / 2**30)
        if not self.keep_plain_weights:
            return
        started = time.perf_counter()
        plain = [m.weight for m in self.model.modules()
                 if isinstance(m, (nn.Linear, PackedLinear)) and m.weight is not None
                 and m.weight.dtype in PLAIN_LOOP_DTYPES and m.weight.device.type == "cpu"]
        if moved := move_to_huge_pages(plain):
            logger.info("moved the one-row loop's weights into huge pages: %.2f GiB in %.1f s",
                        moved / 2**30, time.perf_counter() - started)
        self.huge_page_bytes = moved

    def _pack_then_build(self) -> CompiledDecoder:
        """The background thread's work before its warm-up: the weights, then the decoder."""
        self.prepare_weights()
        c = self.config
        return CompiledDecoder(self.model, self.pool.kv, c.block_size, self.num_blocks,
                               self.device, c.single_row_matvec, c.matvec_kernel,
                               self._flat_attention(), c.compile_cpp_wrapper, c.few_rows_loop)

    def _flat_attention(self) -> Callable[[AttentionMetadata], AttentionFn] | None:
        """What the flat step attends with (notebook 06's backend over this pool), or None
        when ``compile_flat_steps`` is off."""
        if not self.config.compile_flat_steps:
            return None
        return lambda metadata: self.attention_cls(self.pool, metadata)

    @property
    def decoder(self) -> CompiledDecoder | None:
        """The compiled decode step, or None while it is being built (or where it failed).
        Read between steps only: this is where a finished background compile swaps in."""
        if self._warmup is not None and self._warmup.done():
            self._swap_in()
        return self._decoder

    @property
    def decode_step(self) -> str:
        """How the next decode step runs: "compiling" (eagerly: the compile is under way),
        "compiled" or "eager". A read only, safe from any thread (the swap is ``decoder``'s)."""
        warmup = self._warmup
        if warmup is not None:
            if not warmup.done():
                return "compiling"
            return "eager" if warmup.error is not None else "compiled"
        return "compiled" if self._decoder is not None else "eager"

    def wait_until_compiled(self, timeout: float | None = None) -> bool:
        """Block until a background compile has ended (or ``timeout`` s); True once compiled.
        Between steps only, as ``decoder``: a benchmark calls it to measure the compiled step."""
        if self._warmup is not None:
            self._warmup.done(timeout)
        return self.decoder is not None

    def _swap_in(self) -> None:
        warmup, self._warmup = self._warmup, None
        if warmup.error is not None:
            _warn_eager(warmup.error)
            return
        self._decoder, self.compile_seconds = warmup.decoder, warmup.decoder.compile_seconds
        self.compiled_after_s = time.perf_counter() - warmup.started
        logger.info("the compiled decode step takes over: built %.1f s after compiling began "
                    "(%d steps ran eagerly meanwhile)", self.compiled_after_s,
                    self.eager_steps_while_compiling)

    def load_model(self, path) -> nn.Module:
        model = super().load_model(path)
        if self.config.merge_projections:  # q/k/v as one matmul, gate/up as one
            saved = merge_projections(model)  # 0 for tensor-parallel shards
            logger.info("merged projections: %d fewer matmuls per forward pass", saved)
        return model

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> RunnerOutput:
        """A pure-decode step (one new token per sequence, its last) through the compiled
        graph; any other step notebook 03's way, its layers through ``hidden_states``."""
        decoder = self.decoder  # read once: a swap lands between steps, never inside one
        if decoder is None or not all(
                n == 1 and s.num_computed_tokens + 1 == s.num_tokens for s, n in plan.scheduled):
            self.eager_steps_while_compiling += self._warmup is not None
            return super().execute(plan)
        seqs = [s for s, _ in plan.scheduled]
        batch = DecodeInputs([s.token_ids[-1] for s in seqs], [s.num_tokens for s in seqs],
                             [s.block_table for s in seqs])
        out = RunnerOutput(counters={  # a "decode" may be a prompt's last token
            "num_prompt_tokens_computed": num_prompt_tokens(plan.scheduled)})
        self.sample(decoder.logits(batch), seqs, out, sample_logits=self._sample_compiled)
        return out

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      attn: AttentionFn, rows: torch.Tensor) -> torch.Tensor:
        """Every step that is not a pure decode (notebook 03's ``forward`` calls this): the
        compiled flat step once it is built (its last layer past attention for ``rows``
        only), the eager model before that, without ``compile_flat_steps``, and for a step of
        one token (a graph of its own for T = 1)."""
        flat = self._flat_step
        if flat is None or input_ids.shape[0] < 2:
            return super().hidden_states(input_ids, positions, attn, rows)
        return flat.hidden(input_ids, positions, attn, rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of every step that is not a pure decode (notebook 03's ``forward``
        calls this): through the compiled flat step once it is built (``CompiledFlatStep.logits``:
        one row compiled, as the decode step's), notebook 03's way before that."""
        flat = self._flat_step
        if flat is None:
            return super().compute_logits(hidden)
        return flat.logits(hidden)

    @property
    def _flat_step(self) -> CompiledFlatStep | None:
        """The compiled flat step, once ``execute`` has swapped the compiled decoder in (None
        before that, or without ``compile_flat_steps``)."""
        return self._decoder.flat if self._decoder is not None else None

    def _sample_compiled(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """The compiled step's sampler: the logits processors beside the graph, eagerly, on
        the rows that ask; greedy batches skip the graph; logprobs of the raw logits."""
        params = [s.params for s in seqs]
        processed = process_logits(logits, params, [s.token_ids for s in seqs],
                                   [s.num_prompt_tokens for s in seqs],
                                   [self.banned_ids(s) for s in seqs])
        if all(p.is_greedy for p in params):
            tokens = greedy_tokens(processed)
        else:
            u = uniform_draws(len(seqs), [s.generator for s in seqs], self.device)
            tokens = self._decoder.sample(processed, params, u)
        return Sampler.logprobs(logits, tokens, params)  # of the raw logits, as vLLM
