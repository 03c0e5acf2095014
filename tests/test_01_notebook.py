"""Notebook 01_forward_pass: every check cell fails on the learner's stubs and on planted wrong
answers (the classic mistakes: interleaved RoPE, tiled GQA heads, a top-left causal mask
with cached keys, ...), and passes on the reference package objects.

The learner's modules are exported from notebooks/01_forward_pass.ipynb into a temporary
folder and imported from there. Planted wrong answers are "mutants": the package module's
source with one line changed (each mutation asserts that its target text exists, so a
refactor that removes it fails here loudly instead of testing nothing).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from notebook_helpers import export_learner, mutate

import minivllm.model as ref
from minivllm.course import checks_01 as checks

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "01_forward_pass.ipynb"


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    """The stubbed modules a learner starts from, exported from the learner's notebook."""
    names = ["config", "tokenizer", "model"]
    return export_learner(NOTEBOOK, tmp_path_factory.mktemp("nb01"), names, "nb01")


def mutant(*edits: tuple[str, str]):
    """minivllm.model re-imported from its source with each (old, new) replacement applied."""
    return mutate(ref, *edits)


@pytest.fixture(scope="module")
def oracle(tiny_random_qwen2):
    """The tiny random checkpoint, our reference load of it, and transformers' (loaded once)."""
    return tiny_random_qwen2, ref.load_model(tiny_random_qwen2), checks.hf_model(tiny_random_qwen2)


def _graders(m, oracle=None):
    graders = {
        "rmsnorm": lambda: checks.check_rmsnorm(m.RMSNorm),
        "rope": lambda: checks.check_rope(m.rope_cos_sin, m.rotate_half, m.apply_rope),
        "attention": lambda: checks.check_attention(m.causal_attention, m.Attention),
        "mlp": lambda: checks.check_mlp(m.MLP),
        "decoder_layer": lambda: checks.check_decoder_layer(m.DecoderLayer),
        "load_model": lambda: checks.check_load_model(m.load_model),
    }
    if oracle is not None:
        path, model, hf = oracle
        graders["greedy"] = lambda: checks.check_greedy(m.greedy_generate, model, path, hf=hf)
    return graders


GRADERS = [*_graders(ref), "greedy"]


def test_every_exercise_is_a_stub(learner, tiny_random_qwen2):
    m = learner["model"]
    cfg = checks._our_config(checks._hf_config())
    x, cos, sin = torch.ones(3, cfg.hidden_size), torch.ones(3, 8), torch.zeros(3, 8)
    attn = lambda i, q, k, v: q
    model = ref.load_model(tiny_random_qwen2)
    calls = {
        "Exercise 1.1: RMSNorm.forward": lambda: m.RMSNorm(4, 1e-6)(torch.ones(2, 4)),
        "Exercise 1.2: rotate_half": lambda: m.rotate_half(torch.ones(2, 1, 8)),
        "Exercise 1.2: apply_rope": lambda: m.apply_rope(torch.ones(3, 1, 8), cos, sin),
        "Exercise 1.3: causal_attention": lambda: m.causal_attention(
            torch.ones(3, 4, 8), torch.ones(3, 2, 8), torch.ones(3, 2, 8)),
        "Exercise 1.4: MLP.forward": lambda: m.MLP(cfg)(x),
        "Exercise 1.5: DecoderLayer.forward": lambda: m.DecoderLayer(cfg, 0)(x, cos, sin, attn),
        "Exercise 1.6: load_model": lambda: m.load_model(tiny_random_qwen2),
        "Exercise 1.7: greedy_generate": lambda: m.greedy_generate(model, [1, 2], 3),
    }
    for label, call in calls.items():
        with pytest.raises(NotImplementedError, match=label):
            call()


def test_config_and_tokenizer_have_no_exercise(learner, qwen25_tokenizer_dir):
    """The learner's config and tokenizer modules work as exported (they are given code)."""
    tok = learner["tokenizer"].Tokenizer.from_pretrained(qwen25_tokenizer_dir)
    assert tok.decode(tok.encode("héllo 👋 世界")) == "héllo 👋 世界"
    assert learner["config"].EngineConfig().block_size == 16


@pytest.mark.parametrize("grader", GRADERS)
def test_check_fails_on_the_stub(learner, oracle, grader, capsys):
    with pytest.raises(AssertionError, match="not implemented yet"):
        _graders(learner["model"], oracle)[grader]()
    assert "✅" not in capsys.readouterr().out


@pytest.mark.parametrize("grader", GRADERS)
def test_check_passes_on_the_reference(oracle, grader, capsys):
    _graders(ref, oracle)[grader]()
    assert "✅" in capsys.readouterr().out


INTERLEAVED_ROTATE = ("x1, x2 = x.chunk(2, dim=-1)\n    return torch.cat((-x2, x1), dim=-1)",
                      ("x1, x2 = x[..., 0::2], x[..., 1::2]\n"
                      "    return torch.stack((-x2, x1), dim=-1).flatten(-2)"))

MUTANTS = {  # name -> (grader, edits, what the message must say or None)
    "RMSNorm without eps": (
        "rmsnorm", [("mean(-1, keepdim=True) + self.eps)", "mean(-1, keepdim=True))")], "eps"),
    "RMSNorm statistics in bf16": ("rmsnorm", [("x = x.float()", "x = x")], "bfloat16"),
    "RMSNorm weight before the cast back": (
        "rmsnorm", [("return self.weight * x.to(dtype)", "return (self.weight * x).to(dtype)")],
        None),
    "interleaved rotate_half": ("rope", [INTERLEAVED_ROTATE], "interleaved"),
    "interleaved apply_rope": (
        "rope", [("return x * cos + rotate_half(x) * sin",
                  ("rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)\n"
                  "    return x * cos + rot * sin"))], "interleaved"),
    "rope cos/sin not cast to x.dtype": ("rope", [("cos = cos.to(x.dtype)[:, None, :]",
                                                   "cos = cos[:, None, :]"),
                                                  ("sin = sin.to(x.dtype)[:, None, :]",
                                                   "sin = sin[:, None, :]")], "bf16"),
    "tiled GQA heads": (
        "attention", [("k = k.repeat_interleave(n_rep, dim=1)", "k = k.repeat(1, n_rep, 1)"),
                      ("v = v.repeat_interleave(n_rep, dim=1)", "v = v.repeat(1, n_rep, 1)")],
        "tiled"),
    "top-left causal mask with cached keys": ("attention", [("if tq == tk:", "if True:")],
                                              "top-left"),
    "no scaling by sqrt(head_dim)": (
        "attention", [("out = F.scaled_dot_product_attention(q, k, v, is_causal=True)",
                       "out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)")],
        None),
    "silu on the up branch": (
        "mlp", [("F.silu(self.gate_proj(x)) * self.up_proj(x)",
                 "self.gate_proj(x) * F.silu(self.up_proj(x))")], "gate"),
    "missing attention residual": (
        "decoder_layer", [("x = x + self.self_attn(", "x = self.self_attn(")], None),
    "post-norm instead of pre-norm": (
        "decoder_layer", [("return x + self.mlp(self.post_attention_layernorm(x))",
                           "return self.post_attention_layernorm(x + self.mlp(x))")], None),
    "ignores tied embeddings (no re-tie after assign)": (
        "load_model", [(("    if config.tie_word_embeddings:  # assign=True replaced the Parameter: "
                        "tie again\n        model.lm_head.weight = model.model.embed_tokens.weight\n"),
                        "")], "lm_head"),
    "ignores tied embeddings (a stored lm_head is unexpected)": (
        "load_model", [('if name == "lm_head.weight" and config.tie_word_embeddings:', "if False:")],
        "lm_head"),
    "no shape check": ("load_model", [("if tensor.shape != expected[name]:", "if False:")],
                       "shape mismatch"),
    "no missing-tensor check": ("load_model", [("    if missing:\n", "    if False:\n")],
                                "missing tensor"),
    "ignores the dtype argument": ("load_model", [("tensor.to(device=device, dtype=dtype)",
                                                   "tensor.to(device=device)")], "bfloat16"),
    "greedy re-feeds the whole sequence every step": (
        "greedy", [(("input_ids = torch.tensor([token], device=param.device)\n"
                    "        positions = torch.tensor([cache.length], device=param.device)"),
                    ("input_ids = torch.tensor(prompt_ids + out, device=param.device)\n"
                    "        positions = torch.arange(len(input_ids), device=param.device)\n"
                    "        cache = ContiguousKVCache(model.config, len(input_ids), param.dtype, "
                    "param.device)"))], "tokens went through the model"),
    "greedy drops the EOS token": (
        "greedy", [("out.append(token)\n        if token in eos:\n            break",
                    "if token in eos:\n            break\n        out.append(token)")], "eos"),
    "greedy decodes at the wrong position": (
        "greedy", [("positions = torch.tensor([cache.length], device=param.device)",
                    "positions = torch.tensor([cache.length - 1], device=param.device)")], None),
}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_check_fails_on_a_planted_wrong_answer(name, oracle, capsys):
    grader, edits, says = MUTANTS[name]
    with pytest.raises(AssertionError) as err:
        _graders(mutant(*edits), oracle)[grader]()
    if says:
        assert says in str(err.value), str(err.value)
    assert "✅" not in capsys.readouterr().out


def test_milestone_check(learner, tiny_model, capsys):
    """The milestone check passes on the reference and fails on the stubbed loader."""
    prompts = ["def fibonacci(n):", "import os\n"]
    checks.check_milestone(ref.load_model, ref.greedy_generate, tiny_model, prompts, 8)
    assert "✅ Milestone 1 passed" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="not implemented yet"):
        checks.check_milestone(learner["model"].load_model, ref.greedy_generate, tiny_model,
                               prompts, 8)
