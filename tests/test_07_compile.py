"""Milestone 7: the compiled decode step (minivllm/compile.py, notebook 07_compiled_decode).

The Milestone 1 and 3 parity checks, rerun with the decode step compiled on the CPU
(inductor): greedy tokens must equal transformers token for token, a seeded sampled request
must give the eager engine's tokens, and decoding must never recompile after the warm-up.
One compiled engine per model is shared by the session (`compiled_random` in conftest.py:
compiling takes tens of seconds).
"""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
from hf_oracle import hf_greedy
from torch import nn

from minivllm import LLM, SamplingParams
from minivllm.compile import (
    SingleRowLinear,
    bucket,
    compile_enabled_by_default,
    decode_slots,
    use_matvec_for_single_rows,
)
from minivllm.kv_cache import slot_of


def test_compiled_engine_is_really_compiled(compiled_random):
    from minivllm.compile import CompiledRunner

    engine = compiled_random.engine
    runner = engine.runner
    assert type(runner) is CompiledRunner  # engine.RUNNER_VARIANTS["compiled"]
    assert runner.decoder is not None and runner.compile_seconds > 0
    assert runner.pool.num_blocks == engine.num_blocks + 1  # the padding rows' scratch block
    assert runner.decoder.matvec_linears == 0  # float32: the linears keep F.linear


def test_compiled_m3_parity_with_preemption_and_chunking(compiled_random, random_engine_model):
    """Milestone 3's 24-prompt check, compiled: chunked prefills stay eager, every pure decode
    step runs the compiled pipeline, and the output is transformers' greedy output."""
    from torch._dynamo.utils import counters

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(1, 60))] for _ in range(24)]
    graphs_before = counters["stats"]["unique_graphs"]
    outs = compiled_random.generate([{"prompt_token_ids": p} for p in prompts],
                                    SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert counters["stats"]["unique_graphs"] == graphs_before, "decoding recompiled"
    assert compiled_random.engine.stats.num_preemptions > 0
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        assert out.outputs[0].token_ids == hf_greedy(random_engine_model, prompt, 20), f"prompt {i}"
    bm = compiled_random.engine.block_manager
    assert bm.num_free_blocks == compiled_random.engine.num_blocks


def test_compiled_seeded_sampling_equals_eager(compiled_random, random_engine_model):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=30, min_p=0.01, seed=11,
                            max_tokens=16, ignore_eos=True, logprobs=2)
    prompt = {"prompt_token_ids": [7, 70, 170, 270]}
    compiled = compiled_random.generate(prompt, params)[0].outputs[0]
    eager = LLM(str(random_engine_model), block_size=8, num_blocks=12, max_model_len=96,
                compile=False).generate(prompt, params)[0].outputs[0]
    assert compiled.token_ids == eager.token_ids
    for a, b in zip(compiled.logprobs, eager.logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_compiled_m1_parity_on_the_bundled_model(tiny_model, caplog):
    with caplog.at_level("INFO", logger="minivllm.compile"):
        llm = LLM(str(tiny_model), num_blocks=64, max_model_len=512, compile=True,
                  compile_in_background=False)
    # the warm-up says what it is doing, shape by shape (a first start compiles for a minute)
    warmups = [r.getMessage() for r in caplog.records if "compile warm-up: batch" in r.getMessage()]
    # batch 1 and the larger batches at two table widths each; on a CPU whose packed linears
    # kept their plain weights, each few-rows graph too (float32: 2, 3-4, 5-8 rows; bf16: 2)
    buckets = llm.engine.runner.decoder.few_rows_buckets
    assert len(warmups) == 4 + 2 * len(buckets)
    assert warmups[0].startswith("compile warm-up: batch 1,")
    # each batch's second table width reuses the first width's graphs: the width is dynamic,
    # and never tied to the pool's K/V axis (also 2) by dynamo's duck sizing
    assert all(m.endswith(", 0 new graphs") for m in warmups[1::2]), warmups
    assert all(not m.endswith(", 0 new graphs") for m in warmups[0::2]), warmups
    assert any(r.getMessage().startswith("compiled the decode step in ") for r in caplog.records)
    tok = llm.get_tokenizer()
    prompts = ["import os\n", "def parse(path):\n    ", "class Node:\n"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(tiny_model, tok.encode(prompt), 24,
                                                     llm.engine.eos_token_ids)


def test_platform_without_a_compiler_falls_back_to_eager_with_one_warning(
        random_engine_model, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken)
    for background in (False, True):  # up front, or in the background thread (the default)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            llm = LLM(str(random_engine_model), block_size=8, num_blocks=32, max_model_len=96,
                      compile=True, compile_in_background=background)
            assert llm.engine.runner.wait_until_compiled(timeout=60) is False
        messages = [str(w.message) for w in caught if "torch.compile" in str(w.message)]
        assert len(messages) == 1 and "running the decode step eagerly" in messages[0]
        assert llm.engine.runner.decoder is None and llm.engine.runner.decode_step == "eager"
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))
        assert len(out[0].outputs[0].token_ids) == 4  # serving eagerly
    out = llm.generate({"prompt_token_ids": [1, 2, 3]},
                       SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(random_engine_model, [1, 2, 3], 5)


def test_environment_switch(monkeypatch):
    monkeypatch.setenv("MINIVLLM_COMPILE", "0")
    assert not compile_enabled_by_default()
    monkeypatch.setenv("MINIVLLM_COMPILE", "1")
    assert compile_enabled_by_default()


def test_device_side_slots_equal_the_host_slot_mapping():
    tables = [[5, 9, 2], [7, 0, 0]]
    seq_lens = [11, 3]
    slots = decode_slots(torch.tensor(tables), torch.tensor(seq_lens) - 1, 4)
    assert slots.tolist() == [slot_of(t, n - 1, 4) for t, n in zip(tables, seq_lens)]


def test_buckets():
    assert [bucket(n, on_cuda=False) for n in (1, 2, 3, 17)] == [2, 2, 3, 17]
    assert [bucket(n, on_cuda=False, minimum=1) for n in (1, 2, 3)] == [1, 2, 3]
    assert [bucket(n, on_cuda=True) for n in (1, 2, 3, 17, 32)] == [2, 2, 4, 32, 32]


def test_compiled_decode_applies_the_logits_processors(compiled_random, random_engine_model):
    """Issue 19: penalties, logit_bias, allowed ids and min_tokens bans run beside the
    compiled graph, on the logits it returns: same tokens as the eager engine, for a batch
    that mixes them with a neutral greedy and a seeded sampled request."""
    greedy = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 12}
    params = [SamplingParams(repetition_penalty=1.4, presence_penalty=0.5, **greedy),
              SamplingParams(logit_bias={13: 4.0, 40: -100.0}, min_tokens=8, max_tokens=12,
                             temperature=0.0),
              SamplingParams(frequency_penalty=1.0, temperature=0.9, seed=3, max_tokens=12,
                             ignore_eos=True, allowed_token_ids=list(range(100, 300))),
              SamplingParams(**greedy)]
    prompts = [{"prompt_token_ids": [5 + i, 60, 61, 62 + i]} for i in range(4)]
    eager = LLM(str(random_engine_model), block_size=8, num_blocks=12, max_model_len=96,
                compile=False)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in compiled_random.generate(prompts, params,
                                                                     use_tqdm=False)]
    assert got == want
    assert set(got[2]) <= set(range(100, 300)) and 40 not in got[1]
    assert got[3] == hf_greedy(random_engine_model, prompts[3]["prompt_token_ids"], 12)


def _record_cpp_wrappers(monkeypatch) -> list[bool]:
    """Each C++ wrapper a compile loads from now on (inductor's ``CppWrapperCodeCache``; a Python
    wrapper loads only its kernels, through the base class), as whether its kernels' C++ was
    handed over apart from the calls' (``kernel_code``: built as two files, the calls at -O1).
    Graphs compiled before in this process load again."""
    from torch._inductor.codecache import CppWrapperCodeCache, PyCodeCache

    loaded: list[bool] = []
    load = CppWrapperCodeCache.load_pybinding.__func__

    def recording(cls, *args, **kwargs):
        loaded.append(bool(kwargs.get("kernel_code")))  # None: one file at -O3
        return load(cls, *args, **kwargs)

    monkeypatch.setattr(CppWrapperCodeCache, "load_pybinding", classmethod(recording))
    PyCodeCache.cache_clear()
    return loaded


def _two_linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 40, bias=False))


def _aten_mv_calls(fn) -> int:
    """How many times ``fn()`` runs ATen's mv kernel. Counted by the profiler, not by patching
    torch.mv: dynamo remembers which builtins it may trace, and a patched torch.mv seen there
    would make every later compiled graph of the session break at the real one."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for event in prof.events() if event.name == "aten::mv")


def test_single_row_matvec_swaps_only_the_linears_of_a_bf16_cpu_model():
    """Guards: float32 (what the parity tests compare) leaving F.linear; the swap touching
    the weights or the state dict; two rows or more taking torch.mv (which would read the
    weights once per row)."""
    fp32 = _two_linears()
    assert use_matvec_for_single_rows(fp32) == 0
    assert all(type(m) is nn.Linear for m in fp32)

    bf16 = _two_linears().to(torch.bfloat16)
    reference = copy.deepcopy(bf16)
    keys = list(bf16.state_dict())
    assert use_matvec_for_single_rows(bf16) == 2
    assert all(isinstance(m, SingleRowLinear) for m in bf16)
    assert list(bf16.state_dict()) == keys and bf16[0].weight is not reference[0].weight

    with torch.inference_mode():
        one = torch.randn(1, 32, dtype=torch.bfloat16)
        assert torch.allclose(bf16(one).float(), reference(one).float(), rtol=2e-2, atol=2e-2)
        assert _aten_mv_calls(lambda: bf16(one)) == 2  # both layers, through the custom op
        three = torch.randn(3, 32, dtype=torch.bfloat16)
        assert torch.equal(bf16(three), reference(three))  # F.linear, bit for bit
        assert _aten_mv_calls(lambda: bf16(three)) == 0


def test_one_row_matvec_stays_a_custom_op_when_compiled():
    """Guards: inductor lowering the one-row product to its own loop or to mm (both read a
    bf16 weight more slowly than torch.mv on a CPU): the compiled one-row graph must still
    call torch.mv at run time, and the two-row graph must not. (Counted, not read from the
    generated code: run_and_get_code resets dynamo, which would drop the session's graphs.)"""
    torch.manual_seed(0)
    layer = nn.Linear(64, 96).to(torch.bfloat16)
    expected = copy.deepcopy(layer)
    use_matvec_for_single_rows(layer, "mv")
    with torch.inference_mode():
        for rows, calls in ((1, 1), (2, 0)):
            x = torch.randn(rows, 64, dtype=torch.bfloat16)
            compiled = torch.compile(layer, dynamic=False)
            compiled(x)  # the first call compiles
            assert _aten_mv_calls(lambda c=compiled, x=x: c(x)) == calls, rows
            out = compiled(x)
            assert torch.allclose(out.float(), expected(x).float(), rtol=2e-2, atol=2e-2)


def test_the_engine_passes_single_row_matvec_to_the_compiled_step(random_engine_model,
                                                                  monkeypatch):
    """Guards: EngineConfig.single_row_matvec (and so --no-single-row-matvec) not reaching
    CompiledDecoder."""
    import minivllm.compile as compile_module

    seen = []
    monkeypatch.setattr(compile_module, "try_compile", lambda *args, **kwargs: seen.append(
        (kwargs["single_row_matvec"], kwargs["matvec_kernel"])))
    for option, kernel in ((True, "inductor"), (False, "auto")):
        LLM(str(random_engine_model), block_size=8, num_blocks=8, max_model_len=64,
            compile=True, compile_in_background=False, single_row_matvec=option,
            matvec_kernel=kernel)
    assert seen == [(True, "inductor"), (False, "auto")]


def test_matvec_kernel_is_chosen_by_the_cpu():
    """Guards: a Zen-class CPU (avx512_bf16, no AMX) kept on torch.mv, which reads a bf16
    weight at ~12 GiB/s there against ~30 for inductor's loop; an AMX Xeon moved off it; an
    explicit choice overridden; a misspelt one accepted."""
    from minivllm.compile import choose_matvec_kernel
    from minivllm.config import EngineConfig

    assert choose_matvec_kernel("auto", frozenset({"avx512_bf16", "amx_bf16"}))[0] == "mv"
    kernel, why = choose_matvec_kernel("auto", frozenset({"avx512_bf16", "avx2"}))
    assert kernel == "inductor" and "no AMX" in why
    assert choose_matvec_kernel("auto", frozenset({"avx2"}))[0] == "inductor"
    assert choose_matvec_kernel("mv", frozenset({"avx512_bf16"}))[0] == "mv"
    assert choose_matvec_kernel("inductor", frozenset({"amx_bf16"}))[0] == "inductor"
    with pytest.raises(ValueError, match="matvec_kernel"):
        EngineConfig(matvec_kernel="mkl")  # what the engine is given: checked once, here
    with pytest.raises(ValueError, match="kernel must be one of"):  # a direct call: there
        use_matvec_for_single_rows(_two_linears().to(torch.bfloat16), "mkl")


@pytest.mark.parametrize("kernel", ["mv", "inductor"])
def test_one_row_graph_hands_inductor_the_chosen_matvec(kernel):
    """Guards: the "inductor" kernel still hiding torch.mv in the custom op or not reading the
    weight as int32 lanes (or "mv" not hiding it), two rows leaving F.linear, the compiled one-row result wrong, and the eager
    one-row path of "inductor" not being F.linear bit for bit. The graph is read from
    torch.export (what a compiler is handed; it keeps no cache to pollute), not timed."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 96).to(torch.bfloat16)
    expected = copy.deepcopy(layer)
    assert use_matvec_for_single_rows(layer, kernel) == 1 and layer.kernel == kernel
    for rows in (1, 2):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        with torch.no_grad():
            graph = torch.export.export(layer, (x,)).graph
        ops = {str(n.target) for n in graph.nodes if n.op == "call_function"}
        # (torch.export, not torch.compile: dynamo's cache for this layer's forward is small)
        custom, plain_mv = "minivllm.matvec.default" in ops, "aten.mv.default" in ops
        lanes = "aten.__lshift__.Scalar" in ops  # the loop reads the weight's int32 lanes
        if rows == 2:
            assert ops == {"aten.linear.default"}
        else:
            assert (custom, plain_mv, lanes) == ((True, False, False) if kernel == "mv"
                                                 else (False, False, True)), ops
            # inductor's loop reads a row materialised by the opaque copy, never its producer
            assert ("minivllm.materialise.default" in ops) == (kernel == "inductor"), ops
        with torch.inference_mode():
            if kernel == "inductor":  # eagerly: F.linear itself
                assert torch.equal(layer(x), expected(x))
            if rows == 1:
                compiled = torch.compile(layer, dynamic=False)
                out = compiled(x)
                assert torch.allclose(out.float(), expected(x).float(), rtol=2e-2, atol=2e-2)
                # "mv" runs ATen's kernel; "inductor" runs a loop it wrote (no ATen mv call)
                assert _aten_mv_calls(lambda c=compiled, x=x: c(x)) == (1 if kernel == "mv" else 0)


def test_merge_projections_computes_the_same_function_with_the_same_weights(tiny_model):
    """Guards: a merged layer that splits its output into the wrong parts (q/k/v or gate/up
    swapped or misaligned), merging that keeps the separate weights too (twice the memory),
    and merging an already merged model."""
    from minivllm.compile import MergedMLP, MergedQKVAttention, merge_projections
    from minivllm.model import causal_attention, load_model

    model = load_model(tiny_model)
    merged = copy.deepcopy(model)
    layers = model.config.num_hidden_layers
    assert merge_projections(merged) == 3 * layers
    assert merge_projections(merged) == 0  # nothing left to merge
    numel = lambda m: sum(p.numel() for p in m.parameters())
    assert numel(merged) == numel(model)
    for layer in merged.model.layers:
        assert type(layer.self_attn) is MergedQKVAttention and type(layer.mlp) is MergedMLP
        assert not any(hasattr(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj"))
        assert not any(hasattr(layer.mlp, n) for n in ("gate_proj", "up_proj"))
    reference = model.model.layers[1]
    stacked = merged.model.layers[1].self_attn.qkv_proj.linear
    assert torch.equal(stacked.weight, torch.cat([reference.self_attn.q_proj.weight,
                                                  reference.self_attn.k_proj.weight,
                                                  reference.self_attn.v_proj.weight]))
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (9,))
    attention = lambda layer, q, k, v: causal_attention(q, k, v)
    with torch.inference_mode():
        expected = model(ids, torch.arange(9), attention)
        got = merged(ids, torch.arange(9), attention)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, torch.zeros_like(got))


def test_merge_projections_leaves_tensor_parallel_shards_and_refuses_mixed_parts(tiny_model):
    from minivllm.compile import MergedLinear, merge_projections
    from minivllm.model import load_model
    from minivllm.parallel import ColumnParallelLinear

    model = load_model(tiny_model)
    attn = model.model.layers[0].self_attn
    attn.q_proj = ColumnParallelLinear(attn.q_proj.in_features, attn.q_proj.out_features,
                                       attn.q_proj.bias is not None)
    saved = merge_projections(model)
    assert saved == 3 * model.config.num_hidden_layers - 2  # layer 0's q/k/v stay separate
    assert hasattr(attn, "q_proj") and not hasattr(attn, "qkv_proj")
    with pytest.raises(ValueError, match="bias on all or none"):
        MergedLinear([nn.Linear(8, 4), nn.Linear(8, 4, bias=False)])


def test_the_engine_merges_projections_unless_asked_not_to(random_engine_model):
    """Guards: EngineConfig.merge_projections (and so --no-merge-projections) not reaching
    the engine's model, and the merged engine decoding other tokens than the separate one."""
    from minivllm.compile import MergedQKVAttention

    prompt = {"prompt_token_ids": [7, 70, 170, 270, 9]}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    from minivllm.compile import CompiledRunner
    from minivllm.runner import ModelRunner

    tokens = {}
    for option in (True, False):
        llm = LLM(str(random_engine_model), block_size=8, num_blocks=12, max_model_len=96,
                  compile=False, merge_projections=option)
        runner = llm.engine.runner  # neither option: notebook 03's runner, as it is
        assert type(runner) is (CompiledRunner if option else ModelRunner)
        attn_cls = type(runner.model.model.layers[0].self_attn)
        assert (attn_cls is MergedQKVAttention) == option
        tokens[option] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens[True] == tokens[False] == hf_greedy(random_engine_model, prompt["prompt_token_ids"], 12)


def test_merging_a_bf16_checkpoint_unmaps_the_file(tiny_model, tmp_path):
    """Guards: the checkpoint's memory map staying open after merging. A bf16 checkpoint
    loaded in bf16 is a map of the file, and the pages torch.cat read would stay resident
    beside the merged copies (the 0.5B server's RSS grew by 0.5 GiB)."""
    import gc
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    from minivllm.compile import merge_projections
    from minivllm.model import load_model

    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps (Linux)")
    shutil.copy(Path(tiny_model) / "config.json", tmp_path / "config.json")
    weights = load_file(Path(tiny_model) / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, tmp_path / "model.safetensors")
    mapped = lambda: str(tmp_path / "model.safetensors") in maps.read_text()
    model = load_model(tmp_path, dtype=torch.bfloat16)
    assert mapped()  # loaded as a map of the file: what this test is about
    merge_projections(model)
    gc.collect()
    assert not mapped()
    tied = model.config.tie_word_embeddings
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied


def test_the_compiled_step_swapping_in_mid_batch_changes_no_output(compiled_random,
                                                                    random_engine_model,
                                                                    monkeypatch):
    """Guards: the background compile (compile_in_background, the default) changing a token
    when it takes over between two steps of a running batch. The warm-up waits at a gate
    until the batch has decoded eagerly for a while; then it compiles, swaps in, and the
    batch (with two requests that arrive after the swap) ends on the compiled step. In float32
    every request's tokens equal an all-eager and an all-compiled run."""
    import threading

    from minivllm.compile import CompiledDecoder
    from minivllm.config import EngineConfig
    from minivllm.engine import LLMEngine

    gate = threading.Event()
    warmup = CompiledDecoder.warmup
    monkeypatch.setattr(CompiledDecoder, "warmup",
                        lambda self, vocab_size: gate.wait() and warmup(self, vocab_size))
    options = {"block_size": 8, "num_blocks": 12, "max_model_len": 96, "max_num_seqs": 4,
               "max_num_batched_tokens": 24}  # compiled_random's, so its graphs are reused
    engine = LLMEngine(EngineConfig(model=str(random_engine_model), compile=True,
                                    compile_in_background=True, **options))
    runner = engine.runner
    assert runner.decode_step == "compiling" and runner.decoder is None
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randint(3, 8))] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids

    for i, prompt in enumerate(prompts[:4]):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    for _ in range(8):  # <= 32 prompt tokens, 24 a step: prefilled by step 2, then decoding
        step()
    generated = [s.num_tokens - s.num_prompt_tokens for s in engine.scheduler.running]
    assert len(generated) == 4 and min(generated) >= 5, generated  # eager decode steps ran
    assert runner.decode_step == "compiling" and runner.eager_steps_while_compiling == 8
    gate.set()
    assert runner.wait_until_compiled(timeout=900) and runner.decode_step == "compiled"
    compiled_rows = []
    logits = runner.decoder.logits
    monkeypatch.setattr(runner.decoder, "logits",
                        lambda batch: compiled_rows.append(len(batch.input_ids)) or logits(batch))
    for i, prompt in enumerate(prompts[4:], start=4):  # requests that arrive after the swap
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        step()
    assert compiled_rows and max(compiled_rows) > 1  # the running batch went on compiled
    requests = [{"prompt_token_ids": p} for p in prompts]
    eager = LLM(str(random_engine_model), compile=False, **options).generate(requests, params)
    compiled = compiled_random.generate(requests, params)
    for i in range(len(prompts)):
        assert got[str(i)] == eager[i].outputs[0].token_ids == compiled[i].outputs[0].token_ids
    assert engine.block_manager.num_free_blocks == engine.num_blocks


needs_onednn_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="this CPU's oneDNN does not do bf16")


@needs_onednn_bf16
def test_packed_linear_weights_compute_the_same_function_eager_and_compiled(tiny_model):
    """Guards: a packed weight giving other numbers than the plain one (eagerly, or in the
    compiled graph through the custom op, at 1 and at several rows; float32 within 1e-5 of
    F.linear); the plain weights kept
    beside the packed ones (twice the memory); a freed model leaving its packed weights."""
    import gc

    from minivllm.compile import (
        _PACKED_WEIGHTS,
        MergedLinear,
        PackedLinear,
        merge_projections,
        pack_linear_weights,
    )
    from minivllm.model import ContiguousKVCache, load_model

    fp32 = load_model(tiny_model)  # float32 is packed too, and computes what F.linear did
    fp32_packed = copy.deepcopy(fp32)
    assert pack_linear_weights(fp32_packed) == 7 * fp32.config.num_hidden_layers + 1  # unmerged
    assert next(m for m in fp32_packed.modules() if isinstance(m, PackedLinear)).element_size == 4
    ids = torch.tensor([5, 17, 42, 99, 7, 3])
    with torch.inference_mode():
        for model in (fp32, fp32_packed):
            cache = ContiguousKVCache(model.config, 8, torch.float32, "cpu")
            model.out = model.compute_logits(model(ids, torch.arange(6), cache))
    torch.testing.assert_close(fp32_packed.out, fp32.out, rtol=1e-5, atol=1e-5)
    plain = load_model(tiny_model, dtype=torch.bfloat16)
    merge_projections(plain)
    packed = copy.deepcopy(plain)
    before = len(_PACKED_WEIGHTS)
    layers = plain.config.num_hidden_layers
    assert pack_linear_weights(packed) == 4 * layers + 1  # qkv, o, gate/up, down; lm_head
    assert len(_PACKED_WEIGHTS) == before + 4 * layers + 1
    assert isinstance(packed.model.layers[0].mlp.gate_up_proj, MergedLinear)
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    assert "weight" not in dict(packed.model.layers[0].mlp.down_proj.named_parameters())
    ids = torch.tensor([5, 17, 42, 99, 7, 3])
    with torch.inference_mode():
        for model in (plain, packed):  # the same prompt through each: (6, V) logits
            cache = ContiguousKVCache(model.config, 8, torch.bfloat16, "cpu")
            model.out = model.compute_logits(model(ids, torch.arange(6), cache))
        torch.testing.assert_close(packed.out, plain.out, rtol=0, atol=2e-2)
        reference = plain.model.layers[0].mlp.down_proj
        compiled = torch.compile(PackedLinear(reference), dynamic=True)
        for rows in (1, 3, 8):
            x = torch.randn(rows, reference.in_features, dtype=torch.bfloat16)
            torch.testing.assert_close(compiled(x), reference(x), rtol=2e-2, atol=2e-2)
    handles = {m.handle for m in packed.modules() if isinstance(m, PackedLinear)}
    del packed, model
    gc.collect()
    assert not handles & set(_PACKED_WEIGHTS)


def _export_ops(module: nn.Module, x: torch.Tensor) -> list[str]:
    """The ops of ``module(x)`` as a compiler is handed them (torch.export: no cache kept)."""
    with torch.no_grad():
        graph = torch.export.export(module, (x,)).graph
    return [str(n.target) for n in graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_onednn_bf16),
                                   torch.float32])
def test_packed_linears_keep_their_plain_weights_for_the_one_row_loop(tiny_model, dtype):
    """Guards: a one-row compiled step reading the packed weight (oneDNN, slower than
    inductor's loop on CPUs without AMX) when the plain weight was kept, or its loop reading
    an input whose producer it could inline (no materialise, or materialise after the lanes
    are read); a static count of 2..LOOP_MAX_ROWS rows (the decoder's few-rows graph) not
    taking the loop for each row; more rows leaving the packed weight; keeping the weights as copies
    (more memory than the plain weights) or a tied lm_head's as anything but the embedding
    itself; the results differing."""
    from minivllm.compile import (
        LOOP_MAX_ROWS,
        PackedLinear,
        merge_projections,
        pack_linear_weights,
    )
    from minivllm.model import load_model

    model = load_model(tiny_model, dtype=dtype)
    merge_projections(model)
    reference = copy.deepcopy(model)
    plain = {name: m.weight for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert pack_linear_weights(model, keep_plain_weights=True) == len(plain)
    packed = dict(model.named_modules())
    assert all(isinstance(packed[name], PackedLinear) and packed[name].weight is weight
               for name, weight in plain.items())
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    down, expected = model.model.layers[0].mlp.down_proj, reference.model.layers[0].mlp.down_proj
    assert "plain weight for one row" in repr(down)
    one, three, many = (torch.randn(rows, down.in_features, dtype=dtype)
                        for rows in (1, 3, LOOP_MAX_ROWS + 1))
    ops = _export_ops(down, one)  # the loop over the plain weight (int32 lanes in bf16)
    reads = "aten.__lshift__.Scalar" if dtype == torch.bfloat16 else "aten.mul.Tensor"
    assert reads in ops and "minivllm.packed_linear.default" not in ops, ops
    assert ops.index("minivllm.materialise.default") < ops.index(reads), ops
    ops = _export_ops(down, three)  # a static 3 rows: the loop for each row
    assert "minivllm.packed_linear.default" not in ops and ops.count(reads) >= 3, ops
    assert ops.count("minivllm.materialise.default") == 3, ops
    assert "minivllm.packed_linear.default" in _export_ops(down, many)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    with torch.inference_mode():
        compiled = torch.compile(down, dynamic=False)
        for x in (one, three, many):
            torch.testing.assert_close(compiled(x), expected(x), rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(down(x), expected(x), rtol=tolerance, atol=tolerance)
    dropped = copy.deepcopy(reference)
    pack_linear_weights(dropped)  # the default: the plain weights go
    assert all(m.weight is None for m in dropped.modules() if isinstance(m, PackedLinear))


def test_bf16_pairs_are_the_even_and_odd_elements_as_float32():
    """Guards: the lanes' halves swapped (even for odd), a shift or mask that drops or keeps
    the wrong bits, and inductor's lowering of the bit casts differing from eager's. Exact:
    a bf16 number is the top half of a float32, so nothing may be rounded."""
    from minivllm.compile import bf16_pairs_as_float32

    values = torch.randn(6, 64).to(torch.bfloat16)
    values[0, :6] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3.5])
    expected = values[:, 0::2].float(), values[:, 1::2].float()
    for split in (bf16_pairs_as_float32, torch.compile(bf16_pairs_as_float32, dynamic=False)):
        got = split(values.view(torch.int32))  # (6, 32) lanes
        for half, want in zip(got, expected):
            assert half.dtype == torch.float32 and half.shape == (6, 32)
            assert torch.equal(half.view(torch.int32), want.view(torch.int32))  # bit for bit


@pytest.mark.parametrize(("out_features", "in_features", "dtype", "route"), [
    (96, 64, torch.bfloat16, "lanes"), (37, 4096, torch.bfloat16, "lanes"),
    (40, 33, torch.bfloat16, "mv"),  # odd K: no whole int32 lanes, torch.mv
    (40, 64, torch.float32, "partial sums"), (37, 4096, torch.float32, "partial sums"),
    (40, 36, torch.float32, "mv"),  # K not a multiple of the lanes (8 or 16): torch.mv
    (40, 64, torch.float16, "mv")])
def test_loop_matvec_takes_its_route_by_dtype_and_gives_the_product(out_features, in_features,
                                                                   dtype, route):
    """Guards: the one-row loop giving another product than F.linear (bf16 lanes paired with
    the wrong row elements, sums in bf16: over 4096 inputs those drift far beyond one
    rounding; float32 partial sums over the wrong elements), and weights taking a route they
    cannot (odd K for lanes, K not a multiple of FLOAT32_LANES for partial sums, another dtype)."""
    from minivllm.compile import loop_matvec

    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features).to(dtype)
    x = torch.randn(1, in_features).to(dtype)

    class Row(nn.Module):
        def forward(self, row):
            return loop_matvec(row, weight)

    ops = _export_ops(Row(), x)
    taken = ("lanes" if "aten.__lshift__.Scalar" in ops else "mv" if "aten.mv.default" in ops
             else "partial sums" if ops.count("aten.sum.dim_IntList") == 2 else None)
    assert taken == route, ops
    with torch.inference_mode():
        out = torch.compile(Row(), dynamic=False)(x)
    exact = x.double() @ weight.double().t()  # (1, out_features)
    assert out.shape == (1, out_features) and out.dtype == dtype
    rtol = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out.double(), exact, rtol=rtol, atol=1e-5)


@pytest.mark.parametrize(("out_features", "in_features", "route"), [
    (96, 64, "widened"), (37, 4096, "widened"),
    (40, 40, "mv")])  # K not a multiple of BF16_WEIGHT_LANES (16 or 32): torch.mv, widened
def test_loop_matvec_widens_a_bf16_weight_beside_a_float32_row(out_features, in_features, route):
    """Guards: a float32 model's weight held in bf16 (narrow_plain_weights) read as int32
    lanes paired with a float32 row's bits, or its products summed in bf16 (the result is
    float32, exact weights times a float32 row), and K that does not fill the lanes."""
    from minivllm.compile import loop_matvec

    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features).to(torch.bfloat16)
    x = torch.randn(1, in_features)  # float32

    class Row(nn.Module):
        def forward(self, row):
            return loop_matvec(row, weight)

    ops = _export_ops(Row(), x)
    taken = ("mv" if "aten.mv.default" in ops else "widened"
             if ops.count("aten.sum.dim_IntList") == 2 and "aten.__lshift__.Scalar" not in ops
             else None)
    assert taken == route, ops
    with torch.inference_mode():
        out = torch.compile(Row(), dynamic=False)(x)
    exact = x.double() @ weight.double().t()  # (1, out_features)
    assert out.shape == (1, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)


def test_narrow_plain_weights_holds_only_bf16_numbers_in_bf16():
    """Guards: a float32 weight narrowed although one of its numbers is not a bf16 number
    (a changed model), or one whose K does not fill the widened loop's lanes; numbers changed
    by the narrowing; a weight shared with the embedding (the tied lm_head) changed in place,
    which would leave the embedding in bf16."""
    from minivllm.compile import BF16_WEIGHT_LANES, holds_only_bf16_numbers, narrow_plain_weights

    torch.manual_seed(0)
    k = 2 * BF16_WEIGHT_LANES

    def linear(in_features: int, out_features: int) -> nn.Linear:
        module = nn.Linear(in_features, out_features, bias=False).requires_grad_(False)
        module.weight.data = module.weight.data.to(torch.bfloat16).float()  # bf16 numbers
        return module

    exact, inexact, odd = linear(k, 32), linear(k, 32), linear(k + 8, 32)
    inexact.weight.data[3, 5] = 0.1  # not a bf16 number
    embedding = nn.Embedding(48, k).requires_grad_(False)
    embedding.weight.data = embedding.weight.data.to(torch.bfloat16).float()
    head = nn.Linear(k, 48, bias=False)
    head.weight = embedding.weight  # tied
    before = {name: m.weight.detach().clone() for name, m in
              [("exact", exact), ("inexact", inexact), ("odd", odd), ("embedding", embedding)]}
    assert holds_only_bf16_numbers(exact.weight) and not holds_only_bf16_numbers(inexact.weight)

    assert narrow_plain_weights([exact, inexact, odd, head]) == (32 * k + 48 * k) * 2
    assert exact.weight.dtype == head.weight.dtype == torch.bfloat16
    assert torch.equal(exact.weight.float(), before["exact"])
    assert torch.equal(head.weight.float(), before["embedding"])
    for name, module in [("inexact", inexact), ("odd", odd), ("embedding", embedding)]:
        assert module.weight.dtype == torch.float32 and torch.equal(module.weight, before[name])
    assert head.weight is not embedding.weight


def test_many_rows_loops_keep_one_register_of_sums_a_row():
    """Guards: a static batch of more than WIDE_SUMS_MAX_ROWS rows reading a bf16 plain weight
    (a float32 model's, narrowed) in BF16_WEIGHT_LANES partial sums a row, two vector registers
    each, which at 8 rows do not fit AVX2's sixteen (22.7 against 26.7 ms on the lm_head); a
    batch of up to WIDE_SUMS_MAX_ROWS rows not keeping them; the rows' results changing."""
    from minivllm.compile import (
        BF16_WEIGHT_LANES,
        FLOAT32_LANES,
        LOOP_MAX_ROWS,
        WIDE_SUMS_MAX_ROWS,
        PackedLinear,
        can_pack_linear_weights,
        narrow_plain_weights,
    )

    torch.manual_seed(0)
    k, n = 4 * BF16_WEIGHT_LANES, 24
    linear = nn.Linear(k, n, bias=False).requires_grad_(False)
    if not can_pack_linear_weights(linear):
        pytest.skip("no oneDNN on this CPU")
    linear.weight.data = linear.weight.data.to(torch.bfloat16).float()  # bf16 numbers
    packed = PackedLinear(linear, keep_plain_weight=True)
    assert narrow_plain_weights([packed]) == n * k * 2
    assert packed.weight.dtype == torch.bfloat16

    def lanes_read(rows: int) -> set[int]:
        """The partial sums a row of the loops a static batch of ``rows`` takes: the last size
        of each (N, K/L, L) view of the weight."""
        with torch.no_grad():
            graph = torch.export.export(packed, (torch.randn(rows, k),)).graph
        views = [tuple(node.meta["val"].shape) for node in graph.nodes
                 if node.op == "call_function" and "view" in str(node.target)]
        return {shape[-1] for shape in views
                if len(shape) == 3 and shape[0] == n and shape[1] * shape[2] == k}

    assert lanes_read(WIDE_SUMS_MAX_ROWS) == {BF16_WEIGHT_LANES}
    assert lanes_read(LOOP_MAX_ROWS) == {FLOAT32_LANES} != {BF16_WEIGHT_LANES}
    x = torch.randn(LOOP_MAX_ROWS, k)
    exact = x.double() @ linear.weight.double().t()
    with torch.inference_mode():
        out = torch.compile(packed, dynamic=False)(x)
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keep", [True, False])
def test_pack_linear_weights_lets_each_plain_linear_go_as_it_packs_the_next(keep):
    """Guards: packing holding every plain linear (and its weight) until the last is packed,
    which puts the model's weights twice in memory at start-up; ``each`` not called once per
    packed linear, or before that linear is in its place."""
    import weakref

    from minivllm.compile import PackedLinear, can_pack_linear_weights, pack_linear_weights

    model = nn.Sequential(*(nn.Linear(32, 32) for _ in range(3))).requires_grad_(False)
    if not can_pack_linear_weights(model):
        pytest.skip("no oneDNN on this CPU")
    alive = [weakref.ref(linear) for linear in model]
    seen = []

    def each(packed: PackedLinear) -> None:
        index = len(seen)
        assert model[index] is packed  # in its place already
        seen.append([ref() is None for ref in alive])  # which plain linears are gone

    assert pack_linear_weights(model, keep_plain_weights=keep, each=each) == 3
    assert seen == [[True, False, False], [True, True, False], [True, True, True]]
    assert all(isinstance(m, PackedLinear) and (m.weight is not None) == keep for m in model)


def test_narrow_embedding_shares_one_bf16_table_with_a_packed_tied_lm_head():
    """Guards: a float32 embedding narrowed although a number of it is not a bf16 number, or
    while a plain tied lm_head (F.linear) still multiplies the float32 table; looked-up rows
    other than the float32 table's or not float32; a packed tied lm_head given a table of its
    own (the embedding's bytes twice) or changing its logits."""
    from minivllm.compile import (
        BF16_WEIGHT_LANES,
        PackedLinear,
        WideningEmbedding,
        can_pack_linear_weights,
        narrow_embedding,
    )

    torch.manual_seed(0)
    vocab, k = 48, 2 * BF16_WEIGHT_LANES
    if not can_pack_linear_weights(nn.Linear(k, vocab)):
        pytest.skip("no oneDNN on this CPU")

    def tied_model(pack: bool, exact: bool = True) -> nn.Module:
        model = nn.Module()
        model.model = nn.Module()
        model.model.embed_tokens = nn.Embedding(vocab, k).requires_grad_(False)
        table = model.model.embed_tokens.weight
        table.data = table.data.to(torch.bfloat16).float()  # bf16 numbers, as loaded from bf16
        if not exact:
            table.data[7, 3] = 0.1  # not a bf16 number
        model.lm_head = nn.Linear(k, vocab, bias=False)
        model.lm_head.weight = table
        if pack:
            model.lm_head = PackedLinear(model.lm_head, keep_plain_weight=True)
        return model

    ids, row = torch.tensor([0, 7, 47, 7]), torch.randn(3, k)
    for pack, exact in [(False, True), (True, False)]:  # left alone
        model = tied_model(pack, exact)
        assert narrow_embedding(model) == 0
        assert type(model.model.embed_tokens) is nn.Embedding
        assert model.model.embed_tokens.weight.dtype == torch.float32
    model = tied_model(pack=True)
    before = model.model.embed_tokens(ids), model.lm_head(row)
    assert narrow_embedding(model) == vocab * k * 2
    embedding = model.model.embed_tokens
    assert isinstance(embedding, WideningEmbedding) and embedding.weight.dtype == torch.bfloat16
    assert model.lm_head.weight is embedding.weight  # one bf16 table, shared
    looked_up = embedding(ids)
    assert looked_up.dtype == torch.float32 and torch.equal(looked_up, before[0])
    assert torch.equal(model.lm_head(row), before[1])  # the packed weight, untouched


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line
                if inside:
                    break
                low, high = (int(a, 16) for a in head.split("-"))
                inside = low <= address < high
            elif inside:
                fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


def test_move_to_huge_pages_moves_each_weight_once_keeping_its_numbers(monkeypatch):
    """Guards: a tensor listed twice (a tied weight) copied twice, the parameters replaced
    by other objects (a model's modules would keep the old ones), numbers changed, the copies
    left off a huge-page boundary or outside a mapping advised for huge pages, and a kernel
    without transparent huge pages getting a copy anyway."""
    import minivllm.compile as compile_module
    from minivllm.compile import HUGE_PAGE_BYTES, move_to_huge_pages, transparent_huge_pages

    torch.manual_seed(0)
    small = nn.Parameter(torch.randn(300, 64).to(torch.bfloat16), requires_grad=False)
    large = nn.Parameter(torch.randn(3 * 2**20).to(torch.bfloat16), requires_grad=False)  # 6 MiB
    before = {id(p): (p.data_ptr(), p.detach().clone()) for p in (small, large)}
    monkeypatch.setattr(compile_module, "transparent_huge_pages", lambda: False)
    assert move_to_huge_pages([small, large]) == 0
    assert all(p.data_ptr() == before[id(p)][0] for p in (small, large))
    monkeypatch.undo()
    if not transparent_huge_pages():
        pytest.skip("this kernel has no transparent huge pages")
    nbytes = sum(p.numel() * p.element_size() for p in (small, large))
    assert move_to_huge_pages([large, small, large]) == nbytes  # the tied one once
    for p in (small, large):
        assert isinstance(p, nn.Parameter) and p.data_ptr() != before[id(p)][0]
        assert torch.equal(p, before[id(p)][1])
    assert large.data_ptr() % HUGE_PAGE_BYTES == 0  # listed first: on a huge-page boundary
    mapping = _mapping_of(large.data_ptr())
    assert mapping == _mapping_of(small.data_ptr())  # one mapping for all
    assert mapping["THPeligible"] == "1", mapping  # advised: the kernel may back it with huge pages


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_onednn_bf16), "float32"])
@pytest.mark.parametrize(("options", "kept"), [
    ({"matvec_kernel": "inductor"}, True),  # a CPU without AMX: inductor's loop for one row
    ({"matvec_kernel": "mv"}, False),  # AMX: the packed weight (oneDNN) for one row too
    ({"matvec_kernel": "inductor", "single_row_matvec": False}, False),
    ({"matvec_kernel": "inductor", "compile": False}, False),  # nothing compiled reads them
])
def test_the_runner_keeps_plain_weights_only_for_a_compiled_one_row_loop(tiny_model, monkeypatch,
                                                                         options, kept, dtype):
    """Guards: the plain weights kept (the linears' memory twice) where no compiled one-row
    step reads them, or dropped where one does; kept ones left in 4 KiB pages (or others
    moved)."""
    import minivllm.compile as compile_module
    from minivllm.compile import PackedLinear, transparent_huge_pages

    monkeypatch.setattr(compile_module, "try_compile", lambda *args, **kwargs: None)
    config = {"compile": True, **options}
    llm = LLM(str(tiny_model), dtype=dtype, block_size=8, num_blocks=12, max_model_len=96,
              compile_in_background=False, **config)
    runner = llm.engine.runner
    packed = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    assert packed and runner.keep_plain_weights == kept
    assert all((m.weight is not None) == kept for m in packed)
    plain = {id(m.weight): m.weight for m in packed if m.weight is not None}.values()
    in_huge_pages = sum(w.numel() * w.element_size() for w in plain)  # the tied one once
    assert runner.huge_page_bytes == (in_huge_pages if transparent_huge_pages() else 0)
    # the bundled model is saved in bf16: a float32 one's embedding and kept copies hold bf16
    # numbers only, so they are held in bf16 (narrow_embedding, narrow_plain_weights), the
    # tied lm_head's copy is the embedding's table, and a lookup still gives float32 rows
    model = runner.model
    table = model.model.embed_tokens.weight
    assert table.dtype == torch.bfloat16 and (model.lm_head.weight is table) == kept
    if dtype == "float32":
        assert runner.narrowed_bytes == (in_huge_pages if kept else table.numel() * 2)
        ids = torch.tensor([0, 5, 4000])
        assert model.model.embed_tokens(ids).dtype == torch.float32
    else:
        assert runner.narrowed_bytes == 0
    assert all(w.dtype == torch.bfloat16 for w in plain)  # bf16 ones, or narrowed float32 ones


@needs_onednn_bf16
def test_the_engine_packs_bf16_weights_unless_asked_not_to(tiny_model):
    """Guards: EngineConfig.pack_linear_weights (and so --no-pack-linear-weights) not
    reaching the engine's model, and packing changing a greedy bf16 request's tokens."""
    from minivllm.compile import PackedLinear

    prompt = {"prompt_token_ids": [7, 70, 170, 270, 9]}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for option in (True, False):
        llm = LLM(str(tiny_model), dtype="bfloat16", block_size=8, num_blocks=12,
                  max_model_len=96, compile=False, pack_linear_weights=option)
        model = llm.engine.runner.model
        assert any(isinstance(m, PackedLinear) for m in model.modules()) == option
        tokens[option] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_onednn_bf16), "float32"])
def test_the_compiled_engine_reads_plain_weights_through_the_loop_at_one_row(tiny_model, dtype,
                                                                           monkeypatch):
    """Guards, end to end: the engine's compiled one-row decode graph reading the packed
    weights although the plain ones were kept (or its loop reading an unmaterialised input);
    a batch of 2 rows padded (it has a graph of its own); in float32 one of 3-4 not padded to
    4 or of 5..LOOP_MAX_ROWS not to LOOP_MAX_ROWS, their rows not each taking the loop, and a
    larger batch leaving the packed weights; in bf16 a batch of 3+ rows taking the loop (slower
    there than oneDNN's bf16 kernel from 3 rows on); the compiled logits of 1..LOOP_MAX_ROWS + 1
    rows differing from the eager ones (in bf16: beyond 2 % of the largest logit, or another
    greedy token); a decode graph calling its kernels from Python (each loads a C++ wrapper,
    the few-rows graphs too). Counted with the profiler: ``materialise`` runs once per linear
    and row."""
    from torch.profiler import ProfilerActivity, profile

    from minivllm.compile import (
        FEW_ROWS_BUCKETS,
        LOOP_MAX_ROWS,
        DecodeInputs,
        PackedLinear,
        decode_logits,
    )

    wrappers = _record_cpp_wrappers(monkeypatch)
    llm = LLM(str(tiny_model), dtype=dtype, block_size=8, num_blocks=12, max_model_len=96,
              compile=True, compile_in_background=False, compile_flat_steps=False,
              matvec_kernel="inductor")  # a CPU without AMX, whatever this one is
    runner = llm.engine.runner
    linears = sum(isinstance(m, PackedLinear) for m in runner.model.modules())
    assert runner.keep_plain_weights and runner.decoder.plain_weight_linears == linears > 0
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [7, 70, 170, 270, 9]}, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8

    def materialise_calls(rows: int) -> int:
        batch = DecodeInputs([5] * rows, [20] * rows, [[0, 1, 2]] * rows)
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
            runner.decoder.logits(batch)
        return sum(1 for e in prof.events() if e.name == "minivllm::materialise")

    buckets = runner.decoder.few_rows_buckets
    assert buckets == FEW_ROWS_BUCKETS[getattr(torch, dtype)]
    assert FEW_ROWS_BUCKETS == {torch.float32: (2, 4, LOOP_MAX_ROWS), torch.bfloat16: (2,)}
    assert len(wrappers) == 2 + len(buckets), wrappers  # one row, many rows, each few-rows graph
    assert materialise_calls(1) == linears
    # 2 rows as they are; in float32 3-4 padded to 4, 5..LOOP_MAX_ROWS to LOOP_MAX_ROWS, every
    # row through the loop; more rows (bf16: 3+) through the packed weights
    padded_to = {2: 2, 3: 4, 4: 4, 5: LOOP_MAX_ROWS, LOOP_MAX_ROWS: LOOP_MAX_ROWS}
    for rows, padded in padded_to.items():
        assert materialise_calls(rows) == (padded * linears if rows <= buckets[-1] else 0)
    assert materialise_calls(LOOP_MAX_ROWS + 1) == 0
    for rows in range(1, LOOP_MAX_ROWS + 2):
        batch = DecodeInputs([5 + 11 * r for r in range(rows)], [20 - r for r in range(rows)],
                             [[r % 3, 3 + r % 2, 5] for r in range(rows)])
        with torch.inference_mode():
            eager = decode_logits(runner.model, runner.pool.kv,
                                  *(torch.tensor(v) for v in (batch.input_ids, batch.seq_lens,
                                                              batch.block_tables)), 8)
            compiled = runner.decoder.logits(batch)
        assert compiled.shape == eager.shape == (rows, eager.shape[1])
        if dtype == "float32":  # sums in another order
            torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
            continue
        # bf16: the graph rounds its intermediates in other places than the eager model does.
        # A logit's error is the last hidden state's error through the lm_head, about the same
        # size for every logit of a row, so it is bounded by the largest logit's scale (a unit
        # in the last place is 1/16 at |logit| 8-16), not each logit's own: a small logit
        # may differ by more than 2 % of itself (0.026 at 0.25 on a Zen 4), in either route
        torch.testing.assert_close(compiled, eager, rtol=0,
                                   atol=2e-2 * float(eager.abs().max()))
        assert torch.equal(compiled.argmax(-1), eager.argmax(-1))  # the same greedy tokens


@needs_onednn_bf16
def test_background_compile_packs_the_weights_in_its_thread(tiny_model, monkeypatch):
    """Guards: packing (~2 s on the 0.5B model) before /health when the compile runs in the
    background; the thread packing other than the engine's own model. The compile itself is
    stubbed (it fails at once, so the runner stays eager): this is about what precedes it."""
    import threading

    import minivllm.compile as compile_module
    from minivllm.compile import PackedLinear

    seen = {}

    class FailingDecoder:
        def __init__(self, model, *args):
            seen["thread"] = threading.current_thread().name
            seen["packed"] = any(isinstance(m, PackedLinear) for m in model.modules())

        def warmup(self, vocab_size):
            raise RuntimeError("stub compile")

    monkeypatch.setattr(compile_module, "CompiledDecoder", FailingDecoder)
    llm = LLM(str(tiny_model), dtype="bfloat16", block_size=8, num_blocks=12, max_model_len=96,
              compile=True, compile_in_background=True)
    runner = llm.engine.runner
    with pytest.warns(RuntimeWarning, match="stub compile"):
        assert runner.wait_until_compiled(timeout=120) is False
    assert seen == {"thread": "minivllm-compile", "packed": True}
    assert any(isinstance(m, PackedLinear) for m in runner.model.modules())
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [7, 70, 170]}, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6


@needs_onednn_bf16
def test_eager_packed_and_matvec_linears_leave_dynamo_unimported(tiny_model):
    """Guards: an eager step importing torch._dynamo while the compile thread imports it (a
    custom op's first eager call does): the two imports race into a half-initialised module
    and the step fails with an ImportError (seen on the 0.5B server's warm start). A fresh
    interpreter runs a packed model and a torch.mv SingleRowLinear eagerly."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from minivllm.model import ContiguousKVCache, load_model\n"
        "from minivllm.compile import merge_projections, pack_linear_weights, "
        "use_matvec_for_single_rows\n"
        f"m = load_model({str(tiny_model)!r}, dtype=torch.bfloat16)\n"
        "merge_projections(m)\n"
        "layer = torch.nn.Linear(64, 96).to(torch.bfloat16)\n"
        "use_matvec_for_single_rows(layer, 'mv')\n"
        "assert pack_linear_weights(m) > 0\n"
        "with torch.inference_mode():\n"
        "    cache = ContiguousKVCache(m.config, 4, torch.bfloat16, 'cpu')\n"
        "    m(torch.tensor([5, 6]), torch.arange(2), cache)\n"
        "    layer(torch.randn(1, 64, dtype=torch.bfloat16))\n"
        "assert 'torch._dynamo' not in sys.modules, 'an eager step imported torch._dynamo'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _mixed_step(model, pool, block_size: int, scratch: int):
    """A decode after 36 cached tokens beside two prompt chunks (one after 20 cached
    tokens): T = 15 rows, with its metadata."""
    from minivllm.kv_cache import AttentionMetadata

    tables = [[0, 1, 2], [3], [4, 5]]
    cached, new = [36, 0, 20], [1, 9, 5]
    ids = torch.tensor([11, *range(20, 29), *range(40, 45)])
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)])
    md = AttentionMetadata.build(tables, cached, new, block_size, "cpu", pad_block=scratch)
    return ids, positions, md


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_step_is_two_graphs_for_all_layers_and_computes_the_eager_model(tiny_model, dtype):
    """Guards: a graph compiled per layer (24 pairs on the 0.5B model, minutes of start-up)
    because something per layer (a packed linear's handle as an int) became a constant of
    the graph; a new token count or row count recompiling; the two halves computing another
    function than the model's own forward (merged and packed weights included);
    the last layer past attention run for other rows than the logits rows asked for, or
    for every row, or without writing every row's keys and values."""
    from torch._dynamo.utils import counters

    from minivllm.attention import BatchedAttention
    from minivllm.compile import CompiledFlatStep, merge_projections, pack_linear_weights
    from minivllm.kv_cache import KVCachePool
    from minivllm.model import load_model

    model = load_model(tiny_model, dtype=dtype)
    merge_projections(model)
    packed = pack_linear_weights(model)
    assert (packed > 0) == (dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    mc = model.config
    block_size, scratch = 16, 8
    pool = KVCachePool(mc.num_hidden_layers, scratch + 1, block_size, mc.num_key_value_heads,
                       mc.head_dim, dtype, "cpu")
    flat = CompiledFlatStep(model, lambda md: BatchedAttention(pool, md))
    graphs = counters["stats"]["unique_graphs"]
    flat.warmup(block_size, scratch, torch.device("cpu"))
    # two graphs for all layers, the one-row rest of the last layer, one row's logits
    assert mc.num_hidden_layers > 1 and counters["stats"]["unique_graphs"] - graphs <= 4
    graphs = counters["stats"]["unique_graphs"]
    pool.kv.normal_()
    saved = pool.kv.clone()
    ids, positions, md = _mixed_step(model, pool, block_size, scratch)
    with torch.inference_mode():
        eager = model(ids, positions, BatchedAttention(pool, md))
        eager_kv, _ = pool.kv.clone(), pool.kv.copy_(saved)
        got = flat.hidden(ids, positions, BatchedAttention(pool, md))
        for t in (2, 33):  # other token counts: the same graphs
            md_t = type(md).build([[0, 1, 2]], [0], [t], block_size, "cpu", pad_block=scratch)
            flat.hidden(torch.arange(t), torch.arange(t), BatchedAttention(pool, md_t))
    tolerance = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0, "atol": 0.1}
    torch.testing.assert_close(got, eager, **tolerance)
    assert counters["stats"]["unique_graphs"] == graphs, "a new token count recompiled"
    pool.kv.copy_(saved)
    with torch.inference_mode():  # the same keys and values written into the pool
        flat.hidden(ids, positions, BatchedAttention(pool, md))
    torch.testing.assert_close(pool.kv, eager_kv, **tolerance)
    # only the logits rows past the last layer's attention: the same rows of the same
    # function, every row's keys and values still written, and no new graph for any count
    after_rows, after = [], flat._after
    flat._after = lambda layer, x, out: after_rows.append(len(x)) or after(layer, x, out)
    try:
        for rows in ([14], [0, 9, 14], [], list(range(15))):
            pool.kv.copy_(saved)
            with torch.inference_mode():
                some = flat.hidden(ids, positions, BatchedAttention(pool, md), torch.tensor(rows))
            assert some.shape == (len(rows), mc.hidden_size)
            torch.testing.assert_close(some, eager[rows], **tolerance)
            torch.testing.assert_close(pool.kv, eager_kv, **tolerance)
            layers = mc.num_hidden_layers
            assert after_rows == [15] * (layers - 1) + ([len(rows)] if rows else []), rows
            after_rows.clear()
    finally:
        flat._after = after
    assert counters["stats"]["unique_graphs"] == graphs, "a row count recompiled"
    # the logits: one row through its compiled graph, more rows eagerly, the same numbers
    with torch.inference_mode():
        for rows in ([14], [0, 9, 14]):
            torch.testing.assert_close(flat.logits(eager[rows]),
                                       model.compute_logits(eager[rows]), **tolerance)
    assert counters["stats"]["unique_graphs"] == graphs, "one row's logits recompiled"


def test_the_engine_compiles_flat_steps_unless_asked_not_to(compiled_random, random_engine_model):
    """Guards: EngineConfig.compile_flat_steps (and so --no-compile-flat-steps) not reaching
    the runner; a step of one token taking the flat graphs (dynamo would compile a graph of
    its own for T = 1); a lone prompt's one logits row not taking the compiled one-row
    logits (``CompiledRunner.compute_logits``); prefill chunks through the flat step
    changing a greedy request."""
    from torch._dynamo.utils import counters

    from minivllm.kv_cache import AttentionMetadata

    runner = compiled_random.engine.runner
    assert runner.decoder.flat is not None  # compile_flat_steps defaults to on
    calls, logits_rows = [], []
    flat = runner.decoder.flat
    flat_hidden, one_row_logits = flat.hidden, flat._one_row_logits
    flat.hidden = lambda *args: calls.append(len(args[0])) or flat_hidden(*args)
    flat._one_row_logits = lambda m, h: logits_rows.append(len(h)) or one_row_logits(m, h)
    try:
        graphs = counters["stats"]["unique_graphs"]
        prompt = {"prompt_token_ids": [7, 70, 170, 270, 9, 33, 2, 5, 81, 401, 6, 77]}
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        tokens = compiled_random.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert calls == [12], "the prompt's prefill did not take the flat step"
        assert logits_rows == [1], "the prompt's one logits row did not take its compiled graph"
        md = AttentionMetadata.build([[0]], [3], [1], 8, "cpu", pad_block=runner.num_blocks)
        with torch.inference_mode():
            runner.hidden_states(torch.tensor([5]), torch.tensor([3]),
                                 runner.attention_cls(runner.pool, md), torch.tensor([0]))
        assert calls == [12], "a one-token step took the flat step"
        assert counters["stats"]["unique_graphs"] == graphs
    finally:
        flat.hidden, flat._one_row_logits = flat_hidden, one_row_logits
    off = LLM(str(random_engine_model), block_size=8, num_blocks=12, max_model_len=96,
              max_num_seqs=4, max_num_batched_tokens=24, compile=True,
              compile_in_background=False, compile_flat_steps=False)
    assert off.engine.runner.decoder is not None and off.engine.runner.decoder.flat is None
    assert off.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == tokens


def test_the_opaque_kv_write_computes_the_same_step_in_place_compiled(tiny_model):
    """``write_kv`` (the pool write a CUDA graph uses, so that inductor never tunes a kernel
    that writes into the pool, and never clones the pool to do it), forced on a CPU: compiled,
    it gives the inline write's logits, writes the same keys and values into the pool itself
    (not into a copy), and inductor reinplaces it (no functional copy of the pool left)."""
    from torch._dynamo.utils import ReinplaceCounters

    from minivllm.compile import DecodeAttention
    from minivllm.kv_cache import KVCachePool
    from minivllm.model import load_model

    def step(model, kv, input_ids, seq_lens, block_tables, block_size, opaque_write):
        """decode_logits with the write chosen."""
        positions = seq_lens - 1
        slots = decode_slots(block_tables, positions, block_size)
        attn = DecodeAttention(kv, slots, block_tables, seq_lens, block_size, opaque_write)
        return model.compute_logits(model(input_ids, positions, attn))

    model = load_model(tiny_model, dtype=torch.float32)
    mc = model.config
    block_size = 16
    pool = KVCachePool(mc.num_hidden_layers, 8, block_size, mc.num_key_value_heads,
                       mc.head_dim, torch.float32, "cpu")
    pool.kv.normal_()
    saved, address = pool.kv.clone(), pool.kv.data_ptr()
    args = (torch.tensor([5, 9, 13]), torch.tensor([20, 3, 33]),
            torch.tensor([[0, 1, 7], [2, 7, 7], [3, 4, 5]]), block_size)
    with torch.inference_mode():
        want = step(model, pool.kv, *args, opaque_write=False)  # eager, inline index_put_
        want_kv = pool.kv.clone()
        pool.kv.copy_(saved)
        ReinplaceCounters.clear()
        got = torch.compile(step, dynamic=True)(model, pool.kv, *args, opaque_write=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert pool.kv.data_ptr() == address
    torch.testing.assert_close(pool.kv, want_kv, rtol=1e-4, atol=1e-4)
    assert not torch.equal(pool.kv, saved), "the step wrote nothing into the pool"
    assert ReinplaceCounters.get_total_missed() == 0, dict(ReinplaceCounters._values)


def _assert_decoder_matches_eager(decoder, model, pool, saved, row_counts, first_id: int,
                                  first_len: int) -> None:
    """``decoder.logits`` against the eager ``decode_logits`` for batches of each row count,
    the pool put back to ``saved`` before each (both write the new token's keys and values)."""
    from minivllm.compile import DecodeInputs, decode_logits

    for rows in row_counts:
        batch = DecodeInputs(list(range(first_id, first_id + rows)),
                             [first_len + r for r in range(rows)], [[r, 4 + r] for r in range(rows)])
        pool.kv.copy_(saved)
        got = decoder.logits(batch)
        pool.kv.copy_(saved)
        want = decode_logits(model, pool.kv, torch.tensor(batch.input_ids),
                             torch.tensor(batch.seq_lens), torch.tensor(batch.block_tables),
                             decoder.block_size)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_each_compile_checks_only_its_inputs_guards_and_keeps_its_graphs_to_itself(tiny_model,
                                                                                   monkeypatch):
    """Guards: a model's guards dropped while compiles share graphs, so that a second model
    with one layer more, over a pool of the same shape, runs the first one's graph (a wrong
    answer: that graph stops a layer early); the inputs' guards dropped too, so that a 3-row
    batch runs the one-row graph; the filter keeping the module guards (no saving)."""
    from minivllm.attention import BatchedAttention
    from minivllm.compile import (
        CompiledDecoder,
        CompiledFlatStep,
        compile_guarding_inputs,
        decode_logits,
        guards_on_inputs,
    )
    from minivllm.kv_cache import KVCachePool
    from minivllm.model import load_model

    kept: list[tuple[str, str]] = []
    dropped: list[str] = []

    def recording(entries):  # guards_on_inputs, noting what it keeps and drops
        flags = guards_on_inputs(entries)
        for entry, keep in zip(entries, flags):
            (kept.append((entry.name, entry.guard_type)) if keep else dropped.append(entry.name))
        return flags

    whole = load_model(tiny_model, dtype=torch.float32)
    deeper = load_model(tiny_model, dtype=torch.float32)  # another model: one layer more
    extra = copy.deepcopy(deeper.model.layers[-1])
    extra.self_attn.layer_idx = len(deeper.model.layers)
    deeper.model.layers.append(extra)
    block_size, scratch = 16, 8
    mc = whole.config
    with torch.inference_mode():
        for model in (whole, deeper):  # pools of one shape: no input tells the models apart
            pool = KVCachePool(len(deeper.model.layers), scratch + 1, block_size,
                               mc.num_key_value_heads, mc.head_dim, torch.float32, "cpu")
            pool.kv.normal_()
            saved = pool.kv.clone()
            decoder = CompiledDecoder(model, pool.kv, block_size, scratch, torch.device("cpu"))
            flat = CompiledFlatStep(model, lambda md, pool=pool: BatchedAttention(pool, md))
            _assert_decoder_matches_eager(decoder, model, pool, saved, (1, 3, 2), first_id=7,
                                          first_len=30)  # the one-row graph, then the dynamic one
            ids, positions, md = _mixed_step(model, pool, block_size, scratch)
            pool.kv.copy_(saved)
            got = flat.hidden(ids, positions, BatchedAttention(pool, md))
            pool.kv.copy_(saved)
            torch.testing.assert_close(got, model(ids, positions, BatchedAttention(pool, md)),
                                       rtol=1e-4, atol=1e-4)
        # what compile_guarding_inputs keeps: the inputs' guards (the one-row graph's is a size
        # of 1 on input_ids) and the global state, never a module's or a global's
        monkeypatch.setattr("minivllm.compile.guards_on_inputs", recording)
        kv = pool.kv.new_zeros(2, len(whole.model.layers), 16 * 9, mc.num_key_value_heads,
                               mc.head_dim)
        compile_guarding_inputs(decode_logits)(whole, kv, torch.tensor([7]), torch.tensor([5]),
                                               torch.tensor([[0, 8]]), block_size)
    names = {name for name, _ in kept}
    assert {"kv", "input_ids", "seq_lens", "block_tables"} <= names
    assert any(kind in ("GLOBAL_STATE", "GRAD_MODE") for _, kind in kept)
    assert not any(name.startswith(("model", "G[")) for name in names), names
    assert len(dropped) > 10 * len(kept)  # most of a model's guards are on its modules


def test_a_cpu_decode_step_calls_its_kernels_from_cpp_and_computes_the_eager_step(tiny_model,
                                                                                  monkeypatch):
    """``cpp_wrapper``: the one-row and the many-row decode graphs each load a C++ wrapper
    (``_record_cpp_wrappers``), its kernels' C++ built apart from the calls', and give the
    eager model's logits; ``cpp_wrapper=False`` loads none."""
    from torch._inductor.codecache import PyCodeCache

    from minivllm.compile import CompiledDecoder
    from minivllm.kv_cache import KVCachePool
    from minivllm.model import load_model

    loaded = _record_cpp_wrappers(monkeypatch)  # each wrapper: its kernels' C++ apart?
    model = load_model(tiny_model, dtype=torch.float32)
    mc, block_size, scratch = model.config, 16, 8
    pool = KVCachePool(mc.num_hidden_layers, scratch + 1, block_size, mc.num_key_value_heads,
                       mc.head_dim, torch.float32, "cpu")
    pool.kv.normal_()
    saved = pool.kv.clone()
    with torch.inference_mode():
        for cpp_wrapper in (True, False):
            PyCodeCache.cache_clear()  # a graph compiled before in this process loads again
            loaded.clear()
            decoder = CompiledDecoder(model, pool.kv, block_size, scratch, torch.device("cpu"),
                                      cpp_wrapper=cpp_wrapper)
            assert decoder.cpp_wrapper is cpp_wrapper
            _assert_decoder_matches_eager(decoder, model, pool, saved, (1, 3), first_id=5,
                                          first_len=20)  # the one-row graph, then the dynamic one
            assert len(loaded) == (2 if cpp_wrapper else 0), loaded  # one per graph
            assert all(loaded), loaded
