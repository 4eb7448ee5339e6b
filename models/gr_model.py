"""Narsil's own implementation of generative-recommenders' (GR) `DlrmHSTU`
forward after its lookups (the model of MLPerf's DLRMv3), as a split dense
network: `GrDenseNetwork`, built from a GR checkpoint's `dense_dict` by
models/import_gr.py. Written from GR's source (modules/dlrm_hstu.py and
what it calls, commit db1bf8f); none of GR's code is used or needed here.

What GR computes for one user (its contexts, its history of L positions
and its K candidates), inference, as this network computes it:

  * Contextual tokens (one per `contextual_feature_to_max_length` feature,
    of length 1): `bias_c + e_c @ W_c`, the input zeroed where `L + K` is
    under the feature's `contextual_feature_to_min_uih_length`.
  * A token per history position and per candidate:
    `content(item) [+ additional(other embeddings)] [+ action(a)]`, each an
    MLP `Linear, SwishLayerNorm, Linear, LayerNorm` (`SwishLayerNorm(x) = x
    * sigmoid(LN(x))`); `a` the position's action bitmask exploded against
    `action_weights` into learned 8-wide vectors, a candidate's one learned
    vector.
  * `x * sqrt(D) + (time_emb[b] + pos_emb[p])` over `[contexts | history |
    candidates]`: `p` a context's index, a history position's distance from
    the history's end plus the contexts (`L - j + C`), `C` for every
    candidate; `b = int(sqrt(max(q - t, 1e-6) / 60))` in FP32, `t` the
    token's time (0 for contexts, a candidate's own query time), `q` the
    last candidate's query time, clamped to `clamp` (`pytorch`: GR's PyTorch
    path caps at the model dim - 1; `triton`: its GPU kernel at 2048).
  * STU layers: `u, v, q, k = split(LN(x) @ W + beta)`, `u = silu(u)`;
    `attn_i = sum_j silu(alpha q_i.k_j) / N * v_j` over keys `j` the mask
    allows (a context or history token: those at or before it; a
    candidate: every context and history token and itself), `alpha =
    1/sqrt(qk dim)`, `N = C + L + K` (GR divides by the padded length of
    its batch: this network by the user's own, its scores alone); `x + [u,
    attn, u * LN(attn)] @ W_o`.
  * Each candidate's last state through the postprocessor (GR's timestamp
    one: `[state, cos/sin of hour-of-day and day-of-week of its query
    time]`, FP32, `2 * 3.14`, then Linear and LayerNorm; or LayerNorm; or
    L2 norm), times the item tower (an MLP of its item embeddings), through
    the multitask head: one output per task, sigmoid for binary tasks.

Narsil's split form (docs/guide/gr-models.md): `forward(dense, pooled,
seq0_values, seq0_offsets, seq0_row_unit, seq0_raw, seq0_unit_rows, seq0_unit_raw,
raw)`,
jagged throughout, never padded to the batch's longest unit. Each unit's
contexts and history go through the layers once; each candidate runs every
layer against its unit's keys and itself. Under TorchScript (dense.pt) the
attention runs unit by unit on each unit's own tokens where they lie, a
query block of `block` tokens against its unit's keys up to its end in
one product, nothing gathered or padded (`attend_units`); exported
(dense.pt2, torch.export takes no loop over units) in blocks of each
unit's own tokens paired with the key blocks before them, as
models/hstu_model.py's `HstuDenseNetwork` (`attend`). N per unit is its contexts, its history and its request's rows
(`seq0_unit_rows`), so a user's scores do not depend on who shares the
forward. Arithmetic in the weights' dtype (norms in FP32, as GR's); scores
FP32.
"""

from typing import Dict, List

import torch
from torch import nn

from gr_attention import GrAttention
from gr_layers import Mlp, Stu, layer_norm32

# The time-bucket clamp of each GR path (module docstring).
CLAMPS = ("pytorch", "triton")
DEFAULT_CLAMP = "pytorch"
TRITON_TIME_BUCKETS = 2048
# GR's positional encoder's tables (modules/dlrm_hstu.py).
POSITION_BUCKETS = 8192
TIME_BUCKET_SECONDS = 60.0
# Under TorchScript, a batch's units run in groups of at most this many
# positions and rows (`GrDenseNetwork.forward`).
GROUP_TOKENS = 2048


class GrLayout:
    """Where each input GR's forward reads sits in Narsil's tensors (column
    indices), and GR's hyperparameters the network needs. Built by
    models/import_gr.py from the schema it writes."""

    def __init__(self, table_dim: int, contexts: List[int], context_min_lengths: List[int],
                 candidate_post: int, candidate_additional: List[int], item_columns: List[int],
                 history_post: int, history_additional: List[int], action_raw: int, time_raw: int,
                 query_time_raw: int) -> None:
        self.table_dim = table_dim
        # `pooled` column starts: each contextual feature's, the candidate's
        # post id's, its additional embeddings', the item tower's inputs.
        self.contexts = contexts
        self.context_min_lengths = context_min_lengths
        self.candidate_post = candidate_post
        self.candidate_additional = candidate_additional
        self.item_columns = item_columns
        # `seq0_values` column starts: the history's post id, its additional embeddings.
        self.history_post = history_post
        self.history_additional = history_additional
        # `seq0_raw` columns: the action bitmask (-1: none), the time; `raw`'s: the query time.
        self.action_raw = action_raw
        self.time_raw = time_raw
        self.query_time_raw = query_time_raw


def floor_divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.div(a, b, rounding_mode="floor")` for floats as eager PyTorch
    computes it (c10's div_floor_floating: `(a - fmod(a, b)) / b`, then
    floored and rounded up past .5), written out: AOTInductor computes
    `floor(a / b)`, which differs where `a / b` rounds up to an integer
    (1.4% of float32 Unix times over 3,600). `b` nonzero."""
    mod = torch.fmod(a, b)
    div = (a - mod) / b
    div = torch.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floored = torch.floor(div)
    return torch.where(div - floored > 0.5, floored + 1, floored)


def remainder(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`torch.remainder(a, b)` for floats as eager PyTorch computes it
    (c10: `fmod(a, b)`, plus `b` where its sign differs from `b`'s), written
    out: Inductor computes `a - b * floor(a / b)`, which is off by `b`
    where `a / b` rounds across an integer (GR's postprocessor takes
    remainders of float32 times in hours, which for millisecond timestamps
    are near 5e8, where float32 steps by 32). `b` nonzero."""
    mod = torch.fmod(a, b)
    return torch.where((mod != 0) & ((b < 0) != (mod < 0)), mod + b, mod)


def columns(starts: List[int], width: int) -> torch.Tensor:
    """The column indices of blocks of `width` starting at `starts`."""
    if not starts:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(s, s + width) for s in starts])


class GrDenseNetwork(GrAttention):
    """GR's `DlrmHSTU` forward after its lookups, Narsil's split form
    (module docstring):

      forward(dense f32[R, 0], pooled f32[R, (contexts + candidate tables) * E],
              seq0_values f32[P, W], seq0_offsets i64[U + 1], seq0_row_unit i64[R],
              seq0_raw i64[P, K], seq0_unit_rows i64[U], seq0_unit_raw i64[U, J], raw i64[R, J]) -> f32[tasks, R]

    The layout (`GrLayout`) says which columns hold what; `clamp` is the
    time-bucket clamp, fixed here; `block` the attention block (tokens of a unit a
    block), `candidate_block` the candidates' (rows a block, at most `block`)."""

    block: int
    candidate_block: int
    contexts: int
    dim: int
    time_clamp: int
    use_action: bool
    use_additional: bool
    postprocessor: str
    action_raw: int
    time_raw: int
    query_time_raw: int
    history_post: int
    candidate_post: int
    table_dim: int
    max_position: int
    bucket_seconds: float
    group_tokens: int

    def __init__(self, config: dict, layout: GrLayout, clamp: str = DEFAULT_CLAMP, block: int = 64,
                 group_tokens: int = GROUP_TOKENS, candidate_block: int = 16) -> None:
        super().__init__()
        if clamp not in CLAMPS:
            raise ValueError(f"clamp must be one of {CLAMPS}, not {clamp!r}")
        d, e = config["hstu_transducer_embedding_dim"], config["hstu_embedding_table_dim"]
        hidden = config["hstu_preprocessor_hidden_dim"]
        self.block, self.dim, self.table_dim = block, d, e
        # Candidates' query blocks: rows of a unit's candidates a block, padded in its last one only.
        self.candidate_block = min(candidate_block, block)
        self.group_tokens = group_tokens
        self.clamp = clamp
        self.max_position, self.bucket_seconds = POSITION_BUCKETS - 1, TIME_BUCKET_SECONDS
        self.time_clamp = d - 1 if clamp == "pytorch" else TRITON_TIME_BUCKETS
        self.contexts = len(layout.contexts)
        self.register_buffer("context_columns", columns(layout.contexts, e).view(max(self.contexts, 1), -1)
                             if self.contexts else torch.zeros(1, 0, dtype=torch.int64))
        self.register_buffer("context_min_lengths", torch.tensor(layout.context_min_lengths + [0],
                                                                 dtype=torch.int64)[:max(self.contexts, 1)])
        self.context_weight = nn.Parameter(torch.zeros(max(self.contexts, 1), e, d))
        self.context_bias = nn.Parameter(torch.zeros(max(self.contexts, 1), d))
        self.content = Mlp(e, hidden, d, True)
        self.use_additional = len(layout.history_additional) > 0
        self.additional = Mlp(e * len(layout.history_additional), hidden, d, True)
        self.register_buffer("history_additional", columns(layout.history_additional, e))
        self.register_buffer("candidate_additional", columns(layout.candidate_additional, e))
        self.history_post, self.candidate_post = layout.history_post, layout.candidate_post
        weights = config.get("action_weights") or []
        self.use_action = len(weights) > 0
        actions = max(len(weights), 1)
        self.register_buffer("action_weights", torch.tensor(weights or [0], dtype=torch.int64))
        self.action_table = nn.Parameter(torch.zeros(actions, 8))
        self.target_action = nn.Parameter(torch.zeros(1, actions * 8))
        self.action = Mlp(actions * 8, hidden, d, True)
        self.action_raw, self.time_raw, self.query_time_raw = layout.action_raw, layout.time_raw, layout.query_time_raw
        self.position_embeddings = nn.Parameter(torch.zeros(POSITION_BUCKETS, d))
        self.time_embeddings = nn.Parameter(torch.zeros(TRITON_TIME_BUCKETS + 1, d))
        self.layers = nn.ModuleList([Stu(d, config["hstu_num_heads"], config["hstu_attn_linear_dim"],
                                         config["hstu_attn_qk_dim"]) for _ in range(config["hstu_attn_num_layers"])])
        if not config.get("enable_postprocessor", True):
            self.postprocessor = "l2"
        elif config.get("use_layer_norm_postprocessor", False):
            self.postprocessor = "layernorm"
        else:
            self.postprocessor = "timestamp"
        self.register_buffer("period_units", torch.tensor([[3600.0, 86400.0]]))
        self.register_buffer("units_per_period", torch.tensor([[24.0, 7.0]]))
        self.time_combiner = nn.Linear(d + 4, d)
        self.post_norm_weight = nn.Parameter(torch.ones(d))
        self.post_norm_bias = nn.Parameter(torch.zeros(d))
        self.register_buffer("item_columns", columns(layout.item_columns, e))
        self.item = Mlp(e * len(layout.item_columns), 512, d, True)
        tasks = config["multitask_configs"]
        self.prediction = Mlp(d, 512, len(tasks), False)
        self.register_buffer("binary", torch.tensor([t["task_type"] == 0 for t in tasks], dtype=torch.bool))

    def load_gr(self, state: Dict[str, torch.Tensor]) -> None:
        """GR's weights, from its checkpoint's `dense_dict` (keys as
        `DlrmHSTU.state_dict()` names them)."""
        pre = "_hstu_transducer._input_preprocessor."
        with torch.no_grad():
            if self.contexts:
                self.context_weight.copy_(state[pre + "_batched_contextual_linear_weights"])
                self.context_bias.copy_(state[pre + "_batched_contextual_linear_bias"])
            self.content.load(state, pre + "_content_embedding_mlp.")
            if self.use_additional:
                self.additional.load(state, pre + "_additional_embedding_mlp.")
            if self.use_action:
                self.action_table.copy_(state[pre + "_action_encoder._action_embedding_table"])
                self.target_action.copy_(state[pre + "_action_encoder._target_action_embedding_table"])
                self.action_weights.copy_(state[pre + "_action_encoder._combined_action_weights"])
                self.action.load(state, pre + "_action_embedding_mlp.")
            encoder = "_hstu_transducer._positional_encoder."
            self.position_embeddings.copy_(state[encoder + "_position_embeddings_weight"])
            self.time_embeddings.copy_(state[encoder + "_timestamp_embeddings_weight"])
            for i, layer in enumerate(self.layers):
                layer.load(state, f"_hstu_transducer._stu_module._stu_layers.{i}.")
            post = "_hstu_transducer._output_postprocessor."
            if self.postprocessor == "timestamp":
                self.period_units.copy_(state[post + "_period_units"])
                self.units_per_period.copy_(state[post + "_units_per_period"])
                self.time_combiner.weight.copy_(state[post + "_time_feature_combiner.weight"])
                self.time_combiner.bias.copy_(state[post + "_time_feature_combiner.bias"])
            if self.postprocessor != "l2":
                self.post_norm_weight.copy_(state[post + "_layer_norm.weight"])
                self.post_norm_bias.copy_(state[post + "_layer_norm.bias"])
            self.item.load(state, "_item_embedding_mlp.")
            self.prediction.load(state, "_multitask_module._prediction_module.")

    def tokens(self, post: torch.Tensor, additional: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """The preprocessor's token of each row: content, additional and
        action MLPs summed (`actions` `[n, A * 8]`)."""
        x = self.content(post)
        if self.use_additional:
            x = x + self.additional(additional)
        if self.use_action:
            x = x + self.action(actions)
        return x

    def buckets(self, query: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
        """Time bucket of tokens at `times` for query times `query` (int64,
        FP32 arithmetic as GR's)."""
        seconds = (query - times).to(torch.float32).clamp(min=1e-6) / self.bucket_seconds
        return torch.sqrt(seconds).clamp(min=0).to(torch.int32).clamp(0, self.time_clamp).to(torch.int64)

    def encoded(self, x: torch.Tensor, positions: torch.Tensor, buckets: torch.Tensor) -> torch.Tensor:
        """`x * sqrt(D) + (time_emb[b] + pos_emb[p])`."""
        added = self.time_embeddings.index_select(0, buckets) + self.position_embeddings.index_select(0, positions)
        return x * (self.dim ** 0.5) + added.to(x.dtype)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor, seq0_values: torch.Tensor,
                seq0_offsets: torch.Tensor, seq0_row_unit: torch.Tensor, seq0_raw: torch.Tensor,
                seq0_unit_rows: torch.Tensor, seq0_unit_raw: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """Scores `[tasks, R]`. Under TorchScript a batch of more than
        `group_tokens` tokens (positions and rows) runs as groups of whole
        units within it, one after the other: units are independent, so
        the scores are the same, and a group's activations stay in the
        caches (on one core, 16 users of 256-1,024 positions fused in one
        group ran 10-25% slower than each alone)."""
        units = seq0_offsets.numel() - 1
        if not torch.jit.is_scripting() or units < 2 or seq0_values.size(0) + pooled.size(0) <= self.group_tokens:
            return self.score(dense, pooled, seq0_values, seq0_offsets, seq0_row_unit, seq0_raw, seq0_unit_rows,
                              seq0_unit_raw, raw)
        per_unit = torch.zeros(units, dtype=torch.int64, device=pooled.device).index_add(
            0, seq0_row_unit, torch.ones_like(seq0_row_unit))
        tokens: List[int] = (seq0_offsets[1:] - seq0_offsets[:-1] + per_unit).tolist()
        out = torch.zeros(self.binary.size(0), pooled.size(0), dtype=torch.float32, device=pooled.device)
        first, held = 0, 0
        for u in range(units + 1):
            if u == units or (held > 0 and held + tokens[u] > self.group_tokens):
                rows = ((seq0_row_unit >= first) & (seq0_row_unit < u)).nonzero().squeeze(1)
                start, end = int(seq0_offsets[first]), int(seq0_offsets[u])
                out[:, rows] = self.score(
                    dense.index_select(0, rows), pooled.index_select(0, rows), seq0_values[start:end],
                    seq0_offsets[first:u + 1] - start, seq0_row_unit.index_select(0, rows) - first,
                    seq0_raw[start:end], seq0_unit_rows[first:u], seq0_unit_raw[first:u], raw.index_select(0, rows))
                first, held = u, 0
            if u < units:
                held += tokens[u]
        return out

    def score(self, dense: torch.Tensor, pooled: torch.Tensor, seq0_values: torch.Tensor,
              seq0_offsets: torch.Tensor, seq0_row_unit: torch.Tensor, seq0_raw: torch.Tensor,
              seq0_unit_rows: torch.Tensor, seq0_unit_raw: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
        """The forward of one group of units (`forward`)."""
        dtype = self.content.first.weight.dtype
        pooled, values = pooled.to(dtype), seq0_values.to(dtype)
        c, e = self.contexts, self.table_dim
        rows, units, positions = pooled.size(0), seq0_offsets.numel() - 1, values.size(0)
        device = values.device
        starts = seq0_offsets[:-1]
        lengths = seq0_offsets[1:] - starts
        sizes = c + lengths  # tokens per unit: contexts and history
        arange_rows = torch.arange(rows, device=device)
        # Rows by unit, in request order within a unit, and each unit's last row here: its contexts are
        # the unit's. (A sort, not a scatter's amax: AOTInductor's lowering of that one took another row.)
        per_unit = torch.zeros(units, dtype=torch.int64, device=device).index_add(
            0, seq0_row_unit, torch.ones_like(seq0_row_unit))
        # Sorted by (unit, row): keys all distinct, so no sort's stability is relied on (AOTInductor's
        # was not stable).
        sorted_rows = torch.sort(seq0_row_unit * rows + arange_rows).indices
        sorted_units = seq0_row_unit.index_select(0, sorted_rows)
        first_row = torch.cumsum(per_unit, 0) - per_unit
        unit_row = sorted_rows.index_select(0, (first_row + per_unit - 1).clamp(min=0))
        query_times = raw[:, self.query_time_raw]
        # The query time q: the whole request's last candidate's (`seq0_unit_raw`, handed by the stage),
        # the same in every part of a request cut into parts.
        unit_query = seq0_unit_raw[:, self.query_time_raw]  # [U]
        # N per unit: contexts, history and its request's rows (candidates).
        scale = (sizes + seq0_unit_rows).to(dtype)  # [U]
        position = torch.arange(positions, device=device)
        position_unit = torch.searchsorted(seq0_offsets, position, right=True) - 1
        place = position - starts.index_select(0, position_unit)  # j: a position's index in its history
        # History tokens.
        actions = torch.zeros(positions, self.action_table.numel(), dtype=dtype, device=device)
        if self.use_action:
            bits = (seq0_raw[:, self.action_raw].unsqueeze(1) & self.action_weights.unsqueeze(0)) > 0
            actions = (bits.unsqueeze(2).to(dtype) * self.action_table.unsqueeze(0)).reshape(
                positions, self.action_table.numel())
        history = self.tokens(values[:, self.history_post:self.history_post + e],
                              values.index_select(1, self.history_additional), actions)
        history_position = (lengths.index_select(0, position_unit) - place + c).clamp(max=self.max_position)
        history = self.encoded(history, history_position,
                               self.buckets(unit_query.index_select(0, position_unit), seq0_raw[:, self.time_raw]))
        # Contextual tokens, from each unit's last row's pooled features.
        unit_pooled = pooled.index_select(0, unit_row)
        contexts = torch.zeros(units, 0, self.dim, dtype=dtype, device=device)
        if c > 0:
            gate = ((lengths + seq0_unit_rows).unsqueeze(1) >= self.context_min_lengths.unsqueeze(0)).to(dtype)
            inputs = unit_pooled.index_select(1, self.context_columns.reshape(-1)).view(units, c, e) \
                * gate.unsqueeze(2)
            # One GEMM per contextual feature (GR's is one batched GEMM over them).
            contexts = torch.stack([torch.addmm(self.context_bias[i].to(dtype), inputs[:, i],
                                                self.context_weight[i].to(dtype)) for i in range(c)], dim=1)
            context_position = torch.arange(c, device=device).repeat(units)
            context_bucket = self.buckets(unit_query.repeat_interleave(c), torch.zeros(units * c, dtype=torch.int64,
                                                                                        device=device))
            contexts = self.encoded(contexts.reshape(units * c, self.dim), context_position, context_bucket)
        x = torch.cat([contexts.reshape(units * c, self.dim), history])  # [U*C + P, D]: contexts, then positions
        # Candidate tokens (every candidate at position C).
        target = self.target_action.to(dtype).expand(rows, -1)
        candidates = self.tokens(pooled[:, self.candidate_post:self.candidate_post + e],
                                 pooled.index_select(1, self.candidate_additional), target)
        candidates = self.encoded(candidates, torch.full_like(arange_rows, c).clamp(max=self.max_position),
                                  self.buckets(unit_query.index_select(0, seq0_row_unit), query_times))
        if torch.jit.is_scripting():
            candidates = self.attend_units(x, candidates, sizes, position_unit, place, scale, per_unit,
                                           sorted_rows, sorted_units, first_row, units)
        else:
            candidates = self.attend(x, candidates, sizes, starts, position_unit, place, scale, seq0_row_unit,
                                     per_unit, sorted_rows, sorted_units, first_row, units, positions, rows)
        user = self.postprocess(candidates, query_times)
        item = self.item(pooled.index_select(1, self.item_columns))
        logits = self.prediction(user * item).float().transpose(0, 1)  # [tasks, R]
        return torch.where(self.binary.unsqueeze(1), torch.sigmoid(logits), logits)

    def postprocess(self, states: torch.Tensor, query_times: torch.Tensor) -> torch.Tensor:
        """GR's output postprocessor on the candidates' last states."""
        if self.postprocessor == "l2":
            return states / torch.linalg.norm(states, ord=2, dim=-1, keepdim=True).clamp(min=1e-6)
        if self.postprocessor == "timestamp":
            since = floor_divide(query_times.float().unsqueeze(1), self.period_units.float())
            periods = self.units_per_period.float()
            angle = remainder(since, periods) / periods * 2 * 3.14  # [R, 2]
            features = torch.stack([torch.cos(angle), torch.sin(angle)], dim=2).flatten(1).to(states.dtype)
            states = self.time_combiner(torch.cat([states, features], dim=1))
        return layer_norm32(states, self.post_norm_weight, self.post_norm_bias, 1e-5)
