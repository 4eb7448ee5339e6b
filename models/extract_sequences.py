"""The split form of a TorchRec-packaged model with sequence features (an
`EmbeddingCollection`: FBGEMM lookups in pooling mode NONE, one row per
id), for models/extract_split.py.

What it writes: every table in Narsil's stage; the EmbeddingCollection's
features as sequence channels (`"pooling": "none"`): the sequences
`model.json` declares (a history: request-level, sent once per ranking
request, looked up once per unit) and, for each other EC feature (a
candidate's item looked up unpooled), a sequence of its own, per row, of
`PER_ROW_MAX_LEN` positions at most; and a dense network, `dense.pt`:

  forward(dense f32[R, num_dense], pooled f32[R, pooled width],
          seq0_values f32[P, W], seq0_offsets i64[U + 1], seq0_row_unit i64[R], ...) -> f32[outputs, R]

which is the packaged model's own graph (the team's code after its
collections: padding, attention, MLPs) with its lookups cut out. Each
unpooled lookup's output, `[ids, D]` in the lookup's feature order, row
after row, is made inside the graph by a gather: row r's positions of a
sequence are its unit's, `values[offsets[row_unit[r]] : offsets[row_unit[r] +
1]]`; the lengths the model splits them by (`id_list_features.lengths`) are
the units' lengths per row. So the model's code gets, per row, the jagged
input TorchRec's lookup gives it, and nothing outside the graph tiles a
history per row. The pooled lookups' outputs come from `pooled` as in the
pooled extraction.

How each EC feature's rows sit in a lookup's output is measured, not read
from TorchRec's code: one id in one feature alone names its lookup; one id
per feature (distinct rows) in one sample gives the lookup's rows in its
feature order, each matched bit for bit against the INT8 table rows
dequantized as FBGEMM does (`q * scale + bias`, one rounding: Narsil's
stage gives the same bits).

Checked before anything is kept: the golden requests (`golden.json`, flat,
each row its own unit; `golden_ranking.json`, one unit per request for its
candidates, and all of them fused into one batch with flat rows between)
through an emulation of the stage against the model's golden scores,
within 1e-6.

Refused, with the reason and what works instead (single-file serving): an
unpooled lookup inside a branch or loop, an EC feature `model.json`
declares weighted, a declared sequence channel a pooled lookup reads, a
lookup's rows that cannot be told apart, scores off the golden ones.
"""

import json
import linecache
import shutil
from pathlib import Path
from typing import Dict, List, Tuple

import torch
from torch import nn

from packaged_graph import POOLING_NONE, Lookup, block, dequantized, wire_batch, without_lookups
from split_model import SPLIT_FORMAT, write_int8_table

# A per-row EC feature's sequence (a candidate's item) keeps at most this
# many positions; a longer bag is cut (its last ones kept), which the
# single-file model would not do.
PER_ROW_MAX_LEN = 4096
BOUND = 1e-6
SINGLE_FILE = "serve model.pt as a single file (TorchRec's own lookups; Narsil copies a request's history into " \
              "each row)"


def refuse(why: str) -> None:
    raise SystemExit(f"{why}: this sequence model (an EmbeddingCollection) is not split; {SINGLE_FILE}")


class Plan:
    """Where everything goes: per feature its (lookup, position), the
    sequences (declared ones first, then one per other EC feature), each
    channel's (sequence, first column, last column), the pooled features
    in schema order and their columns."""

    def __init__(self, config: dict, lookups: List[Lookup], places: List[Tuple[int, int]]) -> None:
        features = config["sparse_features"]
        names = [f["name"] for f in features]
        self.unpooled = [j for j, (i, _) in enumerate(places) if lookups[i].pooling == POOLING_NONE]
        self.sequences: List[dict] = []
        channel_of: Dict[int, Tuple[int, int, int]] = {}
        for declared in config.get("sequences", []):
            self.sequences.append(dict(declared))
        in_declared = {f for s in self.sequences for f in s["features"]}
        for j in self.unpooled:
            if names[j] not in in_declared:
                self.sequences.append({"name": names[j], "features": [names[j]], "max_len": PER_ROW_MAX_LEN,
                                       "keep": "last"})
        for s, sequence in enumerate(self.sequences):
            start = 0
            for name in sequence["features"]:
                j = names.index(name)
                i, p = places[j]
                if lookups[i].pooling != POOLING_NONE:
                    refuse(f"model.json's sequence {sequence['name']!r} lists {name}, which {lookups[i].path} "
                           f"pools ({lookups[i].pooling}): a sequence's channels must be looked up per position")
                channel_of[j] = (s, start, start + lookups[i].dims[p])
                start += lookups[i].dims[p]
            sequence["width"] = start
        self.channel_of = channel_of
        self.pooled = [j for j in range(len(features)) if j not in channel_of]
        self.feature_start = {}
        width = 0
        for j in self.pooled:
            i, p = places[j]
            self.feature_start[j] = width
            width += lookups[i].dims[p]
        self.pooled_width = width


def order_unpooled(probe, lookups: List[Lookup], places: List[Tuple[int, int]], config: dict) -> None:
    """Gives each EC feature its position in its lookup (`places[j] = (i,
    position)`), measured: one sample, one distinct id per feature of the
    lookup; the lookup's output rows, each equal bit for bit to exactly one
    feature's id's dequantized table row, are in its feature order."""
    features = config["sparse_features"]
    for i, lookup in enumerate(lookups):
        if lookup.pooling != POOLING_NONE:
            continue
        mine = [j for j, (li, _) in enumerate(places) if li == i]
        if len(mine) != len(lookup.dims):
            refuse(f"{lookup.path}: {len(lookup.dims)} features in its lookup, {len(mine)} request features "
                   "measured to feed it")
        ids = {j: (7 * k + 3) % features[j]["num_rows"] for k, j in enumerate(mine)}
        request = {"batch_size": 1, "dense": [0.0] * config["dense_features"],
                   "lengths": [1 if j in ids else 0 for j in range(len(features))],
                   "ids": [ids[j] for j in range(len(features)) if j in ids], "weights": []}
        with torch.inference_mode():
            rows = probe(wire_batch(config, request))[i]
        for position in range(len(mine)):
            table = dequantized(lookup.table_rows(position), lookup.dims[position])
            matches = [j for j in mine if ids[j] < table.shape[0]
                       and torch.equal(table[ids[j]], rows[position])]
            if len(matches) != 1:
                refuse(f"{lookup.path}: its output row {position} matches {len(matches)} features' rows "
                       "bit for bit, expected exactly one")
            places[matches[0]] = (i, position)


# The arity wrapper's source (Narsil calls the dense network with each
# sequence's three tensors as positional arguments).
WRAPPER = '''
class {name}(torch.nn.Module):
    def __init__(self, network):
        super().__init__()
        self.network = network

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor, {args}) -> torch.Tensor:
        return self.network.run(dense, pooled, [{names}])
'''


def with_sequence_arguments(network: nn.Module, sequences: int) -> nn.Module:
    """`network.run(dense, pooled, [v0, o0, r0, ...])` behind `forward(dense,
    pooled, seq0_values, seq0_offsets, seq0_row_unit, ...)`."""
    names = [f"seq{s}_{part}" for s in range(sequences) for part in ("values", "offsets", "row_unit")]
    name = f"SequenceArguments{sequences}"
    source = WRAPPER.format(name=name, args=", ".join(f"{n}: torch.Tensor" for n in names), names=", ".join(names))
    filename = f"<narsil {name}>"
    # TorchScript reads a class's source through linecache.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    scope = {"torch": torch}
    exec(compile(source, filename, "exec"), scope)
    return scope[name](network)


class SequenceDense(nn.Module):
    """The packaged graph without its lookups, fed from the split inputs
    (module docs): `run(dense, pooled, sequences)`, `sequences` each
    sequence's values, offsets and row units in turn."""

    def __init__(self, inner: torch.jit.ScriptModule, config: dict, plan: Plan, lookups: List[Lookup],
                 places: List[Tuple[int, int]]) -> None:
        super().__init__()
        self.inner = inner
        self.outputs: List[str] = config.get("outputs", ["default"])
        features = config["sparse_features"]
        self.num_sequences = len(plan.sequences)
        # Per unweighted, then weighted feature (the model's input groups):
        # the sequence whose row lengths are its lengths, -1 for a pooled one.
        self.unweighted: List[int] = [plan.channel_of[j][0] if j in plan.channel_of else -1
                                      for j, f in enumerate(features) if not f["weighted"]]
        self.num_weighted = sum(1 for f in features if f["weighted"])
        self.pooled_keys: List[str] = []
        self.pooled_columns: List[torch.Tensor] = []
        self.rows_keys: List[str] = []
        self.rows_plan: List[List[int]] = []  # per unpooled lookup: sequence, first, last column per position
        for i, lookup in enumerate(lookups):
            at = {p: j for j, (li, p) in enumerate(places) if li == i}
            if lookup.pooling == POOLING_NONE:
                plan_i = []
                for p in range(len(lookup.dims)):
                    plan_i += list(plan.channel_of[at[p]])
                self.rows_keys.append(f"narsil.rows.{i}")
                self.rows_plan.append(plan_i)
            else:
                if sorted(at) != list(range(len(lookup.dims))):
                    refuse(f"{lookup.path}: column blocks {sorted(set(range(len(lookup.dims))) - set(at))} are fed "
                           "by no request feature")
                columns = [c for p in range(len(lookup.dims))
                           for c in range(plan.feature_start[at[p]], plan.feature_start[at[p]] + lookup.dims[p])]
                self.pooled_keys.append(f"narsil.pooled.{i}")
                self.pooled_columns.append(torch.tensor(columns, dtype=torch.int64))

    def run(self, dense: torch.Tensor, pooled: torch.Tensor, sequences: List[torch.Tensor]) -> torch.Tensor:
        rows = dense.size(0)
        gathered: List[torch.Tensor] = []
        row_lengths: List[torch.Tensor] = []
        for s in range(self.num_sequences):
            values, offsets, row_unit = sequences[3 * s], sequences[3 * s + 1], sequences[3 * s + 2]
            # Each row's positions: its unit's, gathered here (once per row,
            # as TorchRec's lookup gives them per row).
            starts = offsets[:-1].index_select(0, row_unit)
            lengths = (offsets[1:] - offsets[:-1]).index_select(0, row_unit)
            row_starts = torch.cumsum(lengths, 0) - lengths
            index = torch.arange(int(lengths.sum()), device=values.device) \
                + torch.repeat_interleave(starts - row_starts, lengths)
            gathered.append(values.index_select(0, index))
            row_lengths.append(lengths)
        zeros = torch.zeros(rows, dtype=torch.int64, device=dense.device)
        lengths_in = [row_lengths[s] if s >= 0 else zeros for s in self.unweighted]
        all_lengths = torch.cat(lengths_in).to(torch.int32)
        batch: Dict[str, torch.Tensor] = {
            "float_features": dense,
            "id_list_features.lengths": all_lengths,
            # The ids only fed the lookups: any ids of the right count.
            "id_list_features.values": torch.zeros(int(all_lengths.sum()), dtype=torch.int32, device=dense.device),
        }
        if self.num_weighted > 0:
            batch["id_score_list_features.lengths"] = torch.zeros(rows * self.num_weighted, dtype=torch.int32,
                                                                  device=dense.device)
            batch["id_score_list_features.values"] = torch.zeros(0, dtype=torch.int32, device=dense.device)
            batch["id_score_list_features.weights"] = torch.zeros(0, dtype=torch.float32, device=dense.device)
        for key, columns in zip(self.pooled_keys, self.pooled_columns):
            batch[key] = pooled.index_select(1, columns)
        for key, plan in zip(self.rows_keys, self.rows_plan):
            parts: List[torch.Tensor] = []
            for k in range(len(plan) // 3):
                parts.append(gathered[plan[3 * k]][:, plan[3 * k + 1]:plan[3 * k + 2]])
            batch[key] = torch.cat(parts)
        result = self.inner(batch)
        assert torch.jit.isinstance(result, Dict[str, torch.Tensor])
        return torch.stack([result[name] for name in self.outputs])


class Emulated:
    """Narsil's stage for this model, in Python: pooled blocks from the
    packaged model's own lookups, each sequence's positions dequantized
    from the table bytes, laid out unit after unit."""

    def __init__(self, config: dict, plan: Plan, probe, lookups: List[Lookup], places) -> None:
        self.config, self.plan, self.probe, self.lookups, self.places = config, plan, probe, lookups, places
        features = config["sparse_features"]
        self.index = {f["name"]: j for j, f in enumerate(features)}
        self.tables = {}
        for j in plan.channel_of:
            i, p = places[j]
            self.tables[j] = dequantized(lookups[i].table_rows(p), lookups[i].dims[p])

    def cut(self, bag: List[int], sequence: dict) -> List[int]:
        keep = sequence["max_len"]
        if len(bag) <= keep:
            return bag
        return bag[len(bag) - keep:] if sequence.get("keep", "last") == "last" else bag[:keep]

    def inputs(self, rows: List[List[List[int]]], dense: List[List[float]], blocks: List[Dict[str, List[int]]],
               row_block: List[int]) -> tuple:
        """The dense network's inputs for `rows` (each: its bags in feature
        order, as served), `dense` per row, `blocks` (request-level
        sequences' bags by feature name) and each row's block (-1: none;
        its request-level sequences from its own bags)."""
        features = self.config["sparse_features"]
        cut_rows = []
        for bags in rows:
            bags = [list(b) for b in bags]
            for sequence in self.plan.sequences:
                for name in sequence["features"]:
                    bags[self.index[name]] = self.cut(bags[self.index[name]], sequence)
            cut_rows.append(bags)
        request = {"batch_size": len(rows), "dense": [x for d in dense for x in d],
                   "lengths": [len(b) for bags in cut_rows for b in bags],
                   "ids": [i for bags in cut_rows for b in bags for i in b], "weights": []}
        with torch.inference_mode():
            outputs = self.probe(wire_batch(self.config, request))
        pooled = torch.cat([block(outputs[self.places[j][0]], self.lookups[self.places[j][0]], self.places[j][1])
                            for j in self.plan.pooled], dim=1) if self.plan.pooled else torch.zeros(len(rows), 0)
        request_level = set(self.config.get("request_level", []))
        sequence_inputs = []
        for sequence in self.plan.sequences:
            channels = [self.index[n] for n in sequence["features"]]
            sent_once = all(n in request_level for n in sequence["features"])
            units: List[List[List[int]]] = []
            row_unit = []
            block_unit: Dict[int, int] = {}
            for r, bags in enumerate(cut_rows):
                b = row_block[r]
                if sent_once and b >= 0:
                    if b not in block_unit:
                        block_unit[b] = len(units)
                        units.append([self.cut(blocks[b][features[j]["name"]], sequence) for j in channels])
                    row_unit.append(block_unit[b])
                else:
                    row_unit.append(len(units))
                    units.append([bags[j] for j in channels])
            values = [torch.cat([self.tables[j][torch.tensor(unit[k], dtype=torch.int64)]
                                 for k, j in enumerate(channels)], dim=1) for unit in units]
            offsets = [0]
            for unit in units:
                offsets.append(offsets[-1] + len(unit[0]))
            sequence_inputs += [torch.cat(values) if values else torch.zeros(0, sequence["width"]),
                                torch.tensor(offsets, dtype=torch.int64), torch.tensor(row_unit, dtype=torch.int64)]
        return (torch.tensor(dense, dtype=torch.float32).view(len(rows), self.config["dense_features"]), pooled,
                *sequence_inputs)


def golden_batches(model_dir: Path, config: dict) -> List[tuple]:
    """(kind, rows, dense, blocks, row_block, expected [outputs, R]) for
    every golden request: flat ones (each row its own unit), ranking ones
    (one block), and all of them fused."""
    features = config["sparse_features"]
    outputs = config.get("outputs", ["default"])
    batches = []
    golden = json.loads((model_dir / "golden.json").read_text())
    for request in golden["requests"]:
        b, f = request["batch_size"], len(features)
        bags, at = [], 0
        for n in request["lengths"]:
            bags.append(request["ids"][at:at + n])
            at += n
        rows = [bags[s * f:(s + 1) * f] for s in range(b)]
        dense = [request["dense"][s * config["dense_features"]:(s + 1) * config["dense_features"]] for s in range(b)]
        expected = torch.tensor([request["outputs"][o] for o in outputs])
        batches.append(("flat", rows, dense, [], [-1] * b, expected))
    ranking_path = model_dir / "golden_ranking.json"
    if ranking_path.exists():
        ranking = json.loads(ranking_path.read_text())
        level = ranking["request_level"]
        block_features = [f["name"] for f in features if f["name"] in level]
        row_features = [f["name"] for f in features if f["name"] not in level]
        for request in ranking["requests"]:
            user, at, block = request["user"], 0, {}
            for name, n in zip(block_features, user["lengths"]):
                block[name] = user["ids"][at:at + n]
                at += n
            rows, dense, at, k = [], [], 0, 0
            for c in range(request["candidates"]):
                own = {}
                for name in row_features:
                    n = request["lengths"][k]
                    own[name] = request["ids"][at:at + n]
                    at += n
                    k += 1
                rows.append([block.get(f["name"], own.get(f["name"])) for f in features])
                dense.append(user["dense"] if "dense" in level else
                             request["dense"][c * config["dense_features"]:(c + 1) * config["dense_features"]])
            outs = request.get("outputs", {"default": request["scores_int8"]})
            batches.append(("grouped", rows, dense, [block], [0] * len(rows),
                            torch.tensor([outs[o] for o in outputs])))
    fused = [[], [], [], [], []]
    for kind, rows, dense, blocks, row_block, expected in batches:
        offset = len(fused[2])
        fused[0] += rows
        fused[1] += dense
        fused[2] += blocks
        fused[3] += [b + offset if b >= 0 else -1 for b in row_block]
        fused[4].append(expected)
    batches.append(("fused", fused[0], fused[1], fused[2], fused[3], torch.cat(fused[4], dim=1)))
    return batches


def extract_sequence_model(model_dir: Path, out: Path, config: dict, probe, lookups: List[Lookup],
                           places: List[Tuple[int, int]], pt2: bool, log) -> None:
    """Writes the split form of a packaged model with unpooled lookups
    (module docs) into `out`."""
    features = config["sparse_features"]
    order_unpooled(probe, lookups, places, config)
    plan = Plan(config, lookups, places)
    log(f"sequence features (EmbeddingCollection, unpooled): {', '.join(features[j]['name'] for j in plan.unpooled)}; "
        "sequences " + ", ".join(f"{s['name']} ({'+'.join(s['features'])}, max_len {s['max_len']})"
                                 for s in plan.sequences))
    shutil.rmtree(out, ignore_errors=True)
    (out / "tables").mkdir(parents=True)
    names, described = {}, []
    for j, (i, p) in enumerate(places):
        key = (i, lookups[i].offsets[p])
        names.setdefault(key, []).append(features[j]["name"])
    for key, feature_names in names.items():
        i, offset = key
        p = lookups[i].offsets.index(offset)
        described.append(write_int8_table(out, "t_" + "_".join(feature_names), lookups[i].table_rows(p),
                                          lookups[i].dims[p]))
    table_of = {f: "t_" + "_".join(fs) for fs in names.values() for f in fs}
    schema_features = [{"name": f["name"], "table": table_of[f["name"]],
                        "pooling": POOLING_NONE if j in plan.channel_of else lookups[places[j][0]].pooling,
                        "weighted": f["weighted"]} for j, f in enumerate(features)]
    network = SequenceDense(without_lookups(model_dir / "model.pt"), config, plan, lookups, places)
    dense = torch.jit.script(with_sequence_arguments(torch.jit.script(network), len(plan.sequences)))
    dense.save(str(out / "dense.pt"))
    sequences = [{k: v for k, v in s.items() if k != "width"} for s in plan.sequences]
    schema = {"format": SPLIT_FORMAT, "name": config.get("name", model_dir.name) + "-extracted",
              "version": config.get("version", "1"), "num_dense": config["dense_features"], "tables": described,
              "features": schema_features, "outputs": config.get("outputs", ["default"]),
              "dense_network": "dense.pt", "request_level": config.get("request_level", []), "sequences": sequences}
    (out / "schema.json").write_text(json.dumps(schema, indent=2) + "\n")
    if pt2:
        log("--pt2: no AOTInductor package for a sequence model extracted from a TorchScript file: the retrace "
            "for torch.export (ts_retrace.py) takes pooled models' graphs (forward(dense, pooled)), not yet one "
            "whose shapes follow each batch's positions; dense.pt (TorchScript) serves it")
    check(model_dir, out, config, plan, probe, lookups, places, log)
    shown = what_the_history_meets(network, plan, places, config)
    alone = shown["history_only"]
    log(f"the history alone (request-level sequences, read from the graph's data flow): {len(alone)} ops"
        + (" (" + "; ".join(f"`{line}`" for line in alone) + ")" if alone else "")
        + "; run per row on each row's gathered positions, as the model's code is written")
    if shown["met_at"]:
        log(f"the history first meets a row's own inputs (dense, pooled or per-row features) at `{shown['met_at']}`: "
            "what follows (the attention) depends on the candidate, so it cannot be computed once per unit")
    else:
        log("the history never meets a row's own inputs before the outputs")


def check(model_dir: Path, out: Path, config: dict, plan: Plan, probe, lookups, places, log) -> None:
    """The golden requests through the emulated stage and `out/dense.pt`
    against the golden scores (module docs)."""
    if not (model_dir / "golden.json").exists():
        log(f"no {model_dir / 'golden.json'}: scores not checked")
        return
    stage = Emulated(config, plan, probe, lookups, places)
    loaded = torch.jit.load(str(out / "dense.pt"))
    worst: Dict[str, float] = {}
    with torch.inference_mode():
        for kind, rows, dense, blocks, row_block, expected in golden_batches(model_dir, config):
            scores = loaded(*stage.inputs(rows, dense, blocks, row_block))
            diff = (scores - expected).abs().max().item() if expected.numel() else 0.0
            if not diff <= BOUND:
                shutil.rmtree(out, ignore_errors=True)
                refuse(f"the split form's scores differ from the golden ones by {diff} ({kind} batch of "
                       f"{len(rows)} rows)")
            worst[kind] = max(worst.get(kind, 0.0), diff)
    for name in ("golden.json", "golden_ranking.json"):
        if (model_dir / name).exists():
            shutil.copyfile(model_dir / name, out / name)
    log(f"wrote the split model {out}: golden scores " + ", ".join(f"{k} within {v:.1e}" for k, v in worst.items()))


# Ops whose output depends on an input's shape only (that input then
# carries no values into it).
SHAPE_ONLY = {"aten::expand_as": 1, "aten::size": 0, "aten::dim": 0, "aten::numel": 0, "aten::zeros_like": 0,
              "aten::ones_like": 0, "aten::full_like": 0, "aten::empty_like": 0}


def code_line(node) -> str:
    """The line of the model's code (as FX wrote it) a node comes from."""
    lines = node.sourceRange().split("\n")
    for k, line in enumerate(lines):
        if k > 0 and line.strip() and set(line.strip().split(" ")[0]) == {"~"}:
            return lines[k - 1].strip()
    return node.kind()


def what_the_history_meets(network: SequenceDense, plan: Plan, places: List[Tuple[int, int]], config: dict) -> dict:
    """Which of the graph's values depend on the request-level sequences'
    positions (the history) and which on a row's own inputs (dense
    features, pooled features, per-row sequences), read from the graph's
    data flow (shape-only uses excluded): the ops on the history alone and
    the first op where the history meets a row's inputs, by the model's
    code line. The history's values reach the model as rows of an unpooled
    lookup, split per feature (`aten::split` of its output, one list item
    per feature in the lookup's order)."""
    graph = network.inner.graph
    request_level = set(config.get("request_level", []))
    history_sequences = {s for s, seq in enumerate(plan.sequences)
                         if all(f in request_level for f in seq["features"])}
    feature_at = {}  # (lookup, position) -> "history" or "row"
    for j, (i, p) in enumerate(places):
        if j in plan.channel_of:
            feature_at[(i, p)] = "history" if plan.channel_of[j][0] in history_sequences else "row"
    sources: Dict[object, frozenset] = {}
    rows_of: Dict[object, int] = {}  # values carrying lookup i's whole output (or its split list)
    batch = list(graph.inputs())[1]
    slots: Dict[tuple, frozenset] = {}
    met, history_only = [], []

    def constant_of(value):
        return value.toIValue() if value.node().kind() == "prim::Constant" else None

    def visit(block) -> None:
        for node in block.nodes():
            inputs = list(node.inputs())
            if node.kind() == "aten::__getitem__" and inputs and inputs[0] is batch \
                    and inputs[1].node().kind() == "prim::Constant":
                key = inputs[1].toIValue()
                if key.startswith("narsil.rows."):
                    rows_of[node.output()] = int(key.rsplit(".", 1)[1])
                    sources[node.output()] = frozenset(["history", "row"])
                elif key.startswith("narsil.pooled.") or key == "float_features":
                    sources[node.output()] = frozenset(["row"])
                continue
            for inner in node.blocks():
                visit(inner)
            # Values kept in objects (TorchRec's JaggedTensor) and dicts, by
            # attribute or constant key.
            if node.kind() == "prim::SetAttr":
                slots[(inputs[0], node.s("name"))] = sources.get(inputs[1], frozenset())
                continue
            if node.kind() == "prim::GetAttr" and (inputs[0], node.s("name")) in slots:
                sources[node.output()] = slots[(inputs[0], node.s("name"))]
                continue
            if node.kind() == "aten::_set_item" and inputs[1].node().kind() == "prim::Constant":
                slots[(inputs[0], inputs[1].toIValue())] = sources.get(inputs[2], frozenset())
                continue
            if node.kind() == "aten::__getitem__" and (inputs[0], constant_of(inputs[1])) in slots:
                sources[node.output()] = slots[(inputs[0], constant_of(inputs[1]))]
                continue
            shape_only = SHAPE_ONLY.get(node.kind())
            used = [] if shape_only == 0 else [v for k, v in enumerate(inputs) if k != shape_only]
            found = frozenset().union(*[sources.get(v, frozenset()) for v in used]) if used else frozenset()
            for inner in node.blocks():
                for v in inner.returnNode().inputs():
                    found |= sources.get(v, frozenset())
            carried = [rows_of[v] for v in inputs if v in rows_of]
            if node.kind() == "aten::__getitem__" and carried and inputs[1].node().kind() == "prim::Constant":
                # One feature's rows, out of the lookup's output split per feature.
                found = frozenset([feature_at.get((carried[0], inputs[1].toIValue()), "row")])
                carried = []
            for out in node.outputs():
                if carried:
                    rows_of[out] = carried[0]
            for out in node.outputs():
                if found:
                    sources[out] = found
            is_op = not node.kind().startswith("prim::") and node.kind() != "aten::__getitem__" and any(
                isinstance(o.type(), torch._C.TensorType) for o in node.outputs())
            if is_op and not carried and found == {"history"}:
                history_only.append(code_line(node))
            if is_op and not carried and found == {"history", "row"} and not met:
                met.append(code_line(node))

    visit(graph)
    return {"history_only": list(dict.fromkeys(history_only)), "met_at": met[0] if met else None}
