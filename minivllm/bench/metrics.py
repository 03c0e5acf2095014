# Generated from solutions/05_benchmark.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""Benchmark workloads and metrics: the pure half of the harness.

Built in notebook 05_benchmark. A benchmark is a *workload* (seeded requests, identical for
every engine) run at a *concurrency* (how many requests are in flight at once), and for
every request a list of timestamps: when it was sent, when each streamed chunk of tokens
arrived, when it ended. Everything else is arithmetic on those timestamps, named as
``vllm bench serve`` names it so that our numbers sit next to vLLM's without translation:

    TTFT  time to first token   first chunk - sent           (queueing + prefill)
    ITL   inter-token latency   gap between successive chunks (one decode step as seen)
    TPOT  time per output token (end - first chunk) / (output tokens - 1), per request
    E2EL  end-to-end latency    end - sent
    output_throughput           output tokens of all requests / wall time of the run

Means, medians and p99s use linear interpolation between closest ranks (``numpy``'s
default, as vLLM does). The runners that produce the timestamps live in ``clients``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

WORKLOADS = ("fixed", "mixed", "repetitive")


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: a prompt of token ids and exactly how many tokens to
    generate (``max_tokens`` with ``ignore_eos``, so every engine does the same work)."""

    prompt_token_ids: list[int]
    output_len: int


def _lengths(rng: random.Random, n: int, mean: int, range_ratio: float) -> list[int]:
    """``n`` lengths uniform in [mean * (1 - r), mean * (1 + r)] (at least 1)."""
    low, high = max(1, round(mean * (1 - range_ratio))), max(1, round(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def make_workload(kind: str, num_requests: int, input_len: int, output_len: int, *,
                  seed: int = 0, vocab_size: int = 151643, range_ratio: float = 0.9,
                  salt: int = 0, repeat: int = 0) -> list[BenchRequest]:
    """Seeded requests with random token-id prompts, identical for every engine.

    * ``fixed``: every prompt has ``input_len`` tokens and every output ``output_len``
      (the seed tables' shape: no request finishes early, so static batching wastes nothing).
    * ``mixed``: prompt and output lengths uniform within ``range_ratio`` of the means (as
      ``vllm bench serve --random-range-ratio``), so sequences finish at different times.
    * ``repetitive``: fixed lengths, each prompt one random span of ``input_len // 4`` tokens
      repeated, so that an answer which goes on repeating it is predictable from the prompt
      (where speculative decoding's n-gram lookup pays, Milestone 8).

    ``salt`` (e.g. the concurrency) gives each run its own prompts, so that a prefix
    cache warmed by an earlier run cannot flatter a later one; ``repeat`` does the same for
    ``--repeat N``, whose runs of a level would otherwise send one running server the same
    prompts again (every repeat after the first then measured prefix-cache hits, not
    prefill). Repeat 0 draws the prompts it always drew. Token ids are drawn from
    ``[0, vocab_size)``; pass the number of *regular* tokens (151643 for Qwen) so no prompt
    contains a special token.
    """
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r}; choose from {', '.join(WORKLOADS)}")
    key = f"{kind}/{seed}/{salt}" + (f"/repeat{repeat}" if repeat else "")
    rng = random.Random(key)  # str seeds hash deterministically
    ratio = range_ratio if kind == "mixed" else 0.0
    input_lens = _lengths(rng, num_requests, input_len, ratio)
    output_lens = _lengths(rng, num_requests, output_len, ratio)
    if kind == "repetitive":
        spans = [[rng.randrange(vocab_size) for _ in range(max(1, n_in // 4))] for n_in in input_lens]
        return [BenchRequest((span * -(-n_in // len(span)))[:n_in], n_out)
                for span, n_in, n_out in zip(spans, input_lens, output_lens)]
    return [BenchRequest([rng.randrange(vocab_size) for _ in range(n_in)], n_out)
            for n_in, n_out in zip(input_lens, output_lens)]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of a non-empty list, by linear interpolation
    between the closest ranks (``numpy.percentile``'s default, which vLLM reports).

    The sorted values sit at ranks 0 .. n-1; the q-th percentile sits at rank
    ``(n - 1) * q / 100``, usually between two of them, so interpolate linearly.
    """
    if not values:
        raise ValueError("percentile of an empty list")
    xs = sorted(values)
    rank = (len(xs) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass
class RequestResult:
    """What a runner records for one request (seconds on one monotonic clock)."""

    prompt_len: int
    start: float = 0.0  # when the request was sent
    chunk_times: list[float] = field(default_factory=list)  # arrival of each streamed chunk
    end: float = 0.0  # when the response was complete
    output_tokens: int = 0  # tokens generated (a chunk may carry more than one)
    error: str | None = None  # why it failed; None on success

    @property
    def success(self) -> bool:
        return self.error is None and bool(self.chunk_times)


@dataclass(frozen=True)
class RequestLatency:
    """One request's latencies in seconds (``tpot`` is None for a one-token output)."""

    ttft: float
    itls: list[float]
    tpot: float | None
    e2el: float


def request_latency(result: RequestResult) -> RequestLatency:
    """TTFT, ITLs, TPOT and E2EL of one successful request.

    * TTFT runs from when the request was *sent* (not from its first token): a request
      that waits in a queue makes its user wait too.
    * The ITLs are the gaps between successive chunks (``len(chunk_times) - 1`` of them).
    * TPOT averages the decode time over the tokens after the first:
      ``(e2el - ttft) / (output_tokens - 1)``; None when there is only one token.
    * E2EL runs from sent to ``end``.
    """
    times = result.chunk_times
    ttft = times[0] - result.start
    itls = [b - a for a, b in zip(times, times[1:])]  # noqa: RUF007 (3.10+ only)
    e2el = result.end - result.start
    tpot = (e2el - ttft) / (result.output_tokens - 1) if result.output_tokens > 1 else None
    return RequestLatency(ttft, itls, tpot, e2el)


def _stats(name: str, values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """``mean_/median_/p99_<name>_ms`` of a list of seconds (None when it is empty)."""
    if not values:
        return {f"{k}_{name}_ms": None for k in ("mean", "median", "p99")}
    return {f"mean_{name}_ms": scale * sum(values) / len(values),
            f"median_{name}_ms": scale * percentile(values, 50),
            f"p99_{name}_ms": scale * percentile(values, 99)}


def summarize(results: list[RequestResult], duration: float) -> dict[str, float | int | None]:
    """The run's metrics, with ``vllm bench serve``'s names; failed requests are counted
    in ``failures`` and left out of every other number. ``duration`` is the wall time of
    the whole run (first request sent to last response complete), in seconds."""
    ok = [r for r in results if r.success]
    lat = [request_latency(r) for r in ok]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    metrics: dict[str, float | int | None] = {
        "completed": len(ok),
        "failures": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else None,
        "output_throughput": output_tokens / duration if duration > 0 else None,
        "total_token_throughput": (input_tokens + output_tokens) / duration
        if duration > 0 else None,
    }
    metrics |= _stats("ttft", [x.ttft for x in lat])
    metrics |= _stats("tpot", [x.tpot for x in lat if x.tpot is not None])
    metrics |= _stats("itl", [g for x in lat for g in x.itls])
    metrics |= _stats("e2el", [x.e2el for x in lat])
    return metrics


# (header, record key, format): what the end-of-run table shows.
TABLE_COLUMNS = [
    ("engine", "engine", "{}"), ("dtype", "dtype", "{}"), ("workload", "workload", "{}"), ("conc", "concurrency", "{}"),
    ("ok", "completed", "{}"), ("fail", "failures", "{}"),
    ("out tok/s", "output_throughput", "{:.1f}"), ("req/s", "request_throughput", "{:.2f}"),
    ("TTFT p50", "median_ttft_ms", "{:.0f}"), ("TTFT p99", "p99_ttft_ms", "{:.0f}"),
    ("TPOT p50", "median_tpot_ms", "{:.1f}"), ("ITL p99", "p99_itl_ms", "{:.1f}"),
    ("E2EL p50", "median_e2el_ms", "{:.0f}"), ("E2EL p99", "p99_e2el_ms", "{:.0f}"),
    ("peak MiB", "peak_memory_mib", "{:.0f}"), ("other CPU%", "other_cpu_percent", "{:.0f}"),
    ("mem GB/s", "memory_read_gbs", "{:.0f}"),  # the machine's memory read rate, before/after
]


def _cell(record: dict, key: str, fmt: str) -> str:
    value = record.get(key)
    if key == "peak_memory_mib" and record.get("peak_memory_bytes") is not None:
        value = record["peak_memory_bytes"] / 2**20
    elif key == "other_cpu_percent":
        value = record.get("load", {}).get(key)
    elif key == "memory_read_gbs":  # [before, after]: "47/30"
        rates = record.get("load", {}).get(key) or []
        return "/".join(fmt.format(x) for x in rates) or "-"
    elif key == "dtype":  # the dtype the engine ran, as its environment recorded it
        value = record.get("env", {}).get("dtype")
    return "-" if value is None else fmt.format(value)


def samples(sampling: dict | None) -> bool:
    """Whether requests with these --sampling-option fields sample (a temperature above 0)
    where the benchmark's protocol takes the argmax."""
    return float((sampling or {}).get("temperature") or 0) > 0


def engine_label(record: dict) -> str:
    """``minivllm``, or ``minivllm[compile=False]`` for a run with per-engine options."""
    return record["engine"] + (f"[{record['variant']}]" if record.get("variant") else "")


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def median_runs(records: list[dict]) -> list[dict]:
    """One record per (engine label, workload, concurrency): with ``--repeat N`` the run whose
    output throughput is the median of the N (the lower middle one when N is even), with
    ``repeats`` and every run's throughput added, so that one noisy run cannot decide a
    result. Order of first appearance is kept."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        key = (r.get("label"), engine_label(r), r["workload"], r["concurrency"])
        groups.setdefault(key, []).append(r)
    out = []
    for runs in groups.values():
        ranked = sorted(runs, key=lambda r: r.get("output_throughput") or 0.0)
        middle = ranked[(len(ranked) - 1) // 2]
        out.append({**middle, "repeats": len(runs),
                    "output_throughput_runs": [r.get("output_throughput") for r in runs]})
    return out


def level_runs(records: list[dict], label: str, workload: str, concurrency: int) -> list[dict]:
    """Every run of one engine label at one (workload, concurrency) level."""
    return [r for r in records if engine_label(r) == label and r["workload"] == workload
            and r["concurrency"] == concurrency]


def throughput_ratio(records: list[dict], label: str, baseline: str, workload: str,
                     concurrency: int) -> tuple[float, float, float] | None:
    """``label``'s output throughput over ``baseline``'s at one level: (median, min, max) of
    the per-repeat ratios, pairing the runs of the same label and repeat (which ran back to
    back)."""
    def by_repeat(name: str) -> dict[tuple, float]:
        return {(r.get("label"), r.get("repeat", 0)): r["output_throughput"]
                for r in level_runs(records, name, workload, concurrency)
                if r.get("output_throughput")}
    a, b = by_repeat(label), by_repeat(baseline)
    ratios = [a[i] / b[i] for i in a if i in b]
    return (_median(ratios), min(ratios), max(ratios)) if ratios else None


def format_table(records: list[dict], baseline: str = "transformers") -> str:
    """A plain-text table (latencies in ms; with repeats, the median run of each level), a
    ``!`` on rows measured on a busy machine, and each engine's output throughput as a ratio
    of ``baseline``'s (an engine label, e.g. ``minivllm[compile=False]``) at the same
    workload and concurrency: on a CPU the ratios are the result, not the absolute numbers."""
    rows = [[h for h, _, _ in TABLE_COLUMNS] + ["runs", "busy"]]
    medians = median_runs(records)
    for r in medians:
        busy = "!" if r.get("load", {}).get("busy") else ""
        cells = [_cell(r, key, fmt) for _, key, fmt in TABLE_COLUMNS]
        cells[0] = engine_label(r)
        rows.append(cells + [str(r["repeats"]), busy])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    ratios = []
    for r in medians:
        label = engine_label(r)
        ratio = throughput_ratio(records, label, baseline, r["workload"], r["concurrency"])
        if label != baseline and ratio:
            spread = f" (median of {r['repeats']} paired runs, {ratio[1]:.2f}-{ratio[2]:.2f}x)" \
                if r["repeats"] > 1 else ""
            ratios.append(f"{label} / {baseline} output throughput, {r['workload']} "
                          f"c={r['concurrency']}: {ratio[0]:.2f}x{spread}")
    if any(r.get("load", {}).get("busy") for r in records):
        lines.append("! = other processes used CPU during this run: the numbers are not valid")
    return "\n".join(lines + ratios + [roofline_line(r, records) for r in medians
                                        if "roofline" in r])


def roofline_fraction(records: list[dict], label: str, workload: str,
                      concurrency: int) -> tuple[float, float, float] | None:
    """(median, lowest, highest) fraction of the roofline over the repeats of one level: the
    median of each run's fraction against the mean of its two rooflines (from the rates
    measured before and after it), and the extremes against either roofline."""
    runs = [r["roofline"] for r in level_runs(records, label, workload, concurrency)
            if r.get("roofline", {}).get("fraction")]
    if not runs:
        return None
    mids = [2 / (1 / lo + 1 / hi) for lo, hi in (run["fraction"] for run in runs)]
    return (_median(mids), min(run["fraction"][0] for run in runs),
            max(run["fraction"][1] for run in runs))


def roofline_line(record: dict, records: list[dict] | None = None) -> str:
    """``minivllm fixed c=32: 85% of the workload roofline (...)``: the fraction against the
    matmul rate measured just before and just after the level (``--roofline``); with
    repeats, the median over the runs and the range of all of them. The rates and tokens/s
    quoted are those of the level's median run."""
    roof = record["roofline"]
    found = roofline_fraction(records or [record], engine_label(record), record["workload"],
                              record["concurrency"])
    share = f"{100 * found[0]:.0f}% ({100 * found[1]:.0f}-{100 * found[2]:.0f})" if found else "-"
    rates = ", ".join(f"{k} {roof['gflops_before'][k]:.1f}->{roof['gflops_after'][k]:.1f}"
                      for k in ("prefill", "decode"))
    return (f"{engine_label(record)} {record['workload']} c={record['concurrency']}: {share} of "
            f"the workload roofline ({roof['tokens_per_s'][0]:.1f}-{roof['tokens_per_s'][1]:.1f} "
            f"tok/s; matmul GFLOP/s before->after: {rates}; "
            f"{roof['gflop_per_output_token']:.3f} GFLOP per output token)")
