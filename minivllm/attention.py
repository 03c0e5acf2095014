# Generated from solutions/06_batched_attention.ipynb by `python -m minivllm.course export`.
# Edit the notebook, not this file.

"""Batched attention over the paged KV pool.

Built in notebook 06_batched_attention. Milestone 2's ``PagedAttention`` loops over the
sequences of a step in Python: per layer and per sequence, a gather of the whole context
token by token and one small attention call. With 32 sequences and 24 layers that is 768
gathers and 768 attention calls per decode step. Here each layer makes one call per *group*:

* all decoding sequences (one query each) form one group: queries ``(B, 1, H, D)``;
* all prefill chunks that follow cached tokens form another: queries padded to the longest
  chunk ``(B, Q, H, D)``;
* a *fresh* prompt (nothing cached: a first chunk, no prefix-cache hit) is attended on its
  own, over its own rows of the step's new k/v: no pool read, no padding.

Keys and values are read from the pool a whole *block* at a time through the block tables —
``pool.view(num_blocks, block_size, ...)[block_tables]`` — which copies ``block_size``
contiguous slots per index instead of one. Rows are padded to the longest context in the
group, and a boolean mask ``(B, 1, Q, K)`` keeps, for query i of sequence b, the keys at
positions ``<= seq_lens[b] - q_lens[b] + i``: causal with an offset for chunks that follow
cached tokens (SDPA's ``is_causal`` is top-left aligned, which is wrong there). For a fresh
prompt query i and key i are the same position, so there top-left ``is_causal`` is right: no
gather, and one call per fresh prompt pads nothing (prompts of 13 and 243 tokens in one
padded group would cost 2 x 243^2 instead of 13^2 + 243^2). On a CPU a fresh prompt's query
heads are stacked per kv head and its queries go 128 at a time (``attend_fresh``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minivllm.kv_cache import AttentionMetadata, KVCachePool


@dataclass
class AttentionGroup:
    """Sequences attended in one SDPA call, with everything precomputed once per step."""

    rows: torch.Tensor  # (B, Q) int64: row of each query in the flat batch (padding: 0)
    valid: torch.Tensor  # (B, Q) bool: which of those are real queries
    block_tables: torch.Tensor  # (B, NB) int64, padded with md.pad_block (masked out)
    mask: torch.Tensor  # (B, 1, Q, NB * block_size) bool: True = may attend


def build_group(md: AttentionMetadata, members: list[int], device: torch.device) -> AttentionGroup:
    """Pad the members' queries and block tables into rectangles and build the mask."""
    q_lens = [md.query_start_loc[b + 1] - md.query_start_loc[b] for b in members]
    max_q = max(q_lens)
    max_blocks = max(len(md.block_tables[b]) for b in members)
    rows = torch.zeros(len(members), max_q, dtype=torch.long)
    # padding points at a block no sequence owns: a masked key still enters SDPA's sum as
    # 0 x value, and 0 x NaN is NaN, so padding on a live block could leak one sequence's NaN
    tables = torch.full((len(members), max_blocks), md.pad_block, dtype=torch.long)
    for i, b in enumerate(members):
        start = md.query_start_loc[b]
        rows[i, :q_lens[i]] = torch.arange(start, start + q_lens[i])
        tables[i, :len(md.block_tables[b])] = torch.tensor(md.block_tables[b])
    q_len = torch.tensor(q_lens)  # (B,)
    seq_len = torch.tensor([md.seq_lens[b] for b in members])  # (B,)
    query_pos = (seq_len - q_len).unsqueeze(1) + torch.arange(max_q)  # (B, Q) absolute positions
    key_pos = torch.arange(max_blocks * md.block_size)  # (K,)
    valid = torch.arange(max_q) < q_len.unsqueeze(1)  # (B, Q)
    mask = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(-1)  # (B, Q, K)
    mask[~valid] = key_pos == 0  # padded queries see one key: no all-masked (NaN) rows
    return AttentionGroup(rows.to(device), valid.to(device), tables.to(device),
                          mask.unsqueeze(1).to(device))


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """Read whole blocks: (num_slots, n_kv, D) cache, (B, NB) tables -> (B, n_kv, NB*bs, D)."""
    blocks = cache.view(-1, block_size, *cache.shape[1:])  # (num_blocks, bs, n_kv, D)
    gathered = blocks[block_tables]  # (B, NB, bs, n_kv, D)
    return gathered.flatten(1, 2).transpose(1, 2)  # (B, n_kv, NB*bs, D)


def attend_group(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """SDPA with grouped-query heads: q (B, Q, H, D), keys/values (B, n_kv, K, D) -> (B, Q, H, D)."""
    # query head h reads kv head h // n_rep; enable_gqa maps it without copying keys/values
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                         enable_gqa=True)
    return out.transpose(1, 2)  # (B, Q, H, D)


def attend_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """``attend_group`` for one query per sequence: q (B, 1, H, D), keys/values
    (B, n_kv, K, D), mask (B, 1, 1, K) -> (B, 1, H, D), each kv head's query heads as its
    queries (one SDPA item per kv head, not one per query head)."""
    batch, _, num_heads, head_dim = q.shape
    n_kv = keys.shape[1]
    grouped = q.reshape(batch, n_kv, num_heads // n_kv, head_dim)  # head h -> (h // n_rep, h % n_rep)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)  # (B, n_kv, n_rep, D)
    return out.reshape(batch, 1, num_heads, head_dim)


FRESH_QUERY_BLOCK = 128  # a fresh prompt's queries per SDPA call on a CPU
FRESH_BLOCKS_MAX_TOKENS = 1024  # longer: one call (the masks grow with the square of T)


def fresh_block_mask(rows: int, keys: int, group: int, like: torch.Tensor,
                     cache: dict | None = None) -> torch.Tensor:
    """The additive causal mask of one block of a fresh prompt's queries, ``group`` query
    heads stacked: (group * rows, keys), 0 where query r (position keys - rows + r) may see
    key j, -inf where j is later. ``cache`` (one step's dict) keeps it for every layer."""
    key = (rows, keys, group, like.dtype)
    if cache is not None and key in cache:
        return cache[key]
    later = torch.ones(rows, keys, dtype=torch.bool, device=like.device).triu(keys - rows + 1)
    mask = torch.zeros(rows, keys, dtype=like.dtype, device=like.device)
    mask = mask.masked_fill(later, float("-inf")).repeat(group, 1)  # (group * rows, keys)
    if cache is not None:
        cache[key] = mask
    return mask


def attend_fresh_in_one_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A fresh prompt in one SDPA call over all heads: q (T, H, D), k/v (T, n_kv, D) ->
    (T, H, D). Query i and key i are both position i, so top-left ``is_causal`` is exactly
    the causal mask."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0),
                                         k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0),
                                         is_causal=True, enable_gqa=True)  # (1, H, T, D)
    return out[0].transpose(0, 1)


def attend_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 masks: dict | None = None) -> torch.Tensor:
    """One prompt with nothing cached, over its own new keys: q (T, H, D), k/v (T, n_kv, D)
    -> (T, H, D). Query i and key i are both position i: no pool read, no padding.

    On a GPU, ``attend_fresh_in_one_call``. On a CPU, PyTorch's flash kernel runs one small
    matmul per head, far below the linears' rate, so each kv head's ``group`` query heads are
    stacked as the rows of one SDPA item (one larger matmul; the mask, no longer top-left, is
    ``fresh_block_mask``), and the queries go ``FRESH_QUERY_BLOCK`` at a time, each block
    against the keys up to its own end: the scores above the diagonal blocks are never
    computed. Past ``FRESH_BLOCKS_MAX_TOKENS``, one call again: the blocks gain only 5-7 %
    there (1536-2048 tokens, measured), while their masks grow with the square of T
    (~(T / 128)^2 / 2 tiles of 7 * 128 x 128)."""
    if q.device.type != "cpu" or q.shape[0] > FRESH_BLOCKS_MAX_TOKENS:
        return attend_fresh_in_one_call(q, k, v)
    t, n_heads, dim = q.shape
    n_kv = k.shape[1]
    group = n_heads // n_kv
    q = q.view(t, n_kv, group, dim).permute(1, 2, 0, 3)  # (n_kv, group, T, D), a view
    k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # (1, n_kv, T, D)
    out = q.new_empty(n_kv, group, t, dim)
    for start in range(0, t, FRESH_QUERY_BLOCK):
        end = min(start + FRESH_QUERY_BLOCK, t)
        rows = q[:, :, start:end].reshape(1, n_kv, group * (end - start), dim)  # stacked
        mask = fresh_block_mask(end - start, end, group, q, masks)
        o = F.scaled_dot_product_attention(rows, k[:, :, :end], v[:, :, :end], attn_mask=mask)
        out[:, :, start:end] = o.view(n_kv, group, end - start, dim)
    return out.permute(2, 0, 1, 3).reshape(t, n_heads, dim)  # head = kv head * group + g


class BatchedAttention:
    """One SDPA call per layer for all decodes, one for all chunks that follow cached tokens,
    and one per fresh prompt (nothing cached), which reads only its own new keys."""

    def __init__(self, pool: KVCachePool, metadata: AttentionMetadata):
        self.pool = pool
        self.metadata = metadata
        device = metadata.slot_mapping.device
        q_lens = [metadata.query_start_loc[b + 1] - metadata.query_start_loc[b]
                  for b in range(metadata.num_seqs)]
        decodes = [b for b, n in enumerate(q_lens) if n == 1]
        chunks = [b for b, n in enumerate(q_lens) if n > 1 and metadata.seq_lens[b] > n]
        self.groups = [build_group(metadata, members, device)
                       for members in (decodes, chunks) if members]
        self.fresh = [(metadata.query_start_loc[b], metadata.query_start_loc[b + 1])  # rows
                      for b, n in enumerate(q_lens) if n > 1 and metadata.seq_lens[b] == n]
        self.fresh_masks: dict = {}  # built at the first layer, read by the others

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.pool.write(layer_idx, self.metadata.slot_mapping, k, v)
        bs = self.metadata.block_size
        out = torch.empty_like(q)  # (T, H, D)
        for g in self.groups:
            keys = gather_blocks(self.pool.keys(layer_idx), g.block_tables, bs)
            values = gather_blocks(self.pool.values(layer_idx), g.block_tables, bs)
            attend = attend_decode if g.mask.shape[2] == 1 else attend_group  # Q == 1: decodes
            o = attend(q[g.rows], keys, values, g.mask)  # (B, Q, H, D)
            out[g.rows[g.valid]] = o[g.valid]
        for start, end in self.fresh:  # fresh prompts: their keys are their own new ones
            out[start:end] = attend_fresh(q[start:end], k[start:end], v[start:end],
                                          self.fresh_masks)
        return out
