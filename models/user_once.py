"""A DLRM dense network's top with the user's arithmetic done once per
ranking request (`dense_user_once.pt`).

In a ranking request the dense features and some sparse features are the
user's (request-level, `schema.json`'s `request_level`): the same for every
candidate. In DLRM's dot interaction the pairwise products among those
vectors (the dense embedding and the user's pooled features) and their share
of the over arch's first layer (its columns for the dense embedding and for
those products) do not depend on the candidate. This network computes that
share once per unit (one user's request) and adds it to each row's
candidate part: a row computes only the products that involve one of its
candidate vectors and the first layer's columns for them.

    forward(dense_embedding [U, D], pooled [R, F * D], row_unit i64[R],
            unit_row i64[U]) -> scores f32[R]

`dense_embedding` is the dense arch's output once per unit (`dense_bottom.pt`),
`pooled` the batch's pooled block (a unit's user columns broadcast to each
of its rows, as Narsil's stage writes them), `row_unit[r]` the unit of row
`r`, `unit_row[u]` a row of unit `u` (its user columns are read there). A
flat row is a unit of its own. `write_user_once_cut` checks it within 1e-6
of the whole network in FP32.
"""

from pathlib import Path
from typing import List, Optional

import torch
from torch import nn

from dense_packages import TIMED_ROWS, compile_package

# Largest difference allowed from the whole network's scores (FP32): the
# first layer's sum is split in two, so rounding differs.
USER_ONCE_BOUND = 1e-6


class UserOnceNetwork(nn.Module):
    """`network` (a split DLRM DenseNetwork: dense arch, dot interaction,
    over arch of perceptrons then a linear layer, sigmoid) after its dense
    arch, its first over-arch layer cut into a per-unit part (request-level
    vectors) and a per-row part (products involving a candidate vector).
    `user_features` are the request-level features' positions in the pooled
    block; the dense features must be request-level too."""

    def __init__(self, network: nn.Module, user_features: List[int]) -> None:
        super().__init__()
        vectors, dim = network.num_vectors, network.dim
        users = [0] + [1 + f for f in user_features]
        candidates = [v for v in range(vectors) if v not in users]
        mlp = network.over_arch.model[0]._mlp
        first = mlp[0]._linear
        self.first_activation = mlp[0]._activation_fn
        self.over_rest = nn.Sequential(*list(mlp)[1:], network.over_arch.model[1])
        self.num_vectors, self.dim = vectors, dim
        rows, cols = torch.triu_indices(vectors, vectors, 1)
        pairs = list(zip(rows.tolist(), cols.tolist()))
        # The first layer's input: dense embedding (dim columns), then each
        # pair's product in upper-triangle order.
        user_pairs = [k for k, (i, j) in enumerate(pairs) if i in users and j in users]
        row_pairs = [k for k, (i, j) in enumerate(pairs) if not (i in users and j in users)]
        user_columns = list(range(dim)) + [dim + k for k in user_pairs]
        row_columns = [dim + k for k in row_pairs]
        weight = first.weight.detach()
        self.user_weight = nn.Parameter(weight[:, user_columns].contiguous(), requires_grad=False)
        self.row_weight = nn.Parameter(weight[:, row_columns].contiguous(), requires_grad=False)
        self.first_bias = nn.Parameter(first.bias.detach().clone(), requires_grad=False)
        self.register_buffer("users", torch.tensor(users))
        self.register_buffer("candidates", torch.tensor(candidates))
        # A unit's products among its users, `[U, users * users]`; a row's,
        # `[R, candidates * vectors]` (each candidate vector with every vector).
        position = {u: n for n, u in enumerate(users)}
        self.register_buffer("user_products", torch.tensor(
            [position[pairs[k][0]] * len(users) + position[pairs[k][1]] for k in user_pairs], dtype=torch.long))
        slot = {c: n for n, c in enumerate(candidates)}

        def row_product(i: int, j: int) -> int:
            candidate, other = (i, j) if i in slot else (j, i)
            return slot[candidate] * vectors + other

        self.register_buffer("row_products", torch.tensor([row_product(*pairs[k]) for k in row_pairs],
                                                          dtype=torch.long))

    def forward(self, dense_embedding: torch.Tensor, pooled: torch.Tensor, row_unit: torch.Tensor,
                unit_row: torch.Tensor) -> torch.Tensor:
        dtype = self.row_weight.dtype
        dense_embedding = dense_embedding.to(dtype)
        pooled = pooled.to(dtype)
        units, rows = dense_embedding.shape[0], pooled.shape[0]
        # Once per unit: the users' products and their share of layer 1.
        unit_vectors = torch.cat([dense_embedding, torch.index_select(pooled, 0, unit_row)], dim=1)
        user_vectors = torch.index_select(unit_vectors.view(units, self.num_vectors, self.dim), 1, self.users)
        user_products = torch.bmm(user_vectors, user_vectors.transpose(1, 2)).view(units, -1)
        user_input = torch.cat([dense_embedding, torch.index_select(user_products, 1, self.user_products)], dim=1)
        user_part = torch.addmm(self.first_bias, user_input, self.user_weight.t())
        # Once per row: the products with a candidate vector, and the rest.
        vectors = torch.cat([torch.index_select(dense_embedding, 0, row_unit), pooled], dim=1)
        vectors = vectors.view(rows, self.num_vectors, self.dim)
        candidate_vectors = torch.index_select(vectors, 1, self.candidates)
        products = torch.bmm(candidate_vectors, vectors.transpose(1, 2)).view(rows, -1)
        row_input = torch.index_select(products, 1, self.row_products)
        first = torch.addmm(torch.index_select(user_part, 0, row_unit), row_input, self.row_weight.t())
        logits = self.over_rest(self.first_activation(first))
        return torch.sigmoid(logits.float()).reshape(-1)


def cuttable(network: nn.Module) -> Optional[str]:
    """Why `network` cannot be cut this way (None: it can)."""
    over = getattr(network, "over_arch", None)
    if not hasattr(network, "num_vectors") or over is None:
        return "the dense network is not DLRM's dot interaction"
    model = getattr(over, "model", None)
    if not isinstance(model, nn.Sequential) or len(model) != 2 or not hasattr(model[0], "_mlp") \
            or not isinstance(model[1], nn.Linear) or len(model[0]._mlp) < 1:
        return "the over arch is not perceptrons then a linear layer"
    return None


def ranking_batch(units: List[int], flat: int, num_dense: int, features: int, dim: int,
                  user_features: List[int], generator: torch.Generator):
    """A batch as the stage writes one: `units` grouped requests of that many
    rows (user columns the same in each of a unit's rows) then `flat` flat
    rows; returns (dense per unit, pooled, row_unit, unit_row)."""
    rows = sum(units) + flat
    pooled = torch.rand(rows, features * dim, generator=generator)
    dense = torch.randn(len(units) + flat, num_dense, generator=generator)
    row_unit, unit_row, start = [], [], 0
    for unit, size in enumerate(units + [1] * flat):
        for f in user_features:
            pooled[start:start + size, f * dim:(f + 1) * dim] = pooled[start, f * dim:(f + 1) * dim].clone()
        row_unit += [unit] * size
        unit_row.append(start)
        start += size
    return dense, pooled, torch.tensor(row_unit), torch.tensor(unit_row)


def write_user_once_cut(out: Path, network: nn.Module, bottom: nn.Module, top: nn.Module, keys: List[str],
                        request_level: List[str], num_dense: int, precisions: List[str], log) -> dict:
    """`out/dense_user_once.pt` for `network` when `request_level` names the
    dense features and `network` is DLRM's dot interaction, checked within
    USER_ONCE_BOUND of `top(bottom(dense), pooled)` (the whole network, as
    `write_dense_cut` checked it) on grouped and flat rows, and its
    AOTInductor package in each of `precisions` ("fp32", "bf16"); the
    schema's field naming them (none otherwise)."""
    why = cuttable(network)
    if why is None and "dense" not in request_level:
        why = "the dense features are not request-level"
    if why is not None:
        log(f"no user-once cut: {why}")
        return {}
    user_features = [f for f, key in enumerate(keys) if key in request_level]
    cut = UserOnceNetwork(network, user_features).eval()
    generator = torch.Generator().manual_seed(0)

    def inputs(units: List[int], flat: int) -> tuple:
        """The cut's inputs for a ranking_batch: the bottom's output per unit."""
        dense, pooled, row_unit, unit_row = ranking_batch(units, flat, num_dense, len(keys), network.dim,
                                                          user_features, generator)
        with torch.inference_mode():
            return bottom(dense), pooled, row_unit, unit_row

    worst = 0.0
    with torch.inference_mode():
        for units, flat in (([1], 0), ([500], 0), ([3, 40, 1, 17], 5), ([], 4)):
            embedding, pooled, row_unit, unit_row = inputs(units, flat)
            whole = top(torch.index_select(embedding, 0, row_unit), pooled)
            worst = max(worst, (cut(embedding, pooled, row_unit, unit_row) - whole).abs().max().item())
    if not worst <= USER_ONCE_BOUND:
        raise SystemExit(f"user-once cut check failed: {worst} from the whole network")
    torch.jit.script(cut).save(str(out / "dense_user_once.pt"))
    log(f"wrote the user-once cut for ranking requests (dense_user_once.pt, {len(user_features)} request-level "
        f"sparse features; within {worst:.1e} of the whole network)")
    spec = {"network": "dense_user_once.pt", "request_level": list(request_level)}
    units = torch.export.Dim("units", min=1, max=1 << 20)
    rows = torch.export.Dim("rows", min=1, max=1 << 20)
    for precision in precisions:
        try:
            name, _ = compile_package(
                out, "dense_user_once", cut, precision, log, example=inputs([5, 9], 3),
                dynamic_shapes=({0: units}, {0: rows}, {0: rows}, {0: units}),
                checked=[inputs([1], 0), inputs([100], 0), inputs([3, 40, 1], 4), inputs([], 1)],
                # One user per 100 candidates.
                timed=[inputs([100] * (r // 100), 0) for r in TIMED_ROWS])
        except SystemExit as error:
            if precision == "fp32":
                raise
            # Served without it: ranking requests run the top's package.
            log(f"dense_user_once_{precision}.pt2 not kept: {error}")
            continue
        spec["package" if precision == "fp32" else f"package_{precision}"] = name
    return {"dense_user_once": spec}
