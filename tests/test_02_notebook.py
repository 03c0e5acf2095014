"""Notebook 02_paged_kv_cache: every check cell fails on the learner's stubs and on plausible
wrong answers, and passes on the reference module.

A grader that passes a stub or a classic mistake (slot arithmetic with // and % swapped, a free
that ignores reference counts, a prefix match that trusts the hash, a top-left causal mask)
would let a learner export a broken kv_cache.py believing it correct.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from notebook_helpers import export_learner

from minivllm import kv_cache as ref
from minivllm.course.checks_02 import (
    check_allocator,
    check_match_prefix,
    check_paged_attention,
    check_slot_mapping,
)
from minivllm.model import causal_attention

ROOT = Path(__file__).resolve().parents[1]
LEARNER = ROOT / "notebooks" / "02_paged_kv_cache.ipynb"
FAILS = (AssertionError, NotImplementedError)


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    """The module a learner exports before solving anything: every exercise is a stub."""
    out = tmp_path_factory.mktemp("learner02")
    return export_learner(LEARNER, out, ["kv_cache"], "nb02")["kv_cache"]


def _with(cls, **methods):
    """The reference BlockManager with some methods replaced (a learner's partial answer)."""
    return type("Planted", (cls,), methods)


# ----------------------------------------------------------------------------- the stubs


def test_each_exercise_is_a_stub_in_the_learner_notebook(stub, monkeypatch):
    bm = stub.BlockManager(num_blocks=4, block_size=2)
    pool = stub.KVCachePool(1, 4, 2, 1, 4)
    md = ref.AttentionMetadata.build([[0]], [0], [1], 2)  # (uses slot_mapping: Exercise 2.1)
    monkeypatch.setattr(stub, "slot_mapping", ref.slot_mapping)  # PagedAttention.__init__ too
    calls = {
        "2.1": lambda: stub.slot_of([0], 0, 2),
        "2.2": lambda: bm._take_free_block(),
        "2.3": lambda: bm.match_prefix([1, 2, 3, 4, 5]),
        "2.4": lambda: stub.PagedAttention(pool, md)(0, torch.zeros(1, 1, 4),
                                                     torch.zeros(1, 1, 4), torch.zeros(1, 1, 4)),
    }
    for exercise, call in calls.items():
        with pytest.raises(NotImplementedError, match=f"Exercise {exercise}"):
            call()
    monkeypatch.undo()
    with pytest.raises(NotImplementedError, match="Exercise 2.1: slot_mapping"):
        stub.slot_mapping([0], 0, 1, 2)
    with pytest.raises(NotImplementedError, match="Exercise 2.2: free_blocks"):
        bm.free_blocks([0])


def test_graders_fail_on_the_stubs(stub):
    with pytest.raises(FAILS):
        check_slot_mapping(stub.slot_of, stub.slot_mapping)
    with pytest.raises(FAILS):
        check_slot_mapping(ref.slot_of, stub.slot_mapping)  # 2.1 half done
    with pytest.raises(FAILS):
        check_allocator(stub.BlockManager)
    with pytest.raises(FAILS):  # 2.2 open while 2.3 is solved
        check_allocator(_with(ref.BlockManager, _take_free_block=stub.BlockManager._take_free_block))
    with pytest.raises(FAILS):
        check_allocator(_with(ref.BlockManager, free_blocks=stub.BlockManager.free_blocks))
    with pytest.raises(FAILS):  # 2.3 open while 2.2 is solved
        check_match_prefix(_with(ref.BlockManager, match_prefix=stub.BlockManager.match_prefix))
    with pytest.raises(FAILS):
        check_paged_attention(stub.PagedAttention, stub.KVCachePool, stub.AttentionMetadata)


def test_attention_grader_fails_on_the_2_4_stub_alone(stub, monkeypatch):
    """With 2.1 solved (AttentionMetadata and PagedAttention.__init__ call slot_mapping), the
    attention grader stops at the 2.4 stub itself."""
    monkeypatch.setattr(stub, "slot_mapping", ref.slot_mapping)
    with pytest.raises(NotImplementedError, match="Exercise 2.4"):
        check_paged_attention(stub.PagedAttention, stub.KVCachePool, stub.AttentionMetadata)


def test_allocator_grader_does_not_need_exercise_2_3(stub):
    """Exercise 2.2 can be graded before 2.3 is solved (prefix caching off for its basics)."""
    with pytest.raises(NotImplementedError, match="Exercise 2.3"):  # not an AssertionError
        check_allocator(_with(ref.BlockManager, match_prefix=stub.BlockManager.match_prefix))


def test_graders_pass_on_the_reference(capsys):
    check_slot_mapping(ref.slot_of, ref.slot_mapping)
    check_allocator(ref.BlockManager)
    check_match_prefix(ref.BlockManager)
    check_paged_attention(ref.PagedAttention, ref.KVCachePool, ref.AttentionMetadata)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" passed")[0] for line in lines] == [
        "✅ Exercise 2.1 (slot_of, slot_mapping)", "✅ Exercise 2.2 (allocator)",
        "✅ Exercise 2.3 (match_prefix)", "✅ Exercise 2.4 (PagedAttention)"]


# ----------------------------------------------------------------------------- 2.1 wrong answers


@pytest.mark.parametrize("slot_of", [
    lambda table, p, bs: table[p % bs] * bs + p // bs,  # // and % swapped
    lambda table, p, bs: table[p // bs] + p % bs,  # block id used as a slot
    lambda table, p, bs: table[p // bs] * bs + p,  # absolute position as the offset
], ids=["swapped", "no-scaling", "absolute-offset"])
def test_slot_grader_rejects_wrong_arithmetic(slot_of):
    with pytest.raises(AssertionError):
        check_slot_mapping(slot_of, ref.slot_mapping)


def test_slot_grader_rejects_an_inclusive_end():
    def slot_mapping(table, start, end, bs):
        return [ref.slot_of(table, p, bs) for p in range(start, end + 1)]

    with pytest.raises(AssertionError, match="end excluded"):
        check_slot_mapping(ref.slot_of, slot_mapping)


# ----------------------------------------------------------------------------- 2.2 wrong answers


def _free_ignoring_ref_counts(self, block_table):
    """Frees every block outright, even one another sequence still uses."""
    for block_id in reversed(block_table):
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of KV block {block_id}")
        block.ref_count = 0
        self.free[block_id] = None
        if block.hash is None:
            self.free.move_to_end(block_id, last=False)
    block_table.clear()


def _free_head_first(self, block_table):
    """Releases the table head first, so a shared prompt prefix is evicted first."""
    ref.BlockManager.free_blocks(self, list(reversed(block_table)))
    block_table.clear()


def _free_without_double_free_check(self, block_table):
    for block_id in reversed(block_table):
        block = self.blocks[block_id]
        block.ref_count = max(0, block.ref_count - 1)
        if block.ref_count == 0:
            self.free[block_id] = None
            if block.hash is None:
                self.free.move_to_end(block_id, last=False)
    block_table.clear()


def _free_uncached_to_the_back(self, block_table):
    """Every freed block goes to the end: uncached ones are reused only after cached are evicted."""
    for block_id in reversed(block_table):
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of KV block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None
    block_table.clear()


def _take_newest(self):
    """Pops the most recently freed block (LIFO) instead of the least recently used."""
    if not self.free:
        raise RuntimeError("KV cache pool exhausted")
    block_id, _ = self.free.popitem(last=True)
    block = self.blocks[block_id]
    if block.hash is not None:
        del self.cached[block.hash]
    block.hash, block.token_ids, block.parent = None, (), None
    block.epoch += 1
    block.ref_count = 1
    return block_id


def _take_without_evicting(self):
    """Forgets to remove the evicted block from the cache: a stale hash would point at it."""
    if not self.free:
        raise RuntimeError("KV cache pool exhausted")
    block_id, _ = self.free.popitem(last=False)
    block = self.blocks[block_id]
    block.hash, block.token_ids, block.parent = None, (), None
    block.epoch += 1
    block.ref_count = 1
    return block_id


def _take_without_epoch(self):
    if not self.free:
        raise RuntimeError("KV cache pool exhausted")
    block_id, _ = self.free.popitem(last=False)
    block = self.blocks[block_id]
    if block.hash is not None:
        del self.cached[block.hash]
    block.hash, block.token_ids, block.parent = None, (), None
    block.ref_count = 1
    return block_id


@pytest.mark.parametrize("methods", [
    {"free_blocks": _free_ignoring_ref_counts},
    {"free_blocks": _free_head_first},
    {"free_blocks": _free_without_double_free_check},
    {"free_blocks": _free_uncached_to_the_back},
    {"_take_free_block": _take_newest},
    {"_take_free_block": _take_without_evicting},
    {"_take_free_block": _take_without_epoch},
], ids=["ignores-ref-counts", "head-first", "no-double-free", "uncached-last", "lifo",
        "no-evict", "no-epoch"])
def test_allocator_grader_rejects_wrong_answers(methods):
    with pytest.raises(AssertionError):
        check_allocator(_with(ref.BlockManager, **methods))


# ----------------------------------------------------------------------------- 2.3 wrong answers


def _match(verify_tokens: bool, verify_parent: bool, max_blocks=lambda n, bs: (n - 1) // bs):
    def match_prefix(self, token_ids):
        if not self.enable_prefix_caching:
            return []
        hits, parent_hash, parent = [], None, None
        for i in range(max_blocks(len(token_ids), self.block_size)):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = self.hash_fn(parent_hash, tokens)
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if (verify_tokens and block.token_ids != tokens) or (
                    verify_parent and block.parent != parent):
                break
            hits.append(block_id)
            parent_hash, parent = h, (block_id, block.epoch)
        return hits

    return match_prefix


@pytest.mark.parametrize("match_prefix", [
    _match(verify_tokens=False, verify_parent=True),
    _match(verify_tokens=True, verify_parent=False),
    _match(verify_tokens=True, verify_parent=True, max_blocks=lambda n, bs: n // bs),
], ids=["trusts-the-hash", "ignores-the-parent", "matches-the-last-token"])
def test_prefix_grader_rejects_wrong_answers(match_prefix):
    with pytest.raises(AssertionError):
        check_match_prefix(_with(ref.BlockManager, match_prefix=match_prefix))


def test_prefix_grader_accepts_the_planted_helper_when_correct():
    """The helper above, with every rule on, is a correct answer (so the failures above are
    caused by the rule each one breaks, not by the helper)."""
    check_match_prefix(_with(ref.BlockManager, match_prefix=_match(True, True)))


# ----------------------------------------------------------------------------- 2.4 wrong answers


def _context_slots(md) -> list[torch.Tensor]:
    return [torch.tensor(ref.slot_mapping(t, 0, n, md.block_size))
            for t, n in zip(md.block_tables, md.seq_lens)]


class TopLeftMask(ref.PagedAttention):
    """SDPA's is_causal=True over the gathered context: query i sees keys 0..i only."""

    def __call__(self, layer_idx, q, k, v):
        md = self.metadata
        self.pool.write(layer_idx, md.slot_mapping, k, v)
        out = torch.empty_like(q)
        for b, slots in enumerate(_context_slots(md)):
            s, e = md.query_start_loc[b], md.query_start_loc[b + 1]
            kc, vc = self.pool.gather(layer_idx, slots)
            rep = q.shape[1] // kc.shape[1]
            kc, vc = kc.repeat_interleave(rep, 1), vc.repeat_interleave(rep, 1)
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), kc.transpose(0, 1),
                                               vc.transpose(0, 1), is_causal=True)
            out[s:e] = o.transpose(0, 1)
        return out


class NewKeysOnly(ref.PagedAttention):
    """Attends only to this step's keys: forgets the cache."""

    def __call__(self, layer_idx, q, k, v):
        md = self.metadata
        self.pool.write(layer_idx, md.slot_mapping, k, v)
        out = torch.empty_like(q)
        for b in range(len(md.seq_lens)):
            s, e = md.query_start_loc[b], md.query_start_loc[b + 1]
            out[s:e] = causal_attention(q[s:e], k[s:e], v[s:e])
        return out


class ReadBeforeWrite(ref.PagedAttention):
    """Gathers the context before writing the new keys: new tokens see zeros."""

    def __call__(self, layer_idx, q, k, v):
        md = self.metadata
        out = torch.empty_like(q)
        for b, slots in enumerate(_context_slots(md)):
            s, e = md.query_start_loc[b], md.query_start_loc[b + 1]
            kc, vc = self.pool.gather(layer_idx, slots)
            out[s:e] = causal_attention(q[s:e], kc, vc)
        self.pool.write(layer_idx, md.slot_mapping, k, v)
        return out


class WrongLayer(ref.PagedAttention):
    """Always uses layer 0 of the pool."""

    def __call__(self, layer_idx, q, k, v):
        return super().__call__(0, q, k, v)


@pytest.mark.parametrize("cls", [TopLeftMask, NewKeysOnly, ReadBeforeWrite, WrongLayer])
def test_attention_grader_rejects_wrong_answers(cls):
    with pytest.raises(AssertionError):
        check_paged_attention(cls, ref.KVCachePool, ref.AttentionMetadata)


def test_free_list_is_an_ordered_dict():
    """The graders and the exercise text rely on `free` being an OrderedDict (front = next)."""
    assert isinstance(ref.BlockManager(2, 2).free, OrderedDict)
