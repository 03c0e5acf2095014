"""Notebook 09_tensor_parallel: every check cell fails on the learner's stubs and on planted
wrong answers, and passes on the reference package objects.

The graders run the ranks as threads of this process (no process group, no spawn). The
learner's module is exported from notebooks/09_tensor_parallel.ipynb into a temporary folder
and imported from there. Planted wrong answers are "mutants": minivllm/parallel.py with one
line changed (each mutation asserts that its target text exists).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from notebook_helpers import export_learner, grader_tests

import minivllm.parallel as ref
from minivllm.config import ModelConfig
from minivllm.course import checks_09 as checks

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "09_tensor_parallel.ipynb"


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    """The stubbed module a learner starts from, exported from the learner's notebook."""
    return export_learner(NOTEBOOK, tmp_path_factory.mktemp("nb09"), ["parallel"], "nb09")["parallel"]


def _graders(m):
    return {
        "kv": lambda: checks.check_kv_head_range(m.kv_head_range),
        "row": lambda: checks.check_row_parallel(m.RowParallelLinear),
        "spec": lambda: checks.check_shard_spec(m.shard_spec),
    }


def test_every_exercise_is_a_stub(learner):
    config = ModelConfig.from_dict({"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8,
                                    "intermediate_size": 8, "num_hidden_layers": 1,
                                    "num_attention_heads": 2, "rms_norm_eps": 1e-6,
                                    "rope_theta": 1e4, "max_position_embeddings": 8})
    layer = learner.RowParallelLinear(4, 4, False, learner.TPGroup(0, 1))
    calls = {
        "Exercise 9.1: kv_head_range": lambda: learner.kv_head_range(8, 2, 0, 2),
        "Exercise 9.2: RowParallelLinear.forward": lambda: layer(torch.zeros(1, 4)),
        "Exercise 9.3: shard_spec": lambda: learner.shard_spec(
            "model.layers.0.self_attn.o_proj.weight", config, 0, 2),
    }
    for label, call in calls.items():
        with pytest.raises(NotImplementedError, match=label):
            call()


MUTANTS = {
    # 9.1 kv_head_range
    "KV heads sharded where they must be replicated": (
        "kv", [("    if n_kv_heads >= world_size:\n        per = n_kv_heads // world_size",
                "    if True:\n        per = max(1, n_kv_heads // world_size)")]),
    "replicated KV heads dealt round robin": (
        "kv", [("head = rank // ranks_per_head", "head = rank % n_kv_heads")]),
    # 9.2 RowParallelLinear.forward
    "no all-reduce (each rank keeps its partial sum)": (
        "row", [("        self.tp.all_reduce(y)  # (T, out): the full product, on every rank\n", "")]),
    "bias added on every rank before the all-reduce": (
        "row", [("y = F.linear(x, self.weight)  # (T, out): this rank's share of the sum",
                 "y = F.linear(x, self.weight, self.bias)")]),
    # 9.3 shard_spec
    "o_proj split along the output (wrong) dimension": (
        "spec", [("return 1, rank * heads * d, (rank + 1) * heads * d",
                  "return 0, rank * heads * d, (rank + 1) * heads * d")]),
    "down_proj split like gate/up (rows, not columns)": (
        "spec", [("return 1, rank * inter, (rank + 1) * inter",
                  "return 0, rank * inter, (rank + 1) * inter")]),
    "o_proj's bias split instead of replicated": (
        "spec", [('if name.endswith("o_proj.weight"):', 'if ".o_proj." in name:')]),
    "k/v split by the query heads' ranges": (
        "spec", [("return 0, kv_start * d, kv_stop * d",
                  "return 0, rank * heads * d, (rank + 1) * heads * d")]),
}


(test_check_fails_on_the_stub, test_check_passes_on_the_reference,
 test_check_fails_on_a_planted_wrong_answer) = grader_tests(_graders, ref, MUTANTS)