"""bench/plotting.py, the logic behind bench/plots.ipynb: grouping, the median run of a level,
the run drawn against concurrency, the before/after ratios, and the figures themselves. The
last tests hold the committed figures to the committed records: a figure with nothing behind
it, or a PNG left over from records that are gone, fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from notebook_helpers import load_module

ROOT = Path(__file__).resolve().parent.parent
plotting = load_module(ROOT / "bench" / "plotting.py", "bench_plotting")


def rec(label, engine, workload, concurrency, tput, *, variant="", repeat=None, busy=False,
        model="/ckpts/qwen-a", dtype="float32", device="cpu", roofline=None, ramp=False,
        time="2026-01-01T00:00:00", commit="a" * 40):
    r = {"label": label, "engine": engine, "variant": variant, "workload": workload,
         "concurrency": concurrency, "output_throughput": tput, "repeat": repeat,
         "ramp": ramp, "time": time, "input_len": 32, "output_len": 64,
         "median_ttft_ms": 100.0 * concurrency, "p99_ttft_ms": 150.0 * concurrency,
         "median_itl_ms": 10.0 + concurrency, "p99_itl_ms": 20.0 + concurrency,
         "peak_memory_bytes": 2**30 + concurrency * 2**20, "peak_memory_kind": "rss",
         "load": {"busy": busy},
         "env": {"model": model, "device": device, "dtype": dtype, "device_name": "Test CPU",
                 "git_commit": commit, "git_dirty": False}}
    if roofline:
        r["roofline"] = {"fraction": roofline}
    return r


def headline(label="head", **kw):
    """minivllm and transformers at c=1 and 8, both workloads, two interleaved repeats."""
    return [rec(label, engine, wl, c, base * c * (1 + i / 10), repeat=i, **kw)
            for i in range(2) for engine, base in (("minivllm", 12.0), ("transformers", 10.0))
            for wl in ("fixed", "mixed") for c in (1, 8)]


def test_groups_keep_models_dtypes_and_devices_apart_and_drop_ramps():
    """The old notebook put the tiny model and the 0.5B shape on one axis."""
    records = (headline() + headline(model=plotting.TINY_MODEL)
               + headline(dtype="bfloat16")
               + [rec("r", "minivllm", "fixed", 64, 1.0, ramp=True)])
    got = plotting.groups(records)
    assert set(got) == {("qwen-a", "cpu", "float32"), ("bundled tiny model", "cpu", "float32"),
                        ("qwen-a", "cpu", "bfloat16")}
    assert all(not r["ramp"] for rows in got.values() for r in rows)
    assert plotting.group_slug(plotting.Group("bundled tiny model", "cpu", "float32")) == \
        "bundled-tiny-cpu-float32"


def test_a_run_with_its_instruction_set_capped_is_a_figure_of_its_own():
    """Guards: an AMX machine run as an AVX2 one (float32) drawn on the axes of a real
    float32 run of another machine."""
    capped = headline(label="avx2")
    for r in capped:
        r["env"]["isa_caps"] = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    got = plotting.groups(headline() + capped)
    assert set(got) == {("qwen-a", "cpu", "float32"), ("qwen-a", "cpu-avx2", "float32")}
    assert plotting.group_slug(plotting.group_of(capped[0])) == "qwen-a-cpu-avx2-float32"


def test_cpus_of_two_vendors_are_figures_of_their_own():
    """Guards: a Zen 5 run and an AMX Xeon run (which rank the one-row kernels in opposite
    orders) on one axis, so the figure's pick of a run hides one machine's results."""
    zen, xeon = headline(label="zen"), headline(label="xeon")
    for r in zen:
        r["env"]["device_name"] = "AMD EPYC (2 CPUs)"
    for r in xeon:
        r["env"]["device_name"] = "Intel(R) Xeon(R) Processor (2 CPUs)"
    got = plotting.groups(zen + xeon + headline())
    assert set(got) == {("qwen-a", "cpu-amd", "float32"), ("qwen-a", "cpu-intel", "float32"),
                        ("qwen-a", "cpu", "float32")}
    assert {r["label"] for r in got[("qwen-a", "cpu-amd", "float32")]} == {"zen"}


def test_a_level_with_repeats_shows_its_median_run_and_every_run_behind_it():
    records = [rec("x", "minivllm", "fixed", c, t, repeat=i)
               for i, t in enumerate((10.0, 30.0, 20.0)) for c in (1, 8)]
    (line,) = plotting.level_series(records, "output_throughput")
    assert [p.y for p in line.points] == [20.0, 20.0]  # the median of 10, 30, 20
    assert all(len(p.records) == 3 for p in line.points)


def test_a_busy_repeat_marks_its_point_even_when_the_median_run_was_quiet():
    """Never plot a busy-machine record without marking it."""
    records = [rec("x", "minivllm", "fixed", 1, t, repeat=i, busy=i == 0)
               for i, t in enumerate((5.0, 20.0, 10.0))]
    (line,) = plotting.level_series(records, "output_throughput")
    assert line.points[0].y == 10.0 and line.points[0].busy


def test_the_run_drawn_has_the_most_quiet_levels_then_is_newest():
    busy_wide = [rec("busy", e, wl, c, 1.0, busy=True, time="2026-01-03")
                 for e in ("minivllm", "transformers") for wl in ("fixed", "mixed")
                 for c in (1, 4)]
    quiet_old = [rec("old", "minivllm", "fixed", c, 1.0, time="2026-01-01") for c in (1, 4)]
    quiet_new = [rec("new", "minivllm", "fixed", c, 1.0, time="2026-01-02") for c in (1, 4)]
    single = [rec("one", e, "fixed", 1, 1.0, time="2026-01-04") for e in ("minivllm", "vllm")]
    assert plotting.pick_run(busy_wide + quiet_old + quiet_new + single) == "new"
    assert plotting.pick_run(single) is None


def test_an_interleaved_quiet_run_is_drawn_before_a_wider_one():
    """--interleave runs each level by every engine in turn: the fairest lines to draw."""
    wide = [rec("wide", e, "fixed", c, 1.0, time="2026-01-03")
            for e in ("minivllm", "transformers", "vllm") for c in (1, 4)]
    inter = [dict(rec("inter", e, "fixed", c, 1.0, time="2026-01-01"), interleaved=True)
             for e in ("minivllm", "transformers") for c in (1, 4)]
    assert plotting.pick_run(wide + inter) == "inter"
    inter[0]["load"] = {"busy": True}  # one busy level: no longer first
    assert plotting.pick_run(wide + inter) == "wide"


def test_a_group_without_two_levels_is_skipped_and_said():
    specs, skipped = plotting.plan(headline() + [rec("one", "minivllm", "fixed", 1, 5.0,
                                                     model="/ckpts/solo")])
    assert {s.group.model for s in specs} == {"qwen-a"}
    assert any(line.startswith("solo, cpu, float32: no engine") for line in skipped)


def test_speedups_are_the_harness_ratios_of_the_steps_one_run_measured():
    loop = "attention_backend=loop,compile=False"
    batched = "attention_backend=batched,compile=False"
    records = [rec("m6", "minivllm", "fixed", 32, t, variant=v, repeat=i)
               for i, (a, b) in enumerate(((40.0, 48.0), (36.0, 54.0), (39.0, 47.0)))
               for v, t in ((loop, a), (batched, b))] + headline()
    group = plotting.Group("qwen-a", "cpu", "float32")
    (line,) = plotting.speedup_figure(group, records).panels[0].lines
    rows = {p.x.split("  [")[0]: p for p in line.points}
    m6 = rows["M6 batched attention, fixed c=32"]
    want = plotting.throughput_ratio(records, f"minivllm[{batched}]", f"minivllm[{loop}]",
                                     "fixed", 32)
    assert (m6.y, m6.lo, m6.hi) == want and m6.note.endswith("3 pairs")
    assert "vs transformers, mixed c=8" in rows and len(rows) == 5  # m6 + 4 headline levels


def test_the_ratios_and_medians_are_the_harness_functions_not_copies():
    """One definition of "median run" and "paired ratio": the harness's, imported."""
    from minivllm.bench import metrics

    for name in plotting.HARNESS_NAMES:
        assert getattr(plotting, name) is getattr(metrics, name)
    source = (ROOT / "bench" / "plotting.py").read_text()
    assert not any(f"def {name}(" in source for name in plotting.HARNESS_NAMES)


def test_engine_colours_are_fixed_for_the_coming_engines():
    styles = plotting.engine_styles(["transformers-serve", "minivllm-server", "minivllm",
                                     "minivllm[compile=False]"])
    from matplotlib.colors import to_rgb

    for engine in ("transformers-serve", "minivllm-server", "minivllm"):
        assert styles[engine][0] == to_rgb(plotting.ENGINE_COLOURS[engine])
    assert len({c for c, _ in styles.values()}) == 4


@pytest.mark.parametrize("empty", ["panels", "lines", "points", "records"])
def test_a_figure_with_no_records_behind_it_is_refused(empty):
    spec = plotting.throughput_figure(plotting.Group("qwen-a", "cpu", "float32"), headline(),
                                      "head")
    if empty == "panels":
        spec.panels = []
    elif empty == "lines":
        spec.panels[0].lines = []
    elif empty == "points":
        spec.panels[0].lines[0].points = []
    else:
        spec.panels[0].lines[0].points[0].records = []
    with pytest.raises(ValueError, match="throughput-qwen-a-cpu-float32.png"):
        plotting.render(spec)


def test_every_figure_is_written_as_a_png_and_the_same_records_give_the_same_bytes(tmp_path):
    records = headline(busy=True) + [
        rec("roof", "minivllm", "fixed", c, 10.0, repeat=i, roofline=[0.7, 0.9])
        for i in range(2) for c in (1, 8)]
    specs, _ = plotting.plan(records)
    assert {s.kind for s in specs} == set(plotting.KINDS)
    for spec in specs:
        _, path = plotting.save(spec, tmp_path)
        first = path.read_bytes()
        assert first.startswith(b"\x89PNG")
        plotting.save(spec, tmp_path)
        assert path.read_bytes() == first
    assert plotting.stale_pngs(specs, tmp_path) == []
    (tmp_path / "memory-gone-cpu-float32.png").write_bytes(b"")
    stale = plotting.stale_pngs(specs, tmp_path)
    assert [p.name for p in stale] == ["memory-gone-cpu-float32.png"]


def test_the_committed_figures_are_backed_by_the_committed_records():
    """Every figure the notebook draws has >= 1 record behind each line, from its own group,
    and every committed PNG is one of them (none is left from records that are gone)."""
    records = plotting.load_records()
    specs, _ = plotting.plan(records)
    assert specs
    for spec in specs:
        plotting.check(spec)
        assert {plotting.group_of(r) for r in spec.records} == {spec.group}
    names = {s.file_name for s in specs}
    committed = {p.name for kind in plotting.KINDS
                 for p in plotting.RESULTS.glob(f"{kind}-*.png")}
    assert committed == names, "run bench/plots.ipynb (or delete the stale PNGs) and commit"


def test_the_notebook_draws_every_kind_through_the_module():
    cells = json.loads((ROOT / "bench" / "plots.ipynb").read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    for kind in plotting.KINDS:
        assert f'plotting.show(specs, "{kind}")' in code
    assert "plt." not in code  # no drawing logic hidden in the cells


def test_the_notebook_runs_from_the_repository_root(monkeypatch, capsys):
    """nbval runs it from bench/; a reader may run it from the root (the first cell finds
    bench/plotting.py from either). It rewrites the committed PNGs with the same bytes."""
    import sys

    cells = json.loads((ROOT / "bench" / "plots.ipynb").read_text())["cells"]
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "plotting", raising=False)
    namespace: dict = {}
    try:
        for cell in cells:
            if cell["cell_type"] == "code":
                exec("".join(cell["source"]), namespace)  # noqa: S102 (the notebook's cells)
    finally:
        sys.modules.pop("plotting", None)
    assert "bench/results/throughput-" in capsys.readouterr().out
    assert namespace["stale"] == []
