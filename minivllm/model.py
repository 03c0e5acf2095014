# Generated from solutions/01_forward_pass.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""The Qwen2 / Qwen3 decoder in plain PyTorch, safetensors loading, and a greedy loop.

Built in notebook 01_forward_pass.

The numerics follow Hugging Face ``modeling_qwen2.py`` / ``modeling_qwen3.py`` exactly and
the parameter names are Hugging Face's, so ``state_dict()`` keys match the checkpoint.
Two things differ from Hugging Face, both on purpose (see docs/architecture.md):

* Inputs are *flat*: ``input_ids`` and ``positions`` are ``(T,)`` with no batch axis, so
  later milestones can concatenate the tokens of many sequences into one forward.
* The model does not own a KV cache. Each attention layer computes q, k, v and hands them
  to an *attention function* ``attn(layer_idx, q, k, v)`` chosen by the caller. Here that
  is `ContiguousKVCache` (one sequence, one preallocated slab); later milestones swap in
  paged and batched attention without touching this file.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from minivllm.config import ModelConfig

# attn(layer_idx, q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, D)) -> (T, Hq, D)
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    """Root-mean-square norm with Hugging Face's numerics (statistics in fp32)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()  # bf16 has too few mantissa bits for a mean of squares
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)  # cast back *before* the weight, as HF does


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) pair, each (T, head_dim) in fp32."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    )  # (D/2,)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D): frequency i sits at i and i + D/2
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last axis."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, H, D) by its positions' angles; cos, sin are (T, D).

    Qwen (like Llama in HF format) uses the *half-split* convention: dimension i is paired
    with dimension i + D/2. The original RoPE paper and GPT-J pair *interleaved* neighbours
    (2i, 2i+1). Both are valid rotations, but a checkpoint is trained with exactly one of
    them; using the other scrambles the pairs and gives plausible-looking garbage.
    """
    # HF computes cos/sin in fp32, then casts them to the activations' dtype.
    cos = cos.to(x.dtype)[:, None, :]  # (T, 1, D), broadcast over heads
    sin = sin.to(x.dtype)[:, None, :]
    return x * cos + rotate_half(x) * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention of q (Tq, Hq, D) over k, v (Tk, Hkv, D) -> (Tq, Hq, D).

    The queries are the *last* Tq of the Tk positions (a prompt chunk or a decode token
    after Tk - Tq cached keys): query i may see keys 0 .. i + (Tk - Tq). This is the
    bottom-right aligned causal mask. SDPA's ``is_causal=True`` is *top-left* aligned
    (query i sees keys 0 .. i), which is only right when Tq == Tk; with cached keys it
    would hide most of the context from the new queries.
    """
    tq, n_heads, head_dim = q.shape
    tk, n_kv_heads, _ = k.shape
    n_rep = n_heads // n_kv_heads
    # GQA: query head h uses kv head h // n_rep, so each kv head is repeated n_rep times
    # *in place* (repeat_interleave), not tiled ([k0, k1, k0, k1] would be wrong).
    k = k.repeat_interleave(n_rep, dim=1)  # (Tk, Hq, D)
    v = v.repeat_interleave(n_rep, dim=1)
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (H, T, D): SDPA wants heads first
    if tq == tk:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        offset = tk - tq
        rows = torch.arange(tq, device=q.device)[:, None]
        cols = torch.arange(tk, device=q.device)[None, :]
        mask = cols <= rows + offset  # (Tq, Tk), True = may attend
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # SDPA's default scale is 1 / sqrt(head_dim), as in the paper and in HF.
    assert out.shape == (n_heads, tq, head_dim)
    return out.transpose(0, 1)  # (Tq, Hq, D)


class Attention(nn.Module):
    """Project to q, k, v; q/k-norm (Qwen3); RoPE; call the attention function; project out."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.n_kv_heads * self.head_dim, bias=bias)
        # Qwen3's `attention_bias` covers o_proj too (as in Llama); Qwen2 biases only q/k/v.
        o_bias = bias and config.model_type == "qwen3"
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=o_bias)
        if config.qk_norm:  # Qwen3: RMSNorm over each head's D values, before RoPE
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.project_qkv(x)  # (T, Hq*D), (T, Hkv*D), (T, Hkv*D)
        q = q.view(t, self.n_heads, self.head_dim)  # (T, Hq, D)
        k = k.view(t, self.n_kv_heads, self.head_dim)  # (T, Hkv, D)
        v = v.view(t, self.n_kv_heads, self.head_dim)  # (T, Hkv, D)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = attn(self.layer_idx, q, k, v)  # (T, Hq, D)
        return self.o_proj(out.reshape(t, self.n_heads * self.head_dim))  # (T, hidden)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> q, k, v: three matmuls over the same input. (Notebook 07's
        engine merges them into one; see ``merge_projections`` in compile.py.)"""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class QwenModel(nn.Module):
    """Embedding, the decoder layers, and the final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class QwenForCausalLM(nn.Module):
    """The full model; ``forward`` returns hidden states, ``compute_logits`` the logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = QwenModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn
    ) -> torch.Tensor:
        """input_ids, positions: (T,) int64 -> hidden states (T, hidden_size)."""
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attn)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden_size) -> (N, vocab_size) float32. Call it only on rows you sample."""
        return self.lm_head(hidden).float()


class ContiguousKVCache:
    """The M1 attention function: one sequence, a preallocated k/v slab per layer.

    Each layer keeps its own fill count and appends the step's k/v at ``[len : len + T]``
    before attending over everything cached so far. Because every layer advances itself,
    the caller needs no ``advance()`` call; after a complete forward all layers agree and
    `length` is the number of tokens cached.
    """

    def __init__(
        self, config: ModelConfig, max_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        shape = (config.num_hidden_layers, max_len, config.num_key_value_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, max_len, Hkv, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.lengths = [0] * config.num_hidden_layers  # tokens cached per layer

    @property
    def length(self) -> int:
        return self.lengths[-1]

    def __call__(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        start, end = self.lengths[layer_idx], self.lengths[layer_idx] + k.shape[0]
        if end > self.max_len:
            raise ValueError(f"ContiguousKVCache overflow: {end} tokens > max_len {self.max_len}")
        self.k[layer_idx, start:end] = k
        self.v[layer_idx, start:end] = v
        self.lengths[layer_idx] = end
        return causal_attention(q, self.k[layer_idx, :end], self.v[layer_idx, :end])


def _checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: one file, or the shards of an index."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights in the checkpoint")
    return files


@contextmanager
def _skip_init() -> Iterator[None]:
    """Build modules without their random init: on the meta device there are no values to
    fill, and ``nn.Embedding``'s ``normal_`` on meta goes through a Python decomposition
    that imports all of ``torch._dynamo`` first (1.7 s of a server's start-up here)."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved


def _read_tensors(files: Iterable[Path]) -> Iterable[tuple[str, Path, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, path, f.get_tensor(name)


def load_model(
    model_path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> QwenForCausalLM:
    """Build the model on the meta device (no memory, no init) and fill it from safetensors."""
    model_dir = Path(model_path)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: checkpoint directory does not exist")
    config = ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"), _skip_init():
        model = QwenForCausalLM(config)
    expected = {name: p.shape for name, p in model.named_parameters()}  # tied: counted once
    loaded: dict[str, torch.Tensor] = {}
    for name, path, tensor in _read_tensors(_checkpoint_files(model_dir)):
        if "rotary_emb." in name:  # HF may store its inv_freq buffer; we recompute it
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the embedding is the head (HF ignores this copy as well)
        if name not in expected:
            raise ValueError(f"{path}: unexpected tensor {name!r} (not in a {config.model_type})")
        if tensor.shape != expected[name]:
            raise ValueError(
                f"{path}: shape mismatch for {name!r}: expected {tuple(expected[name])}, "
                f"found {tuple(tensor.shape)}"
            )
        loaded[name] = tensor.to(device=device, dtype=dtype)
    missing = [name for name in expected if name not in loaded]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"{model_dir}: checkpoint is missing tensor(s) {missing[:5]}{more}")
    model.load_state_dict(loaded, strict=False, assign=True)
    if config.tie_word_embeddings:  # assign=True replaced the Parameter: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.requires_grad_(False).eval()  # inference only: no autograd bookkeeping


@torch.inference_mode()
def greedy_generate(
    model: QwenForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_token_ids: Iterable[int] = (),
) -> list[int]:
    """Greedy decoding: prefill the prompt in one forward, then one token per step.

    Returns the new tokens only; an EOS token stops generation and is included,
    like ``transformers``' ``generate``.
    """
    param = next(model.parameters())
    eos = set(eos_token_ids)
    cache = ContiguousKVCache(
        model.config, len(prompt_ids) + max_new_tokens, param.dtype, param.device
    )
    input_ids = torch.tensor(prompt_ids, dtype=torch.long, device=param.device)
    positions = torch.arange(len(prompt_ids), device=param.device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        hidden = model(input_ids, positions, cache)  # (T, hidden)
        token = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(token)
        if token in eos:
            break
        input_ids = torch.tensor([token], device=param.device)
        positions = torch.tensor([cache.length], device=param.device)
    return out
