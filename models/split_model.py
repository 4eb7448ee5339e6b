"""Narsil's split model form: embedding tables apart from the dense network.

A split model is a directory (models/README.md, "Split models"):

  schema.json      dense features, tables (rows, dimension, storage, file,
                   sha256), sparse features (each mapped to a table, pooling,
                   weighted), outputs, the dense network's file, its FLOPs
                   per sample (dense_flops_per_sample)
  tables/T.bin     one file per table, rows end to end in the table's storage
  dense.pt         TorchScript: forward(dense f32[B, D], pooled f32[B, F*E])
                   -> f32[B] (probabilities), the pooled embeddings in feature
                   order, each E wide
  dense.pt2        (DLRM exports) the same dense network compiled ahead of
                   time by AOTInductor (torch.export, a dynamic row
                   dimension), FP32; its package metadata
                   names the CPU flags its kernels need (narsil_cpu_flags)
  dense_bf16.pt2   (DLRM exports on CPUs with bf16 instructions) the same,
                   bf16 weights and inputs, FP32 scores
  dense.safetensors  (DLRM exports) the same layers' FP32 weights by name
                   (dense.{i}.*, over.{i}.*), for the Burn backend
  golden.json      requests, the pooled embeddings FBGEMM computed for the
                   small ones, and the scores of the split model

Storage `int8_rowwise` is FBGEMM's inference layout for row-wise INT8
(IntNBitTableBatchedEmbeddingBagsCodegen): each row is an fp16 scale and an
fp16 bias, then E uint8 values, padded to a multiple of 16 bytes; a value
dequantizes as `q * scale + bias` in FP32 and bags sum in FP32. Storage
`fp32` is E little-endian FP32 values per row.
"""

import copy
import hashlib
import json
import shutil
from pathlib import Path
from typing import List, Optional

import torch
from torch import nn
from torchrec.models.dlrm import DLRM
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dense_packages import package_precisions, write_dense_package, write_dense_packages
from user_once import write_user_once_cut

SPLIT_FORMAT = "narsil-split-1"
# Golden requests up to this many samples also carry their pooled embeddings.
POOLED_GOLDEN_MAX_SAMPLES = 16


class DenseNetwork(nn.Module):
    """DLRM after the embedding lookup: dense arch, pairwise-dot interaction
    of the dense embedding with every pooled one (upper triangle, as one
    `index_select` over the flattened products), over arch, sigmoid.

    The arithmetic runs in the dtype of the over arch's weights; scores are
    FP32."""

    def __init__(self, dlrm: nn.Module, num_features: int) -> None:
        super().__init__()
        self.dense_arch = dlrm.dense_arch
        self.over_arch = dlrm.over_arch
        self.num_vectors = num_features + 1
        self.dim = dlrm.sparse_arch.D
        rows, cols = torch.triu_indices(self.num_vectors, self.num_vectors, 1)
        self.register_buffer("upper_triangle", rows * self.num_vectors + cols)

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        dtype = self.over_arch.model[-1].weight.dtype
        dense_embedding = self.dense_arch(dense.to(dtype))
        batch = dense_embedding.shape[0]
        vectors = torch.cat([dense_embedding, pooled.to(dtype)], dim=1).view(batch, self.num_vectors, self.dim)
        products = torch.bmm(vectors, vectors.transpose(1, 2)).view(batch, -1)
        interactions = torch.index_select(products, 1, self.upper_triangle)
        logits = self.over_arch(torch.cat([dense_embedding, interactions], dim=1))
        return torch.sigmoid(logits.float()).reshape(-1)


class BottomNetwork(nn.Module):
    """A dense network's dense arch alone (`forward(dense) -> [B, D]`,
    FP32), for a network whose forward starts with `self.dense_arch(dense)`
    (DLRM, DLRM_DCN, the two-task model). A ranking request whose dense
    features are request-level runs it once, on its user's dense row,
    instead of once per candidate. Inputs come in the network's dtype, as
    Narsil casts them."""

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.dense_arch = network.dense_arch

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.dense_arch(dense).float()


def with_child(module: nn.Module, name: str, child: nn.Module) -> nn.Module:
    """A shallow copy of `module` whose submodule `name` is `child` (the
    others, and `module` itself, untouched)."""
    copied = copy.copy(module)
    copied._modules = type(module._modules)(module._modules)
    setattr(copied, name, child)
    return copied


def top_of(network: nn.Module) -> nn.Module:
    """`network` after its dense arch: the same forward with the dense arch
    replaced by the identity, so `forward(dense_embedding, pooled)`
    (through a WireOrderPooled wrapper too); `top_of(n)(BottomNetwork(n)(dense),
    pooled)` is `n(dense, pooled)`."""
    if isinstance(network, WireOrderPooled):
        return with_child(network, "inner", top_of(network.inner))
    return with_child(network, "dense_arch", nn.Identity())


def write_dense_cut(out: Path, network: nn.Module, num_dense: int, pooled_width: int, pt2: bool, log,
                    keys: Optional[List[str]] = None, request_level: Optional[List[str]] = None) -> dict:
    """`network` cut in two for ranking requests: `dense_bottom.pt` (its
    dense arch, TorchScript) and `dense_top.pt` (the rest; with `pt2` its
    packages too), checked to score as the whole network; with `keys` (the
    features in pooled order) and `request_level`, also the top with the
    user's arithmetic once (`models/user_once.py`). Returns the schema's
    fields naming them (none for a network without a dense arch)."""
    inner = network.inner if isinstance(network, WireOrderPooled) else network
    if not hasattr(inner, "dense_arch"):
        log("no dense network cut: the dense network has no dense arch of its own")
        return {}
    bottom, top = BottomNetwork(inner).eval(), top_of(network).eval()
    with torch.inference_mode():
        dim = bottom(torch.randn(2, num_dense)).shape[1]
        for batch in (1, 7, 100):
            dense, pooled = torch.randn(batch, num_dense), torch.rand(batch, pooled_width)
            diff = (top(bottom(dense), pooled) - network(dense, pooled)).abs().max().item()
            if diff > 1e-6:
                raise SystemExit(f"dense network cut check failed: {diff} from the whole network at {batch} rows")
    torch.jit.script(bottom).save(str(out / "dense_bottom.pt"))
    torch.jit.script(top).save(str(out / "dense_top.pt"))
    fields = {"dense_bottom": "dense_bottom.pt", "dense_top": "dense_top.pt"}
    precisions = package_precisions() if pt2 else []
    for precision in precisions:
        name, _ = write_dense_package(out, top, dim, pooled_width, log, precision=precision, stem="dense_top")
        fields["dense_top_package" if precision == "fp32" else f"dense_top_package_{precision}"] = name
    log(f"wrote the dense network cut for ranking requests ({', '.join(fields.values())})")
    if keys is not None and request_level is not None:
        fields.update(write_user_once_cut(out, network, bottom, top, keys, request_level, num_dense, precisions, log))
    return fields


class DcnDenseNetwork(nn.Module):
    """TorchRec's DLRM_DCN after the embedding lookup: dense arch, the DCNv2
    low-rank cross layers over the dense embedding concatenated with every
    pooled one (the `[B, (F + 1) * D]` block `InteractionDCNArch` builds),
    over arch, sigmoid.

    The arithmetic runs in the dtype of the over arch's weights; scores are
    FP32."""

    def __init__(self, dcn: nn.Module) -> None:
        super().__init__()
        self.dense_arch = dcn.dense_arch
        # FX-traced, as TorchRec's packaging traces it: the loop over layers
        # unrolled (TorchScript cannot index a ParameterList by a variable).
        self.crossnet = torch.fx.symbolic_trace(dcn.inter_arch.crossnet)
        self.over_arch = dcn.over_arch

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        dtype = self.over_arch.model[-1].weight.dtype
        combined = torch.cat([self.dense_arch(dense.to(dtype)), pooled.to(dtype)], dim=1)
        logits = self.over_arch(self.crossnet(combined))
        return torch.sigmoid(logits.float()).reshape(-1)


class LinearCrossNet(nn.Module):
    """TorchRec's LowRankCrossNet with each kernel an `nn.Linear` and each
    layer's bias folded into its W linear: x_{l+1} = x_0 * (W_l(V_l x_l) + b_l)
    + x_l as two linear layers and one fused multiply-add. The form INT8
    quantization takes: the quantizer annotates linear layers, and TorchRec's
    `functional.linear` on ParameterList kernels was left in FP32 (6 of the
    14 GEMMs of MLPerf's DLRM-v2, two thirds of its FLOPs)."""

    def __init__(self, crossnet: nn.Module) -> None:
        super().__init__()
        self.v = nn.ModuleList()
        self.w = nn.ModuleList()
        for v_kernel, w_kernel, bias in zip(crossnet.V_kernels, crossnet.W_kernels, crossnet.bias):
            v = nn.Linear(v_kernel.shape[1], v_kernel.shape[0], bias=False)
            w = nn.Linear(w_kernel.shape[1], w_kernel.shape[0])
            with torch.no_grad():
                v.weight.copy_(v_kernel)
                w.weight.copy_(w_kernel)
                w.bias.copy_(bias)
            self.v.append(v)
            self.w.append(w)

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        x = x0
        for v, w in zip(self.v, self.w):
            x = x0 * w(v(x)) + x
        return x


class Int8DcnDenseNetwork(DcnDenseNetwork):
    """DcnDenseNetwork in the form INT8 quantization takes (its cross layers
    a LinearCrossNet): the same scores, every GEMM a linear layer."""

    def __init__(self, dcn: nn.Module) -> None:
        super().__init__(dcn)
        self.crossnet = LinearCrossNet(dcn.inter_arch.crossnet)


class DlrmPredictor(nn.Module):
    """Narsil's model interface around TorchRec's DLRM: builds the
    KeyedJaggedTensor from flat key-major tensors and returns probabilities.

    It computes exactly what `DLRM.forward` computes (bit for bit in FP32)
    with three fewer copies: the pooled embeddings stay in the
    `[B, F * D]` block the embedding collection writes (TorchRec's SparseArch
    splits it per key and concatenates it again), the dense embedding and the
    pooled ones are concatenated once, and the upper triangle of the
    interaction is one `index_select` over the flattened `[B, (F+1)^2]`
    products instead of a two-index gather.

    The dense arithmetic runs in the dtype of the over arch's weights, so the
    same file serves FP32 and, once Narsil casts its floating-point weights
    (`--dense-precision bf16`), bf16; the scores are always FP32.
    """

    def __init__(self, dlrm: DLRM, keys: List[str]) -> None:
        super().__init__()
        self.keys = keys
        self.embeddings = dlrm.sparse_arch.embedding_bag_collection
        self.dense_network = DenseNetwork(dlrm, len(keys))

    def forward(self, dense: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        sparse = KeyedJaggedTensor(keys=self.keys, values=ids, lengths=lengths)
        pooled = self.embeddings(sparse).values()  # [B, F * D], key order
        return self.dense_network(dense, pooled)


def int8_tables(quantized: nn.Module) -> List[torch.Tensor]:
    """Every table of a quantized DLRM as FBGEMM's fused INT8 rows
    (`[rows, row_bytes]` uint8), in feature order."""
    tables = []
    for module in quantized.sparse_arch.embedding_bag_collection._emb_modules:
        for fused, _ in module.split_embedding_weights(split_scale_shifts=False):
            tables.append(fused.contiguous())
    return tables


def fp32_tables(dlrm: nn.Module) -> List[torch.Tensor]:
    """Every table of an FP32 DLRM as little-endian FP32 rows
    (`[rows, 4 * dim]` uint8), in feature order."""
    bags = dlrm.sparse_arch.embedding_bag_collection.embedding_bags
    return [bags[name].weight.detach().contiguous().view(torch.uint8) for name in bags]


def write_split(out: Path, dlrm: nn.Module, quantized: nn.Module, keys: List[str], name: str, version: str,
                num_dense: int, requests: List[dict], key_major, log, dense_weights: dict,
                storage: str = "int8_rowwise", pt2: bool = True, request_level: Optional[List[str]] = None) -> None:
    """Writes `out` (a split model) from `quantized`'s INT8 tables (or, for
    `storage` "fp32", `dlrm`'s FP32 tables) and `dlrm`'s dense network (as
    TorchScript, with `pt2` as an AOTInductor package too, and as
    `dense_weights`, its FP32 weights by name, for Narsil's Burn backend),
    and checks its scores against the single-file
    model's (INT8 or FP32) on `requests`."""
    # Fresh files, never rewritten in place: a published version may share
    # them as hard links.
    shutil.rmtree(out, ignore_errors=True)
    (out / "tables").mkdir(parents=True)
    source = quantized if storage == "int8_rowwise" else dlrm
    tables = int8_tables(quantized) if storage == "int8_rowwise" else fp32_tables(dlrm)
    dim = dlrm.sparse_arch.D
    if len(tables) != len(keys):
        raise SystemExit(f"split export: {len(tables)} tables for {len(keys)} features")
    described = []
    for key, rows_bytes in zip(keys, tables):
        rows, row_bytes = rows_bytes.shape
        data = rows_bytes.numpy().tobytes()
        file = f"tables/{key}.bin"
        (out / file).write_bytes(data)
        described.append({"name": key, "rows": rows, "dim": dim, "storage": storage,
                          "row_bytes": row_bytes, "file": file, "sha256": hashlib.sha256(data).hexdigest()})
    log(f"wrote {len(tables)} {storage} tables ({sum(t.numel() for t in tables) / 2**20:.1f} MiB) into {out / 'tables'}")
    dense_module = DenseNetwork(dlrm, len(keys)).eval()
    dense_network = torch.jit.script(dense_module)
    dense_network.save(str(out / "dense.pt"))
    packages = write_dense_packages(out, dense_module, num_dense, len(keys) * dim, log) if pt2 else {}
    packages.update(write_dense_cut(out, dense_module, num_dense, len(keys) * dim, pt2, log, keys, request_level))
    from safetensors.torch import save_file
    save_file(dense_weights, str(out / "dense.safetensors"))
    schema = {
        "format": SPLIT_FORMAT, "name": name, "version": version, "num_dense": num_dense,
        "tables": described,
        "features": [{"name": key, "table": key, "pooling": "sum", "weighted": False} for key in keys],
        "outputs": ["default"],
        "dense_network": "dense.pt",
        "dense_weights": "dense.safetensors",
        "dense_flops_per_sample": dense_flops_per_sample(dense_module, num_dense, len(keys) * dim),
    }
    schema.update(packages)
    (out / "schema.json").write_text(json.dumps(schema, indent=2) + "\n")

    single = DlrmPredictor(source, keys).eval()
    embeddings = source.sparse_arch.embedding_bag_collection
    exact = storage == "int8_rowwise"
    golden = []
    with torch.inference_mode():
        for request in requests:
            dense, lengths, ids = key_major(request)
            pooled = embeddings(KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths)).values()
            scores = dense_network(dense, pooled)
            expected = single(dense, lengths, ids)
            diff = (scores - expected).abs().max().item()
            if diff > 1e-6:
                raise SystemExit(f"split export check failed: split scores differ from the single-file model's by {diff}")
            entry = {"batch_size": request["batch_size"], "dense": request["dense"].reshape(-1).tolist(),
                     "lengths": request["lengths"].reshape(-1).tolist(), "ids": request["ids"].tolist(),
                     "scores": scores.tolist()}
            if exact and request["batch_size"] <= POOLED_GOLDEN_MAX_SAMPLES:
                entry["pooled"] = pooled.reshape(-1).tolist()
            golden.append(entry)
    (out / "golden.json").write_text(json.dumps({"requests": golden}))
    log(f"wrote the split model {out} (dense network, schema, golden scores equal to the single-file model's)")


def dense_flops_per_sample(dense_network: nn.Module, num_dense: int, pooled_width: int) -> int:
    """`dense_network`'s FLOPs per sample (forward(dense, pooled); 2 per
    multiply-add of its GEMMs and batched products, as torch's
    FlopCounterMode counts them over 8 rows): the arithmetic a forward cannot
    avoid, which `narsil bench-forward` holds against this core's peak."""
    from torch.utils.flop_counter import FlopCounterMode
    rows = 8
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        dense_network(torch.randn(rows, num_dense), torch.rand(rows, pooled_width))
    return counter.get_total_flops() // rows


def named_int8_tables(quantized_ebc: nn.Module) -> dict:
    """Every table of a TorchRec quantized EmbeddingBagCollection as FBGEMM's
    fused INT8 rows (`[rows, row_bytes]` uint8), by table name."""
    tables = {}
    for module in quantized_ebc._emb_modules:
        names = [spec[0] for spec in module.embedding_specs]
        for name, (fused, _) in zip(names, module.split_embedding_weights(split_scale_shifts=False)):
            tables[name] = fused.contiguous()
    return tables


class WireOrderPooled(nn.Module):
    """A dense network whose pooled input comes in the wire's feature order
    (the order requests send them), put back into the order the model
    concatenates its lookups in (TorchRec groups a collection's outputs by
    pooling mode, so the two can differ)."""

    def __init__(self, inner: nn.Module, order: List[int], dim: int) -> None:
        super().__init__()
        self.inner = inner
        self.dim = dim
        self.permute = order != list(range(len(order)))
        self.register_buffer("order", torch.tensor(order, dtype=torch.int64))

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        if self.permute:
            batch = pooled.shape[0]
            pooled = pooled.view(batch, -1, self.dim).index_select(1, self.order).reshape(batch, -1)
        return self.inner(dense, pooled)



def write_int8_table(out: Path, name: str, fused: torch.Tensor, dim: int) -> dict:
    """Writes a table's FBGEMM INT8 row-wise rows (`fused`, `[rows,
    row_bytes]` uint8) to `out/tables/NAME.bin`; its schema.json entry."""
    data = fused.numpy().tobytes()
    file = f"tables/{name}.bin"
    (out / file).write_bytes(data)
    return {"name": name, "rows": fused.shape[0], "dim": dim, "storage": "int8_rowwise",
            "row_bytes": fused.shape[1], "file": file, "sha256": hashlib.sha256(data).hexdigest()}

def write_torchrec_split(out: Path, ebcs: List[nn.Module], dense_network: nn.Module, wire_features: List[str],
                         name: str, version: str, num_dense: int, outputs: List[str], golden: list,
                         pooled_of, log, pt2: bool = False) -> None:
    """Writes `out` (a split model) from TorchRec quantized
    EmbeddingBagCollections `ebcs` (their tables and feature-to-table
    mapping) and `dense_network` (forward(dense, pooled in the model's
    concatenation order) -> [outputs, B] or [B]). `golden` holds pairs of a
    request and its single-file scores (`outputs` by name); `pooled_of`
    gives a request's dense tensor and its pooled embeddings per feature
    name. Checks the split scores against the single-file model's. With
    `pt2`, also compiles the dense network's AOTInductor packages."""
    shutil.rmtree(out, ignore_errors=True)
    (out / "tables").mkdir(parents=True)
    described, features, model_order, weighted = [], {}, [], set()
    for ebc in ebcs:
        rows = named_int8_tables(ebc)
        if ebc.is_weighted():
            weighted.update(f for c in ebc.embedding_bag_configs() for f in c.feature_names)
        for config in ebc.embedding_bag_configs():
            described.append(write_int8_table(out, config.name, rows[config.name], config.embedding_dim))
            for feature in config.feature_names:
                features[feature] = {"name": feature, "table": config.name,
                                     "pooling": config.pooling.value.lower(), "weighted": ebc.is_weighted()}
        # The order the collection returns its pooled features in.
        model_order += list(ebc(empty_features(ebc)).keys())
    dim = described[0]["dim"]
    in_wire_order = WireOrderPooled(dense_network, [wire_features.index(f) for f in model_order], dim).eval()
    wrapped = torch.jit.script(in_wire_order)
    wrapped.save(str(out / "dense.pt"))
    packages = write_dense_packages(out, in_wire_order, num_dense, len(wire_features) * dim, log) if pt2 else {}
    packages.update(write_dense_cut(out, in_wire_order, num_dense, len(wire_features) * dim, pt2, log))
    schema = {
        "format": SPLIT_FORMAT, "name": name, "version": version, "num_dense": num_dense,
        "tables": described,
        "features": [features[f] for f in wire_features],
        "outputs": outputs,
        "dense_network": "dense.pt",
        "dense_flops_per_sample": dense_flops_per_sample(in_wire_order, num_dense, len(wire_features) * dim),
        **packages,
    }
    (out / "schema.json").write_text(json.dumps(schema, indent=2) + "\n")
    log(f"wrote {len(described)} INT8 tables for {len(wire_features)} features "
        f"({sum(t['rows'] * t['row_bytes'] for t in described) / 2**20:.2f} MiB) into {out}")
    with torch.inference_mode():
        for i, (request, expected) in enumerate(golden):
            dense, pooled = pooled_of(request)
            scores = wrapped(dense, torch.cat([pooled[f] for f in wire_features], dim=1)).reshape(len(outputs), -1)
            for k, output in enumerate(outputs):
                diff = (scores[k] - torch.tensor(expected["outputs"][output])).abs().max().item()
                if diff > 1e-6:
                    raise SystemExit(f"split export check failed: request {i} output {output} differs from the "
                                     f"single-file model's by {diff}")
    log(f"wrote the split model {out} (its scores equal the single-file model's on every golden request)")


def empty_features(ebc: nn.Module):
    """A batch of one sample with empty bags for every feature of `ebc`."""
    keys = [f for c in ebc.embedding_bag_configs() for f in c.feature_names]
    weights = torch.zeros(0) if ebc.is_weighted() else None
    return KeyedJaggedTensor(keys=keys, values=torch.zeros(0, dtype=torch.int64),
                             lengths=torch.zeros(len(keys), dtype=torch.int32), weights=weights)
