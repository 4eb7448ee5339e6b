"""The STU layers' attention of models/gr_model.py's `GrDenseNetwork`, in
its two forms (`GrAttention`): `attend`, in blocks of each unit's own
tokens paired with the key blocks before them, every pair at once (what
torch.export takes for `dense.pt2`: no loop over units), and
`attend_units`, unit by unit on each unit's own tokens where they lie
(what TorchScript runs for `dense.pt`). Both score each candidate against
its unit's contexts and history and itself, and divide by the unit's own
N (contexts, history and its request's rows): a user's scores do not
depend on who shares the forward."""

from typing import List

import torch
import torch.nn.functional as F
from torch import nn

from din_model import longest_unit
from hstu_model import by_head


class GrAttention(nn.Module):
    """The attention methods `GrDenseNetwork` inherits: they read its
    `contexts`, `block`, `candidate_block` and `layers` (`gr_layers.Stu`)."""

    contexts: int
    block: int
    candidate_block: int

    def attend(self, x: torch.Tensor, candidates: torch.Tensor, sizes: torch.Tensor, starts: torch.Tensor,
               position_unit: torch.Tensor, place: torch.Tensor, scale: torch.Tensor, row_unit: torch.Tensor,
               per_unit: torch.Tensor, sorted_rows: torch.Tensor, sorted_units: torch.Tensor, first_row: torch.Tensor,
               units: int, positions: int, rows: int) -> torch.Tensor:
        """The STU layers: each unit's tokens `x` (its contexts, then its
        history) once, in blocks; each candidate against its unit's key
        blocks and itself. Returns the candidates' last states."""
        c, b = self.contexts, self.block
        dtype, device = x.dtype, x.device
        # Blocks, unit after unit, `blocks_of[u]` each (at least one); slot
        # `s` of block `k` is its unit's token `index[k] * b + s`.
        blocks_of = ((sizes + b - 1) // b).clamp(min=1)
        block_steps = torch.arange(longest_unit(blocks_of), device=device).unsqueeze(0)
        found = (block_steps < blocks_of.unsqueeze(1)).nonzero()
        block_unit, block_index = found[:, 0], found[:, 1]
        blocks = block_unit.size(0)
        step = torch.arange(b, device=device)
        slot = block_index.unsqueeze(1) * b + step.unsqueeze(0)  # [K, b]
        valid = slot < sizes.index_select(0, block_unit).unsqueeze(1)
        real = units * c + positions  # the appended zero row
        token = torch.where(slot < c, block_unit.unsqueeze(1) * c + slot,
                            units * c + starts.index_select(0, block_unit).unsqueeze(1) + slot - c)
        token = torch.where(valid, token, torch.full_like(token, real))
        # Pairs: query block, and a key block of its unit at or before it.
        pairs = (block_steps <= block_index.unsqueeze(1)).nonzero()
        pair_query = pairs[:, 0]
        pair_key = pair_query - block_index.index_select(0, pair_query) + pairs[:, 1]
        before = (block_index.index_select(0, pair_query) - pairs[:, 1]).view(-1, 1, 1) * b \
            + step.view(1, b, 1) - step.view(1, 1, b)
        pair_mask = (valid.index_select(0, pair_query).unsqueeze(2) & valid.index_select(0, pair_key).unsqueeze(1)
                     & (before >= 0)).unsqueeze(1).to(dtype)
        pair_mask = pair_mask / scale.index_select(0, block_unit.index_select(0, pair_query)).view(-1, 1, 1, 1)
        # Each real token's place among the blocks.
        first_block = torch.cumsum(blocks_of, 0) - blocks_of
        token_place_in_unit = torch.cat([torch.arange(c, device=device).repeat(units), c + place])
        token_unit = torch.cat([torch.arange(units, device=device).repeat_interleave(c), position_unit])
        token_place = (first_block.index_select(0, token_unit) + token_place_in_unit // b) * b \
            + token_place_in_unit % b
        # Candidates in blocks of `cb` rows (fewer than a key block's: a unit's candidates pad only its last
        # candidate block), unit after unit (rows ranked within their unit), each candidate block paired
        # with every key block of its unit.
        cb = self.candidate_block
        rank = torch.zeros_like(row_unit).index_copy(
            0, sorted_rows, torch.arange(rows, device=device) - first_row.index_select(0, sorted_units))
        candidate_blocks_of = (per_unit + cb - 1) // cb
        candidate_found = (torch.arange(longest_unit(candidate_blocks_of), device=device).unsqueeze(0)
                           < candidate_blocks_of.unsqueeze(1)).nonzero()
        candidate_block_unit = candidate_found[:, 0]
        candidate_blocks = candidate_block_unit.size(0)
        first_candidate_block = torch.cumsum(candidate_blocks_of, 0) - candidate_blocks_of
        candidate_place = (first_candidate_block.index_select(0, row_unit) + rank // cb) * cb + rank % cb  # [R]
        cross = (block_steps < blocks_of.index_select(0, candidate_block_unit).unsqueeze(1)).nonzero()
        cross_query = cross[:, 0]
        cross_key = first_block.index_select(0, candidate_block_unit.index_select(0, cross_query)) + cross[:, 1]
        cross_mask = (valid.to(dtype) / scale.index_select(0, block_unit).unsqueeze(1)).index_select(
            0, cross_key).view(-1, 1, 1, b)
        row_scale = scale.index_select(0, row_unit).unsqueeze(1)  # [R, 1]
        for layer in self.layers:
            heads, hidden, qk, alpha = layer.heads, layer.hidden, layer.qk, layer.alpha
            # The units' contexts and histories, block pair by block pair.
            u, v, q, k = layer.project(x)
            qb = torch.cat([q, torch.zeros(1, heads, qk, dtype=dtype, device=device)])[token]  # [K, b, H, qk]
            kb = torch.cat([k, torch.zeros(1, heads, qk, dtype=dtype, device=device)])[token]
            vb = torch.cat([v, torch.zeros(1, heads, hidden, dtype=dtype, device=device)])[token]
            attended = self.pair_attention(qb, kb, vb, pair_query, pair_key, pair_mask, alpha, blocks)
            attended = attended.transpose(1, 2).reshape(blocks * b, heads * hidden).index_select(0, token_place)
            x = layer.finish(x, attended, u)
            # The candidates, against their unit's key blocks and themselves.
            cu, cv, cq, ck = layer.project(candidates)
            padded = torch.zeros(candidate_blocks * cb, heads, qk, dtype=dtype, device=device).index_copy(
                0, candidate_place, cq).view(candidate_blocks, cb, heads, qk)
            attended = self.pair_attention(padded, kb, vb, cross_query, cross_key, cross_mask, alpha,
                                           candidate_blocks)
            attended = attended.transpose(1, 2).reshape(candidate_blocks * cb, heads * hidden).index_select(
                0, candidate_place)
            own = F.silu((cq * ck).sum(-1) * alpha) / row_scale  # [R, H]
            candidates = layer.finish(candidates, attended + (own.unsqueeze(2) * cv).flatten(1), cu)
        return candidates

    def attend_units(self, x: torch.Tensor, candidates: torch.Tensor, sizes: torch.Tensor,
                     position_unit: torch.Tensor, place: torch.Tensor, scale: torch.Tensor, per_unit: torch.Tensor,
                     sorted_rows: torch.Tensor, sorted_units: torch.Tensor, first_row: torch.Tensor,
                     units: int) -> torch.Tensor:
        """`attend` as TorchScript runs it: unit by unit, on the unit's own
        tokens where they lie, nothing gathered or padded. The tokens are
        laid out unit after unit (its contexts, then its history) and by
        head once a layer; each query block of `block` tokens is scored
        against every key of its unit up to its own end in one product
        (the causal mask applied inside its own block only), and a unit's
        candidates, laid out unit after unit, against every key of their
        unit in one. The same keys and `1/N` as `attend` (which the
        exported `.pt2` runs: torch.export takes no loop over units), at
        half the work of a unit's whole square."""
        c, b = self.contexts, self.block
        dtype, device = x.dtype, x.device
        tokens, rows = x.size(0), candidates.size(0)
        # x is every unit's contexts, then every unit's positions: its rows unit after unit.
        unit_first = torch.cumsum(sizes, 0) - sizes
        token_unit = torch.cat([torch.arange(units, device=device).repeat_interleave(c), position_unit])
        token_place = torch.cat([torch.arange(c, device=device).repeat(units), c + place])
        order = torch.zeros(tokens, dtype=torch.int64, device=device).index_copy(
            0, unit_first.index_select(0, token_unit) + token_place, torch.arange(tokens, device=device))
        x = x.index_select(0, order)
        candidates = candidates.index_select(0, sorted_rows)  # unit after unit
        firsts: List[int] = unit_first.tolist()
        lengths: List[int] = sizes.tolist()
        row_firsts: List[int] = first_row.tolist()
        row_counts: List[int] = per_unit.tolist()
        inverse = (1.0 / scale.float().clamp(min=1.0)).to(dtype)
        inverses: List[float] = inverse.float().tolist()
        row_scale = scale.index_select(0, sorted_units).unsqueeze(1)  # [R, 1]
        causal = torch.ones(b, b, dtype=dtype, device=device).tril()
        for layer in self.layers:
            heads, hidden, alpha = layer.heads, layer.hidden, layer.alpha
            u, v, q, k = layer.project(x)
            qh, kh, vh = q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
            out = torch.empty(heads, tokens, hidden, dtype=dtype, device=device)
            for unit in range(units):
                first, end, inv = firsts[unit], firsts[unit] + lengths[unit], inverses[unit]
                for start in range(first, end, b):
                    stop = min(start + b, end)
                    weights = F.silu(torch.bmm(qh[:, start:stop], kh[:, first:stop].transpose(1, 2)) * alpha) * inv
                    weights[:, :, start - first:].mul_(causal[:stop - start, :stop - start])
                    out[:, start:stop] = torch.bmm(weights, vh[:, first:stop])
            x = layer.finish(x, out.transpose(0, 1).reshape(tokens, heads * hidden), u)
            cu, cv, cq, ck = layer.project(candidates)
            cqh = cq.transpose(0, 1).contiguous()
            attended = torch.zeros(heads, rows, hidden, dtype=dtype, device=device)
            for unit in range(units):
                first, end, inv = firsts[unit], firsts[unit] + lengths[unit], inverses[unit]
                start, stop = row_firsts[unit], row_firsts[unit] + row_counts[unit]
                if stop > start and end > first:
                    weights = F.silu(torch.bmm(cqh[:, start:stop], kh[:, first:end].transpose(1, 2)) * alpha) * inv
                    attended[:, start:stop] = torch.bmm(weights, vh[:, first:end])
            own = F.silu((cq * ck).sum(-1) * alpha) / row_scale  # [R, H]
            candidates = layer.finish(candidates, attended.transpose(0, 1).reshape(rows, heads * hidden)
                                      + (own.unsqueeze(2) * cv).flatten(1), cu)
        return torch.zeros_like(candidates).index_copy(0, sorted_rows, candidates)

    def pair_attention(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pair_query: torch.Tensor,
                       pair_key: torch.Tensor, mask: torch.Tensor, alpha: float, blocks: int) -> torch.Tensor:
        """`[blocks, H, rows, hidden]`: for each query block (of `queries`
        `[blocks, rows, H, qk]`), the sum over its pairs of `silu(alpha q.k) *
        mask @ v` against the key block (of `keys`, `values`) the pair
        names; `mask` per pair (`1/N` where a key counts, 0 elsewhere).
        Every pair at once (run by torch.export and eager PyTorch only:
        TorchScript attends unit by unit, `attend_units`)."""
        rows, heads, hidden = queries.size(1), values.size(2), values.size(3)
        out = torch.zeros(blocks, heads, rows, hidden, dtype=values.dtype, device=values.device)
        return out.index_add(0, pair_query, self.shares(queries, keys, values, pair_query, pair_key, mask, alpha))

    def shares(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor,
               key: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
        """`[pairs, H, rows, hidden]`: each pair's `silu(alpha q.k) * mask @ v`
        (`rows` of a query block, `b` of a key block)."""
        b, rows, heads, hidden = self.block, queries.size(1), values.size(2), values.size(3)
        scores = torch.bmm(by_head(queries.index_select(0, query)), by_head(keys.index_select(0, key)).transpose(1, 2))
        weights = F.silu(scores.view(query.size(0), heads, rows, b) * alpha) * mask
        return torch.bmm(weights.view(query.size(0) * heads, rows, b), by_head(values.index_select(0, key))).view(
            query.size(0), heads, rows, hidden)
