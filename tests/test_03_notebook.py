"""Notebook 03_continuous_batching: every check cell fails on the learner's stubs and on
planted wrong answers, and passes on the reference package objects.

The learner's modules are exported from notebooks/03_continuous_batching.ipynb into a
temporary folder and imported from there. Planted wrong answers are "mutants": the package
module's source with one line changed (each mutation asserts that its target text exists,
so a refactor that removes it fails here loudly instead of testing nothing).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from notebook_helpers import export_learner
from notebook_helpers import mutate as mutant

import minivllm.sampling as ref_sampling
import minivllm.scheduler as ref_scheduler
from minivllm.course import checks_03 as checks
from minivllm.engine import LLMEngine

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "03_continuous_batching.ipynb"


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    """The stubbed modules a learner starts from, exported from the learner's notebook."""
    names = ["scheduler", "sampling", "engine"]
    return export_learner(NOTEBOOK, tmp_path_factory.mktemp("nb03"), names, "nb03")


def _graders(sch, smp):
    return {
        "schedule": lambda: checks.check_schedule(sch.Scheduler, sch.Sequence),
        "stop": lambda: checks.check_stop(sch.Scheduler, sch.Sequence),
        "top_k": lambda: checks.check_top_k(smp.mask_top_k),
        "top_p": lambda: checks.check_top_p(smp.mask_top_p),
        "min_p": lambda: checks.check_min_p(smp.mask_min_p),
        "uniforms": lambda: checks.check_uniform_draws(smp.uniform_draws),
        "inverse_cdf": lambda: checks.check_inverse_cdf(smp.inverse_cdf),
        "penalties": lambda: checks.check_penalties(smp.apply_penalties),
    }


GRADERS = list(_graders(ref_scheduler, ref_sampling))


def test_every_exercise_is_a_stub(learner):
    import torch

    sch, smp = learner["scheduler"], learner["sampling"]
    bm = ref_scheduler.BlockManager(4, 4)
    sched = sch.Scheduler(bm, 2, 8, 16)
    seq = sch.Sequence(0, "r", [1, 2], ref_sampling.SamplingParams())
    calls = {
        "Exercise 3.1": lambda: sched.schedule(),
        "Exercise 3.2": lambda: sched.check_stop(seq, 2),
        "Exercise 3.3: mask_top_k": lambda: smp.mask_top_k(torch.zeros(1, 4), torch.tensor([1])),
        "Exercise 3.3: mask_top_p": lambda: smp.mask_top_p(torch.zeros(1, 4), torch.tensor([0.5])),
        "Exercise 3.3: mask_min_p": lambda: smp.mask_min_p(torch.zeros(1, 4), torch.tensor([0.1])),
        "Exercise 3.4: uniform_draws": lambda: smp.uniform_draws(1, [None]),
        "Exercise 3.4: inverse_cdf": lambda: smp.inverse_cdf(torch.ones(1, 4) / 4,
                                                             torch.zeros(1, dtype=torch.float64)),
        "Exercise 3.5: apply_penalties": lambda: smp.apply_penalties(
            torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(1),
            torch.zeros(1), torch.ones(1)),
    }
    for label, call in calls.items():
        with pytest.raises(NotImplementedError, match=label):
            call()


@pytest.mark.parametrize("grader", GRADERS)
def test_check_fails_on_the_stub(learner, grader, capsys):
    with pytest.raises(AssertionError, match="not implemented yet"):
        _graders(learner["scheduler"], learner["sampling"])[grader]()
    assert "passed" not in capsys.readouterr().out


@pytest.mark.parametrize("grader", GRADERS)
def test_check_passes_on_the_reference(grader, capsys):
    _graders(ref_scheduler, ref_sampling)[grader]()
    assert "✅" in capsys.readouterr().out


SCHEDULER_MUTANTS = {
    "preempts the oldest running sequence": (
        "schedule", [("victim = self.running.pop()", "victim = self.running.pop(0)")]),
    "admits the newest waiting sequence first": (
        "schedule", [("seq = self.waiting[0]", "seq = self.waiting[-1]"),
                     ("self.waiting.popleft()", "self.waiting.pop()")]),
    "ignores max_num_seqs": ("schedule", [("and len(self.running) < self.max_num_seqs", "")]),
    "packs every waiting prompt into the step": (
        "schedule", [("if not self._joins_step(out, seq, budget):", "if False:")]),
    "admits without charging the budget": (
        "schedule", [("out.admitted.append(seq)\n            budget -= n",
                      "out.admitted.append(seq)")]),
    "stops on EOS despite ignore_eos": ("stop", [("not p.ignore_eos and ", "")]),
    "stops before min_tokens": ("stop", [("if seq.num_output_tokens >= p.min_tokens:",
                                          "if True:")]),
    "runs one token past max_tokens": ("stop", [("seq.num_output_tokens >= p.max_tokens",
                                                 "seq.num_output_tokens > p.max_tokens")]),
}

SAMPLING_MUTANTS = {
    "top_k keeps k+1 tokens": ("top_k", [("(k - 1).unsqueeze(-1)",
                                          "k.clamp(max=vocab - 1).unsqueeze(-1)")]),
    "top_p drops the top token when it alone exceeds p": (
        "top_p", [("mass_before = probs.cumsum(dim=-1) - probs",
                   "mass_before = probs.cumsum(dim=-1)")]),
    "top_p keeps the mask in sorted order": (
        "top_p", [("drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)",
                   "drop = drop_sorted")]),
    "min_p uses an absolute threshold": (
        "min_p", [("probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(-1)",
                   "min_p.unsqueeze(-1)")]),
    "uniforms ignore the per-request generators": (
        "uniforms", [("if gen is not None:  # a CPU generator draws on the CPU", "if False:")]),
    "uniforms in float32": (
        "uniforms", [("u = torch.rand(rows, dtype=torch.float64, device=device)",
                      "u = torch.rand(rows, device=device)")]),
    "inverse CDF finds the first token whose sum reaches the target (right=False)": (
        "inverse_cdf", [("chunk = torch.searchsorted(upto, target, right=True)",
                         "chunk = torch.searchsorted(upto, target)"),
                        ("within = torch.searchsorted(inside, rest, right=True)",
                         "within = torch.searchsorted(inside, rest)")]),
    "inverse CDF ignores the row's total (assumes it is 1)": (
        "inverse_cdf", [("target = u.unsqueeze(-1) * upto[:, -1:]", "target = u.unsqueeze(-1)")]),
    "inverse CDF sums in float32": (
        "inverse_cdf", [("upto = blocks.sum(-1).double().cumsum(-1)",
                         "upto = blocks.sum(-1).cumsum(-1).double()"),
                        ("inside = inside.double().cumsum(-1)", "inside = inside.cumsum(-1).double()")]),
    "inverse CDF searches the chunk without rescaling the target to it": (
        "inverse_cdf", [("rest = (target - before) / (upto.gather(-1, chunk) - before) * inside[:, -1:]",
                         "rest = (target - before) / upto.gather(-1, chunk) * inside[:, -1:]")]),
    "repetition divides negative logits too": (
        "penalties", [("logits = torch.where(logits > 0, logits / scale, logits * scale)",
                       "logits = logits / scale")]),
    "repetition ignores the prompt": (
        "penalties", [("seen = (prompt_counts + output_counts) > 0", "seen = output_counts > 0")]),
    "presence scales with the count": (
        "penalties", [("return logits - presence.unsqueeze(-1) * (output_counts > 0)",
                       "return logits - presence.unsqueeze(-1) * output_counts")]),
    "frequency ignores the count": (
        "penalties", [("logits = logits - frequency.unsqueeze(-1) * output_counts",
                       "logits = logits - frequency.unsqueeze(-1) * (output_counts > 0)")]),
}


@pytest.mark.parametrize("name", list(SCHEDULER_MUTANTS) + list(SAMPLING_MUTANTS))
def test_check_fails_on_a_planted_wrong_answer(name, capsys):
    if name in SCHEDULER_MUTANTS:
        grader, edits = SCHEDULER_MUTANTS[name]
        sch, smp = mutant(ref_scheduler, *edits), ref_sampling
    else:
        grader, edits = SAMPLING_MUTANTS[name]
        sch, smp = ref_scheduler, mutant(ref_sampling, *edits)
    with pytest.raises(AssertionError):
        _graders(sch, smp)[grader]()
    assert "✅" not in capsys.readouterr().out


def test_engine_check(learner, random_engine_model, capsys):
    """The end-to-end check passes on the reference classes and fails on the stub scheduler
    and on a sampler whose seeded rows ignore their generators."""
    sch, smp = ref_scheduler, ref_sampling
    checks.check_engine(LLMEngine, sch.Scheduler, sch.Sequence, smp.Sampler, random_engine_model)
    assert "✅" in capsys.readouterr().out
    stub = learner["scheduler"]
    with pytest.raises(AssertionError, match="not implemented yet"):
        checks.check_engine(LLMEngine, stub.Scheduler, stub.Sequence, smp.Sampler,
                            random_engine_model)
    unseeded = mutant(ref_sampling, ("if gen is not None:  # a CPU generator draws on the CPU", "if False:"))
    with pytest.raises(AssertionError, match="seeded request"):
        checks.check_engine(LLMEngine, sch.Scheduler, sch.Sequence, unseeded.Sampler,
                            random_engine_model)
    assert "✅" not in capsys.readouterr().out
