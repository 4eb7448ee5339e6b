"""A DIN-style ranker (Deep Interest Network, Zhou et al., KDD 2018) built
from TorchRec modules, and its two serving forms.

`Din` is the model as a team writes it with TorchRec:

  * an `EmbeddingCollection` (unpooled: one vector per position) with the
    tables `item` (features `hist_item`, `cand_item`) and `cat` (`hist_cat`,
    `cand_cat`): the candidate's item and category share their tables with
    the behaviour history's;
  * an `EmbeddingBagCollection` (sum pooling) for the user's pooled features;
  * a bottom MLP over the dense features;
  * DIN's target attention: for candidate `c = [item, cat]` and each history
    position `p = [item, cat]`, an MLP over `[c, p, c - p, c * p]` gives a
    weight (no softmax, as in DIN), masked to the history's positions; the
    interest is the weighted sum of the positions;
  * an MLP over `[bottom(dense), pooled user features, c, interest]` to one
    logit, through a sigmoid.

`forward(dense, features: KeyedJaggedTensor) -> f32[B]` is the reference:
once quantized (`quantize_inference_model`: INT8 `QuantEmbeddingCollection`
and `QuantEmbeddingBagCollection`), its eager forward gives every golden
score. A candidate's bag is sum-pooled from its unpooled rows (one id: the
row itself, exactly), so a candidate with no id or several scores as a
pooled bag would.

`DinPredictor` is Narsil's single-file interface around it
(`forward(dense, lengths, ids)`, key-major over every sparse feature);
`DinDenseNetwork` is the split form's dense network
(`forward(dense, pooled, seq0_values, seq0_offsets, seq0_row_unit)`), which
takes each unit's history once and gathers it per candidate in its graph.
"""

import math
from typing import List, Tuple

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mlp import MLP
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

# The sequence and its aligned channels (in the order a position's vectors
# are concatenated), and the candidate's features over the same tables.
SEQUENCE = "history"
HISTORY = ["hist_item", "hist_cat"]
CANDIDATE = ["cand_item", "cand_cat"]


def sequence_json(max_len: int) -> dict:
    """The sequence as schema.json and narsil_schema() declare it."""
    return {"name": SEQUENCE, "features": HISTORY, "max_len": max_len, "keep": "last"}


def bag_sum(values: torch.Tensor, lengths: torch.Tensor, bags: int) -> torch.Tensor:
    """The sum of each bag's rows (`values` `[N, D]`, bag after bag;
    `lengths` `[bags]`): `[bags, D]`, zeros for an empty bag; a bag of one
    row is that row, bit for bit."""
    bag_of_row = torch.repeat_interleave(torch.arange(bags, device=values.device), lengths.long())
    return torch.zeros(bags, values.size(1), dtype=values.dtype, device=values.device).index_add_(
        0, bag_of_row, values)


torch.fx.wrap("bag_sum")


def pad_jagged(values: torch.Tensor, lengths: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Jagged `values` `[N, W]` (`lengths` `[U]`, unit after unit) as a
    zero-padded `[U, L, W]` block (`L` the longest unit) and its mask
    `[U, L]` (true at a unit's positions)."""
    lengths = lengths.long()
    longest = int(lengths.max()) if lengths.numel() > 0 else 0
    mask = torch.arange(longest, device=values.device).unsqueeze(0) < lengths.unsqueeze(1)
    padded = torch.zeros(lengths.numel(), longest, values.size(1), dtype=values.dtype, device=values.device)
    padded[mask] = values
    return padded, mask


torch.fx.wrap("pad_jagged")


def longest_unit(lengths: torch.Tensor) -> int:
    """The largest of `lengths` (0 for none): a Python int in TorchScript, an
    unbacked size (known at run time only) under torch.export."""
    if torch.jit.is_scripting():
        return int(lengths.max()) if lengths.numel() > 0 else 0
    if lengths.numel() == 0:
        return 0
    longest = lengths.max().item()
    torch._check(longest >= 0)
    return longest


class TargetAttention(nn.Module):
    """DIN's activation unit: for each candidate `c` `[B, W]` and each
    position `p` of its history (`[B, L, W]`, `mask` `[B, L]`), the weight
    `mlp([c, p, c - p, c * p])` (ReLU layers, then one linear unit; no
    softmax), zero at padding; returns the weighted sum of the positions,
    `[B, W]`."""

    def __init__(self, width: int, layers: List[int]) -> None:
        super().__init__()
        self.mlp = MLP(4 * width, layers)
        self.weight = nn.Linear(layers[-1], 1)

    def forward(self, candidate: torch.Tensor, history: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        c = candidate.unsqueeze(1).expand_as(history)
        units = self.mlp(torch.cat([c, history, c - history, c * history], dim=2))
        weights = self.weight(units).squeeze(2) * mask.to(history.dtype)
        return torch.bmm(weights.unsqueeze(1), history).squeeze(1)


class Din(nn.Module):
    """The DIN ranker over TorchRec collections (module docstring)."""

    def __init__(self, sequence_collection: nn.Module, pooled_collection: nn.Module, num_dense: int, dim: int,
                 user_features: List[str], bottom_arch: List[int], attention_arch: List[int],
                 over_arch: List[int]) -> None:
        super().__init__()
        self.sequence_collection = sequence_collection
        self.pooled_collection = pooled_collection
        self.user_features: List[str] = user_features
        self.bottom_arch = MLP(num_dense, bottom_arch)
        self.attention = TargetAttention(2 * dim, attention_arch)
        self.over_arch = MLP(bottom_arch[-1] + len(user_features) * dim + 4 * dim, over_arch)
        self.logit = nn.Linear(over_arch[-1], 1)

    def forward(self, dense: torch.Tensor, features: KeyedJaggedTensor) -> torch.Tensor:
        batch = dense.size(0)
        pooled = self.pooled_collection(features).values()  # [B, F_user * D], user feature order
        sequences = self.sequence_collection(features)
        item, cat = sequences["cand_item"], sequences["cand_cat"]
        candidate = torch.cat([bag_sum(item.values(), item.lengths(), batch),
                               bag_sum(cat.values(), cat.lengths(), batch)], dim=1)
        hist_item, hist_cat = sequences["hist_item"], sequences["hist_cat"]
        history, mask = pad_jagged(torch.cat([hist_item.values(), hist_cat.values()], dim=1), hist_item.lengths())
        interest = self.attention(candidate, history, mask)
        hidden = self.over_arch(torch.cat([self.bottom_arch(dense), pooled, candidate, interest], dim=1))
        return torch.sigmoid(self.logit(hidden)).reshape(-1)


class DinPredictor(nn.Module):
    """Narsil's single-file interface around `Din`: `lengths` (int32) and
    `ids` (int64) key-major over every sparse feature in wire order, as
    TorchRec's KeyedJaggedTensor holds them; probabilities `[B]`."""

    def __init__(self, din: Din, keys: List[str]) -> None:
        super().__init__()
        self.keys: List[str] = keys
        self.din = din

    def forward(self, dense: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.din(dense, KeyedJaggedTensor(keys=self.keys, values=ids, lengths=lengths))


class DinDenseNetwork(nn.Module):
    """`Din` after its lookups, Narsil's split form for one sequence:

      forward(dense f32[R, num_dense], pooled f32[R, (F_user + 2) * D],
              seq0_values f32[P, 2D], seq0_offsets i64[U + 1], seq0_row_unit i64[R]) -> f32[R]

    `pooled` holds the user features' pooled vectors, then `cand_item`'s
    and `cand_cat`'s (schema order); `seq0_values` the history's positions
    (item row, cat row side by side) unit after unit; row `r` attends to unit
    `row_unit[r]`.

    Each unit's positions are padded once (as row indices, `[U, L]`, `L`
    the longest unit; padding points at a zero row), and each candidate
    gathers its unit's padded positions by `row_unit`. With `factored` (the
    default), what does not depend on the candidate also runs once per
    position: the attention's first layer is split by its input blocks,
    `W [c, p, c - p, c * p] = (W_c + W_d) c + (W_p - W_d) p + W_m (c * p)`,
    and `(W_p - W_d) p` is computed on the jagged positions (`[P, 2D]`, once
    per unit) and gathered with them: a quarter of the first layer's
    multiply-adds per candidate and position, its sums in another order
    (scores within about 5e-7 of `Din`'s). Without, the first layer runs
    over `[c, p, c - p, c * p]` per candidate as `Din` runs it (the same
    scores as `Din`, bit for bit in the export's checks). `P == 0` and
    empty units give an interest of zeros. The arithmetic runs in the dtype
    of the weights (FP32, or bf16 once Narsil casts them); scores are FP32."""

    factored: bool

    def __init__(self, din: Din, num_user: int, dim: int, factored: bool = True) -> None:
        super().__init__()
        self.bottom_arch = din.bottom_arch
        self.over_arch = din.over_arch
        self.logit = din.logit
        self.user_width = num_user * dim
        self.width = 2 * dim
        first = din.attention.mlp._mlp[0]._linear
        w = first.weight.detach()
        blocks = w.split(self.width, dim=1)  # W_c, W_p, W_d, W_m
        self.candidate_projection = nn.Linear(self.width, w.shape[0])
        self.position_projection = nn.Linear(self.width, w.shape[0], bias=False)
        self.product_projection = nn.Linear(self.width, w.shape[0], bias=False)
        with torch.no_grad():
            self.candidate_projection.weight.copy_(blocks[0] + blocks[2])
            self.candidate_projection.bias.copy_(first.bias.detach())
            self.position_projection.weight.copy_(blocks[1] - blocks[2])
            self.product_projection.weight.copy_(blocks[3])
        self.attention_rest = nn.Sequential(*list(din.attention.mlp._mlp[1:]))
        self.attention_weight = din.attention.weight
        self.factored = factored
        self.attention = din.attention

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor, seq0_values: torch.Tensor,
                seq0_offsets: torch.Tensor, seq0_row_unit: torch.Tensor) -> torch.Tensor:
        dtype = self.logit.weight.dtype
        dense, pooled, values = dense.to(dtype), pooled.to(dtype), seq0_values.to(dtype)
        user = pooled[:, :self.user_width]
        candidate = pooled[:, self.user_width:self.user_width + self.width]
        positions = values.size(0)
        # Once per unit: its positions' projections, and its padded row
        # indices (`positions` -- an appended zero row -- at padding).
        projected = values
        if self.factored:
            projected = torch.cat([self.position_projection(values),
                                   torch.zeros(1, self.position_projection.out_features, dtype=dtype,
                                               device=values.device)])
        values = torch.cat([values, torch.zeros(1, self.width, dtype=dtype, device=values.device)])
        starts = seq0_offsets[:-1]
        lengths = seq0_offsets[1:] - starts
        steps = torch.arange(longest_unit(lengths), device=values.device).unsqueeze(0)
        mask = steps < lengths.unsqueeze(1)
        rows = torch.where(mask, starts.unsqueeze(1) + steps, torch.full_like(steps, positions))  # [U, L]
        # Per candidate: its unit's positions, gathered.
        rows = rows.index_select(0, seq0_row_unit)  # [R, L]
        mask = mask.index_select(0, seq0_row_unit)
        history = values[rows]  # [R, L, 2D]
        if self.factored:
            hidden = torch.relu(projected[rows] + self.candidate_projection(candidate).unsqueeze(1)
                                + self.product_projection(history * candidate.unsqueeze(1)))
            weights = self.attention_weight(self.attention_rest(hidden)).squeeze(2) * mask.to(dtype)
            interest = torch.bmm(weights.unsqueeze(1), history).squeeze(1)
        else:
            interest = self.attention(candidate, history, mask)
        hidden = self.over_arch(torch.cat([self.bottom_arch(dense), user, candidate, interest], dim=1))
        return torch.sigmoid(self.logit(hidden).float()).reshape(-1)


def build(args, user: List[str]) -> Din:
    """A `Din` of `args`' shape (models/export_din.py's flags) with seeded
    random weights, in eval mode."""
    bound = args.embedding_init
    init = lambda w: nn.init.uniform_(w, -bound, bound)  # noqa: E731
    ec = EmbeddingCollection(tables=[
        EmbeddingConfig(name="item", embedding_dim=args.embedding_dim, num_embeddings=args.item_rows,
                        feature_names=["hist_item", "cand_item"], init_fn=init),
        EmbeddingConfig(name="cat", embedding_dim=args.embedding_dim, num_embeddings=args.cat_rows,
                        feature_names=["hist_cat", "cand_cat"], init_fn=init),
    ], device=torch.device("cpu"))
    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=name, embedding_dim=args.embedding_dim, num_embeddings=args.user_rows,
                           feature_names=[name], pooling=PoolingType.SUM, init_fn=init)
        for name in user
    ], device=torch.device("cpu"))
    din = Din(ec, ebc, args.num_dense, args.embedding_dim, user, args.bottom_arch, args.attention_arch,
              args.over_arch)
    # He-initialised layers (nn.Linear's default gives every candidate nearly the same score, 0.51 to 0.52 here):
    # scores spread over about 0.05 to 0.75.
    for layer in din.modules():
        if isinstance(layer, nn.Linear):
            nn.init.normal_(layer.weight, std=math.sqrt(2.0 / layer.in_features))
            nn.init.uniform_(layer.bias, -0.1, 0.1)
    return din.eval()
