"""The benchmark's closed loop, simulated through the real scheduler with a step-cost model.

A benchmark level on a 2-core CPU takes minutes and drifts with the machine's state; a
question such as "would a 384-token budget shorten TTFT at mixed c=32?" or "what does this
admission rule do to the second wave of fixed c=32?" can be asked here in a second, before
any run. The simulation drives notebook 03's ``Scheduler`` and notebook 02's
``BlockManager`` themselves, step by step, on the benchmark's own seeded requests
(``make_workload``): C clients, each sending its next request the moment its previous one
ends (``python -m minivllm.bench``'s closed loop). No model runs: a step takes

    cost(step) = step_ms + row_ms * (decode rows) + token_ms * (prompt tokens)
                 + prompt_ms (if the step computes any prompt tokens)

milliseconds, every decode row samples one token, and a prompt's last chunk its first. The
default coefficients were fitted on the 2-vCPU Zen 3 in float32, the 0.5B shape, the server's
engine (``--calibrate``; docs/decisions.md, issue 30, twenty-fifth part): a 32-row decode
step ~340 ms, a prompt-only step of 128 tokens ~660 ms, one row ~42 ms (the fit's 53: the
one-row step has a route of its own). On another machine fit them again:
``--calibrate MODEL`` times steps of the engine as the server builds it (a fresh prompt of
16, 128 and 512 tokens alone; 1, 8 and 32 sequences decoding) and fits the four by least
squares; or pass ``--cost``. Requests arrive at the step boundary after they are sent, as an
engine thread that is stepping sees them; the server's burst window, HTTP and the time
between steps are left out, so simulated TTFTs run below measured ones.

Policies (``--policies``): ``fcfs`` is the package's scheduler as shipped (first come, first
served, with ``step_overhead_tokens`` weighing which waiting prompts join a step);
``shortest-first`` sorts the queue by prompt length before every step (not FCFS: a long
prompt may wait behind any number of shorter ones); ``arrivals`` counts the requests that
arrived during the last step among those that would wait behind a deferred prompt. The last
two are what-ifs, not in the package.

    python bench/experiments/schedule_sim.py --workloads fixed,mixed --concurrency 2,8,32 \\
        --budgets 256,512 --overheads 0,16 --policies fcfs,shortest-first
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from minivllm.bench.metrics import make_workload, percentile
from minivllm.kv_cache import BlockManager
from minivllm.sampling import SamplingParams
from minivllm.scheduler import RunnerOutput, Scheduler, Sequence

# ms: per step, per decode row, per prompt token, per step with prompt tokens (Zen 3, fp32)
DEFAULT_COST = (43.9, 9.3, 4.7, 21.1)


class ShortestFirst(Scheduler):
    """What-if: the waiting queue sorted by tokens to compute before every step."""

    def schedule(self):
        self.waiting = deque(sorted(self.waiting, key=lambda s: s.num_tokens - s.num_computed_tokens))
        return super().schedule()


class CountArrivals(Scheduler):
    """What-if: a deferred prompt also keeps waiting the requests that arrive while the next
    step runs (estimated by the arrivals during the last one), so the weighing admits more
    when arrivals come faster than one at a time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._arrived = 0
        self.arrivals_per_step = 0

    def add(self, seq: Sequence) -> None:
        self._arrived += 1
        super().add(seq)

    def schedule(self):
        self.arrivals_per_step, self._arrived = self._arrived, 0
        return super().schedule()

    def _joins_step(self, out, seq, budget):
        # the package's rule, with the expected arrivals counted among the prompts behind
        # ``seq``: it reads only how many wait, so stand-ins are queued for the question
        stand_ins = [seq] * self.arrivals_per_step
        self.waiting.extend(stand_ins)
        try:
            return super()._joins_step(out, seq, budget)
        finally:
            for _ in stand_ins:
                self.waiting.pop()


POLICIES = {"fcfs": Scheduler, "shortest-first": ShortestFirst, "arrivals": CountArrivals}


def simulate(workload: str, concurrency: int, *, budget: int = 512, step_overhead_tokens: int = 0,
             policy: str = "fcfs", cost: tuple[float, ...] = DEFAULT_COST,
             num_requests: int | None = None, input_len: int = 128, output_len: int = 64,
             seed: int = 0, max_num_seqs: int = 256, block_size: int = 16) -> dict:
    """One closed-loop level: TTFT and TPOT per request (s, ms) as the benchmark reports them,
    output tokens per second, and the steps taken."""
    step_ms, row_ms, token_ms, prompt_ms = cost
    num_requests = num_requests or max(2 * concurrency, 8)
    requests = make_workload(workload, num_requests, input_len, output_len, seed=seed,
                             salt=concurrency)
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    blocks = -(-longest // block_size) * min(concurrency, num_requests) + 1
    scheduler = POLICIES[policy](BlockManager(blocks, block_size), max_num_seqs, budget,
                                 longest, (), step_overhead_tokens=step_overhead_tokens)
    now, steps = 0.0, 0
    sent = {i: 0.0 for i in range(min(concurrency, num_requests))}  # request -> when sent
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    added: set[int] = set()
    while len(done) < num_requests:
        for i in sorted(set(sent) - added):
            if sent[i] <= now:  # sent before this step boundary: the scheduler sees it now
                # distinct token ids per request: nothing is a prefix-cache hit
                prompt = [i * 1_000_000 + j for j in range(len(requests[i].prompt_token_ids))]
                params = SamplingParams(max_tokens=requests[i].output_len, ignore_eos=True)
                scheduler.add(Sequence(i, str(i), prompt, params))
                added.add(i)
        plan = scheduler.schedule()
        decode_rows = sum(1 for _, n in plan.scheduled if n == 1)
        prompt_tokens = sum(n for _, n in plan.scheduled if n > 1)
        now += (step_ms + row_ms * decode_rows + token_ms * prompt_tokens
                + (prompt_ms if prompt_tokens else 0.0))
        steps += 1
        out = RunnerOutput(token_ids={seq.seq_id: [0] for seq, n in plan.scheduled
                                      if seq.num_computed_tokens + n >= seq.num_tokens})
        scheduler.update(plan, out)
        for seq, _ in plan.scheduled:
            if seq.seq_id in out.token_ids:
                first.setdefault(seq.seq_id, now)
            if seq.is_finished and seq.seq_id not in done:
                done[seq.seq_id] = now
                if len(sent) < num_requests:  # its client sends the next request
                    sent[len(sent)] = now
    ttft = [(first[i] - sent[i]) / 1e3 for i in range(num_requests)]
    tpot = [(done[i] - first[i]) / (requests[i].output_len - 1)
            for i in range(num_requests) if requests[i].output_len > 1]
    return {"ttft_p50_s": percentile(ttft, 50), "ttft_mean_s": statistics.mean(ttft),
            "ttft_p99_s": percentile(ttft, 99), "tpot_p50_ms": percentile(tpot, 50) if tpot else 0.0,
            "output_tok_s": sum(r.output_len for r in requests) / now * 1e3, "steps": steps}


def measure_steps(model: str, prompt_lens=(16, 128, 512), decode_rows=(1, 8, 32),
                  context: int = 128, repeats: int = 3, **engine_options) -> list[tuple[int, int, float]]:
    """(decode rows, prompt tokens, ms) of single engine steps, timed on an engine built as
    the server builds it (its compiled step in the foreground): a fresh prompt alone, and
    sequences decoding at ``context`` tokens, after one untimed pass (first calls compile and
    allocate). Each step's rows and tokens are read from the engine's counters, not assumed."""
    from minivllm.engine import LLMEngine

    engine = LLMEngine.from_options(model, compile_in_background=False, **engine_options)
    budget = engine.config.max_num_batched_tokens
    rng = random.Random(0)
    ids = iter(range(10**9))
    vocab = min(engine.model_config.vocab_size, 100_000)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]  # fresh: no prefix-cache hit

    def timed_step() -> tuple[int, int, float]:
        before = (engine.stats.num_prompt_tokens_computed, engine.stats.num_generated_tokens)
        start = time.perf_counter()
        engine.step()
        ms = (time.perf_counter() - start) * 1e3
        tokens = engine.stats.num_prompt_tokens_computed - before[0]
        generated = engine.stats.num_generated_tokens - before[1]
        return generated - (1 if tokens else 0), tokens, ms  # a prompt's step samples its first

    samples = []
    for rep in range(repeats + 1):
        for n in prompt_lens:
            engine.add_request(f"calibrate-{next(ids)}", prompt(min(n, budget)),
                               SamplingParams(max_tokens=1, ignore_eos=True))
            sample = timed_step()
            while engine.has_unfinished_requests():
                engine.step()
            samples += [sample] if rep else []
        for rows in decode_rows:
            names = [f"calibrate-{next(ids)}" for _ in range(rows)]
            for name in names:
                engine.add_request(name, prompt(context), SamplingParams(max_tokens=64, ignore_eos=True))
            while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                                  for s in engine.scheduler.running):
                engine.step()  # prefill them all
            sample = timed_step()
            for name in names:
                engine.abort_request(name)
            samples += [sample] if rep else []
    return samples


def fit_cost(samples: list[tuple[int, int, float]]) -> tuple[float, float, float, float]:
    """Least squares of ms = step_ms + row_ms * rows + token_ms * tokens + prompt_ms * (tokens
    > 0) over the samples: (step_ms, row_ms, token_ms, prompt_ms)."""
    a = torch.tensor([[1.0, rows, tokens, float(tokens > 0)] for rows, tokens, _ in samples],
                     dtype=torch.float64)
    b = torch.tensor([[ms] for _, _, ms in samples], dtype=torch.float64)
    step_ms, row_ms, token_ms, prompt_ms = torch.linalg.lstsq(a, b).solution.flatten().tolist()
    return step_ms, row_ms, token_ms, prompt_ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="fixed,mixed")
    p.add_argument("--concurrency", default="2,8,32")
    p.add_argument("--num-requests", type=int, default=None, help="per level (default max(2*c, 8))")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--budgets", default="512", help="max_num_batched_tokens values")
    p.add_argument("--overheads", default="0,16", help="step_overhead_tokens values")
    p.add_argument("--policies", default="fcfs", help=", ".join(POLICIES))
    p.add_argument("--cost", default=",".join(map(str, DEFAULT_COST)),
                   help="ms per step, per decode row, per prompt token, per step with a prompt")
    p.add_argument("--calibrate", metavar="MODEL", default=None,
                   help="measure the cost model on this checkpoint instead of --cost")
    a = p.parse_args()
    cost = tuple(float(x) for x in a.cost.split(","))
    if len(cost) != len(DEFAULT_COST):
        p.error(f"--cost takes {len(DEFAULT_COST)} numbers: ms per step, per decode row, per "
                "prompt token, per step with a prompt")
    if a.calibrate:
        samples = measure_steps(a.calibrate)
        for rows, tokens, ms in samples:
            print(f"step of {rows:3d} decode rows and {tokens:4d} prompt tokens: {ms:8.1f} ms")
        cost = fit_cost(samples)
        print("fitted cost, ms per step, per decode row, per prompt token, per step with a "
              "prompt: "
              + ", ".join(f"{x:.2f}" for x in cost))
    print(f"{'workload':8s} {'c':>3s} {'budget':>6s} {'ovh':>4s} {'policy':15s} "
          f"{'TTFT p50':>8s} {'mean':>6s} {'p99':>6s} {'TPOT p50':>8s} {'tok/s':>6s} {'steps':>5s}")
    for workload in a.workloads.split(","):
        for c in map(int, a.concurrency.split(",")):
            for budget in map(int, a.budgets.split(",")):
                for overhead in map(int, a.overheads.split(",")):
                    for policy in a.policies.split(","):
                        r = simulate(workload, c, budget=budget, step_overhead_tokens=overhead,
                                     policy=policy, cost=cost, num_requests=a.num_requests,
                                     input_len=a.input_len, output_len=a.output_len)
                        print(f"{workload:8s} {c:3d} {budget:6d} {overhead:4d} {policy:15s} "
                              f"{r['ttft_p50_s']:8.2f} {r['ttft_mean_s']:6.2f} {r['ttft_p99_s']:6.2f} "
                              f"{r['tpot_p50_ms']:8.1f} {r['output_tok_s']:6.1f} {r['steps']:5d}")


if __name__ == "__main__":
    main()
