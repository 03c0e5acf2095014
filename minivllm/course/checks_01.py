"""Graders for notebook 01_forward_pass: every layer against its ``transformers`` twin.

Each ``check_*`` takes the object the learner defined in the notebook, gives it and the
matching ``transformers.models.qwen2.modeling_qwen2`` module the *same* weights and inputs,
and prints one ``passed(...)`` line or raises an ``AssertionError`` that says what differs
(and, for the classic mistakes — interleaved RoPE, tiled GQA heads, a top-left causal mask,
silu on the wrong branch — names the mistake). A stub (``NotImplementedError``) fails too.

The references are Hugging Face's code, never minivllm's: the last cell of the notebook
overwrites the package with the learner's export.
"""

from __future__ import annotations

import inspect
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from .grading import assert_close, assert_equal, exercise, passed, require
from .random_weights import randomize_

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 64, 8, 2, 8  # small GQA shapes: 4 query heads per kv head


def _hf():
    from transformers.models.qwen2 import modeling_qwen2

    return modeling_qwen2


def _hf_config(**overrides):
    from transformers import Qwen2Config

    kwargs = {"vocab_size": 256, "hidden_size": HIDDEN, "intermediate_size": 160,
              "num_hidden_layers": 2, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "max_position_embeddings": 512,
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "bos_token_id": None, "eos_token_id": 2, "pad_token_id": 0}
    cfg = Qwen2Config(**{**kwargs, **overrides})
    cfg._attn_implementation = "eager"
    return cfg


def _our_config(hf_cfg):
    from minivllm.config import ModelConfig

    return ModelConfig.from_dict(hf_cfg.to_dict(), source="grader config")


def _load_same_weights(ours: torch.nn.Module, ref: torch.nn.Module, what: str) -> None:
    try:
        ours.load_state_dict(ref.state_dict())  # strict: the names must be Hugging Face's
    except RuntimeError as err:
        raise AssertionError(f"{what}: its parameters are not named like transformers' "
                             f"({str(err).splitlines()[0]})") from None


def _hf_rope(hf_cfg, positions: torch.Tensor, dtype=torch.float32):
    """transformers' cos, sin for ``positions``: each (T, D)."""
    emb = _hf().Qwen2RotaryEmbedding(hf_cfg)
    cos, sin = emb(torch.zeros(1, 1, dtype=dtype), positions[None])
    return cos[0], sin[0]


def _causal_mask(tq: int, tk: int, top_left: bool = False) -> torch.Tensor:
    """Additive (Tq, Tk) mask: query i sees keys 0 .. i + (Tk - Tq) (bottom-right aligned)."""
    offset = 0 if top_left else tk - tq
    allowed = torch.arange(tk)[None, :] <= torch.arange(tq)[:, None] + offset
    return torch.zeros(tq, tk).masked_fill(~allowed, torch.finfo(torch.float32).min)


def reference_attention(q, k, v, *, tiled: bool = False, top_left: bool = False):
    """transformers' eager attention on our flat layout: q (Tq, Hq, D), k, v (Tk, Hkv, D).

    ``tiled`` / ``top_left`` give the two classic wrong answers, to name them in messages.
    """
    tq, n_heads, d = q.shape
    tk, n_kv, _ = k.shape
    n_rep = n_heads // n_kv
    if tiled:  # [k0, k1, k0, k1, ...]: transformers' repeat_kv never does this
        k, v = k.repeat(1, n_rep, 1), v.repeat(1, n_rep, 1)
        n_rep = 1
    module = SimpleNamespace(num_key_value_groups=n_rep, training=False)
    heads_first = [t.transpose(0, 1)[None].float() for t in (q, k, v)]  # (1, H, T, D)
    mask = _causal_mask(tq, tk, top_left)[None, None]
    out, _ = _hf().eager_attention_forward(module, *heads_first, mask, scaling=d**-0.5)
    return out[0].to(q.dtype)  # (Tq, Hq, D)


def _matches(got, want, atol=1e-4) -> bool:
    return (isinstance(got, torch.Tensor) and got.shape == want.shape
            and bool(torch.allclose(got.double(), want.double(), atol=atol, rtol=1e-4)))


# ----------------------------------------------------------------------------- Exercise 1.1


def check_rmsnorm(RMSNorm) -> None:
    """RMSNorm(64, 1e-6) against Qwen2RMSNorm, in fp32 (a zero row and a tiny row, where eps
    matters) and in bf16 (exactly: statistics in fp32, cast back before the weight)."""
    what = "Exercise 1.1 (RMSNorm)"
    gen = torch.Generator().manual_seed(0)
    weight = 1 + 0.5 * torch.randn(HIDDEN, generator=gen)
    x = 3 * torch.randn(6, HIDDEN, generator=gen)
    x[1] = 0.0  # all zeros: without eps this is 0 / 0
    x[2] *= 1e-4  # mean(x^2) ~ 1e-8, far below eps = 1e-6: eps changes the answer
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        ref = _hf().Qwen2RMSNorm(HIDDEN, eps=1e-6)
        with torch.no_grad():
            ref.weight.copy_(weight)
        ours = RMSNorm(HIDDEN, 1e-6)
        _load_same_weights(ours, ref, what)
        ref, ours = ref.to(dtype), ours.to(dtype)
        xd = x.to(dtype)
        with exercise(what), torch.no_grad():
            got = ours(xd)
        want = ref(xd)
        require(isinstance(got, torch.Tensor), what, f"forward returned {type(got).__name__}")
        bad_rows = (~torch.isfinite(got)).any(-1).nonzero().flatten().tolist()
        require(not bad_rows, what, f"non-finite output in {dtype} in rows {bad_rows} (row 1 "
                "of the input is all zeros)",
                "add eps inside the square root: x * rsqrt(mean(x**2) + eps)")
        if dtype == torch.float32:
            if not _matches(got[2:3], want[2:3], atol=1e-3) and _matches(got[:1], want[:1]):
                raise AssertionError(f"{what}: a row of tiny values (mean(x^2) ~ 1e-8) is off, "
                                     "the others are right\n  hint: eps belongs inside the "
                                     "square root, added to mean(x**2)")
            worst = assert_close(got, want, what=f"{what}, float32", atol=1e-5, rtol=1e-5,
                                 hint="y = weight * x / sqrt(mean(x**2, last axis) + eps)")
        else:
            require(got.dtype == dtype, what, f"bf16 input gave a {got.dtype} output",
                    "cast x back to the input dtype before multiplying by the weight")
            assert_close(got, want, what=f"{what}, bfloat16 (must match exactly)", atol=0,
                         rtol=0, hint="compute the mean of squares in float32 (x.float()), "
                                      "cast back with .to(dtype), then multiply by the weight")
    passed("1.1 (RMSNorm)", f"matches Qwen2RMSNorm: fp32 to {worst:.1g}, bf16 exactly")


# ----------------------------------------------------------------------------- Exercise 1.2


def _convention(rotated: torch.Tensor, d: int) -> str:
    """Which dimension did dimension 0 move to? ``rotated`` is (d,): the image of e_0."""
    moved = [i for i in range(1, d) if abs(float(rotated[i])) > 1e-6]
    if moved == [d // 2]:
        return "half-split"
    if moved == [1]:
        return "interleaved"
    return f"neither (dimension 0 leaked into dimensions {moved})"


_INTERLEAVED = ("you rotate *interleaved* pairs (2i, 2i+1), the RoPE paper / GPT-J / Meta "
                "Llama convention; Qwen's Hugging Face checkpoints pair dimension i with "
                "i + D/2 (*half-split*)")
_HALF_SPLIT_HINT = "split the last axis in halves x1, x2 and return cat(-x2, x1)"


def check_rope(rope_cos_sin, rotate_half, apply_rope) -> None:
    """cos/sin against Qwen2RotaryEmbedding, then rotate_half and apply_rope against
    transformers' apply_rotary_pos_emb; on failure, say which pairing convention was used."""
    what = "Exercise 1.2 (RoPE)"
    hf = _hf()
    d, theta = 16, 1e6
    cfg = _hf_config(hidden_size=4 * d, num_attention_heads=4, num_key_value_heads=2,
                     rope_theta=theta)
    positions = torch.tensor([0, 1, 2, 7, 300, 5])  # positions, not an arange
    cos, sin = _hf_rope(cfg, positions)
    ours_cos, ours_sin = rope_cos_sin(positions, d, theta)
    assert_close(ours_cos, cos, what=f"{what}: rope_cos_sin cos", atol=1e-6,
                 hint="frequency i must sit at dimensions i and i + D/2: cat(freqs, freqs)")
    assert_close(ours_sin, sin, what=f"{what}: rope_cos_sin sin", atol=1e-6)

    basis = torch.eye(d)
    with exercise(f"{what}: rotate_half"):
        rotated = rotate_half(basis)
    require(isinstance(rotated, torch.Tensor) and rotated.shape == basis.shape,
            f"{what}: rotate_half", f"expected a tensor of shape {tuple(basis.shape)}")
    if not torch.equal(rotated, hf.rotate_half(basis)):
        convention = _convention(rotated[0], d)
        if convention == "interleaved":
            raise AssertionError(f"{what}: rotate_half: {_INTERLEAVED}\n  hint: "
                                 f"{_HALF_SPLIT_HINT}")
        assert_close(rotated, hf.rotate_half(basis), what=f"{what}: rotate_half on the identity"
                     f" (convention: {convention})", atol=0, hint=_HALF_SPLIT_HINT)

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(len(positions), 3, d, generator=gen)  # (T, H, D)
    with exercise(f"{what}: apply_rope"):
        got = apply_rope(q, cos, sin)
    probe = torch.zeros(len(positions), 1, d)
    probe[..., 0] = 1.0  # e_0 at every position: where does it rotate to?
    with torch.no_grad():
        image = apply_rope(probe, cos, sin)
    convention = _convention(image[1, 0], d)  # position 1: a non-zero angle for every pair
    ref_q, _ = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos[None],
                                       sin[None])
    want = ref_q[0].transpose(0, 1)
    if convention == "interleaved":
        raise AssertionError(f"{what}: apply_rope: {_INTERLEAVED}\n  hint: x * cos + "
                             "rotate_half(x) * sin with the half-split rotate_half")
    worst = assert_close(got, want, what=f"{what}: apply_rope (convention used: {convention})",
                         atol=1e-6, hint="x * cos + rotate_half(x) * sin, with cos/sin "
                                         "broadcast over the heads axis: cos[:, None, :]")
    q16 = q.to(torch.bfloat16)
    got16 = apply_rope(q16, cos, sin)
    require(got16.dtype == torch.bfloat16, what, f"apply_rope on bf16 q returned {got16.dtype}",
            "cast cos and sin to x.dtype first, as transformers does")
    ref16, _ = hf.apply_rotary_pos_emb(q16.transpose(0, 1)[None], q16.transpose(0, 1)[None],
                                       cos.to(torch.bfloat16)[None], sin.to(torch.bfloat16)[None])
    assert_close(got16, ref16[0].transpose(0, 1), what=f"{what}: apply_rope in bfloat16",
                 atol=0, rtol=0, hint="cast cos and sin to x.dtype before multiplying")
    passed("1.2 (RoPE)", f"half-split convention (dimension i pairs with i + D/2), matches "
                         f"transformers' apply_rotary_pos_emb to {worst:.1g}")


# ----------------------------------------------------------------------------- Exercise 1.3


def check_attention(causal_attention, Attention) -> None:
    """causal_attention against transformers' eager attention (GQA 8 query / 2 kv heads), with
    Tq == Tk and with Tq < Tk (queries after cached keys), then the whole Attention layer
    against Qwen2Attention with the same weights."""
    what = "Exercise 1.3 (causal_attention)"
    gen = torch.Generator().manual_seed(0)
    tk, d = 7, 16
    k, v = torch.randn(tk, KV_HEADS, d, generator=gen), torch.randn(tk, KV_HEADS, d, generator=gen)
    worst = 0.0
    for tq in (7, 3, 1):
        q = torch.randn(tq, HEADS, d, generator=gen)
        with exercise(what):
            got = causal_attention(q, k, v)
        want = reference_attention(q, k, v)
        where = f"{what}, {tq} queries over {tk} keys"
        require(isinstance(got, torch.Tensor) and got.shape == want.shape, where,
                f"expected shape {tuple(want.shape)} (Tq, Hq, D), got "
                f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
        if not _matches(got, want, atol=1e-5):
            if _matches(got, reference_attention(q, k, v, tiled=True), atol=1e-5):
                raise AssertionError(
                    f"{where}: the kv heads are *tiled* ([k0, k1, k0, k1, ...]); query head h "
                    f"must use kv head h // n_rep ([k0, k0, k0, k0, k1, ...])\n  hint: "
                    "k.repeat_interleave(n_rep, dim=1), not k.repeat(1, n_rep, 1)")
            if tq < tk and _matches(got, reference_attention(q, k, v, top_left=True), atol=1e-5):
                raise AssertionError(
                    f"{where}: the causal mask is *top-left* aligned (query i sees keys 0..i), "
                    f"but these queries are the last {tq} of {tk} positions, so query i must "
                    f"see keys 0..i + {tk - tq}\n  hint: SDPA's is_causal=True is top-left; "
                    "build the mask cols <= rows + (Tk - Tq) when Tq != Tk")
            worst = assert_close(got, want, what=where, atol=1e-5, hint="softmax(q k^T / "
                                 "sqrt(D) + causal mask) v, per query head")
        worst = max(worst, float((got - want).abs().max()))

    cfg = _hf_config()
    ref = _hf().Qwen2Attention(cfg, layer_idx=0).eval()
    randomize_(ref, seed=1, std=0.2)
    layer = "Exercise 1.3 (the Attention layer with your causal_attention)"
    ours = Attention(_our_config(cfg), layer_idx=0)
    _load_same_weights(ours, ref, layer)
    x, positions = torch.randn(9, HIDDEN, generator=gen), torch.arange(9)
    cos, sin = _hf_rope(cfg, positions)
    with torch.no_grad(), exercise(layer):
        want, _ = ref(x[None], (cos[None], sin[None]), attention_mask=_causal_mask(9, 9)[None, None])
        got = ours(x, cos, sin, lambda i, q, k, v: causal_attention(q, k, v))
    layer_diff = assert_close(got, want[0], what=layer, atol=1e-5, rtol=1e-5)
    passed("1.3 (causal_attention)", f"GQA by repeat_interleave, bottom-right causal mask; "
           f"matches eager attention to {worst:.1g} and Qwen2Attention to {layer_diff:.1g}")


# ----------------------------------------------------------------------------- Exercise 1.4


def check_mlp(MLP) -> None:
    """MLP against Qwen2MLP with the same weights."""
    what = "Exercise 1.4 (MLP)"
    cfg = _hf_config()
    ref = _hf().Qwen2MLP(cfg)
    randomize_(ref, seed=2, std=0.2)
    ours = MLP(_our_config(cfg))
    _load_same_weights(ours, ref, what)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), exercise(what):
        got = ours(x)
    with torch.no_grad():
        want = ref(x)
        silu = torch.nn.functional.silu
        up_gated = ref.down_proj(ref.gate_proj(x) * silu(ref.up_proj(x)))
    if _matches(got, up_gated, atol=1e-5):
        raise AssertionError(f"{what}: silu is applied to the up projection; SwiGLU gates with "
                             "the *gate* projection\n  hint: down(silu(gate(x)) * up(x))")
    worst = assert_close(got, want, what=what, atol=1e-5, hint="down(silu(gate(x)) * up(x))")
    passed("1.4 (MLP)", f"SwiGLU matches Qwen2MLP to {worst:.1g}")


# ----------------------------------------------------------------------------- Exercise 1.5


def check_decoder_layer(DecoderLayer) -> None:
    """DecoderLayer against Qwen2DecoderLayer (same weights, transformers' eager attention as
    the attention function, so only the layer's own wiring is graded)."""
    what = "Exercise 1.5 (DecoderLayer)"
    cfg = _hf_config()
    ref = _hf().Qwen2DecoderLayer(cfg, layer_idx=0).eval()
    randomize_(ref, seed=4, std=0.2)
    ours = DecoderLayer(_our_config(cfg), layer_idx=0)
    _load_same_weights(ours, ref, what)
    x, positions = torch.randn(6, HIDDEN, generator=torch.Generator().manual_seed(5)), torch.arange(6)
    cos, sin = _hf_rope(cfg, positions)
    with torch.no_grad():
        want = ref(x[None], attention_mask=_causal_mask(6, 6)[None, None],
                   position_embeddings=(cos[None], sin[None]))
        want = want[0] if isinstance(want, tuple) else want
        with exercise(what):
            got = ours(x, cos, sin, lambda i, q, k, v: reference_attention(q, k, v))
    worst = assert_close(got, want[0], what=what, atol=1e-5, rtol=1e-5,
                         hint="pre-norm residuals: x = x + attn(input_layernorm(x)), then "
                              "x = x + mlp(post_attention_layernorm(x))")
    passed("1.5 (DecoderLayer)", f"pre-norm residual block matches Qwen2DecoderLayer to "
                                 f"{worst:.1g}")


# ----------------------------------------------------------------------------- Exercise 1.6


def _save_checkpoint(path: Path, tensors: dict[str, torch.Tensor], hf_cfg) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    hf_cfg.to_json_file(str(path / "config.json"))
    save_file({k: v.contiguous().clone() for k, v in tensors.items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _expect_error(load_model, path: Path, name: str, problem: str, what: str) -> None:
    try:
        load_model(path)
    except NotImplementedError:
        raise
    except ValueError as err:
        require(name in str(err), what, f"the {problem} error does not name the tensor "
                f"{name!r}: {err}", "say which tensor is wrong, and how")
        return
    except Exception as err:  # noqa: BLE001 (any other exception is the wrong kind)
        raise AssertionError(f"{what}: a checkpoint with a {problem} raised "
                             f"{type(err).__name__}: {err}\n  hint: check it yourself and "
                             f"raise ValueError naming the file and {name!r}") from None
    raise AssertionError(f"{what}: a checkpoint with a {problem} ({name!r}) loaded without "
                         "an error\n  hint: compare every tensor with the model's parameters")


def check_load_model(load_model) -> None:
    """Load small checkpoints written by the grader (untied; tied with and without a stored
    lm_head.weight; with a rotary buffer) and compare every parameter with transformers';
    broken checkpoints (shape mismatch, missing or unexpected tensor) must raise ValueError
    naming the tensor."""
    from transformers import Qwen2ForCausalLM

    what = "Exercise 1.6 (load_model)"
    tmp = Path(tempfile.mkdtemp(prefix="minivllm-check-01-"))
    for n, (tied, store_head) in enumerate(((False, True), (True, False), (True, True))):
        cfg = _hf_config(tie_word_embeddings=tied)
        torch.manual_seed(6)
        hf = Qwen2ForCausalLM(cfg)
        randomize_(hf, seed=6 + n, std=0.2)
        state = {k: v for k, v in hf.state_dict().items()}
        if store_head:  # a tied checkpoint may still carry a copy (transformers ignores it)
            state["lm_head.weight"] = hf.lm_head.weight.detach().clone()
        else:
            state.pop("lm_head.weight", None)
        if tied:
            state["model.rotary_emb.inv_freq"] = torch.ones(HIDDEN // HEADS // 2)
        path = _save_checkpoint(tmp / f"ckpt{n}", state, cfg)
        case = f"{what}, tie_word_embeddings={tied}, lm_head.weight stored={store_head}"
        with exercise(what):
            try:
                model = load_model(path)
            except NotImplementedError:  # a RuntimeError, but the stub's: _exercise says so
                raise
            except (ValueError, RuntimeError, KeyError) as err:
                raise AssertionError(f"{case}: loading a valid checkpoint raised "
                                     f"{type(err).__name__}: {err}") from None
        ours = dict(model.named_parameters(remove_duplicate=False))
        for name, ref_param in hf.named_parameters(remove_duplicate=False):
            require(name in ours, case, f"the model has no parameter {name!r}")
            require(ours[name].device.type != "meta", case, f"{name!r} is still on the meta "
                    "device (never filled)",
                    "a tied lm_head must point at embed_tokens.weight again after "
                    "load_state_dict(assign=True) replaced that Parameter" if "lm_head" in name
                    else "every parameter must come from the checkpoint")
            assert_close(ours[name], ref_param, what=f"{case}: {name}", atol=0, rtol=0)
        if tied:
            require(model.lm_head.weight is model.model.embed_tokens.weight, case,
                    "lm_head.weight is not the same Parameter as embed_tokens.weight",
                    "tie them: model.lm_head.weight = model.model.embed_tokens.weight")

    cfg = _hf_config()
    hf = Qwen2ForCausalLM(cfg)
    randomize_(hf, seed=9, std=0.2)
    base = dict(hf.state_dict())
    victim = "model.layers.1.self_attn.k_proj.weight"
    with exercise(what):
        model = load_model(_save_checkpoint(tmp / "bf16", base, cfg), dtype=torch.bfloat16)
    require(model.lm_head.weight.dtype == torch.bfloat16, what,
            f"load_model(dtype=torch.bfloat16) gave {model.lm_head.weight.dtype} weights",
            "cast each tensor with .to(device=device, dtype=dtype)")
    broken = {**base, victim: base[victim][:, :-1]}
    _expect_error(load_model, _save_checkpoint(tmp / "shape", broken, cfg), victim,
                  "shape mismatch", what)
    broken = {k: v for k, v in base.items() if k != victim}
    _expect_error(load_model, _save_checkpoint(tmp / "missing", broken, cfg), victim,
                  "missing tensor", what)
    extra = "model.layers.0.mlp.extra_proj.weight"
    broken = {**base, extra: torch.zeros(2, 2)}
    _expect_error(load_model, _save_checkpoint(tmp / "unexpected", broken, cfg), extra,
                  "unexpected tensor", what)
    passed("1.6 (load_model)", "every tensor equals transformers' (untied, tied with and "
                               "without a stored lm_head); bad checkpoints raise clear errors")


# ----------------------------------------------------------------------------- Exercise 1.7


def hf_model(model_path: str | Path):
    """transformers' model in fp32 with eager attention: the oracle."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()

    return AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=torch.float32, attn_implementation="eager").eval()


@torch.inference_mode()
def hf_greedy(hf, prompt_ids: list[int], max_new_tokens: int,
              eos_token_ids=()) -> list[int]:
    """transformers' greedy continuation (its KV cache, argmax each step, stop after EOS)."""
    params = inspect.signature(hf.forward).parameters
    cache_arg = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5
    out = hf(torch.tensor([prompt_ids]), use_cache=True)
    tokens = []
    for _ in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        if token in eos_token_ids:
            break
        out = hf(torch.tensor([[token]]), use_cache=True, **{cache_arg: out[cache_arg]})
    return tokens


def _count_fed_tokens(model):
    """Count the tokens that go through the embedding (how much the loop recomputes)."""
    count = [0]
    handle = model.model.embed_tokens.register_forward_pre_hook(
        lambda _module, args: count.__setitem__(0, count[0] + args[0].numel()))
    return count, handle


def check_greedy(greedy_generate, model, model_path: str | Path, max_new_tokens: int = 12,
                 hf=None) -> None:
    """Greedy tokens of ``model`` (loaded from ``model_path``) against transformers' greedy
    loop on three random prompts; the prompt must be fed once (a KV cache, not a re-run);
    an EOS id must stop generation and be included, like ``generate``."""
    what = "Exercise 1.7 (greedy_generate)"
    hf = hf if hf is not None else hf_model(model_path)
    gen = torch.Generator().manual_seed(7)
    high = min(model.config.vocab_size, 1000)
    prompts = [torch.randint(3, high, (n,), generator=gen).tolist() for n in (1, 6, 17)]
    count, handle = _count_fed_tokens(model)
    try:
        for prompt in prompts:
            want = hf_greedy(hf, prompt, max_new_tokens)
            count[0] = 0
            with exercise(what):
                got = greedy_generate(model, prompt, max_new_tokens)
            assert_equal(got, want, what=f"{what}, prompt of {len(prompt)} tokens",
                         hint="return only the new tokens; argmax of the last position's logits")
            fed = len(prompt) + len(got) - 1
            require(count[0] == fed, what, f"{count[0]} tokens went through the model for a "
                    f"{len(prompt)}-token prompt and {len(got)} new tokens; with a KV cache it "
                    f"is {fed} (the prompt once, then one token per step)",
                    "after the prefill feed only the new token, at position cache.length")
        prompt = prompts[1]
        free = hf_greedy(hf, prompt, max_new_tokens)
        eos = free[3]
        want = free[: free.index(eos) + 1]
        got = greedy_generate(model, prompt, max_new_tokens, eos_token_ids=[eos])
        assert_equal(got, want, what=f"{what}, with eos_token_ids=[{eos}]",
                     hint="append the token, then stop if it is an EOS id (it is included)")
    finally:
        handle.remove()
    passed("1.7 (greedy_generate)", f"{len(prompts)} prompts token for token with "
                                    "transformers; prompt fed once; stops after EOS")


# ----------------------------------------------------------------------------- the milestone


def check_milestone(load_model, greedy_generate, model_path: str | Path, prompts: list[str],
                    max_new_tokens: int = 32) -> None:
    """Milestone 1: the learner's whole model (loaded by their load_model) against
    transformers — prefill logits, then greedy text for every prompt, EOS included."""
    from minivllm.config import read_eos_token_ids
    from minivllm.tokenizer import Tokenizer

    what = "Milestone 1"
    tok = Tokenizer.from_pretrained(model_path)
    eos = tuple(read_eos_token_ids(model_path))
    with exercise(what):
        ours = load_model(model_path)
    hf = hf_model(model_path)
    ids = tok.encode(prompts[0])
    with torch.no_grad(), exercise(what):
        hidden = ours(torch.tensor(ids), torch.arange(len(ids)),
                      lambda i, q, k, v: reference_attention(q, k, v))
        got = ours.compute_logits(hidden)
        want = hf(torch.tensor([ids])).logits[0]
    diff = assert_close(got, want, what=f"{what}: prefill logits of {prompts[0]!r}", atol=1e-4,
                        rtol=0)
    total = 0
    for prompt in prompts:
        ids = tok.encode(prompt)
        want = hf_greedy(hf, ids, max_new_tokens, eos)
        with exercise(what):
            got = greedy_generate(ours, ids, max_new_tokens, eos_token_ids=eos)
        assert_equal(got, want, what=f"{what}: greedy continuation of {prompt!r}",
                     hint=f"yours: {tok.decode(got)!r}\n  transformers: {tok.decode(want)!r}")
        total += len(got)
    print(f"✅ Milestone 1 passed — {len(prompts)} prompts, {total} greedy tokens identical to "
          f"transformers; prefill logits max abs diff {diff:.2g}")
