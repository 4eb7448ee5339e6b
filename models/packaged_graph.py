"""The graph of a TorchRec-packaged model (`model.pt`: TorchScript,
`forward(batch: Dict[str, Tensor])`, quantized table-batched lookups,
FX-traced, scripted) as the extraction of its split form reads it
(models/extract_split.py, models/extract_sequences.py): its FBGEMM lookups
(`Lookup`: module, pooling, tables, INT8 rows), the graph with them
returning their outputs (the probe) or cut out (their outputs read from the
batch dict), the model's input dict for a request as Narsil sends it, and
FBGEMM's INT8 rows dequantized."""

from pathlib import Path
from typing import Dict, List, Tuple

import torch

import fbgemm_gpu  # noqa: F401  (registers FBGEMM's operators)

LOOKUP = "fbgemm::int_nbit_split_embedding_codegen_lookup_function"
# Positional arguments of the lookup (fbgemm_gpu's
# int_nbit_split_embedding_codegen_lookup_function).
WEIGHTS_HOST, POOLING_MODE, OUTPUT_DTYPE = 0, 14, 16
SPARSE_TYPE_INT8, SPARSE_TYPE_FP32 = 2, 0
# FBGEMM's PoolingMode: SUM, MEAN, and NONE (TorchRec's EmbeddingCollection:
# one row per id, unpooled; a sequence model's lookups).
POOLING = {0: "sum", 1: "mean", 2: "none"}
POOLING_NONE = "none"
LOCATION_HOST = 3
ROW_ALIGNMENT = 16


class Lookup:
    """One table-batched lookup of the packaged model: its module's path,
    its pooling (`none` for an EmbeddingCollection's: rows `[ids, D]`, not
    bags), and per column block (feature position) the block's width and
    table."""

    def __init__(self, node, module: torch.jit.ScriptModule) -> None:
        inputs = list(node.inputs())
        path = []
        value = inputs[WEIGHTS_HOST]
        while value.node().kind() == "prim::GetAttr":
            path.append(value.node().s("name"))
            value = value.node().input()
        path.reverse()
        if len(path) < 2 or path[-1] != "weights_host":
            raise SystemExit(f"a {LOOKUP} call does not read a module's weights_host buffer ({'.'.join(path)})")
        self.path = ".".join(path[:-1])
        self.tbe = module
        for name in path[:-1]:
            self.tbe = getattr(self.tbe, name)
        self.pooling = POOLING.get(constant(inputs[POOLING_MODE], "pooling_mode", self.path))
        if self.pooling is None:
            raise SystemExit(f"{self.path}: pooling mode {constant(inputs[POOLING_MODE], 'pooling_mode', self.path)} "
                             "is none of sum (0), mean (1) and none (2, an EmbeddingCollection's: sequence "
                             "features); serve model.pt as a single file")
        output_dtype = constant(inputs[OUTPUT_DTYPE], "output_dtype", self.path)
        if output_dtype != SPARSE_TYPE_FP32:
            raise SystemExit(f"{self.path}: lookup output dtype {output_dtype}, only FP32 (0) is extracted")
        tys = self.tbe.weights_tys.tolist()
        if any(t != SPARSE_TYPE_INT8 for t in tys):
            raise SystemExit(f"{self.path}: weights_tys {sorted(set(tys))}; only INT8 row-wise tables "
                             f"(SparseType {SPARSE_TYPE_INT8}) are extracted")
        if any(p != LOCATION_HOST for p in self.tbe.weights_placements.tolist()):
            raise SystemExit(f"{self.path}: tables placed off the host (weights_placements "
                             f"{self.tbe.weights_placements.tolist()})")
        d_offsets = self.tbe.D_offsets.tolist()
        self.dims = [b - a for a, b in zip(d_offsets, d_offsets[1:])]
        self.offsets = self.tbe.weights_offsets.tolist()
        self.rows = self.tbe.rows_per_table.tolist()

    def table_rows(self, position: int) -> torch.Tensor:
        """The rows of the table at column block `position`, FBGEMM's fused
        INT8 layout (`[rows, row_bytes]` uint8)."""
        row_bytes = int8_row_bytes(self.dims[position])
        start = self.offsets[position]
        end = start + self.rows[position] * row_bytes
        host = self.tbe.weights_host
        if end > host.numel():
            raise SystemExit(f"{self.path}: table at block {position} ends at byte {end}, past weights_host "
                             f"({host.numel()} bytes)")
        return host[start:end].view(self.rows[position], row_bytes)


def int8_row_bytes(dim: int) -> int:
    """FBGEMM's INT8 row: fp16 scale and bias, then `dim` bytes, padded."""
    return (dim + 4 + ROW_ALIGNMENT - 1) // ROW_ALIGNMENT * ROW_ALIGNMENT


def constant(value, what: str, where: str) -> int:
    if value.node().kind() != "prim::Constant":
        raise SystemExit(f"{where}: the lookup's {what} is not a constant")
    return value.toIValue()


def lookup_nodes(graph) -> list:
    nodes = [n for n in graph.nodes() if n.kind() == LOOKUP]
    if len(graph.findAllNodes(LOOKUP)) != len(nodes):
        raise SystemExit(f"a {LOOKUP} call sits inside a branch or loop; only straight-line lookups are extracted")
    if not nodes:
        raise SystemExit(f"the model calls no {LOOKUP}: nothing to extract")
    return nodes


def inlined(path: Path) -> torch.jit.ScriptModule:
    module = torch.jit.load(str(path))
    torch._C._jit_pass_inline(module.graph)
    return module


def returning_lookups(path: Path) -> Tuple[torch.jit.ScriptModule, List[Lookup]]:
    """The packaged model, its forward changed to return its lookups'
    outputs (in graph order) instead of its scores, and nothing else run."""
    module = inlined(path)
    graph = module.graph
    nodes = lookup_nodes(graph)
    lookups = [Lookup(n, module) for n in nodes]
    ret = graph.return_node()
    outputs = graph.create("prim::ListConstruct", [n.output() for n in nodes])
    outputs.output().setType(torch._C.ListType(torch._C.TensorType.get()))
    outputs.insertBefore(ret)
    ret.replaceInput(0, outputs.output())
    # The model's code after its lookups would run too (TorchScript's
    # dead-code elimination keeps its checks), and fail on the probes'
    # empty bags (a candidate with no id).
    keep_only_what_the_outputs_read(graph)
    torch._C._jit_pass_dce(graph)
    return module, lookups


def without_lookups(path: Path) -> torch.jit.ScriptModule:
    """The packaged model with lookup N's output read from the batch dict's
    `narsil.pooled.N` (`narsil.rows.N` for an unpooled lookup's), the
    lookups and their bounds checks removed and the table buffers emptied."""
    module = inlined(path)
    graph = module.graph
    batch = list(graph.inputs())[1]
    for i, node in enumerate(lookup_nodes(graph)):
        unpooled = constant(list(node.inputs())[POOLING_MODE], "pooling_mode", "") == 2
        key = graph.insertConstant(f"narsil.rows.{i}" if unpooled else f"narsil.pooled.{i}")
        key.node().moveBefore(node)
        read = graph.create("aten::__getitem__", [batch, key])
        read.output().setType(node.output().type())
        read.insertBefore(node)
        node.output().replaceAllUsesWith(read.output())
        node.destroy()
    for node in graph.findAllNodes("fbgemm::bounds_check_indices"):
        node.destroy()
    keep_only_what_the_outputs_read(graph)
    torch._C._jit_pass_dce(graph)
    for name, buffer in list(module.named_buffers()):
        if name.endswith(("weights_host", "weights_uvm", "lxu_cache_weights")):
            owner = module
            for part in name.split(".")[:-1]:
                owner = getattr(owner, part)
            setattr(owner, name.split(".")[-1], torch.empty([0] * buffer.dim(), dtype=buffer.dtype))
    return module


def keep_only_what_the_outputs_read(graph) -> None:
    """Removes every top-level node the graph's outputs do not depend on.
    TorchScript's dead-code elimination keeps writes to objects and failed
    assertions as effects, so the jagged-tensor bookkeeping that fed the
    removed lookups would stay and run. Here a node is kept when its outputs
    (or, for a node with blocks, anything its blocks use) reach the return;
    an object or list created in the graph and kept brings every node that
    uses it (its writes). Whatever this removes wrongly shows up as a failed
    run or a score that differs from the packaged model's, both checked."""
    top = list(graph.nodes())
    top_set = set(top)

    def top_level(node):
        while node not in top_set and node.kind() != "prim::Return":
            node = node.owningBlock().owningNode()
        return node

    def used_values(node):
        values = list(node.inputs())
        for block in node.blocks():
            for inner in block.nodes():
                values += used_values(inner)
            values += list(block.returnNode().inputs())
        return values

    mutable = ("prim::CreateObject", "prim::ListConstruct", "prim::DictConstruct", "aten::__getitem__")
    live, work = set(), [graph.return_node()]
    while work:
        node = work.pop()
        for value in used_values(node):
            producer = value.node()
            if producer.kind() == "prim::Param" or producer not in top_set:
                continue
            if producer not in live:
                live.add(producer)
                work.append(producer)
            if producer.kind() in mutable and not isinstance(value.type(), torch._C.TensorType):
                for use in value.uses():
                    user = top_level(use.user)
                    if user in top_set and user not in live:
                        live.add(user)
                        work.append(user)
    for node in reversed(top):
        if node not in live:
            node.destroy()


def takes_raw_ids(config: dict) -> bool:
    """Whether the model takes raw 64-bit ids (a managed-collision model:
    model.json's `raw_ids`), passed as int64 like Narsil passes them."""
    return any(f.get("raw_ids", False) for f in config["sparse_features"])


def wire_batch(config: dict, request: dict) -> Dict[str, torch.Tensor]:
    """A golden request (sample-major) as TorchRec's input dict: each
    feature group key-major, ids int32 (int64 for a model of raw ids)."""
    features = config["sparse_features"]
    b = request["batch_size"]
    lengths = torch.tensor(request["lengths"], dtype=torch.int32).view(b, len(features))
    id_type = torch.int64 if takes_raw_ids(config) else torch.int32
    bags = torch.split(torch.tensor(request["ids"], dtype=id_type), lengths.reshape(-1).tolist())
    weighted_lengths = [int(lengths[s, j]) for s in range(b) for j, f in enumerate(features) if f["weighted"]]
    weights = iter(torch.split(torch.tensor(request.get("weights", []), dtype=torch.float32), weighted_lengths))
    weight_of = {(s, j): next(weights) for s in range(b) for j, f in enumerate(features) if f["weighted"]}
    batch = {"float_features": torch.tensor(request["dense"], dtype=torch.float32).view(b, config["dense_features"])}
    for group, weighted in (("id_list_features", False), ("id_score_list_features", True)):
        order = [(s, j) for j, f in enumerate(features) if f["weighted"] == weighted for s in range(b)]
        if not order:
            continue
        batch[f"{group}.lengths"] = torch.stack([lengths[s, j] for s, j in order]).to(torch.int32)
        batch[f"{group}.values"] = torch.cat([bags[s * len(features) + j] for s, j in order])
        if weighted:
            batch[f"{group}.weights"] = torch.cat([weight_of[o] for o in order])
    return batch


def one_id_request(config: dict, feature: int, row: int, weight: float = 1.0) -> dict:
    features = config["sparse_features"]
    lengths = [1 if j == feature else 0 for j in range(len(features))]
    return {"batch_size": 1, "dense": [0.0] * config["dense_features"], "lengths": lengths, "ids": [row],
            "weights": [weight] if features[feature]["weighted"] else []}


def block(output: torch.Tensor, lookup: "Lookup", position: int) -> torch.Tensor:
    start = sum(lookup.dims[:position])
    return output[:, start:start + lookup.dims[position]]


def dequantized(rows: torch.Tensor, dim: int) -> torch.Tensor:
    """FBGEMM's INT8 row-wise rows (`[rows, row_bytes]` uint8: fp16 scale,
    fp16 bias, `dim` values) as FP32 `[rows, dim]`."""
    scale = rows[:, 0:2].contiguous().view(torch.float16).float()
    bias = rows[:, 2:4].contiguous().view(torch.float16).float()
    return rows[:, 4:4 + dim].float() * scale + bias




def place_features(probe: torch.jit.ScriptModule, lookups: List[Lookup], config: dict) -> List[Tuple[int, int]]:
    """For each request feature, the (lookup, column block) it feeds,
    measured by looking up one id in that feature alone; a weighted
    feature's block must scale with the id's weight. A feature an unpooled
    lookup (an EmbeddingCollection's) reads is placed at block -1: its
    rows, not a column block, change (models/extract_sequences.py orders
    them)."""
    places = []
    with torch.inference_mode():
        for j, feature in enumerate(config["sparse_features"]):
            found = set()
            for row in range(min(8, feature["num_rows"])):
                outputs = probe(wire_batch(config, one_id_request(config, j, row)))
                found = {(i, -1) for i, (lookup, output) in enumerate(zip(lookups, outputs))
                         if lookup.pooling == POOLING_NONE and output.shape[0] > 0}
                found |= {(i, p) for i, (lookup, output) in enumerate(zip(lookups, outputs))
                          if lookup.pooling != POOLING_NONE
                          for p in range(len(lookup.dims)) if block(output, lookup, p).abs().sum() > 0}
                if found:
                    break
            if len(found) != 1:
                raise SystemExit(f"feature {feature['name']}: one id in its bag alone changed "
                                 f"{len(found)} lookup column blocks {sorted(found)}, expected exactly one")
            i, p = found.pop()
            places.append((i, p))
            if p < 0:
                if feature["weighted"]:
                    raise SystemExit(f"feature {feature['name']}: model.json says weighted, but "
                                     f"{lookups[i].path} looks it up unpooled (an EmbeddingCollection: "
                                     "a position has no weight)")
                continue
            halved = probe(wire_batch(config, one_id_request(config, j, row, weight=0.5)))[i]
            scales = (block(halved, lookups[i], p).abs().sum() / block(outputs[i], lookups[i], p).abs().sum()).item()
            expected = 0.5 if feature["weighted"] else 1.0
            if abs(scales - expected) > 1e-3:
                raise SystemExit(f"feature {feature['name']}: model.json says weighted={feature['weighted']} but "
                                 f"halving its id's weight scaled its pooled embedding by {scales:.3f}")
    return places
