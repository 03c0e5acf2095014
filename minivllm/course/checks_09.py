"""Graders for notebook 09_tensor_parallel (Milestone 9: tensor parallelism).

The graders run N ranks as N *threads* of this process (`ThreadGroup`: the same
``all_reduce`` / ``all_gather`` as ``minivllm.parallel.TPGroup``, through a barrier), so a
check takes a fraction of a second and needs no process group. References:

* 9.1 ``kv_head_range``: the KV heads that a rank's query heads read (h // n_rep), and
  Milestone 1's ``causal_attention`` over all heads, sliced per rank;
* 9.2 ``RowParallelLinear``: ``F.linear`` with the whole weight and bias;
* 9.3 ``shard_spec``: Milestone 1's whole ``QwenForCausalLM``: the shards it describes,
  loaded into ``shard_model``'s layers on every rank, must give the same logits.

Each prints one ``passed(...)`` line or raises an ``AssertionError`` that says what differs;
a stub's ``NotImplementedError`` becomes an ``AssertionError`` saying "not implemented yet".
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .grading import assert_close, call_learner, passed, require


class ThreadGroup:
    """Rank ``rank`` of a tensor-parallel group whose ranks are threads of one process.

    ``all_reduce`` and ``all_gather`` behave as ``minivllm.parallel.TPGroup``'s: every rank
    calls them in the same order, each waits for all the others (a barrier), and the sum /
    concatenation runs in rank order, so every rank gets bit-identical results.
    """

    def __init__(self, rank: int, world_size: int, shared: dict) -> None:
        self.rank, self.world_size, self._shared = rank, world_size, shared

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        slots, barrier = self._shared["slots"], self._shared["barrier"]
        slots[self.rank] = x.clone()
        barrier.wait()
        parts = list(slots)
        barrier.wait()  # everyone has read the slots: they may be overwritten again
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return x.copy_(total)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=-1)


def run_ranks(world_size: int, fn: Callable[[ThreadGroup], object]) -> list:
    """Run ``fn(group)`` on every rank (one thread each); return the results in rank order.

    An exception on any rank breaks the barrier for the others and is re-raised here.
    """
    shared = {"slots": [None] * world_size,
              "barrier": threading.Barrier(world_size, timeout=60)}
    results: list = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def body(rank: int) -> None:
        try:
            with torch.inference_mode():
                results[rank] = fn(ThreadGroup(rank, world_size, shared))
        except BaseException as err:  # noqa: BLE001 (re-raised in the caller)
            errors[rank] = err
            shared["barrier"].abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real:
        raise real[0]
    if any(errors):
        raise AssertionError("a rank stopped before its collective: the ranks did not call "
                             "all_reduce / all_gather the same number of times")
    return results


# ----------------------------------------------------------------------------- 9.1

KV_HINT = ("rank r owns query heads [r * n_heads/N, (r+1) * n_heads/N) and query head h reads KV "
           "head h // (n_heads / n_kv_heads); with fewer KV heads than ranks several ranks need "
           "the same KV head, so each of them keeps a copy (replicate, don't split)")

KV_CASES = [(8, 2, 2), (8, 2, 4), (8, 8, 4), (16, 8, 2), (16, 2, 8), (8, 1, 4), (14, 2, 2),
            (4, 4, 1)]


def check_kv_head_range(kv_head_range) -> None:
    """Exercise 9.1: each rank's KV heads are exactly those its query heads read, and
    attention over a rank's heads equals its slice of the full attention."""
    from minivllm.model import causal_attention

    what = "Exercise 9.1 (kv_head_range)"
    torch.manual_seed(0)
    for n_heads, n_kv, world in KV_CASES:
        n_rep, per_rank = n_heads // n_kv, n_heads // world
        q = torch.randn(5, n_heads, 4)
        k, v = torch.randn(5, n_kv, 4), torch.randn(5, n_kv, 4)
        full = causal_attention(q, k, v)  # (T, Hq, D)
        for rank in range(world):
            got = call_learner(what, kv_head_range, n_heads, n_kv, rank, world, hint=KV_HINT)
            need = sorted({h // n_rep for h in range(rank * per_rank, (rank + 1) * per_rank)})
            where = f"{n_heads} heads, {n_kv} KV heads, rank {rank} of {world}"
            require(isinstance(got, tuple | list) and len(got) == 2, what,
                    f"{where}: expected a (start, stop) pair, got {got!r}", KV_HINT)
            start, stop = got
            require((start, stop) == (need[0], need[-1] + 1), what,
                    f"{where}: returned KV heads [{start}, {stop}), but this rank's query heads "
                    f"{rank * per_rank}..{(rank + 1) * per_rank - 1} read KV heads "
                    f"[{need[0]}, {need[-1] + 1})", KV_HINT)
            heads = slice(rank * per_rank, (rank + 1) * per_rank)
            mine = causal_attention(q[:, heads], k[:, start:stop], v[:, start:stop])
            assert_close(mine, full[:, heads], what=f"{what}: {where}: attention over its heads")
    passed(what, f"{len(KV_CASES)} shapes, split and replicated KV heads")


# ----------------------------------------------------------------------------- 9.3

SPEC_HINT = ("column-parallel layers (q/k/v, gate/up) keep rows of the weight (dim 0) and of the "
             "bias; row-parallel ones (o_proj, down_proj) keep the matching *columns* (dim 1) and "
             "replicate their bias; embed_tokens / lm_head keep a range of vocabulary rows")


def _small_configs():
    from minivllm.config import ModelConfig

    common = {"vocab_size": 37, "hidden_size": 32, "intermediate_size": 24,
              "num_hidden_layers": 2, "num_attention_heads": 4, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 64}
    return [
        (ModelConfig.from_dict({**common, "model_type": "qwen2", "num_key_value_heads": 2,
                                "tie_word_embeddings": True}), 2),
        (ModelConfig.from_dict({**common, "model_type": "qwen2", "num_key_value_heads": 2,
                                "tie_word_embeddings": False}), 4),
        (ModelConfig.from_dict({**common, "model_type": "qwen3", "num_key_value_heads": 2,
                                "head_dim": 16, "attention_bias": True,
                                "tie_word_embeddings": False}), 2),
    ]


def _random_model(config, seed: int):
    from minivllm.model import QwenForCausalLM

    torch.manual_seed(seed)
    model = QwenForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.ndim == 1 else 0.0))
    return model.eval()


def shard_state(full: dict[str, torch.Tensor], config, rank: int, world: int, shard_spec,
                expected: dict[str, torch.Size], what: str) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors cut from the whole state dict as ``shard_spec`` says."""
    out = {}
    for name, shape in expected.items():
        spec = call_learner(what, shard_spec, name, config, rank, world, hint=SPEC_HINT)
        tensor = full[name]
        if spec is not None:
            require(isinstance(spec, tuple | list) and len(spec) == 3 and 0 <= spec[0] < tensor.ndim,
                    what, f"{name} has {tensor.ndim} dimension(s); shard_spec returned {spec!r}",
                    SPEC_HINT)
            dim, start, stop = spec
            tensor = tensor.narrow(dim, start, max(0, min(stop, tensor.shape[dim]) - start))
        if name.endswith(("embed_tokens.weight", "lm_head.weight")) and tensor.shape[0] < shape[0]:
            tensor = torch.cat([tensor, tensor.new_zeros(shape[0] - tensor.shape[0], *tensor.shape[1:])])
        require(tuple(tensor.shape) == tuple(shape), what,
                f"rank {rank} of {world}, {name}: the slice {spec} gives shape "
                f"{tuple(tensor.shape)}, but the sharded layer holds {tuple(shape)}", SPEC_HINT)
        out[name] = tensor
    return out


def check_shard_spec(shard_spec) -> None:
    """Exercise 9.3: the shards it describes give the whole model's logits on every rank
    (Qwen2 tied and untied, Qwen3 with biases; 2 and 4 ranks)."""
    from minivllm.model import ContiguousKVCache, QwenForCausalLM
    from minivllm.parallel import shard_model

    what = "Exercise 9.3 (shard_spec)"
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 36])
    positions = torch.arange(len(ids))
    for i, (config, world) in enumerate(_small_configs()):
        model = _random_model(config, seed=i)
        full = dict(model.state_dict())
        with torch.inference_mode():
            cache = ContiguousKVCache(config, 16, torch.float32, "cpu")
            want = model.compute_logits(model(ids, positions, cache))

        def rank_logits(group, config=config, full=full, world=world):
            with torch.device("meta"):
                sharded = shard_model(QwenForCausalLM(config), group)
            expected = {n: p.shape for n, p in sharded.named_parameters()}
            state = shard_state(full, config, group.rank, world, shard_spec, expected, what)
            sharded.load_state_dict(state, strict=False, assign=True)
            if config.tie_word_embeddings:
                sharded.lm_head.weight = sharded.model.embed_tokens.weight
            local = dataclasses.replace(  # this rank's cache holds its KV heads only
                config, num_key_value_heads=sharded.model.layers[0].self_attn.n_kv_heads)
            cache = ContiguousKVCache(local, 16, torch.float32, "cpu")
            return sharded.compute_logits(sharded(ids, positions, cache))

        got = run_ranks(world, rank_logits)
        kind = f"{config.model_type}, {'tied' if config.tie_word_embeddings else 'untied'}, {world} ranks"
        for rank, logits in enumerate(got):
            assert_close(logits, want, what=f"{what}: {kind}: rank {rank}'s logits", atol=1e-4,
                         rtol=1e-4, hint=SPEC_HINT)
    passed(what, "logits of 3 sharded models equal the whole model's on every rank")


# ----------------------------------------------------------------------------- 9.2

ROW_HINT = ("each rank multiplies its slice of the input by its columns of the weight: a partial "
            "sum. all_reduce the partial sums (tp.all_reduce), then add the bias once")


def check_row_parallel(row_parallel_linear) -> None:
    """Exercise 9.2: a row-parallel linear over 2, 3 and 4 ranks equals the whole F.linear,
    with and without bias, on every rank."""
    what = "Exercise 9.2 (RowParallelLinear.forward)"
    torch.manual_seed(3)
    for world, bias in ((2, True), (3, False), (4, True)):
        in_features, out_features = 6 * world, 5
        weight = torch.randn(out_features, in_features)
        b = torch.randn(out_features) if bias else None
        x = torch.randn(7, in_features)
        want = F.linear(x, weight, b)
        width = in_features // world

        def rank_output(group, weight=weight, b=b, x=x, width=width, out_features=out_features):
            layer = row_parallel_linear(width, out_features, b is not None, group)
            cols = slice(group.rank * width, (group.rank + 1) * width)
            with torch.no_grad():
                layer.weight = torch.nn.Parameter(weight[:, cols].clone())
                if b is not None:
                    layer.bias = torch.nn.Parameter(b.clone())
            return call_learner(what, layer, x[:, cols], hint=ROW_HINT)

        for rank, y in enumerate(run_ranks(world, rank_output)):
            assert_close(y, want, what=f"{what}: {world} ranks, bias={bias}, rank {rank}",
                         atol=1e-5, rtol=1e-5, hint=ROW_HINT)
    passed(what, "2, 3 and 4 ranks: the all-reduced partial products equal the full product")
