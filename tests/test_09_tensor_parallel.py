"""Milestone 9: tensor parallelism on CPU with gloo (device="cpu" even where CUDA is present).

Two kinds of tests:

* in one process, no process group: the sharded loader, the split refusal, and the sharded
  model run as N threads (``minivllm.course.checks_09.run_ranks``) against the whole model;
* real tensor-parallel engines (spawned gloo workers) against TP=1 and ``transformers``
  greedy, token for token, with prefix caching, chunked prefill and preemption under a tight
  pool; logprobs within 1e-4 (the all-reduce changes the order of the sums); a killed worker;
  no worker left after ``del`` or process exit.

A TP engine costs a few seconds of process start-up, so the TP=2 engine under pressure is
module-scoped and shared; one TP engine may run per process, so the tests that start their
own come first, and the worker-kill test runs last and breaks the shared engine on purpose.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
from hf_oracle import hf_greedy

from checkpoints import QWEN25_05B, build_checkpoint
from minivllm import LLM, TINY_MODEL, SamplingParams
from minivllm.config import ModelConfig
from minivllm.course.checks_09 import run_ranks
from minivllm.model import ContiguousKVCache, QwenForCausalLM, load_model
from minivllm.parallel import (
    FORWARD,
    HEADER,
    TensorParallelError,
    TensorParallelRunner,
    TPGroup,
    check_tp_split,
    decode_inputs,
    encode_inputs,
    load_sharded_model,
    weight_bytes,
)
from minivllm.runner import ModelInputs, ModelRunner

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SMALL = {"vocab_size": 509,  # not divisible by 2 or 4: the last rank's vocab shard is padded
         "hidden_size": 64, "num_hidden_layers": 2, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "bos_token_id": None, "eos_token_id": 2}
SHAPES = {
    # Qwen3, untied, biases, 8 heads / 4 KV heads: TP=2 splits them 2 + 2
    "qwen3": ("qwen3", {**SMALL, "intermediate_size": 128, "num_attention_heads": 8,
                        "num_key_value_heads": 4, "head_dim": 16, "attention_bias": True,
                        "tie_word_embeddings": False}),
    # Qwen2, tied, one KV head: TP=2 replicates it on both ranks
    "qwen2_tied_kv1": ("qwen2", {**SMALL, "intermediate_size": 96, "num_attention_heads": 4,
                                 "num_key_value_heads": 1, "tie_word_embeddings": True}),
}


def prompts(n: int, length: int, seed: int, vocab: int = 509) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, vocab, (length + 7 * i,), generator=g).tolist()}
            for i in range(n)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Small random fp32 checkpoints of SHAPES, with the bundled model's tokenizer files."""
    built = {}

    def get(name: str) -> Path:
        if name not in built:
            model_type, kwargs = SHAPES[name]
            out = build_checkpoint(tmp_path_factory.mktemp(name), model_type, kwargs, seed=9,
                                   std=0.15)
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copyfile(Path(TINY_MODEL) / f, out / f)
            built[name] = out
        return built[name]

    return get


def worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.engine.runner.workers]


def assert_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"tensor-parallel worker(s) {alive} still running")


# ----------------------------------------------------------------------------- one process


def test_bad_split_is_refused_naming_heads_and_sizes():
    qwen25 = ModelConfig.from_dict({**QWEN25_05B, "model_type": "qwen2"})
    with pytest.raises(ValueError, match=r"14 attention heads.*Allowed sizes: 1, 2$") as err:
        check_tp_split(qwen25, 4)
    assert "2 KV heads" in str(err.value)
    start = time.monotonic()
    with pytest.raises(ValueError, match="tensor_parallel_size=3.*8 attention heads"):
        LLM(TINY_MODEL, tensor_parallel_size=3, device="cpu", compile=False)  # refused before any spawn
    assert time.monotonic() - start < 30


def test_tp1_keeps_the_plain_model():
    llm = LLM(TINY_MODEL, dtype="float32", device="cpu", compile=False, num_blocks=8,
              max_model_len=128)
    assert isinstance(llm.engine.runner, ModelRunner)
    assert not isinstance(llm.engine.runner, TensorParallelRunner)
    assert type(llm.engine.runner.model) is QwenForCausalLM


def test_a_worker_serves_from_the_frame_room(monkeypatch):
    """Guards: a worker rank's step loop (``_serve``) not started from notebook 03's frame
    room, where a chunk of CPython's frame stack can be mapped and unmapped every step (rank
    0's engine loop starts from it). The group and the shard are stand-ins: only the call
    path into the loop is under test."""
    import types

    from frame_room import under_frame_room

    from minivllm import parallel
    from minivllm.config import EngineConfig

    served = []
    model = types.SimpleNamespace(config=ModelConfig.from_pretrained(TINY_MODEL))
    monkeypatch.setattr(parallel, "_init_group", lambda *args: (None, None))
    monkeypatch.setattr(parallel, "load_sharded_model", lambda *args: model)
    monkeypatch.setattr(parallel, "_serve", lambda tp, runner: served.append(
        (tp.rank, runner.model is model, under_frame_room())))
    parallel.run_worker(1, 2, str(TINY_MODEL), "float32", "cpu", None,
                        EngineConfig(model=str(TINY_MODEL)), torch.get_num_threads())
    assert served == [(1, True, True)]


@pytest.mark.parametrize("logits_rows", [[0, 3], []])
def test_model_inputs_travel_whole(logits_rows):
    """What rank 0 broadcasts decodes to the very ModelInputs its runner got (a step without
    logits rows too: then no rank computes logits)."""
    step = ModelInputs([812, 11, 12, 13, 14], [20, 0, 1, 2, 3], [[3, 7], [5], []], [20, 0, 0],
                       [1, 3, 1], logits_rows)
    header, payload = encode_inputs(step, num_blocks=64)
    assert header[0] == FORWARD and len(header) == HEADER and header[-1] == 64
    assert payload.dtype == torch.long
    assert decode_inputs(header, payload) == step


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_loads_only_its_shards(world):
    full = load_model(TINY_MODEL, torch.float32)
    cfg = full.config
    shards = [load_sharded_model(TINY_MODEL, TPGroup(r, world), torch.float32)
              for r in range(world)]
    layer = lambda m: m.model.layers[1].self_attn
    q = torch.cat([layer(s).q_proj.weight for s in shards])
    o = torch.cat([layer(s).o_proj.weight for s in shards], dim=1)
    emb = torch.cat([s.model.embed_tokens.weight for s in shards])[:cfg.vocab_size]
    assert torch.equal(q, layer(full).q_proj.weight)
    assert torch.equal(o, layer(full).o_proj.weight)
    assert torch.equal(emb, full.model.embed_tokens.weight)
    kv_rows = [layer(s).k_proj.weight for s in shards]  # 2 KV heads: split over 2, copied over 4
    assert torch.equal(kv_rows[0], layer(full).k_proj.weight[:cfg.head_dim * 2 // min(world, 2)])
    total = weight_bytes(full)
    for s in shards:  # about 1/N each: the norms are whole on every rank, and at TP=4 each of
        assert weight_bytes(s) < total / world * 1.05, (weight_bytes(s), total)  # 2 KV heads twice


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_forward_equals_the_whole_model(world):
    """The ranks as threads of this process: every rank's logits equal TP=1's within 1e-4."""
    full = load_model(TINY_MODEL, torch.float32)
    ids = torch.tensor([5, 77, 4001, 12, 3999, 8, 1024, 2048, 3])
    positions = torch.arange(len(ids))
    with torch.inference_mode():
        want = full.compute_logits(full(ids, positions, ContiguousKVCache(full.config, 16,
                                                                          torch.float32, "cpu")))

    def rank_logits(group):
        model = load_sharded_model(TINY_MODEL, group, torch.float32)
        n_kv = model.model.layers[0].self_attn.n_kv_heads
        cfg = dataclasses.replace(full.config, num_key_value_heads=n_kv)  # this rank's heads
        return model.compute_logits(model(ids, positions, ContiguousKVCache(cfg, 16,
                                                                            torch.float32, "cpu")))

    for logits in run_ranks(world, rank_logits):
        torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(logits.argmax(-1), want.argmax(-1))


# ----------------------------------------------------------------------------- real engines

@pytest.mark.parametrize(("name", "world"), [(None, 4), ("qwen3", 2), ("qwen2_tied_kv1", 2)])
def test_tp_equals_tp1_and_transformers(checkpoint, name, world, caplog):
    path = TINY_MODEL if name is None else str(checkpoint(name))
    vocab = ModelConfig.from_pretrained(path).vocab_size
    batch = prompts(3, 12, seed=world, vocab=vocab)
    options = {"dtype": "float32", "device": "cpu", "compile": False, "num_blocks": 32,
               "max_model_len": 128}
    ref = token_ids(LLM(path, **options).generate(batch, GREEDY, use_tqdm=False))
    with caplog.at_level("INFO", logger="minivllm.parallel"):  # compile asked: TP runs eagerly
        llm = LLM(path, tensor_parallel_size=world, **{**options, "compile": True})
    assert type(llm.engine.runner) is TensorParallelRunner
    assert "tensor parallel: the decode step runs eagerly (not compiled)" in caplog.text
    pids = worker_pids(llm)
    try:
        assert token_ids(llm.generate(batch, GREEDY, use_tqdm=False)) == ref
    finally:
        del llm
        gc.collect()
    assert_gone(pids)  # deleting the LLM stops its workers
    for p, ids in zip(batch, ref):
        assert ids == hf_greedy(path, p["prompt_token_ids"], GREEDY.max_tokens)


def test_process_exit_leaves_no_worker():
    script = textwrap.dedent(f"""
        from minivllm import LLM
        if __name__ == "__main__":
            llm = LLM({str(TINY_MODEL)!r}, tensor_parallel_size=2, dtype="float32",
                      device="cpu", compile=False, num_blocks=8, max_model_len=128)
            print(*[p.pid for p in llm.engine.runner.workers], flush=True)
    """)
    run = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                         timeout=180, env={**os.environ, "MINIVLLM_TP_TIMEOUT": "60"})
    assert run.returncode == 0, run.stderr[-2000:]
    pids = [int(p) for p in run.stdout.split()]
    assert len(pids) == 1
    assert_gone(pids)


def test_torchrun_launch(tmp_path):
    """The ranks of a torchrun launch (RANK / WORLD_SIZE / MASTER_*): no spawn; rank 1 serves
    inside LLM(...) and exits with rank 0; rank 0's tokens equal TP=1's; close() stops this
    process's gloo threads (/proc/self/task: Linux), so none is left for the exit to trip on."""
    script = tmp_path / "tp_torchrun.py"
    script.write_text(textwrap.dedent(f"""
        import os
        from minivllm import LLM, SamplingParams
        llm = LLM({str(TINY_MODEL)!r}, tensor_parallel_size=2, dtype="float32", device="cpu",
                  compile=False, num_blocks=16, max_model_len=128)
        assert os.environ["RANK"] == "0" and not llm.engine.runner.workers
        out = llm.generate([{{"prompt_token_ids": [5, 6, 7, 8]}}],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        print("tokens", *out[0].outputs[0].token_ids, flush=True)
        gloo = lambda: [t for t in os.listdir("/proc/self/task")
                        if open(f"/proc/self/task/{{t}}/comm").read().startswith(("gloo", "pt_gloo"))]
        assert gloo(), "expected gloo threads while the group is up"
        llm.engine.runner.close()
        assert not gloo(), "close() left gloo threads running (they abort the exit)"
        print("closed", flush=True)
    """))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(port), str(script)], check=False,
                         capture_output=True, text=True, timeout=180,
                         env={**os.environ, "MINIVLLM_TP_TIMEOUT": "60", "TQDM_DISABLE": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "closed" in run.stdout.splitlines(), run.stdout[-2000:]
    (line,) = [t for t in run.stdout.splitlines() if t.startswith("tokens")]
    ref = LLM(TINY_MODEL, dtype="float32", device="cpu", compile=False, num_blocks=16,
              max_model_len=128).generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(
                  temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [int(t) for t in line.split()[1:]] == ref[0].outputs[0].token_ids


TIGHT = {"dtype": "float32", "device": "cpu", "block_size": 16, "num_blocks": 14, "max_model_len": 160,
         "max_num_batched_tokens": 48, "enable_prefix_caching": True, "compile": False}


def shared_prefix_prompts() -> list[dict]:
    """Six prompts over a shared 40-token prefix: prefix hits, 48-token chunks, and (with 24
    new tokens each in a 14-block pool) preemptions."""
    prefix = prompts(1, 40, seed=1, vocab=4000)[0]["prompt_token_ids"]
    tails = prompts(6, 9, seed=2, vocab=4000)
    return [{"prompt_token_ids": prefix + t["prompt_token_ids"]} for t in tails]


@pytest.fixture(scope="module")
def tiny_tp2():
    llm = LLM(TINY_MODEL, tensor_parallel_size=2, **TIGHT)
    yield llm
    llm.engine.runner.close()


@pytest.fixture(scope="module")
def tiny_tp1():
    return LLM(TINY_MODEL, **TIGHT)


def test_tp2_equals_tp1_and_transformers_under_pressure(tiny_tp2, tiny_tp1):
    batch = shared_prefix_prompts()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    tp, ref = tiny_tp2.generate(batch, params, use_tqdm=False), tiny_tp1.generate(
        batch, params, use_tqdm=False)
    assert token_ids(tp) == token_ids(ref)
    for p, ids in zip(batch[:2], token_ids(tp)):
        assert ids == hf_greedy(TINY_MODEL, p["prompt_token_ids"], 24)
    for a, b in zip(tp, ref):  # the all-reduce sums in another order: logprobs within 1e-4
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert lp_a.keys() == lp_b.keys()
            assert all(abs(lp_a[k] - lp_b[k]) < 1e-4 for k in lp_a)
    stats = tiny_tp2.engine.stats
    assert stats.num_preemptions > 0
    assert stats.num_prefix_cached_tokens > 0
    assert stats.max_batched_tokens <= 48  # the 49-token prompts ran in chunks


def test_tp2_memory_per_rank_is_half(tiny_tp2):
    sizes = tiny_tp2.engine.runner.weight_bytes_per_rank
    total = weight_bytes(load_model(TINY_MODEL, torch.float32))
    assert len(sizes) == 2 and all(s < total / 2 * 1.02 for s in sizes), (sizes, total)
    assert tiny_tp2.engine.runner.pool.kv.shape[3] == 1  # of the model's 2 KV heads


def test_killed_worker_fails_the_engine_clearly(tiny_tp2):
    """Runs last: it breaks the shared TP=2 engine."""
    (pid,) = worker_pids(tiny_tp2)
    os.kill(pid, signal.SIGKILL)
    assert_gone([pid])
    start = time.monotonic()
    for _ in range(2):  # and stays failed
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {pid}, exit code -9\)"):
            tiny_tp2.generate(prompts(1, 5, seed=0), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
