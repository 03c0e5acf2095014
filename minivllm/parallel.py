# Generated from solutions/09_tensor_parallel.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""Tensor parallelism: one model split across several processes, Megatron style.

Built in notebook 09_tensor_parallel. With ``tensor_parallel_size=N`` every weight matrix of
the decoder is cut into N shards and rank r holds shard r only, so each process needs about
1/N of the weights and 1/N of the KV cache:

* **column-parallel** (q/k/v, gate/up): rank r keeps a slice of the *output* features. Its
  output is a slice of the full output; nothing to communicate. Attention heads are output
  features of q/k/v, so rank r owns whole heads and attends over them alone.
* **row-parallel** (o_proj, down_proj): rank r keeps the slice of the *input* features that
  matches the column-parallel slice before it. Its product is a partial sum of the full
  product; one ``all_reduce`` (sum) per layer and projection makes it whole on every rank.
* **vocab-parallel** (embed_tokens, lm_head): rank r keeps a range of vocabulary rows. The
  embedding looks up the ids in its range (zeros elsewhere) and all-reduces; the head
  computes its slice of the logits and all-gathers them, so every rank sees all logits.

KV heads split like the query heads they serve; where there are fewer KV heads than ranks
(Qwen2.5-0.5B: 2 KV heads), each KV head is *replicated* on the ranks whose query heads
read it. Each rank reads only its slices from the safetensors files (``get_slice``).

Control: rank 0 is the engine (scheduler, sampler, requests) and its runner is a
``TensorParallelRunner``, the ``ModelRunner`` of notebook 03 with two methods that matter
changed: its ``load_model`` starts the workers and loads rank 0's shard, and its ``forward``
broadcasts the step's ``ModelInputs`` — one small int64 tensor of token ids, positions,
block tables and the rows whose logits are wanted — before running ``ModelRunner.forward``
itself. Each worker rank runs that same ``ModelRunner.forward`` on its shard, with a KV pool
of its own heads, and joins the collectives. The workers are spawned processes
(``torch.multiprocessing``), or the other ranks of a ``torchrun`` launch (``RANK`` /
``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn  # before any group exists: see TPGroup.leave
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from minivllm.config import ATTENTION_BACKENDS, EngineConfig, ModelConfig, resolve_qualname
from minivllm.engine import call_with_frame_room
from minivllm.model import QwenForCausalLM, _checkpoint_files, _skip_init, causal_attention
from minivllm.runner import ModelInputs, ModelRunner

logger = logging.getLogger("minivllm.parallel")


class TPGroup:
    """This process's place in the tensor-parallel group and the collectives the model uses.

    ``all_reduce`` sums a tensor over the ranks in place; ``all_gather`` concatenates every
    rank's tensor along the last axis, in rank order. The notebook's checks swap in a group
    of threads with the same two methods. ``group`` carries the model's collectives,
    ``control`` the step's inputs from rank 0 (both ``None`` outside a process group).
    """

    def __init__(self, rank: int, world_size: int, group=None, control=None) -> None:
        self.rank, self.world_size, self.group, self.control = rank, world_size, group, control

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def leave(self) -> None:
        """Destroy the process groups and let go of them, so that their threads stop now.

        ``destroy_process_group`` only unregisters a group: its gloo threads run until the
        last Python reference to it is gone. Dropping ours here joins them while the
        interpreter is whole; left to the interpreter's teardown at exit, a gloo thread
        still running can abort the process ("terminate called without an active
        exception") after its work is done. (That is also why this module imports
        ``torch.distributed.nn`` before any group exists: its functions' ``group=WORLD``
        defaults would otherwise hold the default group for the life of the process.)
        """
        if dist.is_initialized():
            dist.destroy_process_group()
        self.group = self.control = None


def allowed_sizes(config: ModelConfig) -> list[int]:
    """Every tensor_parallel_size this model can be split into."""
    return [n for n in range(1, config.num_attention_heads + 1) if not _split_problems(config, n)]


def _split_problems(config: ModelConfig, n: int) -> list[str]:
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    problems = []
    if heads % n:
        problems.append(f"{heads} attention heads are not divisible by {n}")
    if kv % n and n % kv:
        problems.append(f"{kv} KV heads neither divide into {n} shards nor replicate evenly "
                        f"over {n} ranks")
    if config.intermediate_size % n:
        problems.append(f"intermediate_size {config.intermediate_size} is not divisible by {n}")
    return problems


def check_tp_split(config: ModelConfig, world_size: int) -> None:
    """Refuse, before anything starts, a tensor_parallel_size the model cannot be split into."""
    problems = _split_problems(config, world_size) if world_size >= 1 else ["it must be >= 1"]
    if problems:
        raise ValueError(
            f"tensor_parallel_size={world_size} does not fit this model "
            f"({config.num_attention_heads} attention heads, {config.num_key_value_heads} KV "
            f"heads): {'; '.join(problems)}. Allowed sizes: "
            f"{', '.join(map(str, allowed_sizes(config)))}")


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """Vocabulary rows [start, stop) of a rank: ceil(V / N) each, the last rank fewer."""
    per = -(-vocab_size // world_size)
    return min(rank * per, vocab_size), min((rank + 1) * per, vocab_size)


def kv_head_range(n_heads: int, n_kv_heads: int, rank: int, world_size: int) -> tuple[int, int]:
    """KV heads [start, stop) that rank ``rank`` of ``world_size`` holds.

    Rank r owns query heads [r * n_heads/N, (r+1) * n_heads/N); query head h reads KV head
    h // (n_heads / n_kv_heads). With at least as many KV heads as ranks, each rank gets
    n_kv_heads / N of them; with fewer, one KV head serves several ranks and each of those
    ranks holds a copy of it.
    """
    if n_kv_heads >= world_size:
        per = n_kv_heads // world_size
        return rank * per, (rank + 1) * per
    ranks_per_head = world_size // n_kv_heads  # the ranks that share (replicate) one KV head
    head = rank // ranks_per_head
    return head, head + 1


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r: this rank's slice of the output features. No communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # (out/N, in)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)  # (T, out/N)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_r W_r^T) + b: the partial products of every rank, summed.

    ``x`` is this rank's slice of the input features (what the column-parallel layer before
    it produced); ``weight`` the matching columns of the full weight, (out, in/N). The bias
    is whole on every rank and added once, after the sum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # (out, in/N)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # (T, out): this rank's share of the sum
        self.tp.all_reduce(y)  # (T, out): the full product, on every rank
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocabulary rows [start, stop) (padded to ceil(V/N)); other ids read 0."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.stop = vocab_range(vocab_size, tp.rank, tp.world_size)
        per_rank = -(-vocab_size // tp.world_size)
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size))  # (ceil(V/N), hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        mine = (input_ids >= self.start) & (input_ids < self.stop)  # (T,)
        local = torch.where(mine, input_ids - self.start, 0)
        x = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(x)  # (T, hidden): exactly one rank contributed each row


class ParallelLMHead(nn.Module):
    """Each rank's slice of the logits, all-gathered: (N, hidden) -> (N, vocab) on every rank."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup,
                 weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        per_rank = -(-vocab_size // tp.world_size)
        self.weight = weight if weight is not None else nn.Parameter(
            torch.empty(per_rank, hidden_size))  # tied: the embedding's shard is the head's

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)  # (N, ceil(V/N))
        return self.tp.all_gather(local)[:, :self.vocab_size]  # (N, V): padding rows dropped


def shard_model(model: QwenForCausalLM, tp: TPGroup) -> QwenForCausalLM:
    """Swap every linear and the embedding of a (meta-device) model for its sharded version.

    ``model.py`` stays as it is: the attention layers view q/k/v with ``n_heads`` and
    ``n_kv_heads``, which become this rank's counts, and the decoder loop is unchanged.
    """
    c, n = model.config, tp.world_size
    d, hidden = c.head_dim, c.hidden_size
    kv_start, kv_stop = kv_head_range(c.num_attention_heads, c.num_key_value_heads, tp.rank, n)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.n_heads, attn.n_kv_heads = c.num_attention_heads // n, kv_stop - kv_start
        bias = c.attention_bias
        attn.q_proj = ColumnParallelLinear(hidden, attn.n_heads * d, bias)
        attn.k_proj = ColumnParallelLinear(hidden, attn.n_kv_heads * d, bias)
        attn.v_proj = ColumnParallelLinear(hidden, attn.n_kv_heads * d, bias)
        attn.o_proj = RowParallelLinear(attn.n_heads * d, hidden, attn.o_proj.bias is not None, tp)
        inter = c.intermediate_size // n
        mlp.gate_proj = ColumnParallelLinear(hidden, inter, False)
        mlp.up_proj = ColumnParallelLinear(hidden, inter, False)
        mlp.down_proj = RowParallelLinear(inter, hidden, False, tp)
    model.model.embed_tokens = VocabParallelEmbedding(c.vocab_size, hidden, tp)
    tied = model.model.embed_tokens.weight if c.tie_word_embeddings else None
    model.lm_head = ParallelLMHead(c.vocab_size, hidden, tp, tied)
    return model


def shard_spec(name: str, config: ModelConfig, rank: int,
               world_size: int) -> tuple[int, int, int] | None:
    """Which part of checkpoint tensor ``name`` rank ``rank`` keeps: (dim, start, stop), or
    None where every rank keeps all of it (norms, o_proj's bias)."""
    d = config.head_dim
    heads = config.num_attention_heads // world_size  # query heads per rank
    inter = config.intermediate_size // world_size
    kv_start, kv_stop = kv_head_range(config.num_attention_heads, config.num_key_value_heads,
                                      rank, world_size)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return (0, *vocab_range(config.vocab_size, rank, world_size))  # vocab rows
    if ".q_proj." in name:  # column-parallel: this rank's query heads (weight rows, bias)
        return 0, rank * heads * d, (rank + 1) * heads * d
    if ".k_proj." in name or ".v_proj." in name:  # column-parallel: its KV heads
        return 0, kv_start * d, kv_stop * d
    if name.endswith("o_proj.weight"):  # row-parallel: the input columns of its heads
        return 1, rank * heads * d, (rank + 1) * heads * d
    if ".gate_proj." in name or ".up_proj." in name:  # column-parallel
        return 0, rank * inter, (rank + 1) * inter
    if name.endswith("down_proj.weight"):  # row-parallel
        return 1, rank * inter, (rank + 1) * inter
    return None  # replicated: norms, o_proj's bias (added once, after the all-reduce)


def load_sharded_model(model_path: str | Path, tp: TPGroup, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> QwenForCausalLM:
    """This rank's shard of the model, read slice by slice from the safetensors files.

    ``safe_open(...).get_slice(name)[start:stop]`` reads only those rows (or columns) from
    the memory-mapped file, so a rank never holds more than its 1/N of a matrix.
    """
    model_dir = Path(model_path)
    config = ModelConfig.from_pretrained(model_dir)
    check_tp_split(config, tp.world_size)
    with torch.device("meta"), _skip_init():
        model = shard_model(QwenForCausalLM(config), tp)
    expected = {name: p.shape for name, p in model.named_parameters()}  # tied: counted once
    loaded: dict[str, torch.Tensor] = {}
    for path in _checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if "rotary_emb." in name or (name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                if name not in expected:
                    raise ValueError(f"{path}: unexpected tensor {name!r} (not in a {config.model_type})")
                spec = shard_spec(name, config, tp.rank, tp.world_size)
                part = f.get_slice(name)
                if spec is None:
                    tensor = part[:]
                else:
                    dim, start, stop = spec
                    tensor = part[start:stop] if dim == 0 else part[:, start:stop]
                if tensor.shape[0] < expected[name][0] and name.endswith(
                        ("embed_tokens.weight", "lm_head.weight")):  # the last rank's padding
                    pad = tensor.new_zeros(expected[name][0] - tensor.shape[0], tensor.shape[1])
                    tensor = torch.cat([tensor, pad])
                if tensor.shape != expected[name]:
                    raise ValueError(f"{path}: shard of {name!r} for rank {tp.rank} has shape "
                                     f"{tuple(tensor.shape)}, expected {tuple(expected[name])}")
                loaded[name] = tensor.to(device=device, dtype=dtype)
    missing = [name for name in expected if name not in loaded]
    if missing:
        raise ValueError(f"{model_dir}: checkpoint is missing tensor(s) {missing[:5]}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:  # assign=True replaced the Parameter: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.requires_grad_(False).eval()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters (a tied weight counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# Rank 0 drives; every command starts with a broadcast of HEADER int64 values on the control
# group:  [command, T tokens, B sequences, total block-table length, R logits rows, num_blocks]
# FORWARD: one int64 payload follows, the runner's ModelInputs flattened:
#   input_ids (T) | positions (T) | num_computed (B) | num_new (B) | table lengths (B)
#   | block tables (flat) | logits_rows (R)
# and every rank runs ModelRunner.forward on it (num_blocks: the block manager's blocks; the
# pool has one more, the scratch block that padded block-table entries point at).
# NO_CACHE: a cache-less forward of T tokens, no payload (measure_cuda_kv_budget's probe).
# ZERO: a payload of T block ids whose keys and values every rank zeroes (a failed request).
# STOP: the workers leave the group and exit.
FORWARD, NO_CACHE, ZERO, STOP = 1, 2, 3, 4
HEADER = 6


def encode_inputs(inputs: ModelInputs, num_blocks: int) -> tuple[list[int], torch.Tensor]:
    """The header and the one int64 payload that carry a step's ``ModelInputs`` to a worker."""
    tables = inputs.block_tables
    flat = [block for table in tables for block in table]
    header = [FORWARD, len(inputs.input_ids), len(tables), len(flat), len(inputs.logits_rows),
              num_blocks]
    payload = torch.tensor([*inputs.input_ids, *inputs.positions, *inputs.num_computed,
                            *inputs.num_new, *map(len, tables), *flat, *inputs.logits_rows],
                           dtype=torch.long)
    return header, payload


def decode_inputs(header: list[int], payload: torch.Tensor) -> ModelInputs:
    """A worker's copy of rank 0's ``ModelInputs`` (``encode_inputs`` undone)."""
    _, t, b, n_flat, r, _ = header
    ids, positions, computed, new, lens, flat, rows = (
        part.tolist() for part in payload.split([t, t, b, b, b, n_flat, r]))
    tables, start = [], 0
    for n in lens:
        tables.append(flat[start:start + n])
        start += n
    return ModelInputs(ids, positions, tables, computed, new, rows)


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: ``ModelRunner`` over rank 0's shard, and every rank in step with it.

    ``load_model`` spawns the workers (or joins a torchrun launch) and loads rank 0's shard;
    ``forward(inputs)`` broadcasts the step's ``ModelInputs``, then runs ``ModelRunner.forward``
    (the workers run the same forward on their shards and meet it in each all-reduce, and in
    the logits' all-gather). Sampling, logprobs and fault isolation are ``ModelRunner``'s, on
    rank 0. The decode step is not compiled (a graph would have to hold the collectives) and
    projections are not merged (they are split across ranks). A dead worker turns the next
    step into a ``TensorParallelError``; ``close()`` stops the workers.
    """

    def __init__(self, config: EngineConfig, *args) -> None:
        compile_asked = config.compile
        if compile_asked is None:  # notebook 07's default: $MINIVLLM_COMPILE, on
            from minivllm.compile import compile_enabled_by_default

            compile_asked = compile_enabled_by_default()
        if compile_asked:
            logger.info("tensor parallel: the decode step runs eagerly (not compiled)")
        self._closer = None
        try:
            super().__init__(config, *args)
        except BaseException:
            self.close()  # the workers started; a pool that does not fit stops them again
            raise

    def load_model(self, path: Path) -> nn.Module:
        threads_before = torch.get_num_threads()
        model, self.tp, self.workers, self.weight_bytes_per_rank = start_tensor_parallel(
            path, self.config, self.dtype, self.device)
        self._lock, self._failed = threading.Lock(), None
        self._closer = weakref.finalize(self, _shutdown, self.tp, self.workers, self._lock,
                                        threads_before)
        model.num_kv_heads = model.model.layers[0].self_attn.n_kv_heads  # per rank: the pool's
        return model

    @property
    def world_size(self) -> int:
        return self.tp.world_size

    def kv_cache_blocks(self) -> int:
        if self.device.type == "cuda" and self.config.num_blocks is None:
            # ModelRunner measures the budget with one cache-less forward of the largest step
            # through rank 0's shard: the workers run it too, to meet it in the collectives
            with self._collective():
                _broadcast_header([NO_CACHE, self.config.max_num_batched_tokens, 0, 0, 0, 0],
                                  self.tp.control)
                return super().kv_cache_blocks()
        return super().kv_cache_blocks()

    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        header, payload = encode_inputs(inputs, self.num_blocks)
        with self._collective():
            _broadcast_header(header, self.tp.control)
            dist.broadcast(payload, 0, group=self.tp.control)
            return super().forward(inputs)  # (R, V): the all-gathered logits

    def zero_blocks(self, block_ids: list[int]) -> None:
        with self._collective():  # every rank's pool holds its heads of these blocks
            _broadcast_header([ZERO, len(block_ids), 0, 0, 0, self.num_blocks], self.tp.control)
            dist.broadcast(torch.tensor(block_ids, dtype=torch.long), 0, group=self.tp.control)
            super().zero_blocks(block_ids)

    def check_workers(self) -> None:
        """Raise TensorParallelError if a worker process has died."""
        if self._failed:
            raise TensorParallelError(self._failed)
        dead = [(rank, p) for rank, p in enumerate(self.workers, start=1) if not p.is_alive()]
        if dead:
            self._failed = "tensor-parallel worker(s) died: " + ", ".join(
                f"rank {rank} (pid {p.pid}, exit code {p.exitcode})" for rank, p in dead) + (
                "; the engine cannot continue (restart it)")
            raise TensorParallelError(self._failed)

    @contextlib.contextmanager
    def _collective(self):
        """One rank-0 turn of the protocol: refuse if a worker is dead, name it if one dies."""
        self.check_workers()
        with self._lock:
            try:
                yield
            except Exception as error:  # a collective failed (a peer closed, a timeout), or
                # rank 0 failed mid-step: either way the ranks are out of step for good
                if isinstance(error, TensorParallelError):
                    raise
                deadline = time.monotonic() + 5  # a peer's socket can close before its exit
                while time.monotonic() < deadline:  # is seen: wait for it, to say which
                    self.check_workers()
                    time.sleep(0.05)
                self._failed = (f"tensor-parallel step failed ({type(error).__name__}: {error}); "
                                "the ranks are out of step: the engine cannot continue")
                raise TensorParallelError(self._failed) from error

    def close(self) -> None:
        """Stop the workers and leave the process group (idempotent; also on garbage
        collection and at interpreter exit)."""
        if self._closer is not None:
            self._closer()


class TensorParallelError(RuntimeError):
    """The tensor-parallel group is broken (a worker died): the engine cannot step again."""

    engine_dead = True  # the server stops its engine loop on this, and /health says 503


def _broadcast_header(values: list[int], control) -> torch.Tensor:
    header = torch.tensor(values, dtype=torch.long)
    dist.broadcast(header, 0, group=control)
    return header


def _shutdown(tp: TPGroup, workers: list, lock: threading.Lock, threads: int) -> None:
    """Tell the workers to stop, wait a little, make sure they are gone, leave the group."""
    alive = all(p.is_alive() for p in workers)
    if alive and tp.control is not None and lock.acquire(timeout=5):
        try:
            _broadcast_header([STOP, 0, 0, 0, 0, 0], tp.control)
        except Exception as err:  # noqa: BLE001 (best effort: they are killed below anyway)
            logger.debug("tensor parallel: STOP not delivered (%s)", err)
        finally:
            lock.release()
    for p in workers:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    tp.leave()
    torch.set_num_threads(threads)  # what this process had before it became rank 0


def _threads() -> int:
    """Intra-op threads per rank on a CPU: $MINIVLLM_TP_THREADS, else 1 (N ranks share the cores)."""
    return int(os.environ.get("MINIVLLM_TP_THREADS", "1"))


def _rank_device(device: torch.device, rank: int) -> torch.device:
    """One GPU per rank: cuda:(base + rank); a CPU rank stays on the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _init_group(rank: int, world_size: int, device: torch.device, store=None):
    """Join the process group; return (model group, control group).

    The model's collectives use NCCL on CUDA and gloo on CPU. The step's inputs travel on
    a second, gloo group (CPU tensors), whose timeout is long: a worker waits there while
    the server is idle.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=float(os.environ.get("MINIVLLM_TP_TIMEOUT", "300")))
    kwargs = {"store": store} if store is not None else {"init_method": "env://"}
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    control = dist.new_group(backend="gloo", timeout=timedelta(days=365))
    return dist.group.WORLD, control


def start_tensor_parallel(model_path: str | Path, config: EngineConfig, dtype: torch.dtype,
                          device: torch.device) -> tuple[QwenForCausalLM, TPGroup, list, list[int]]:
    """Rank 0: spawn the workers (or join a torchrun launch), load this rank's shard.

    Returns rank 0's shard, its ``TPGroup``, the spawned worker processes (none under
    torchrun) and every rank's weight bytes. A worker gets ``config`` too: its attention
    backend and block size are rank 0's."""
    world_size = config.tensor_parallel_size
    check_tp_split(ModelConfig.from_pretrained(model_path), world_size)  # before any spawn
    if device.type == "cuda" and "RANK" not in os.environ and (
            (device.index or 0) + world_size > torch.cuda.device_count()):
        raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} GPUs from "
                         f"{device} on (one per rank); this machine has "
                         f"{torch.cuda.device_count()}")
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine is already running in this process "
                           "(one per process: close it first)")
    threads_before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(_threads())
    workers, store = [], None
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: the ranks exist
        rank = int(os.environ["RANK"])
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but tensor_parallel_size="
                             f"{world_size}")
        device = _rank_device(device, int(os.environ.get("LOCAL_RANK", rank)))
        if rank != 0:  # not the engine: serve rank 0 until it stops, then end the process
            run_worker(rank, world_size, str(model_path), str(dtype)[6:], str(device), None,
                       config)
            raise SystemExit(0)
    else:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True,
                              timeout=timedelta(seconds=120), wait_for_workers=False)
        ctx = torch.multiprocessing.get_context("spawn")
        for rank in range(1, world_size):
            p = ctx.Process(target=_worker_main, name=f"minivllm-tp-rank{rank}", daemon=True,
                            args=(rank, world_size, store.port, str(model_path), str(dtype)[6:],
                                  str(_rank_device(device, rank)), config, _threads()))
            p.start()
            workers.append(p)
    try:
        group, control = _init_group(0, world_size, device, store)
        tp = TPGroup(0, world_size, group, control)
        del group, control  # tp holds them, and tp.leave() lets them go
        model = load_sharded_model(model_path, tp, dtype, device)
        sizes: list = [None] * world_size
        dist.all_gather_object(sizes, weight_bytes(model), group=tp.control)
    except BaseException:
        for p in workers:
            p.kill()
        torch.set_num_threads(threads_before)
        raise
    logger.info("tensor parallel: %d ranks (%s), weights per rank %s MiB", world_size,
                "nccl" if device.type == "cuda" else f"gloo, {torch.get_num_threads()} thread(s) each",
                ", ".join(f"{b / 2**20:.1f}" for b in sizes))
    return model, tp, workers, sizes


def _worker_main(rank: int, world_size: int, port: int, model_path: str, dtype: str,
                 device: str, config: EngineConfig, threads: int) -> None:
    """Entry point of a spawned worker process."""
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                          timeout=timedelta(seconds=120))
    run_worker(rank, world_size, model_path, dtype, device, store, config, threads)


@torch.inference_mode()
def run_worker(rank: int, world_size: int, model_path: str, dtype: str, device: str,
               store, config: EngineConfig, threads: int | None = None) -> None:
    """A worker rank: load its shard, then run whatever rank 0 broadcasts until STOP."""
    device_ = torch.device(device)
    if device_.type == "cpu":
        torch.set_num_threads(threads or _threads())
    tp = TPGroup(rank, world_size, *_init_group(rank, world_size, device_, store))
    try:
        model = load_sharded_model(model_path, tp, getattr(torch, dtype), device_)
        # the step loop from notebook 03's frame room, as rank 0's engine loop runs: no
        # chunk of CPython's frame stack mapped and unmapped every step
        call_with_frame_room(_serve, tp, WorkerRunner(config, model, device_))
    finally:
        tp.leave()


class WorkerRunner:
    """A worker rank's side of the runner: its shard, a KV pool of its own KV heads, rank 0's
    attention backend (by name, from the config) — and ``ModelRunner``'s own ``forward``
    (with its ``hidden_states`` and ``compute_logits``) and ``zero_blocks``, so every rank
    runs exactly the step rank 0 runs."""

    forward = ModelRunner.forward
    hidden_states = ModelRunner.hidden_states
    compute_logits = ModelRunner.compute_logits
    zero_blocks = ModelRunner.zero_blocks

    def __init__(self, config: EngineConfig, model: QwenForCausalLM, device: torch.device):
        self.config, self.model, self.device = config, model, device
        self.model_config = model.config
        self.attention_cls = resolve_qualname(ATTENTION_BACKENDS[config.attention_backend])
        self.num_blocks, self.pool = 0, None

    def ensure_pool(self, num_blocks: int) -> None:
        """A pool like rank 0's (its blocks, plus the scratch block), of this rank's KV heads."""
        if self.pool is None or self.num_blocks != num_blocks:
            from minivllm.kv_cache import KVCachePool

            c = self.model_config
            self.num_blocks = num_blocks
            self.pool = KVCachePool(c.num_hidden_layers, num_blocks + 1, self.config.block_size,
                                    self.model.model.layers[0].self_attn.n_kv_heads, c.head_dim,
                                    self.model.lm_head.weight.dtype, self.device)


def _cache_less_forward(model: QwenForCausalLM, num_tokens: int, device: torch.device) -> None:
    """The forward of ``measure_cuda_kv_budget`` (notebook 02), on this rank's shard."""
    hidden = model(torch.zeros(num_tokens, dtype=torch.long, device=device),
                   torch.arange(num_tokens, device=device),
                   lambda layer, q, k, v: causal_attention(q, k, v))
    model.compute_logits(hidden[-1:])


def _serve(tp: TPGroup, runner: WorkerRunner) -> None:
    """A worker's loop: receive each command rank 0 broadcasts and run it on this shard."""
    dist.all_gather_object([None] * tp.world_size, weight_bytes(runner.model), group=tp.control)
    header = torch.zeros(HEADER, dtype=torch.long)
    while True:
        try:
            dist.broadcast(header, 0, group=tp.control)
        except RuntimeError as err:  # rank 0 is gone (killed): nothing is left to serve
            logger.warning("tensor parallel rank %d: rank 0 went away (%s); exiting", tp.rank, err)
            return
        values = header.tolist()
        command, t, b, n_flat, r, num_blocks = values
        if command == STOP:
            return
        if command == NO_CACHE:
            _cache_less_forward(runner.model, t, runner.device)
            continue
        payload = torch.empty(t if command == ZERO else 2 * t + 3 * b + n_flat + r,
                              dtype=torch.long)
        dist.broadcast(payload, 0, group=tp.control)
        runner.ensure_pool(num_blocks)
        if command == ZERO:
            runner.zero_blocks(payload.tolist())
        else:  # FORWARD: joins the all-reduces and the logits' all-gather; rank 0 samples
            runner.forward(decode_inputs(values, payload))
