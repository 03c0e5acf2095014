"""Prototype: paged attention that reads the KV pool IN PLACE with FlexAttention (CPU).

Keys/values are the whole layer's pool viewed as (1, n_kv, num_slots, D) -- a strided view
of ``kv[0, layer]`` (num_slots, n_kv, D), no copy. A BlockMask with KV_BLOCK_SIZE equal to
the pool's block_size (16) lists, per query, exactly the physical blocks in its block table,
so the kernel only visits the sequence's own blocks. BlockMask "full" blocks (every slot
valid) skip the mask_mod; only each sequence's last, partially filled block is "partial" and
runs the mask_mod.

mask_mod: ``tab[s, blk]`` = logical index of physical block ``blk`` in sequence ``s``'s table
(-1 if not in it); a slot is visible iff it is in the sequence's table and its logical
position is < seq_len (decode) or <= the query's position (prefill). The table is
(B, num_blocks + 1): column num_blocks is a dump for padded table entries. Prefix-cache
sharing (one physical block in several tables) is fine: each row of the table is separate.

Decode layouts:
  "rows":  q as (1, H, B, D): the B decode queries are the Q dimension; Q_BLOCK_SIZE = 1 so
           each query row has its own kv-block list; mask_mod uses q_idx as the sequence.
  "batch": q as (B, H, 1, D); keys broadcast over the batch (Bkv = 1); mask_mod uses b.

Everything that depends on the step (index tensors, table) is built once per step by
``DecodeFlexMeta.build`` and shared by all layers; the BlockMask object itself is wrapped
inside the compiled function (``BlockMask.from_kv_blocks`` with compute_q_blocks=False is
just a constructor), so no BlockMask/closure crosses the compile boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# ----------------------------------------------------------------------------- decode


def _layer_kv(kv, layer: int):
    """Keys/values of one layer as (1, n_kv, S, D) views. ``kv`` is one of:

    * the pool tensor (2, L, S, n_kv, D): correct but SLOW -- keys and values are views of one
      graph input, so inductor's CPU flex lowering (_realize_duplicate_buffer_inputs) copies
      both, i.e. the whole layer's pool, on every call;
    * a pair (k_cache, v_cache) of (L, S, n_kv, D) graph inputs: no copy, but WRONG for
      layer > 0 -- the CPU template drops the view's storage offset (reads layer 0);
    * a pair of per-layer (S, n_kv, D) tensors (each its own graph input, offset handled by
      its data pointer): correct and no copy. ``layer`` is then ignored.
    """
    if isinstance(kv, torch.Tensor):
        k, v = kv[0, layer], kv[1, layer]
    elif kv[0].dim() == 4:
        k, v = kv[0][layer], kv[1][layer]
    else:
        k, v = kv
    return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)



@dataclass
class DecodeFlexMeta:
    """Per-step tensors for a decode group (built once per step, shared by all layers)."""

    kv_num: torch.Tensor  # (nb, 1, nq) int32: partial blocks per query row (0 or 1)
    kv_idx: torch.Tensor  # (nb, 1, nq, num_blocks) int32
    full_num: torch.Tensor  # (nb, 1, nq) int32: full blocks per row
    full_idx: torch.Tensor  # (nb, 1, nq, num_blocks) int32
    tab: torch.Tensor  # (B, num_blocks + 1) int32 logical block index, -1 = not this seq's
    seq_lens: torch.Tensor  # (B,) int32

    @staticmethod
    def build(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
              num_blocks: int, layout: str = "rows", max_rows: int | None = None) -> DecodeFlexMeta:
        """block_tables (B, NB) int64 padded with anything, seq_lens (B,) -> metadata.

        Pure tensor ops (no Python loop over sequences): can run on the device / be compiled.
        """
        B, NB = block_tables.shape
        seq_lens = seq_lens.to(torch.int32)
        n_used = (seq_lens + block_size - 1) // block_size  # (B,) blocks in use
        n_full = seq_lens // block_size  # (B,) completely filled blocks
        col = torch.arange(NB, device=block_tables.device)
        used = col < n_used.unsqueeze(1)  # (B, NB)
        tables32 = block_tables.to(torch.int32)
        # kv_indices must be num_blocks wide: the CPU kernel asserts
        # kvSize <= kv_indices.size(-1) * KV_BLOCK_SIZE.
        full_idx = torch.zeros(B, num_blocks, dtype=torch.int32, device=block_tables.device)
        full_idx[:, :NB] = tables32
        last = tables32.gather(1, (n_used - 1).clamp(min=0).long().unsqueeze(1))  # (B, 1)
        kv_idx = torch.zeros(B, num_blocks, dtype=torch.int32, device=block_tables.device)
        kv_idx[:, :1] = last
        kv_num = (n_used - n_full).to(torch.int32)  # 1 if the last block is partial
        full_num = n_full.to(torch.int32)
        tab = torch.full((B, num_blocks + 1), -1, dtype=torch.int32, device=block_tables.device)
        dump = torch.full_like(block_tables, num_blocks)
        tab.scatter_(1, torch.where(used, block_tables, dump),
                     col.to(torch.int32).expand(B, NB).contiguous())
        tab[:, num_blocks] = -1
        if layout == "rows":  # (1, 1, B, ...)
            shape = lambda t: t.unsqueeze(0).unsqueeze(0)
        else:  # (B, 1, 1, ...)
            shape = lambda t: t.unsqueeze(1).unsqueeze(1)
        if max_rows is not None:  # fixed-size mask buffers (see mark_static_dims)
            tab = torch.cat([tab, tab.new_full((max_rows - B, num_blocks + 1), -1)])
            seq_lens = torch.cat([seq_lens, seq_lens.new_zeros(max_rows - B)])
        return DecodeFlexMeta(shape(kv_num), shape(kv_idx), shape(full_num), shape(full_idx),
                              tab, seq_lens)


def flex_decode(q: torch.Tensor, kv, layer: int, kv_num: torch.Tensor,
                kv_idx: torch.Tensor, full_num: torch.Tensor, full_idx: torch.Tensor,
                tab: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                layout: str = "rows") -> torch.Tensor:
    """Decode attention over the pool in place: q (B, H, D) -> (B, H, D).

    ``kv``: see _layer_kv.
    Meant to be called under torch.compile (flex_attention on CPU needs it).
    """
    B = q.shape[0]
    keys, values = _layer_kv(kv, layer)
    S = keys.shape[2]

    if layout == "rows":
        def mask_mod(b, h, q_idx, kv_idx_):
            t = tab[q_idx, kv_idx_ // block_size]
            return (t >= 0) & (t * block_size + kv_idx_ % block_size < seq_lens[q_idx])

        bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(1, block_size),
                                      mask_mod=mask_mod, seq_lengths=(B, S), compute_q_blocks=False)
        # a fresh 4D buffer: inductor's CPU template reads query.data.data.layout.size and
        # fails ("expected 4, got 3") on a view of a 3D buffer
        q4 = q.transpose(0, 1).unsqueeze(0).clone(memory_format=torch.contiguous_format)
        out = flex_attention(q4, keys, values, block_mask=bm, enable_gqa=True)  # (1, H, B, D)
        return out[0].transpose(0, 1)

    def mask_mod(b, h, q_idx, kv_idx_):
        t = tab[b, kv_idx_ // block_size]
        return (t >= 0) & (t * block_size + kv_idx_ % block_size < seq_lens[b])

    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(1, block_size),
                                  mask_mod=mask_mod, seq_lengths=(1, S), compute_q_blocks=False)
    # see above; clone()/copy_ of an already contiguous view are elided by inductor, so make
    # a 4D pointwise buffer by folding the softmax scale into q
    scale = q.shape[-1] ** -0.5
    q4 = q.unsqueeze(2) * scale
    out = flex_attention(q4, keys, values, block_mask=bm, scale=1.0, enable_gqa=True)  # (B,H,1,D)
    return out[:, :, 0]


def create_block_mask_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                             num_blocks: int):
    """The 'reference' way: evaluate a mask_mod over every (query, slot) with create_block_mask.

    Same mask_mod as above (rows layout). Cost ~ B * num_slots mask evaluations per step.
    """
    from torch.nn.attention.flex_attention import create_block_mask
    meta = DecodeFlexMeta.build(block_tables, seq_lens, block_size, num_blocks, "rows")
    tab, sl = meta.tab, meta.seq_lens

    def mask_mod(b, h, q_idx, kv_idx_):
        t = tab[q_idx, kv_idx_ // block_size]
        return (t >= 0) & (t * block_size + kv_idx_ % block_size < sl[q_idx])

    B = block_tables.shape[0]
    return create_block_mask(mask_mod, 1, 1, B, num_blocks * block_size, device="cpu",
                             BLOCK_SIZE=(1, block_size))


# ----------------------------------------------------------------------------- prefill


@dataclass
class PrefillFlexMeta:
    kv_num: torch.Tensor  # (1, 1, nQB)
    kv_idx: torch.Tensor  # (1, 1, nQB, num_blocks)
    full_num: torch.Tensor
    full_idx: torch.Tensor
    tab: torch.Tensor  # (B, num_blocks + 1) int32
    seq_of_q: torch.Tensor  # (T_pad,) int32 sequence of each flat query row (B = padding)
    pos_of_q: torch.Tensor  # (T_pad,) int32 absolute position of each query row
    T_pad: int

    @staticmethod
    def build(block_tables: list[list[int]], num_computed: list[int], num_new: list[int],
              block_size: int, num_blocks: int, q_block: int, max_tokens: int | None = None,
              max_rows: int | None = None) -> PrefillFlexMeta:
        """Host-side (Python) build: flat queries of all sequences, Q tiles of ``q_block`` rows.

        A Q tile may span two sequences: its kv list is the union of their needed blocks; a kv
        block is 'full' for the tile only if the whole tile is one sequence and the block is
        entirely at positions <= the tile's first query position.
        """
        B = len(block_tables)
        T = sum(num_new)
        T_pad = -(-T // q_block) * q_block
        nQB = T_pad // q_block
        # mask buffers padded to fixed sizes (max_tokens, max_rows): dynamic sizes of mask_mod
        # buffers trigger the inductor codegen bug described in mark_static_dims
        n_q = max(T_pad, max_tokens or 0)
        seq_of_q = torch.full((n_q,), B, dtype=torch.int32)
        pos_of_q = torch.zeros(n_q, dtype=torch.int32)
        tab = torch.full((max(B, max_rows or 0) + 1, num_blocks + 1), -1, dtype=torch.int32)
        start = 0
        for b, (table, c, n) in enumerate(zip(block_tables, num_computed, num_new)):
            seq_of_q[start:start + n] = b
            pos_of_q[start:start + n] = torch.arange(c, c + n, dtype=torch.int32)
            tab[b, torch.tensor(table, dtype=torch.long)] = torch.arange(len(table), dtype=torch.int32)
            start += n
        dense_partial = torch.zeros(nQB, num_blocks, dtype=torch.bool)
        dense_full = torch.zeros(nQB, num_blocks, dtype=torch.bool)
        sq, pq = seq_of_q[:T_pad].view(nQB, q_block), pos_of_q[:T_pad].view(nQB, q_block)
        for t in range(nQB):
            seqs = sq[t].unique().tolist()
            single = len(seqs) == 1
            for s in seqs:
                if s >= B:
                    continue
                rows = sq[t] == s
                lo, hi = int(pq[t][rows].min()), int(pq[t][rows].max())
                table = block_tables[s]
                n_need = hi // block_size + 1
                n_full = (lo + 1) // block_size if single else 0  # blocks entirely <= lo
                blocks = torch.tensor(table[:n_need], dtype=torch.long)
                dense_full[t, blocks[:n_full]] = True
                dense_partial[t, blocks[n_full:]] = True
        dense_partial &= ~dense_full

        def ordered(dense):
            num = dense.sum(-1).to(torch.int32)
            idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
            return num.view(1, 1, nQB), idx.to(torch.int32).view(1, 1, nQB, num_blocks).contiguous()

        kv_num, kv_idx = ordered(dense_partial)
        full_num, full_idx = ordered(dense_full)
        return PrefillFlexMeta(kv_num, kv_idx, full_num, full_idx, tab, seq_of_q, pos_of_q, T_pad)


def flex_prefill(q: torch.Tensor, kv: torch.Tensor, layer: int, kv_num, kv_idx, full_num, full_idx,
                 tab, seq_of_q, pos_of_q, block_size: int, q_block: int) -> torch.Tensor:
    """Flat prefill queries q (T_pad, H, D) over the pool in place -> (T_pad, H, D)."""
    T = q.shape[0]
    keys, values = _layer_kv(kv, layer)
    S = keys.shape[2]

    def mask_mod(b, h, q_idx, kv_idx_):
        t = tab[seq_of_q[q_idx], kv_idx_ // block_size]
        return (t >= 0) & (t * block_size + kv_idx_ % block_size <= pos_of_q[q_idx])

    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(q_block, block_size),
                                  mask_mod=mask_mod, seq_lengths=(T, S), compute_q_blocks=False)
    q4 = q.transpose(0, 1).unsqueeze(0).clone(memory_format=torch.contiguous_format)
    out = flex_attention(q4, keys, values, block_mask=bm, enable_gqa=True)
    return out[0].transpose(0, 1)


def mark_static_dims(kv: torch.Tensor, *index_tensors: torch.Tensor, fixed=()) -> None:
    """Keep every size except the batch dimension static under dynamic=True.

    Works around an inductor bug (torch 2.13, CPU flex template): the generated C++ replaces
    the size-variable name of the KV split size (e.g. ``ks1``) with ``cur_kvSplitSize`` by a
    plain string replace, which also mangles ``ks10``, ``ks14``... -> "cur_kvSplitSize0 was not
    declared". Fewer dynamic sizes, fewer collisions.
    """
    for t in ((kv,) if isinstance(kv, torch.Tensor) else kv):
        for d in range(t.dim()):
            torch._dynamo.mark_static(t, d)
    for t in index_tensors:
        torch._dynamo.mark_static(t, t.dim() - 1)
    for t in fixed:  # wholly static tensors (mask buffers padded to max_rows)
        for d in range(t.dim()):
            torch._dynamo.mark_static(t, d)
