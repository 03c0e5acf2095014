"""Tests for the course tool (export / strip / check) and the graders of the check cells.

Everything runs on synthetic notebooks in a temporary repository, so these tests do not
depend on the real notebooks; the last test runs ``check`` on the real repository.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from minivllm.course import (
    CourseError,
    assert_close,
    assert_equal,
    export_all,
    export_notebook,
    passed,
    run_milestone_tests,
    strip_all,
    strip_notebook,
)
from minivllm.course.__main__ import main

REPO = Path(__file__).resolve().parent.parent
v4 = nbformat.v4

ROPE = '''# export: model
"""The model."""
import torch


def apply_rope(x):
    ### BEGIN SOLUTION Exercise 1.2: apply_rope
    y = x * 2
    return y
    ### END SOLUTION
'''


def make_nb(*sources: str, markdown: str = "# Title") -> nbformat.NotebookNode:
    """A small notebook: one markdown cell then code cells with outputs and metadata."""
    nb = v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Py"}})
    nb.cells.append(v4.new_markdown_cell(markdown, metadata={"tags": ["intro"], "foo": 1}))
    for i, src in enumerate(sources):
        cell = v4.new_code_cell(src, execution_count=i + 1,
                                metadata={"tags": ["t"], "editable": False, "scrolled": True})
        cell.outputs = [v4.new_output("stream", name="stdout", text="hi\n")]
        nb.cells.append(cell)
    return nb


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A temporary repo with solutions/, notebooks/ and minivllm/ folders."""
    for name in ("solutions", "notebooks", "minivllm"):
        (tmp_path / name).mkdir()
    return tmp_path


def write(path: Path, nb: nbformat.NotebookNode) -> Path:
    nbformat.write(nb, path)
    return path


# --- strip ----------------------------------------------------------------------------------


def test_strip_replaces_regions_with_labelled_stub_at_indentation():
    nb = strip_notebook(make_nb(ROPE, "### BEGIN SOLUTION\nx = 1\n### END SOLUTION\nprint(x)"))
    code = nb.cells[1].source
    assert '    raise NotImplementedError("Exercise 1.2: apply_rope")' in code.splitlines()
    assert "y = x * 2" not in code and "SOLUTION" not in code
    assert code.startswith("# export: model\n")
    assert nb.cells[2].source == (
        'raise NotImplementedError("Exercise: replace this line with your solution")\nprint(x)')


def test_strip_clears_outputs_counts_and_metadata_but_keeps_ids():
    solved = make_nb(ROPE)
    nb = strip_notebook(solved)
    code, md = nb.cells[1], nb.cells[0]
    assert code.outputs == [] and code.execution_count is None
    assert dict(code.metadata) == {"tags": ["t"], "editable": False}
    assert dict(md.metadata) == {"tags": ["intro"]} and md.source == "# Title"
    assert [c.id for c in nb.cells] == [c.id for c in solved.cells]
    assert nb.metadata.kernelspec.name == "python3"
    assert solved.cells[1].outputs, "strip must not modify its input"


@pytest.mark.parametrize("src, words", [
    ("### BEGIN SOLUTION\nx = 1\n", "has no END"),
    ("x = 1\n### END SOLUTION\n", "has no BEGIN"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "cannot nest"),
])
def test_strip_errors_on_unmatched_markers_naming_notebook_and_cell(src, words):
    with pytest.raises(CourseError, match=rf"01_x\.ipynb, cell 2: .*{words}"):
        strip_notebook(make_nb("x = 0", src), "solutions/01_x.ipynb")


def test_strip_all_writes_learner_notebooks_byte_stable(repo: Path):
    write(repo / "solutions" / "01_x.ipynb", make_nb(ROPE))
    [out] = strip_all(root=repo)
    assert out == repo / "notebooks" / "01_x.ipynb"
    first = out.read_bytes()
    assert first.endswith(b"}\n") and b"NotImplementedError" in first
    strip_all(root=repo)
    assert out.read_bytes() == first
    assert strip_all(check=True, root=repo) == []


# --- export ---------------------------------------------------------------------------------


def test_export_writes_header_cells_and_drops_markers(repo: Path):
    nb = make_nb(ROPE, "print('not exported')", "# export: model\n\nX = 1   \n\n")
    write(repo / "solutions" / "01_forward_pass.ipynb", nb)
    [path] = export_all(root=repo)
    assert path == repo / "minivllm" / "model.py"
    assert path.read_text() == (
        "# Generated from solutions/01_forward_pass.ipynb by "
        "`python -m minivllm.course export`.\n"
        "# Edit the notebook, not this file.\n\n"
        '"""The model."""\nimport torch\n\n\ndef apply_rope(x):\n'
        "    y = x * 2\n    return y\n\n\nX = 1\n")


def test_export_is_byte_stable(repo: Path):
    write(repo / "solutions" / "01_x.ipynb", make_nb(ROPE, "# export: config\nA = 1"))
    files = export_all(root=repo)
    before = {p: p.read_bytes() for p in files}
    assert export_all(root=repo) == files
    assert {p: p.read_bytes() for p in files} == before
    assert sorted(p.name for p in files) == ["config.py", "model.py"]


def test_export_errors_when_two_notebooks_export_one_module(repo: Path):
    write(repo / "solutions" / "01_a.ipynb", make_nb("# export: model\nA = 1"))
    write(repo / "solutions" / "02_b.ipynb", make_nb("# export: model\nB = 2"))
    with pytest.raises(CourseError, match="`model` is exported by both solutions/01_a.ipynb"):
        export_all(root=repo)


def test_export_notebook_to_out_dir_exports_learner_stubs(repo: Path, tmp_path: Path):
    solved = write(repo / "solutions" / "01_x.ipynb", make_nb(ROPE))
    strip_all(root=repo)
    learner = repo / "notebooks" / "01_x.ipynb"
    out = tmp_path / "graded"
    assert main(["export", "--root", str(repo), "--notebook", str(learner),
                 "--out", str(out)]) == 0
    text = (out / "model.py").read_text()
    assert text.startswith("# Generated from notebooks/01_x.ipynb")
    assert 'raise NotImplementedError("Exercise 1.2: apply_rope")' in text
    assert not (repo / "minivllm" / "model.py").exists()
    assert export_notebook(solved, out, root=repo) == [out / "model.py"]
    assert "y = x * 2" in (out / "model.py").read_text()


def test_dotted_modules_export_into_a_subpackage(repo: Path):
    """``# export: bench.metrics`` writes minivllm/bench/metrics.py; ``bench.__init__`` and
    ``bench.__main__`` are the subpackage's own files."""
    nb = make_nb('# export: bench.__init__\n"""The bench."""', "# export: bench.metrics\nA = 1",
                 "# export: bench.__main__\nprint('main')")
    write(repo / "solutions" / "05_x.ipynb", nb)
    files = export_all(root=repo)
    bench = repo / "minivllm" / "bench"
    assert sorted(files) == [bench / "__init__.py", bench / "__main__.py", bench / "metrics.py"]
    assert (bench / "metrics.py").read_text().endswith("\n\nA = 1\n")
    assert export_all(check=True, root=repo) == []


@pytest.mark.parametrize("cells, words", [
    (["# export: bench.metrics\nA = 1"], "no notebook exports `bench.__init__`"),
    (["# export: course.x\nA = 1"], "`course.x` is hand-written"),
    (["# export: __init__\nA = 1"], "`__init__` is hand-written"),
    (["# export: bench.__init__.x\nA = 1"], "can only end a name"),
])
def test_export_refuses_bad_module_names(repo: Path, cells, words):
    """Guards a subpackage without its ``__init__`` (it would import only as a namespace
    package) and writes into the hand-written parts of the package."""
    write(repo / "solutions" / "05_x.ipynb", make_nb(*cells))
    with pytest.raises(CourseError, match=words):
        export_all(root=repo)


def test_export_removes_and_check_reports_modules_no_notebook_exports(repo: Path, capsys):
    """Guards stale modules left behind when a module is renamed (bench_metrics.py after the
    move to bench/metrics.py): importable, and silently out of date. Hand-written files stay."""
    write(repo / "solutions" / "05_x.ipynb", make_nb("# export: bench_metrics\nA = 1"))
    export_all(root=repo)
    old = repo / "minivllm" / "bench_metrics.py"
    hand = repo / "minivllm" / "hand.py"
    hand.write_text('"""Written by hand."""\n')
    write(repo / "solutions" / "05_x.ipynb",
          make_nb('# export: bench.__init__\n"""The bench."""', "# export: bench.metrics\nA = 1"))
    strip_all(root=repo)
    assert main(["export", "--check", "--root", str(repo)]) == 1  # missing and orphaned
    capsys.readouterr()
    assert main(["check", "--root", str(repo)]) == 1
    out = capsys.readouterr().out
    assert "orphan: minivllm/bench_metrics.py" in out and "hand.py" not in out
    assert "missing: minivllm/bench/metrics.py" in out
    assert old.exists(), "--check must not delete"
    assert main(["export", "--root", str(repo)]) == 0
    assert "removed minivllm/bench_metrics.py" in capsys.readouterr().out
    assert not old.exists() and hand.exists()
    assert main(["check", "--root", str(repo)]) == 0


# --- check ----------------------------------------------------------------------------------


def test_check_detects_drift_and_exits_1_then_0_when_in_sync(repo: Path, capsys):
    write(repo / "solutions" / "01_x.ipynb", make_nb(ROPE))
    assert main(["check", "--root", str(repo)]) == 1
    assert "missing: minivllm/model.py" in capsys.readouterr().out
    assert main(["export", "--root", str(repo)]) == 0
    assert main(["strip", "--root", str(repo)]) == 0
    assert main(["check", "--root", str(repo)]) == 0
    assert "OK" in capsys.readouterr().out.splitlines()[-1]

    model = repo / "minivllm" / "model.py"
    model.write_text(model.read_text().replace("x * 2", "x * 3"))
    assert main(["export", "--check", "--root", str(repo)]) == 1
    out = capsys.readouterr().out
    assert "stale: minivllm/model.py" in out and "+    y = x * 2" in out
    assert "x * 3" in model.read_text(), "--check must not write"
    assert main(["strip", "--check", "--root", str(repo)]) == 0


def test_broken_notebook_exits_2_with_location(repo: Path, capsys):
    write(repo / "solutions" / "01_x.ipynb", make_nb("# export: m\n### END SOLUTION"))
    assert main(["export", "--root", str(repo)]) == 2
    assert "solutions/01_x.ipynb, cell 1" in capsys.readouterr().err


def test_check_on_empty_solutions_is_ok(repo: Path, capsys):
    assert main(["check", "--root", str(repo)]) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_check_on_the_real_repository():
    result = subprocess.run([sys.executable, "-m", "minivllm.course", "check"], cwd=REPO,
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout


# --- graders --------------------------------------------------------------------------------


def test_assert_close_passes_and_returns_max_diff():
    x = torch.zeros(2, 3)
    assert assert_close(x + 1e-7, x, what="RMSNorm output") == pytest.approx(1e-7, rel=0.1)


def test_assert_close_reports_what_shapes_diff_index_and_hint():
    x = torch.zeros(2, 3)
    y = x.clone()
    y[1, 2] = 0.5
    with pytest.raises(AssertionError) as err:
        assert_close(y, x, what="RMSNorm output", hint="divide by the RMS")
    msg = str(err.value)
    for part in ("RMSNorm output", "(2, 3)", "max abs diff 0.5", "(1, 2)", "divide by the RMS"):
        assert part in msg
    with pytest.raises(AssertionError, match=r"q: shape \(3, 2\) != expected \(2, 3\)"):
        assert_close(x.T, x, what="q")
    with pytest.raises(AssertionError, match="expected a torch.Tensor, got NoneType"):
        assert_close(None, x, what="q")
    with pytest.raises(AssertionError, match="dtype torch.int64 is not compatible"):
        assert_close(x.long(), x, what="q")
    nan = x.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(AssertionError, match="index \\(0, 0\\)"):
        assert_close(nan, x, what="q")


def test_assert_equal_reports_first_differing_token():
    assert_equal(torch.tensor([1, 2, 3]), [1, 2, 3], what="tokens")
    with pytest.raises(AssertionError) as err:
        assert_equal([5, 6, 7, 8], [5, 6, 9, 8], what="greedy tokens", hint="check RoPE")
    msg = str(err.value)
    assert "greedy tokens" in msg and "index 2: got 7, expected 9" in msg
    assert "check RoPE" in msg
    with pytest.raises(AssertionError, match="index 2: got <end>, expected 7"):
        assert_equal([5, 6], [5, 6, 7], what="tokens")
    with pytest.raises(AssertionError, match="n: got 3, expected 4"):
        assert_equal(3, 4, what="n")


def test_passed_prints_one_line(capsys):
    passed("1.2 (apply_rope)", "matches transformers to 3e-07")
    assert capsys.readouterr().out == (
        "✅ Exercise 1.2 (apply_rope) passed — matches transformers to 3e-07\n")


def test_run_milestone_tests_runs_pytest_and_honours_skip(tmp_path: Path, monkeypatch, capsys):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_ok.py").write_text("def test_ok():\n    assert True\n")
    (tmp_path / "tests" / "test_bad.py").write_text("def test_bad():\n    assert 1 == 2\n")
    monkeypatch.delenv("MINIVLLM_NB_SKIP_PYTEST", raising=False)
    run_milestone_tests("test_ok.py", root=tmp_path)
    with pytest.raises(AssertionError, match="test_bad.py failed"):
        run_milestone_tests("test_bad.py", root=tmp_path)
    with pytest.raises(AssertionError, match="no test file matches"):
        run_milestone_tests("test_none*.py", root=tmp_path)
    monkeypatch.setenv("MINIVLLM_NB_SKIP_PYTEST", "1")
    run_milestone_tests("test_bad.py", root=tmp_path)
    assert "skipped (MINIVLLM_NB_SKIP_PYTEST=1)" in capsys.readouterr().out


def test_export_and_grade_exports_learner_notebook_then_runs_tests(repo: Path, monkeypatch,
                                                                   capsys):
    from minivllm.course import export_and_grade, notebooks

    write(repo / "solutions" / "01_x.ipynb", make_nb(ROPE))
    strip_all(root=repo)
    monkeypatch.setattr(notebooks, "package_dir", lambda: repo / "minivllm")
    monkeypatch.setattr(notebooks, "repo_root", lambda: repo)
    monkeypatch.setenv("MINIVLLM_NB_SKIP_PYTEST", "1")
    monkeypatch.chdir(repo / "notebooks")
    export_and_grade("01_x.ipynb", "test_01_*.py")
    out = capsys.readouterr().out
    assert "model.py" in out and "git checkout minivllm/" in out and "skipped" in out
    assert "NotImplementedError" in (repo / "minivllm" / "model.py").read_text()
    with pytest.raises(AssertionError, match="cannot find 02_y.ipynb"):
        export_and_grade("02_y.ipynb", "test_02_*.py")


def test_random_weight_checkpoints_need_no_notebook_machinery():
    """``minivllm.course.random_weights`` (the tests' and tools' random-weight checkpoints) is
    usable where only the package's own dependencies are installed, as on a lent GPU machine:
    importing it loads neither nbformat nor the course's notebook and grading modules, while
    the course's names still resolve on first use."""
    code = ("import sys\n"
            "import minivllm.course.random_weights\n"
            "loaded = {'nbformat', 'minivllm.course.notebooks', 'minivllm.course.grading'}\n"
            "assert not loaded & set(sys.modules), loaded & set(sys.modules)\n"
            "from minivllm.course import export_all, passed\n"
            "assert callable(export_all) and callable(passed)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
