"""The figures of bench/plots.ipynb, drawn from the committed ``bench/results/*.jsonl``.

Pure functions first (load, group, pick the run to draw, compute each figure's series), then
three small renderers (lines against concurrency, grouped bars, intervals per row). The
notebook calls ``plan`` once and ``show`` per figure kind; the tests check the plan against
the records, so a figure with nothing behind it fails instead of being drawn empty.

Figures are grouped by (model, device, dtype): the bundled tiny model and the 0.5B shape never
share an axis. The throughput, latency and memory figures show one run (one ``--label``) per
group (an ``--interleave`` run quiet at every level first, else the one with the most levels
measured on a quiet machine), so their lines are measured side by side; the speedup and
roofline figures show every run with repeats, one row each.
With ``--repeat N`` each level shows its median run, and every ratio is the median of the
per-repeat paired ratios with their range: the harness's own functions (``median_runs``,
``throughput_ratio``, ``roofline_fraction``), imported, not restated.
"""

from __future__ import annotations

import io
import json
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from minivllm import TINY_MODEL

# The harness's own definitions (one place): a plotted ratio is the ratio the CLI printed.
from minivllm.bench.metrics import (
    engine_label,
    level_runs,
    median_runs,
    roofline_fraction,
    samples,
    throughput_ratio,
)

HARNESS_NAMES = ("engine_label", "level_runs", "median_runs", "roofline_fraction", "samples",
                 "throughput_ratio")

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
WORKLOADS = ("fixed", "mixed")
KINDS = ("throughput", "latency", "speedup", "roofline", "memory")
ROOFLINE_TARGET = 0.8
SPEEDUP_NOTE = ("dot: median of the per-repeat ratios (each pair ran back to back in one "
                "invocation); whisker: min–max; dashed: 1.0× = no change")
ROOFLINE_NOTE = ("dot: median over the repeats; whisker: lowest–highest against either "
                 f"roofline; dashed: the {ROOFLINE_TARGET:.0%} target")
# One colour per engine, the same in every figure (variants of an engine get shades of it).
ENGINE_COLOURS = {
    "minivllm": "#1f77b4", "minivllm-server": "#2ca02c", "transformers": "#ff7f0e",
    "transformers-serve": "#d62728", "vllm": "#9467bd", "openai": "#8c564b",
}
OTHER_COLOUR = "#7f7f7f"
MARKERS = "osD^vP"
# Before/after steps recognised inside one run: an option flipped on one engine ...
OPTION_STEPS = {
    ("attention_backend", "loop", "batched"): "M6 batched attention",
    ("compile", "false", "true"): "M7 compiled decode",
}
# ... or (after engine, before engine): the same variant, or a baseline with none.
ENGINE_STEPS = {
    ("minivllm", "transformers"): "vs transformers",
    ("minivllm", "transformers-serve"): "vs transformers serve",
    ("minivllm-server", "transformers"): "server vs transformers",
    ("minivllm-server", "transformers-serve"): "server vs transformers serve",
    ("minivllm-server", "minivllm"): "HTTP path vs in-process",
}


class Group(NamedTuple):
    model: str  # short name: the checkpoint directory, or "bundled tiny model"
    device: str
    dtype: str


@dataclass
class Point:
    x: int | str  # concurrency (lines, bars) or a row's name (intervals)
    y: float
    records: list[dict]  # every run behind the point (the repeats of its level)
    lo: float | None = None
    hi: float | None = None
    note: str = ""  # printed beside a row
    engine: str = ""  # a row's colour

    @property
    def busy(self) -> bool:
        return any(r.get("load", {}).get("busy") for r in self.records)


@dataclass
class Line:
    name: str  # legend entry
    engine: str  # engine label: picks the colour
    points: list[Point]
    workload: str = ""
    dashed: bool = False


@dataclass
class Panel:
    title: str
    ylabel: str
    lines: list[Line]
    log: bool = False


@dataclass
class FigureSpec:
    kind: str
    group: Group
    title: str
    panels: list[Panel]
    style: str  # "lines", "bars" or "rows"
    ncols: int = 1
    notes: list[str] = field(default_factory=list)

    @property
    def file_name(self) -> str:
        return f"{self.kind}-{group_slug(self.group)}.png"

    @property
    def records(self) -> list[dict]:
        return [r for p in self.panels for ln in p.lines for pt in ln.points for r in pt.records]


def load_records(results: Path = RESULTS) -> list[dict]:
    """Every record of every ``*.jsonl`` file, in file then line order, with ``file`` added."""
    return [{**json.loads(line), "file": path.name}
            for path in sorted(results.glob("*.jsonl"))
            for line in path.read_text().splitlines() if line.strip()]


def model_name(record: dict) -> str:
    path = Path(record["env"]["model"])
    return "bundled tiny model" if path.name == Path(TINY_MODEL).name else path.name


CPU_VENDORS = ("AMD", "Intel")  # a CPU's figures are its vendor's: Zen and Xeon rank kernels apart


def group_of(record: dict) -> Group:
    env = record["env"]
    device = env["device"]
    if device == "cpu":  # an AMX Xeon and a Zen 5 are not one machine: one figure each
        name = env.get("device_name") or ""
        device += next(("-" + v.lower() for v in CPU_VENDORS if v in name), "")
    caps = env.get("isa_caps") or {}
    if caps:  # a bf16 machine run with its instruction set capped (AVX2) is a figure of its own
        device += "-" + (caps.get("ONEDNN_MAX_CPU_ISA") or next(iter(caps.values()))).lower()
    return Group(model_name(record), device, env["dtype"])


def group_slug(group: Group) -> str:
    model = "bundled-tiny" if group.model == "bundled tiny model" else group.model
    return "-".join(s.replace("/", "_").replace(" ", "_") for s in (model, group.device,
                                                                   group.dtype))


def is_sampled(record: dict) -> bool:
    """Whether the run's requests sampled (``--sampling-option temperature=...``) where the
    benchmark's protocol is greedy."""
    return samples((record.get("env") or {}).get("sampling"))


def groups(records: list[dict]) -> dict[Group, list[dict]]:
    """(model, device, dtype) -> its records, ramp runs left out (as the harness's table), and
    sampled runs too: the figures compare greedy runs, the benchmark's protocol."""
    out: dict[Group, list[dict]] = {}
    for r in records:
        if not r.get("ramp") and not is_sampled(r):
            out.setdefault(group_of(r), []).append(r)
    return out


def by_label(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["label"], []).append(r)
    return out


def levels(records: list[dict]) -> dict[tuple[str, str], list[int]]:
    """(engine label, workload) -> the sorted concurrency levels measured."""
    out: dict[tuple[str, str], set[int]] = {}
    for r in records:
        out.setdefault((engine_label(r), r["workload"]), set()).add(r["concurrency"])
    return {k: sorted(v) for k, v in out.items()}


def is_multi_level(records: list[dict]) -> bool:
    return any(len(cs) > 1 for cs in levels(records).values())


def pick_run(records: list[dict]) -> str | None:
    """The label to draw against concurrency: among runs with some engine at two or more
    levels, an ``--interleave`` run that was quiet at every level first (its engines ran each
    level minutes apart, so their lines are the fairest comparison), then the one with the
    most levels measured on a quiet machine, then the most levels, then the newest."""
    def score(label: str, rows: list[dict]) -> tuple[bool, int, int, str]:
        keys = {(engine_label(r), r["workload"], r["concurrency"]) for r in rows}
        quiet = [k for k in keys if not any(r.get("load", {}).get("busy")
                                            for r in level_runs(rows, *k))]
        interleaved = all(r.get("interleaved") for r in rows) and len(quiet) == len(keys)
        return interleaved, len(quiet), len(keys), max(r.get("time", "") for r in rows)
    runs = {lb: rows for lb, rows in by_label(records).items() if is_multi_level(rows)}
    return max(runs, key=lambda lb: score(lb, runs[lb])) if runs else None


def short_commits(records: list[dict]) -> str:
    """``commit d2054ed9, 602806ce (dirty tree)``: the dirty tree if any record says so."""
    seen = dict.fromkeys(r["env"]["git_commit"][:8] for r in records
                         if r["env"].get("git_commit"))
    dirty = any(r["env"].get("git_dirty") for r in records)
    return "commit " + (", ".join(seen) or "unknown") + \
        (" (dirty tree)" if dirty else "")


def title(what: str, group: Group, records: list[dict], run: str | None = None) -> str:
    names = ", ".join(dict.fromkeys(r["env"].get("device_name") or r["env"]["device"]
                                    for r in records))
    head = f"{what}\n{group.model}, {group.dtype}, {names}"
    tail = short_commits(records)
    if run:
        r = records[0]
        tail = f"run '{run}', {r.get('input_len')}-token prompts, {r.get('output_len')} out; " \
            + tail
    return f"{head}\n{tail}"


def level_series(records: list[dict], metric: str, scale: float = 1.0) -> list[Line]:
    """One line per (engine label, workload): each level's median run's ``metric``, the
    point carrying every run of its level (so that a busy repeat is marked)."""
    lines: dict[tuple[str, str], Line] = {}
    for m in median_runs(records):
        if m.get(metric) is None:
            continue
        label, wl = engine_label(m), m["workload"]
        line = lines.setdefault((label, wl), Line(label, label, [], wl))
        runs = level_runs([r for r in records if r["label"] == m["label"]], label, wl,
                          m["concurrency"])
        line.points.append(Point(m["concurrency"], m[metric] * scale, runs))
    for line in lines.values():
        line.points.sort(key=lambda p: p.x)
    return [lines[k] for k in sorted(lines)]


def _panels(records: list[dict], metric: str, ylabel: str, scale: float = 1.0,
            log: bool = False, suffix: str = "", dashed: bool = False) -> list[Panel]:
    """One panel per workload (fixed, then mixed), one line per engine label in each."""
    per: dict[str, list[Line]] = {}
    for line in level_series(records, metric, scale):
        line.name, line.dashed = f"{line.name} {suffix}".strip(), dashed
        per.setdefault(line.workload, []).append(line)
    order = sorted(per, key=lambda w: (w not in WORKLOADS, w))
    return [Panel(f"{wl} workload", ylabel, per[wl], log) for wl in order]


def throughput_figure(group: Group, records: list[dict], run: str) -> FigureSpec:
    rows = by_label(records)[run]
    panels = _panels(rows, "output_throughput", "output tok/s")
    return FigureSpec("throughput", group, title("Output throughput vs concurrency", group,
                                                 rows, run), panels, "lines", len(panels))


def latency_figure(group: Group, records: list[dict], run: str) -> FigureSpec:
    """TTFT on the top row, ITL below; a column per workload; p99 dashed beside p50."""
    rows = by_label(records)[run]
    panels = []
    for name, metric in (("TTFT", "ttft"), ("ITL", "itl")):
        p50 = _panels(rows, f"median_{metric}_ms", f"{name} (ms)", log=True, suffix="p50")
        p99 = _panels(rows, f"p99_{metric}_ms", f"{name} (ms)", log=True, suffix="p99",
                      dashed=True)
        panels += [Panel(f"{name}, {a.title}", a.ylabel, a.lines + b.lines, True)
                   for a, b in zip(p50, p99)]
    what = "Latency p50 (solid) and p99 (dashed) vs concurrency"
    return FigureSpec("latency", group, title(what, group, rows, run), panels, "lines",
                      max(1, len(panels) // 2))


def memory_figure(group: Group, records: list[dict], run: str) -> FigureSpec:
    rows = by_label(records)[run]
    kind = rows[0].get("peak_memory_kind") or "memory"
    panels = _panels(rows, "peak_memory_bytes", f"peak {kind} (GiB)", scale=2**-30)
    return FigureSpec("memory", group, title(f"Peak memory ({kind}) per engine", group, rows,
                                             run), panels, "bars", len(panels))


def _options(variant: str | None, lower: bool = True) -> dict[str, str]:
    pairs = (p.partition("=") for p in (variant or "").split(",") if p.strip())
    return {k.strip(): v.strip().lower() if lower else v.strip() for k, _, v in pairs}


def steps(records: list[dict]) -> list[tuple[int, str, str, str]]:
    """(order, name, after label, before label) for every before/after pair one run measured:
    an option of ``OPTION_STEPS`` flipped with every other option equal, or an engine pair
    of ``ENGINE_STEPS`` (with the same options, or against a transformers engine)."""
    engines = {engine_label(r): r for r in records}
    found = []
    for a, ra in engines.items():
        for b, rb in engines.items():
            oa, ob = _options(ra.get("variant")), _options(rb.get("variant"))
            key: tuple = (ra["engine"], rb["engine"])
            if ra["engine"] == rb["engine"] and oa.keys() == ob.keys():
                diff = [k for k in oa if oa[k] != ob[k]]
                key = (diff[0], ob[diff[0]], oa[diff[0]]) if len(diff) == 1 else ()
            elif not (oa == ob or (not ob and rb["engine"].startswith("transformers"))):
                continue
            names = [*OPTION_STEPS, *ENGINE_STEPS]
            if key in names:
                found.append((names.index(key), {**OPTION_STEPS, **ENGINE_STEPS}[key], a, b))
    return sorted(found)


def _step_label(after: str, before: str) -> str:
    """``compile=True / False  (attention_backend=batched)`` for two variants of one engine,
    ``minivllm / transformers`` otherwise."""
    ea, _, va = after.partition("[")
    eb, _, vb = before.partition("[")
    oa, ob = _options(va.rstrip("]"), False), _options(vb.rstrip("]"), False)
    if ea != eb or oa.keys() != ob.keys():
        return f"{after} / {before}"
    diff = [k for k in oa if oa[k] != ob[k]]
    same = ", ".join(f"{k}={v}" for k, v in oa.items() if k not in diff)
    return (f"{ea}: " + ", ".join(f"{k}={oa[k]}" for k in diff) + " / "
            + ", ".join(ob[k] for k in diff) + (f"  ({same})" if same else ""))


def speedup_figure(group: Group, records: list[dict]) -> FigureSpec:
    """Every step of every run with repeats, at every level both sides measured."""
    rows = []
    for run, recs in by_label(records).items():
        if len({r.get("repeat") for r in recs} - {None}) < 2:
            continue
        for order, name, after, before in steps(recs):
            for wl, c in sorted({(r["workload"], r["concurrency"]) for r in recs}):
                ratio = throughput_ratio(recs, after, before, wl, c)
                if ratio is None:
                    continue
                a, b = level_runs(recs, after, wl, c), level_runs(recs, before, wl, c)
                pairs = len({r.get("repeat") for r in a} & {r.get("repeat") for r in b})
                note = f"{ratio[0]:.2f}× ({ratio[1]:.2f}–{ratio[2]:.2f}), {pairs} pairs"
                text = f"{name}, {wl} c={c}  [{run}]\n{_step_label(after, before)}"
                rows.append(((order, run, WORKLOADS.index(wl) if wl in WORKLOADS else 9, c),
                             Point(text, ratio[0], a + b, ratio[1], ratio[2], note,
                                   after.split("[")[0])))
    line = Line("median of the paired per-repeat ratios, whisker min–max", "",
                [p for _, p in sorted(rows, key=lambda kp: kp[0])])
    return FigureSpec("speedup", group, title("Speedup of each step: output tok/s after / "
                                              "before", group, line_records(line)),
                      [Panel("", "ratio (×)", [line])], "rows",
                      notes=[SPEEDUP_NOTE])


def roofline_figure(group: Group, records: list[dict]) -> FigureSpec:
    points = []
    for run, rows in sorted(by_label(records).items()):
        rows = [r for r in rows if r.get("roofline", {}).get("fraction")]
        for label, wl, c in sorted({(engine_label(r), r["workload"], r["concurrency"])
                                    for r in rows}):
            found = roofline_fraction(rows, label, wl, c)
            if found:
                runs = level_runs(rows, label, wl, c)
                points.append(Point(f"{label}\n{wl} c={c}  [{run}]", 100 * found[0], runs,
                                    100 * found[1], 100 * found[2],
                                    f"{100 * found[0]:.0f} % ({100 * found[1]:.0f}–"
                                    f"{100 * found[2]:.0f}), {len(runs)} runs",
                                    engine=label))
    line = Line("median over the repeats, whisker the lowest–highest", "", points)
    what = "Fraction of the workload roofline (runs with --roofline)"
    return FigureSpec("roofline", group, title(what, group, line_records(line)),
                      [Panel("", "% of the roofline measured around the level", [line])],
                      "rows", notes=[ROOFLINE_NOTE])


def line_records(line: Line) -> list[dict]:
    return [r for p in line.points for r in p.records]


def plan(records: list[dict]) -> tuple[list[FigureSpec], list[str]]:
    """Every figure worth drawing, and one line of text for each one left out and why."""
    specs, skipped = [], []
    for group, rows in sorted(groups(records).items()):
        name = f"{group.model}, {group.device}, {group.dtype}"
        run = pick_run(rows)
        if run is None:
            skipped.append(f"{name}: no engine measured at two or more concurrency levels "
                           "(throughput, latency and memory not drawn)")
        else:
            specs += [throughput_figure(group, rows, run), latency_figure(group, rows, run)]
            others = sorted(lb for lb, rs in by_label(rows).items()
                            if lb != run and is_multi_level(rs))
            if others:
                skipped.append(f"{name}: drawn against concurrency is run '{run}'; other "
                               f"multi-level runs not drawn: {', '.join(others)}")
        for make in (speedup_figure, roofline_figure):
            spec = make(group, rows)
            if len(spec.panels[0].lines[0].points) >= 2:
                specs.append(spec)
            else:
                skipped.append(f"{name}: {spec.kind} not drawn (fewer than two rows: "
                               + ("runs with repeats" if spec.kind == "speedup" else
                                  "levels measured with --roofline") + ")")
        if run is not None and any(r.get("peak_memory_bytes") for r in by_label(rows)[run]):
            specs.append(memory_figure(group, rows, run))
    return specs, skipped


def roofline_files(results: Path = RESULTS) -> str:
    """The machine-only rooflines of ``tools/roofline.py`` (``*roofline*.json``) as a table:
    the matmul rate alone, at the checkpoint's shapes, per dtype."""
    lines = [f"{'file':50} {'dtype':9} {'GFLOP/s':>7} {'tok/s':>6}  roofline of"]
    for path in sorted(results.glob("*roofline*.json")):
        r = json.loads(path.read_text())
        if "workload_roofline_tokens_per_s" in r:
            tok_s, of = r["workload_roofline_tokens_per_s"], \
                f"the workload ({r['input_len']}-token prompts, {r['output_len']} out)"
        else:
            tok_s, of = r["roofline_tokens_per_s"], "decode alone"
        lines.append(f"{path.name:50} {r['dtype']:9} {r['sustained_gflops']:7.1f} {tok_s:6.1f}"
                     f"  {of}, batch {r['batch']}, {Path(r['model']).name}")
    return "\n".join(lines)


# --- drawing ---------------------------------------------------------------------------------

BUSY_NOTE = "a run of this level was on a busy machine (load.busy): not valid"


def check(spec: FigureSpec) -> None:
    """Refuse a figure with nothing behind it: no panel, a panel without lines, a line without
    points, or a point without records."""
    where = f"{spec.file_name}"
    if not spec.panels:
        raise ValueError(f"{where}: no panels")
    for panel in spec.panels:
        if not panel.lines:
            raise ValueError(f"{where}: panel {panel.title!r} has no lines")
        for line in panel.lines:
            if not line.points or any(not p.records for p in line.points):
                raise ValueError(f"{where}: {line.name!r} has no records behind it")


def engine_styles(labels: list[str]) -> dict[str, tuple[tuple[float, ...], str]]:
    """Engine label -> (colour, marker): the engine's fixed colour, one shade and marker per
    variant (in sorted order, so the same set of variants looks the same in every figure)."""
    from matplotlib.colors import to_rgb

    shades = (0.0, -0.45, 0.45, -0.25, 0.25, -0.6)
    family: dict[str, list[str]] = {}
    for label in sorted(set(labels)):
        family.setdefault(label.split("[")[0], []).append(label)
    out = {}
    for engine, members in family.items():
        base = to_rgb(ENGINE_COLOURS.get(engine, OTHER_COLOUR))
        for i, label in enumerate(members):
            t = shades[i % len(shades)]
            target = 0.0 if t < 0 else 1.0
            out[label] = (tuple(c + abs(t) * (target - c) for c in base),
                          MARKERS[i % len(MARKERS)])
    return out


def _draw_lines(ax, panel: Panel, styles) -> bool:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    busy = False
    for line in panel.lines:
        colour, marker = styles[line.engine]
        xs, ys = [p.x for p in line.points], [p.y for p in line.points]
        ax.plot(xs, ys, color=colour, marker=marker, ls="--" if line.dashed else "-",
                label=line.name, ms=5)
        for p in line.points:
            if p.busy:
                busy = True
                ax.plot([p.x], [p.y], marker=marker, ms=9, mfc="white", mec=colour, mew=1.5)
    levels = sorted({p.x for ln in panel.lines for p in ln.points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.minorticks_off()
    if panel.log:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrency")
    return busy


def _draw_bars(ax, panel: Panel, styles) -> bool:
    levels = sorted({p.x for ln in panel.lines for p in ln.points})
    width = 0.8 / len(panel.lines)
    busy = False
    for i, line in enumerate(panel.lines):
        colour, _ = styles[line.engine]
        for p in line.points:
            x = levels.index(p.x) - 0.4 + (i + 0.5) * width
            ax.bar(x, p.y, width, color=colour, hatch="//" if p.busy else None,
                   edgecolor="white", label=line.name if p is line.points[0] else None)
            ax.text(x, p.y, f"{p.y:.2f}", ha="center", va="bottom", fontsize=7)
            busy |= p.busy
    ax.set_xticks(range(len(levels)), [str(c) for c in levels])
    ax.set_xlabel("concurrency")
    ax.margins(y=0.15)
    return busy


def _draw_rows(ax, panel: Panel, styles, reference: float, ref_text: str) -> bool:
    points = panel.lines[0].points
    busy = False
    right = max(max(p.hi for p in points), reference) * 1.15
    for i, p in enumerate(points):
        colour, marker = styles[p.engine]
        ax.errorbar(p.y, i, xerr=[[p.y - p.lo], [p.hi - p.y]], fmt=marker, color=colour,
                    mfc="white" if p.busy else colour, capsize=3, ms=6)
        ax.text(right, i, " " + p.note + ("  busy!" if p.busy else ""), va="center",
                fontsize=8)
        busy |= p.busy
    ax.axvline(reference, color="0.3", ls="--", lw=1)
    ax.text(reference, -0.6, ref_text, ha="center", va="bottom", fontsize=8, color="0.3",
            bbox={"fc": "white", "ec": "none", "pad": 1})
    ax.set_yticks(range(len(points)), [p.x for p in points], fontsize=8)
    ax.set_ylim(len(points) - 0.5, -0.9)
    ax.set_xlim(0, right * 1.55)
    ax.axvspan(right, right * 1.55, color="white", zorder=0)
    ax.set_xticks([t for t in ax.get_xticks() if t <= right])
    ax.set_xlabel(panel.ylabel)
    ax.grid(axis="x", alpha=0.3)
    return busy


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.fill(line, width) for line in text.splitlines())


def render(spec: FigureSpec):
    """The matplotlib ``Figure`` of ``spec`` (no pyplot: nothing is shown or kept open)."""
    from matplotlib.figure import Figure

    check(spec)
    if spec.style == "rows":
        n = len(spec.panels[0].lines[0].points)
        fig = Figure(figsize=(10, 1.3 + 0.42 * n), layout="constrained")
        axes = [fig.add_subplot()]
    else:
        nrows = -(-len(spec.panels) // spec.ncols)
        fig = Figure(figsize=(max(7.0, 4.6 * spec.ncols + 0.6), 3.0 * nrows + 1.3),
                     layout="constrained")
        # one y scale per row, so that fixed and mixed compare at a glance
        axes = fig.subplots(nrows, spec.ncols, squeeze=False, sharey="row").ravel().tolist()
    labels = [ln.engine for p in spec.panels for ln in p.lines] + \
        [pt.engine for p in spec.panels for ln in p.lines for pt in ln.points if pt.engine]
    styles = engine_styles(labels)
    busy = False
    for ax, panel in zip(axes, spec.panels):
        if spec.style == "rows":
            ref = (1.0, "1.0×") if spec.kind == "speedup" else \
                (100 * ROOFLINE_TARGET, f"{ROOFLINE_TARGET:.0%} target")
            busy |= _draw_rows(ax, panel, styles, *ref)
        else:
            busy |= (_draw_lines if spec.style == "lines" else _draw_bars)(ax, panel, styles)
            ax.set_title(panel.title, fontsize=9)
            if ax.get_subplotspec().is_first_col():  # the row shares one y axis
                ax.set_ylabel(panel.ylabel)
            ax.grid(alpha=0.3)
    width = fig.get_figwidth()
    fig.suptitle(_wrap(spec.title, int(11.5 * width)), fontsize=10)
    if spec.style != "rows":
        handles = {}
        for ax in axes:
            for h, lb in zip(*ax.get_legend_handles_labels()):
                handles.setdefault(lb, h)
        if busy:
            from matplotlib.lines import Line2D
            from matplotlib.patches import Patch

            handles[("hatched: " if spec.style == "bars" else "hollow: ") + BUSY_NOTE] = Patch(facecolor="white", edgecolor="0.3", hatch="//") \
                if spec.style == "bars" else Line2D([], [], marker="o", ls="", mfc="white",
                                                     mec="0.3", ms=8)
        ncols = 2 if spec.kind == "latency" else min(len(handles), 4)
        fig.legend(handles.values(), handles.keys(), loc="outside lower center",
                   ncols=ncols, fontsize=8, frameon=False)
    if spec.style == "rows":
        notes = spec.notes + ([f"hollow: {BUSY_NOTE}"] if busy else [])
        axes[0].set_xlabel(_wrap("\n".join([axes[0].get_xlabel(), *notes]), int(9 * width)),
                           fontsize=8)
    return fig


def save(spec: FigureSpec, out_dir: Path = RESULTS) -> tuple[object, Path]:
    """Render and write ``out_dir/<kind>-<model>-<device>-<dtype>.png``: dpi 100, reduced to
    a 64-colour palette (a quarter of the bytes, no visible change) and no metadata, so the
    same records give the same bytes."""
    from PIL import Image

    fig = render(spec)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    path = Path(out_dir) / spec.file_name
    image = Image.open(buffer).convert("RGB")
    image.quantize(64, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)
    return fig, path


def show(specs: list[FigureSpec], kind: str, out_dir: Path = RESULTS) -> None:
    """Save every figure of one kind and display the saved PNG (the notebook's one call per
    figure): what the notebook shows is byte for byte the committed file."""
    from IPython.display import Image, display

    drawn = [s for s in specs if s.kind == kind]
    for spec in drawn:
        _, path = save(spec, out_dir)
        path = path.resolve()
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
        display(Image(filename=str(path)))
    if not drawn:
        print(f"no {kind} figure: see what was left out, at the top")


def stale_pngs(specs: list[FigureSpec], out_dir: Path = RESULTS) -> list[Path]:
    """Figure files under ``out_dir`` that no figure of ``specs`` writes (a group or kind that
    is gone from the records): delete them or restore their records."""
    wanted = {s.file_name for s in specs}
    return sorted(p for kind in KINDS for p in Path(out_dir).glob(f"{kind}-*.png")
                  if p.name not in wanted)
