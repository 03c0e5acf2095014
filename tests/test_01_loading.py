"""M1: config parsing and checkpoint loading, including the errors a learner will meet.

Every error must name the file and the problem, so a broken checkpoint is a one-line fix.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import TINY_COMMON, build_checkpoint
from minivllm.config import (
    EngineConfig,
    ModelConfig,
    read_eos_token_ids,
    resolve_dtype,
    resolve_model_path,
)
from minivllm.model import load_model


@pytest.fixture
def checkpoint(tiny_random_qwen2, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may break."""
    return Path(shutil.copytree(tiny_random_qwen2, tmp_path / "ckpt"))


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def edit_weights(path: Path, edit) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_checkpoint_dir(tmp_path):
    """Guards: a typo in the model path surfacing as a confusing error deep inside loading."""
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(tmp_path / "nope")


def test_missing_config_json(checkpoint):
    """Guards: a directory without config.json reported without naming the file."""
    (checkpoint / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_model(checkpoint)


def test_unsupported_model_type(checkpoint):
    """Guards: silently running a Llama/Mistral checkpoint as if it were Qwen."""
    edit_config(checkpoint, model_type="llama")
    with pytest.raises(ValueError, match=r"config\.json.*'llama'.*qwen2, qwen3"):
        load_model(checkpoint)


def test_missing_config_key(checkpoint):
    """Guards: a KeyError without the file name for a truncated config.json."""
    config = json.loads((checkpoint / "config.json").read_text())
    del config["hidden_size"]
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*hidden_size"):
        load_model(checkpoint)


def test_unsupported_rope_scaling():
    """Guards: computing plain RoPE for a yarn/linear-scaled checkpoint (wrong past 4k)."""
    d = {**TINY_COMMON, "model_type": "qwen2", "rope_scaling": {"type": "yarn", "factor": 4.0}}
    with pytest.raises(ValueError, match=r"my/config\.json.*yarn"):
        ModelConfig.from_dict(d, source="my/config.json")


def test_no_safetensors(checkpoint):
    """Guards: a pytorch_model.bin-only checkpoint failing with a cryptic open() error."""
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"safetensors"):
        load_model(checkpoint)


def test_missing_tensor(checkpoint):
    """Guards: a missing weight left at its meta/uninitialised value."""
    edit_weights(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"ckpt.*missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(checkpoint)


def test_unexpected_tensor(checkpoint):
    """Guards: silently ignoring weights of a different architecture."""
    edit_weights(checkpoint, lambda t: t.update({"model.layers.0.extra.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"model\.safetensors.*unexpected.*layers\.0\.extra"):
        load_model(checkpoint)


def test_shape_mismatch(checkpoint):
    """Guards: a transposed or truncated weight loading without complaint."""
    name = "model.layers.0.self_attn.k_proj.weight"  # (n_kv * D, hidden) = (16, 64)
    edit_weights(checkpoint, lambda t: t.update({name: t[name].T.contiguous()}))
    with pytest.raises(ValueError, match=r"model\.safetensors.*k_proj.*\(16, 64\).*\(64, 16\)"):
        load_model(checkpoint)


def test_extra_rotary_buffer_is_ignored(checkpoint):
    """Guards: failing on old checkpoints that saved rotary_emb.inv_freq."""
    key = "model.layers.0.self_attn.rotary_emb.inv_freq"
    edit_weights(checkpoint, lambda t: t.update({key: torch.ones(4)}))
    load_model(checkpoint)


@pytest.mark.parametrize("with_head", [False, True])
def test_tied_embeddings(tmp_path, with_head):
    """Guards: an uninitialised lm_head when the checkpoint omits it, or an untied copy."""
    path = build_checkpoint(tmp_path, "qwen2", {**TINY_COMMON, "tie_word_embeddings": True}, 3)
    if with_head:  # some exporters write the tied head anyway: it must be ignored
        edit_weights(path, lambda t: t.update({"lm_head.weight": torch.zeros(512, 64)}))
    model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.abs().sum() > 0


def test_sharded_matches_single_file(tiny_random_qwen2, tmp_path):
    """Guards: loading only the first shard of a model.safetensors.index.json checkpoint."""
    sharded = build_checkpoint(
        tmp_path, "qwen2", TINY_COMMON, seed=1, std=0.15, max_shard_size="100KB"
    )
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    assert (sharded / "model.safetensors.index.json").is_file()
    want, got = load_model(tiny_random_qwen2).state_dict(), load_model(sharded).state_dict()
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_load_casts_dtype(tiny_random_qwen2):
    """Guards: a model left half in the checkpoint's dtype after a cast."""
    model = load_model(tiny_random_qwen2, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.is_meta for p in model.parameters())


def test_hub_id_not_in_cache(monkeypatch, tmp_path):
    """Guards: a hang or a stack trace from the hub client instead of a clear message."""
    import huggingface_hub.constants as hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)  # read once at import: patch it too
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="neither a local checkpoint directory nor"):
        resolve_model_path("minivllm-tests/no-such-model")


def test_local_dir_resolves_to_itself(tiny_random_qwen2):
    assert resolve_model_path(str(tiny_random_qwen2)) == tiny_random_qwen2


def test_config_fields_qwen2_and_qwen3(tiny_random_qwen2, tiny_random_qwen3):
    """Guards: Qwen2 q/k/v bias dropped (its configs carry no attention_bias), and Qwen3's
    explicit head_dim ignored."""
    qwen2 = ModelConfig.from_pretrained(tiny_random_qwen2)
    assert (qwen2.attention_bias, qwen2.qk_norm, qwen2.head_dim) == (True, False, 8)
    qwen3 = ModelConfig.from_pretrained(tiny_random_qwen3)
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.rope_theta) == (True, 16, 10000.0)


def test_rope_theta_top_level_or_rope_parameters():
    """Guards: reading rope_theta from only one of the two config layouts."""
    base = {**TINY_COMMON, "model_type": "qwen3"}
    old = ModelConfig.from_dict({**base, "rope_theta": 1e6})
    new = ModelConfig.from_dict(
        {
            **{k: v for k, v in base.items() if k != "rope_theta"},
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        }
    )
    assert old.rope_theta == new.rope_theta == 1e6


def test_eos_ids_from_generation_config(tmp_path):
    """Guards: stopping only on <|endoftext|> when the chat model ends turns with <|im_end|>."""
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 151643}))
    assert read_eos_token_ids(tmp_path) == (151643,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert read_eos_token_ids(tmp_path) == (151645, 151643)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "fp8"}, "dtype"),
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": -1}, "num_blocks"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"step_overhead_tokens": -1}, "step_overhead_tokens"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"attention_backend": "flash"}, "attention_backend"),
    ],
)
def test_engine_config_validation(kwargs, message):
    """Guards: a bad engine option failing much later, far from its cause."""
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_step_token_budget_defaults_by_device():
    """Guards: a CPU engine taking a GPU's 2048-token step (a 0.5B prefill chunk of 2048
    tokens stalls every decoding sequence for over a second on two cores), and a budget
    that was asked for being replaced by the device's default."""
    from minivllm.config import default_max_num_batched_tokens

    assert EngineConfig().max_num_batched_tokens is None  # None: chosen by the device
    assert default_max_num_batched_tokens("cpu") == 512
    assert default_max_num_batched_tokens(torch.device("cuda", 1)) == 2048
    assert EngineConfig().with_device_defaults("cpu").max_num_batched_tokens == 512
    assert EngineConfig().with_device_defaults("cuda").max_num_batched_tokens == 2048
    asked = EngineConfig(max_num_batched_tokens=4096, step_overhead_tokens=0)
    assert asked.with_device_defaults("cpu") is asked


def test_step_overhead_defaults_by_device():
    """Guards: a GPU engine weighing whether prompts share a step (there they always should:
    a step costs about the same for 1 token as for 2048), a CPU engine packing every waiting
    prompt into one step, and an asked-for value being replaced."""
    from minivllm.config import default_step_overhead_tokens

    assert EngineConfig().step_overhead_tokens is None  # None: chosen by the device
    assert default_step_overhead_tokens("cpu") == 16
    assert default_step_overhead_tokens(torch.device("cuda", 1)) == 0  # 0: always pack
    assert EngineConfig().with_device_defaults("cpu").step_overhead_tokens == 16
    assert EngineConfig().with_device_defaults("cuda").step_overhead_tokens == 0
    assert EngineConfig(step_overhead_tokens=0).with_device_defaults("cpu").step_overhead_tokens == 0


def _config(path: Path, **changes) -> ModelConfig:
    return dataclasses.replace(ModelConfig.from_pretrained(path), **changes)


QWEN25_05B_SHAPE = {"vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                    "head_dim": 64, "tie_word_embeddings": True}


def test_num_parameters_matches_the_checkpoint(tiny_random_qwen2, tiny_random_qwen3):
    """Guards: the dtype rule's model size counting what the checkpoint does not hold."""
    for path in (tiny_random_qwen2, tiny_random_qwen3):
        weights = load_file(str(next(Path(path).glob("*.safetensors"))))
        assert ModelConfig.from_pretrained(path).num_parameters == sum(
            t.numel() for t in weights.values())
    assert _config(tiny_random_qwen2, **QWEN25_05B_SHAPE).num_parameters == 494_032_768


def test_resolve_dtype_auto_follows_the_cpu(tiny_random_qwen2, monkeypatch):
    """Guards: 'auto' running a bf16 checkpoint in fp32 on a CPU with bf16 units (1.9-2.8x
    slower), or in bf16 on one without them (emulated, ~4x slower), or for a model too small
    for bf16 to pay."""
    from minivllm import config

    big_bf16 = _config(tiny_random_qwen2, torch_dtype="bfloat16", **QWEN25_05B_SHAPE)
    small_bf16 = _config(tiny_random_qwen2, torch_dtype="bfloat16")
    big_fp32 = dataclasses.replace(big_bf16, torch_dtype="float32")
    monkeypatch.setattr(config, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert resolve_dtype("auto", "cpu", big_bf16) == torch.bfloat16
    assert "amx_bf16" in config.auto_dtype("cpu", big_bf16)[1]
    assert resolve_dtype("auto", "cpu", small_bf16) == torch.float32
    assert "too small" in config.auto_dtype("cpu", small_bf16)[1]
    assert resolve_dtype("auto", "cpu", big_fp32) == torch.float32
    monkeypatch.setattr(config, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert resolve_dtype("auto", "cpu", big_bf16) == torch.float32
    assert "no native bf16" in config.auto_dtype("cpu", big_bf16)[1]
    assert resolve_dtype("auto", "cuda", big_bf16) == torch.bfloat16
    # an AMX machine told to behave like an AVX2 one (docs/decisions.md, issue 15)
    monkeypatch.setattr(config, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert resolve_dtype("auto", "cpu", big_bf16) == torch.float32
    assert "capped below it (ONEDNN_MAX_CPU_ISA=AVX2)" in config.auto_dtype("cpu", big_bf16)[1]
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")  # a cap above bf16: no change
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")  # float32's library only
    assert resolve_dtype("auto", "cpu", big_bf16) == torch.bfloat16
    assert config.isa_caps() == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX",
                                 "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert resolve_dtype("auto", "cpu", big_bf16) == torch.float32
    assert resolve_dtype("float16", "cpu", big_bf16) == torch.float16
    assert resolve_dtype("float32", "cpu", big_bf16) == torch.float32


def test_cpu_flags_reads_this_machine():
    """Guards: the feature probe returning nothing on Linux (every CPU would look AVX2-less)."""
    from minivllm.config import cpu_flags

    flags = cpu_flags()
    assert isinstance(flags, frozenset)
    if Path("/proc/cpuinfo").is_file() and "flags" in Path("/proc/cpuinfo").read_text():
        assert flags and all(" " not in f for f in flags)
