"""A generative ranker of the HSTU family (Zhai et al., "Actions Speak Louder
than Words", ICML 2024: the architecture of MLPerf's DLRMv3), Narsil's own
implementation, built from TorchRec modules, and its split serving form.

`Hstu` is the model as a team writes it with TorchRec:

  * an `EmbeddingCollection` (unpooled) with the tables `item` (features
    `hist_item`, `cand_item`: the candidates share the history's item
    table), `action` (`hist_action`: what the user did) and `age`
    (`hist_age`: how long before the request the action happened, log-
    bucketed by the caller: `floor(ln(max(seconds, 1)) / 0.301)`);
  * an `EmbeddingBagCollection` (sum pooling) for the user's contextual
    features, each projected into one contextual token;
  * one sequence per request, `[contexts ‖ history ‖ candidates]`: a
    history token is a projection of its item's and action's rows, a
    candidate token of its item's row and a learned "no action yet" vector;
  * stacked STU layers (HSTU's sequential transduction unit): `u, v, q, k =
    silu(W LayerNorm(x))`, pointwise attention `silu(q k^T + bias) / n`
    (no softmax; `n` the model's longest sequence, a constant, so a score
    does not depend on what else is in the batch), `x + W_o (LayerNorm(A v)
    * u)`; the bias is learned per head and layer from the query's and the
    key's relative position and from the key's age bucket;
  * the target-aware causal mask: a context or history token sees the
    tokens before it and itself, never a candidate; each candidate sees
    every context and history token and itself, no other candidate. Every
    candidate sits at the position right after the history (as
    generative-recommenders clamps its targets' positions), so its score does
    not depend on the other candidates of its request;
  * a head over each candidate's last-layer state (LayerNorm, MLP, one
    logit, sigmoid).

`Hstu.forward(dense, features)` scores flat samples (each its own sequence
with its one candidate); `Hstu.rank(features, candidates)` scores one
request's candidates appended to its history in one forward, as the model
serves itself. Both run the sequence padded, with the whole `[N, N]`
attention under the mask: the eager reference.

`HstuDenseNetwork` is Narsil's split form (`forward(dense, pooled,
seq0_values, seq0_offsets, seq0_row_unit)`): each unit's contexts and
history go through the layers once (jagged: projections per token,
attention in blocks of each unit's own tokens); each candidate then runs the
layers alone against its unit's keys and values.
"""

import math
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from din_model import bag_sum, longest_unit, pad_jagged

SEQUENCE = "history"
HISTORY = ["hist_item", "hist_action", "hist_age"]
CANDIDATE = ["cand_item"]


def sequence_json(max_len: int) -> dict:
    """The sequence as schema.json declares it."""
    return {"name": SEQUENCE, "features": HISTORY, "max_len": max_len, "keep": "last"}


def age_bucket(seconds: torch.Tensor) -> torch.Tensor:
    """The `hist_age` id of actions `seconds` before the request: HSTU's
    log bucketing of time differences."""
    return (torch.log(seconds.double().clamp(min=1)) / 0.301).long()


class StuLayer(nn.Module):
    """One STU layer's weights and its relative bias (module docstring)."""

    def __init__(self, dim: int, heads: int, head_dim: int, max_relative: int, age_dim: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.input_norm = nn.LayerNorm(dim)
        self.uvqk = nn.Linear(dim, 4 * heads * head_dim)
        self.output_norm = nn.LayerNorm(heads * head_dim)
        self.output = nn.Linear(heads * head_dim, dim)
        # bias[h, d]: query d positions after the key (0: itself), clamped.
        self.position_bias = nn.Parameter(torch.zeros(heads, max_relative + 1))
        self.age_bias = nn.Linear(age_dim, heads, bias=False)

    def project(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`u, v, q, k` of tokens `x` `[..., dim]`: the gate `u` `[...,
        heads * head_dim]`, the others `[..., heads, head_dim]`."""
        u, v, q, k = F.silu(self.uvqk(self.input_norm(x))).split(self.heads * self.head_dim, dim=-1)
        shape = (self.heads, self.head_dim)
        return u, v.unflatten(-1, shape), q.unflatten(-1, shape), k.unflatten(-1, shape)

    def relative(self, distance: torch.Tensor) -> torch.Tensor:
        """`[heads, *distance.shape]`: the position bias of queries
        `distance` positions after their keys (negative: masked anyway)."""
        clamped = distance.clamp(0, self.position_bias.size(1) - 1)
        return self.position_bias[:, clamped]

    def finish(self, x: torch.Tensor, attended: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The layer's output from the attention `attended` `[..., heads *
        head_dim]` and the gate `u`."""
        return x + self.output(self.output_norm(attended) * u)


class HstuNetwork(nn.Module):
    """Everything of the ranker but its lookups: the token projections,
    the STU layers and the head (module docstring)."""

    def __init__(self, embedding_dim: int, contexts: int, dim: int, layers: int, heads: int, head_dim: int,
                 max_len: int, head_arch: List[int]) -> None:
        super().__init__()
        self.contexts = contexts
        self.embedding_dim = embedding_dim
        self.heads, self.head_dim = heads, head_dim
        self.context_projection = nn.Linear(embedding_dim, contexts * dim)
        self.token_projection = nn.Linear(2 * embedding_dim, dim)
        self.candidate_action = nn.Parameter(torch.zeros(embedding_dim))
        longest = contexts + max_len + 1
        self.scale = float(longest)
        self.layers = nn.ModuleList([StuLayer(dim, heads, head_dim, longest, embedding_dim) for _ in range(layers)])
        self.final_norm = nn.LayerNorm(dim)
        arch = [dim] + head_arch
        self.head = nn.Sequential(*[m for a, b in zip(arch, arch[1:]) for m in (nn.Linear(a, b), nn.ReLU())],
                                  nn.Linear(arch[-1], 1))

    def context_tokens(self, pooled: torch.Tensor) -> torch.Tensor:
        """`[B, contexts, dim]` from the user features' pooled rows
        `[B, contexts * D]` (feature after feature): feature `f`'s token is
        its block of the projection, of its own vector."""
        d, width = self.embedding_dim, self.context_projection.out_features // self.contexts
        weight, bias = self.context_projection.weight, self.context_projection.bias
        tokens = [F.linear(pooled[:, f * d:(f + 1) * d], weight[f * width:(f + 1) * width],
                           bias[f * width:(f + 1) * width]) for f in range(self.contexts)]
        return torch.stack(tokens, dim=1)

    def candidate_tokens(self, item: torch.Tensor) -> torch.Tensor:
        action = self.candidate_action.to(item.dtype).expand(item.size(0), -1)
        return self.token_projection(torch.cat([item, action], dim=1))

    def encode(self, contexts: torch.Tensor, history: torch.Tensor, ages: torch.Tensor, lengths: torch.Tensor,
               candidates: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The reference attention: per sequence `b`, `contexts[b]`
        `[C, dim]`, `history[b, :lengths[b]]` (ages' rows `ages[b]`),
        `candidates[b, :counts[b]]` as one padded sequence `[contexts |
        history (padded) | candidates]` under the target-aware causal mask,
        the whole `[N, N]` attention computed. Returns the candidates' last
        states `[B, K, dim]`."""
        batch, c, longest, k = contexts.size(0), self.contexts, history.size(1), candidates.size(1)
        x = torch.cat([contexts, history, candidates], dim=1)
        slot = torch.arange(c + longest + k, device=x.device)
        is_candidate = slot >= c + longest
        in_history = (slot >= c) & (slot < c + longest)
        valid = (slot.unsqueeze(0) < c) | (in_history.unsqueeze(0) & ((slot - c).unsqueeze(0) < lengths.unsqueeze(1))) \
            | (is_candidate.unsqueeze(0) & ((slot - c - longest).unsqueeze(0) < counts.unsqueeze(1)))
        position = torch.where(is_candidate.unsqueeze(0), (c + lengths).unsqueeze(1), slot.unsqueeze(0))  # [B, N]
        causal = (slot.unsqueeze(1) >= slot.unsqueeze(0)) & ~is_candidate.unsqueeze(1) & ~is_candidate.unsqueeze(0)
        own = torch.eye(slot.numel(), dtype=torch.bool, device=x.device) & is_candidate.unsqueeze(1)
        sees_all = is_candidate.unsqueeze(1) & ~is_candidate.unsqueeze(0)
        mask = (causal | own | sees_all).unsqueeze(0) & valid.unsqueeze(2) & valid.unsqueeze(1)  # [B, N, N]
        distance = position.unsqueeze(2) - position.unsqueeze(1)
        age_rows = torch.cat([torch.zeros(batch, c, ages.size(2), dtype=x.dtype), ages,
                              torch.zeros(batch, k, ages.size(2), dtype=x.dtype)], dim=1)
        for layer in self.layers:
            u, v, q, key = layer.project(x)
            scores = torch.einsum("bihd,bjhd->bhij", q, key) + layer.relative(distance).transpose(0, 1) \
                + layer.age_bias(age_rows).transpose(1, 2).unsqueeze(2)
            weights = F.silu(scores) * mask.unsqueeze(1).to(x.dtype) / self.scale
            x = layer.finish(x, torch.einsum("bhij,bjhd->bihd", weights, v).flatten(-2), u)
        return x[:, c + longest:]

    def score(self, states: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.head(self.final_norm(states)).float()).squeeze(-1)


class Hstu(nn.Module):
    """The HSTU ranker over TorchRec collections (module docstring)."""

    def __init__(self, sequence_collection: nn.Module, pooled_collection: nn.Module, network: HstuNetwork) -> None:
        super().__init__()
        self.sequence_collection = sequence_collection
        self.pooled_collection = pooled_collection
        self.network = network

    def histories(self, features: KeyedJaggedTensor, batch: int):
        """The samples' history tokens and ages, padded, and lengths."""
        sequences = self.sequence_collection(features)
        item, action, age = sequences["hist_item"], sequences["hist_action"], sequences["hist_age"]
        tokens = self.network.token_projection(torch.cat([item.values(), action.values()], dim=1))
        history, _ = pad_jagged(tokens, item.lengths())
        ages, _ = pad_jagged(age.values(), item.lengths())
        return history, ages, item.lengths().long(), sequences

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        """Flat samples: each its own sequence with its one candidate."""
        batch = dense.size(0)
        net = self.network
        contexts = net.context_tokens(self.pooled_collection(features).values())
        history, ages, lengths, sequences = self.histories(features, batch)
        cand = sequences["cand_item"]
        candidate = net.candidate_tokens(bag_sum(cand.values(), cand.lengths(), batch)).unsqueeze(1)
        states = net.encode(contexts, history, ages, lengths, candidate, torch.ones_like(lengths))
        return net.score(states).reshape(-1)

    def rank(self, features: KeyedJaggedTensor, candidates: int) -> torch.Tensor:
        """One request in one forward: sample 0 of `features` carries the
        user's contexts and history, samples `0..candidates` one candidate
        each; the candidates appended to the history."""
        net = self.network
        contexts = net.context_tokens(self.pooled_collection(features).values()[:1])
        history, ages, lengths, sequences = self.histories(features, candidates)
        cand = sequences["cand_item"]
        tokens = net.candidate_tokens(bag_sum(cand.values(), cand.lengths(), candidates)).unsqueeze(0)
        states = net.encode(contexts, history[:1], ages[:1], lengths[:1], tokens,
                            torch.full((1,), candidates, dtype=torch.int64))
        return net.score(states).reshape(-1)


def most_rows(per_unit: torch.Tensor) -> int:
    """The most rows a unit has, at least 2 (a Python int in TorchScript;
    under torch.export a size known at run time only, known to be at
    least 2: AOTInductor's `bmm` asks whether such a size is 1, and a
    padded slot costs less than a second graph)."""
    most = per_unit.max().clamp(min=2)
    if torch.jit.is_scripting():
        return int(most)
    most = most.item()
    torch._check(most >= 2)
    return most


def by_head(padded: torch.Tensor) -> torch.Tensor:
    """`[B, T, H, hd]` as `[B * H, T, hd]` (for `torch.bmm`, whose batch
    sizes never broadcast: no size is assumed to be or not to be 1)."""
    return padded.transpose(1, 2).reshape(padded.size(0) * padded.size(2), padded.size(1), padded.size(3))


class HstuDenseNetwork(nn.Module):
    """`Hstu` after its lookups, Narsil's split form for one sequence:

      forward(dense f32[R, 0], pooled f32[R, (F_user + 1) * D],
              seq0_values f32[P, 3D], seq0_offsets i64[U + 1], seq0_row_unit i64[R]) -> f32[R]

    `pooled` holds the user features' pooled rows, then `cand_item`'s;
    `seq0_values` each position's item, action and age rows side by side,
    unit after unit; row `r`'s history is unit `row_unit[r]`'s.

    Jagged throughout, never padded to the batch's longest unit. A unit's
    tokens (its contexts, from any of its rows' pooled user features, then
    its history) go through every layer once: projections on the jagged
    tokens; attention in blocks of `block` tokens, each unit cut into its
    own blocks (only a unit's last block is padded) and each query block
    attending to its unit's key blocks at or before it (the blocks above
    the diagonal, all masked, are never computed). HSTU's attention is
    pointwise (no softmax), so each key block's share is summed on its own.
    Each candidate then goes through every layer against its unit's key
    blocks and itself: the candidates laid out per unit (padded to the most
    rows a unit has), one GEMM per key block and head. The history's work
    is never repeated per candidate, and fused users cost what they cost
    alone. Arithmetic in the weights' dtype; scores FP32."""

    block: int

    def __init__(self, network: HstuNetwork, block: int = 32) -> None:
        super().__init__()
        self.hstu = network
        self.block = block

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor, seq0_values: torch.Tensor,
                seq0_offsets: torch.Tensor, seq0_row_unit: torch.Tensor) -> torch.Tensor:
        hstu = self.hstu
        dtype = hstu.final_norm.weight.dtype
        pooled, values = pooled.to(dtype), seq0_values.to(dtype)
        d, c, b = hstu.embedding_dim, hstu.contexts, self.block
        heads, head_dim, scale = hstu.heads, hstu.head_dim, hstu.scale
        rows, units, positions = pooled.size(0), seq0_offsets.numel() - 1, values.size(0)
        device = values.device
        starts = seq0_offsets[:-1]
        sizes = c + seq0_offsets[1:] - starts  # tokens per unit
        # A row of each unit (its pooled user features are the unit's).
        unit_row = torch.zeros(units, dtype=torch.int64, device=device).scatter_reduce(
            0, seq0_row_unit, torch.arange(rows, device=device), "amax", include_self=False)
        contexts = hstu.context_tokens(pooled.index_select(0, unit_row)[:, :c * d])  # [U, C, dim]
        tokens = torch.cat([contexts.reshape(units * c, contexts.size(2)),
                            hstu.token_projection(values[:, :2 * d])])  # [U*C + P, dim]: contexts, then positions
        ages = torch.cat([torch.zeros(units * c, d, dtype=dtype, device=device), values[:, 2 * d:3 * d]])
        real = units * c + positions  # the appended zero row's index
        # Blocks: unit after unit, `blocks_of[u]` each (at least one: a
        # unit has its contexts); slot `s` of block `k` is its unit's token
        # `index[k] * b + s`.
        blocks_of = (sizes + b - 1) // b
        block_steps = torch.arange(longest_unit(blocks_of), device=device).unsqueeze(0)  # [1, most blocks]
        grid = block_steps < blocks_of.unsqueeze(1)
        found = grid.nonzero()
        block_unit, block_index = found[:, 0], found[:, 1]
        blocks = block_unit.size(0)
        step = torch.arange(b, device=device)
        slot = block_index.unsqueeze(1) * b + step.unsqueeze(0)  # [K, b]: the token's place in its unit
        owner = block_unit.unsqueeze(1)
        valid = slot < sizes.index_select(0, block_unit).unsqueeze(1)
        token = torch.where(slot < c, owner * c + slot, units * c + starts.index_select(0, block_unit).unsqueeze(1)
                            + slot - c)
        token = torch.where(valid, token, torch.full_like(token, real))  # [K, b]
        # Pairs: query block `pair_query`, key block `pair_key` of its unit, at or before it.
        before = block_steps <= block_index.unsqueeze(1)
        pairs = before.nonzero()
        pair_query = pairs[:, 0]
        pair_key = pair_query - block_index.index_select(0, pair_query) + pairs[:, 1]
        distance = ((block_index.index_select(0, pair_query) - pairs[:, 1]) * b).view(-1, 1, 1) \
            + (step.view(1, b, 1) - step.view(1, 1, b))  # [pairs, b, b]: query's place minus key's
        pair_mask = (valid.index_select(0, pair_query).unsqueeze(2) & valid.index_select(0, pair_key).unsqueeze(1)
                     & (distance >= 0)).unsqueeze(1).to(dtype)
        # Each real token's place among the blocks.
        first_block = torch.cumsum(blocks_of, 0) - blocks_of
        position = torch.arange(positions, device=device)
        position_unit = torch.searchsorted(seq0_offsets, position, right=True) - 1
        place = torch.cat([torch.arange(c, device=device).repeat(units),
                           c + position - starts.index_select(0, position_unit)])
        token_unit = torch.cat([torch.arange(units, device=device).repeat_interleave(c), position_unit])
        token_place = (first_block.index_select(0, token_unit) + place // b) * b + place % b
        # Candidates: laid out per unit (`[U, most]`: rows sorted by unit,
        # stably, ranked within it), positions right after their history.
        candidates = hstu.candidate_tokens(pooled[:, c * d:(c + 1) * d])
        per_unit = torch.zeros(units, dtype=torch.int64, device=device).index_add(
            0, seq0_row_unit, torch.ones_like(seq0_row_unit))
        most = most_rows(per_unit)
        by_unit = torch.sort(seq0_row_unit, stable=True)
        first_row = torch.cumsum(per_unit, 0) - per_unit
        rank = torch.zeros_like(seq0_row_unit).index_copy(
            0, by_unit.indices, torch.arange(rows, device=device) - first_row.index_select(0, by_unit.values))
        candidate_slot = seq0_row_unit * most + rank
        candidate_distance = sizes.index_select(0, block_unit).unsqueeze(1) - slot  # [K, b]
        key_valid = valid.view(blocks, 1, 1, b).to(dtype)
        x = tokens
        zero_row = torch.zeros(1, heads, head_dim, dtype=dtype, device=device)
        width = heads * head_dim
        for layer in hstu.layers:
            # The units' contexts and histories, block pair by block pair.
            u, v, q, k = layer.project(x)
            age_bias = torch.cat([layer.age_bias(ages), torch.zeros(1, layer.heads, dtype=dtype, device=device)])
            age_bias = age_bias[token].transpose(1, 2).unsqueeze(2)  # [K, H, 1, b]
            qb = torch.cat([q, zero_row])[token]  # [K, b, H, hd]
            kb = torch.cat([k, zero_row])[token]
            vb = torch.cat([v, zero_row])[token]
            scores = torch.bmm(by_head(qb.index_select(0, pair_query)),
                               by_head(kb.index_select(0, pair_key)).transpose(1, 2))
            scores = scores.view(pairs.size(0), heads, b, b) + layer.relative(distance).transpose(0, 1) \
                + age_bias.index_select(0, pair_key)
            weights = F.silu(scores) * pair_mask / scale
            shares = torch.bmm(weights.view(pairs.size(0) * heads, b, b), by_head(vb.index_select(0, pair_key)))
            # Block pairs' shares summed in FP32 (a no-op in FP32; in bf16, AOTInductor has no C shim for
            # a bf16 index_add, and its fallback fails at run time).
            attended = torch.zeros(blocks, heads, b, head_dim, device=device).index_add(
                0, pair_query, shares.view(pairs.size(0), heads, b, head_dim).float()).to(dtype)
            attended = attended.transpose(1, 2).reshape(blocks * b, width).index_select(0, token_place)
            x = layer.finish(x, attended, u)
            # The candidates, against their unit's key blocks and themselves.
            cu, cv, cq, ck = layer.project(candidates)
            padded = torch.zeros(units * most, heads, head_dim, dtype=dtype, device=device)
            padded = padded.index_copy(0, candidate_slot, cq).view(units, most, heads, head_dim)
            scores = torch.bmm(by_head(padded.index_select(0, block_unit)), by_head(kb).transpose(1, 2))
            scores = scores.view(blocks, heads, most, b) \
                + layer.relative(candidate_distance).transpose(0, 1).unsqueeze(2) + age_bias
            weights = F.silu(scores) * key_valid / scale
            shares = torch.bmm(weights.view(blocks * heads, most, b), by_head(vb))
            attended = torch.zeros(units, heads, most, head_dim, device=device).index_add(
                0, block_unit, shares.view(blocks, heads, most, head_dim).float()).to(dtype)
            attended = attended.transpose(1, 2).reshape(units * most, width).index_select(0, candidate_slot)
            own = F.silu((cq * ck).sum(-1) + layer.position_bias[:, 0]) / scale
            candidates = layer.finish(candidates, attended + (own.unsqueeze(2) * cv).flatten(1), cu)
        return hstu.score(candidates).reshape(-1)


def build(args, user: List[str]) -> Hstu:
    """An `Hstu` of `args`' shape (models/export_hstu.py's flags) with
    seeded random weights, in eval mode."""
    bound = args.embedding_init
    init = lambda w: nn.init.uniform_(w, -bound, bound)  # noqa: E731
    d = args.embedding_dim
    ec = EmbeddingCollection(tables=[
        EmbeddingConfig(name="item", embedding_dim=d, num_embeddings=args.item_rows,
                        feature_names=["hist_item", "cand_item"], init_fn=init),
        EmbeddingConfig(name="action", embedding_dim=d, num_embeddings=args.action_rows,
                        feature_names=["hist_action"], init_fn=init),
        EmbeddingConfig(name="age", embedding_dim=d, num_embeddings=args.age_rows,
                        feature_names=["hist_age"], init_fn=init),
    ], device=torch.device("cpu"))
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=name, embedding_dim=d, num_embeddings=args.user_rows, feature_names=[name],
                           pooling=PoolingType.SUM, init_fn=init)
        for name in user
    ], device=torch.device("cpu"))
    network = HstuNetwork(d, len(user), args.model_dim, args.layers, args.heads, args.head_dim, args.max_len,
                          args.head_arch)
    hstu = Hstu(ec, ebc, network)
    for module in hstu.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=math.sqrt(2.0 / module.in_features))
            if module.bias is not None:
                nn.init.uniform_(module.bias, -0.1, 0.1)
        elif isinstance(module, StuLayer):
            nn.init.normal_(module.position_bias, std=0.5)
    nn.init.normal_(network.candidate_action, std=bound)
    return hstu.eval()
