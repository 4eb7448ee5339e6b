#!/usr/bin/env python3
"""Exports models with TorchRec's inference signature, the way TorchRec's
inference tooling packages them (`torchrec/inference/dlrm_predict.py`):
a `PredictModule` around the model, `quantize_inference_model` (INT8 FBGEMM
tables), TorchRec's FX tracer with the table-batched lookups as leaves, then
`torch.jit.script`. Unlike TorchRec's packager, whose tables live on the meta
device (all zeros once materialised), the weights are seeded random values.

  forward(batch: Dict[str, Tensor]) -> Dict[str, Tensor]

reads `float_features` f32[B, D], `id_list_features.lengths` i32[F*B] and
`id_list_features.values` i32[N] (key-major, as TorchRec's C++ server sends
them), and for weighted features `id_score_list_features.{lengths,values}`
and `id_score_list_features.weights` f32[N]. It returns one f32[B] tensor of
probabilities per task.

--kind dlrm       TorchRec's DLRMPredictModule: one output, "default".
--kind dlrm_dcn   TorchRec's DLRM_DCN (DCNv2 low-rank cross layers in place of
                  the pairwise dot interaction) with DLRMPredictModule's
                  signature: one output, "default".
--shape mlperf-dlrm-v2  MLPerf Inference's DLRM-v2: DLRM_DCN with 13 dense and
                  26 multi-hot features (MLPerf's multi-hot sizes, 214 ids a
                  pair), dimension 128, 3 cross layers of rank 512, dense
                  arch 512-256-128, over arch 1024-1024-512-256-1, and
                  MLPerf's table sizes each capped at --max-rows (default
                  1M: 7.1M rows, 1.0 GB of INT8 rows; uncapped, 204M rows
                  need about 29 GB as INT8 and 104 GB as FP32). The cap
                  changes only how many distinct rows the ids reach (the
                  cache behaviour): the dense network and the ids a pair
                  carries are MLPerf's. Also writes loadgen_golden.npz:
                  MLPerf-shaped queries (models/mlperf_traffic.py) and their
                  scores, for benchmarks/loadgen's accuracy pass.
--kind multitask  a two-task ranking model ("click", "conversion") over
                  unweighted and weighted (id-score) features; cat_0 and
                  cat_1 share one table, and the last unweighted feature is
                  mean-pooled.

Writes into --out: model.pt, model.json (the schema Narsil reads beside the
model; see models/README.md), golden.json (fixed random requests with every
output's scores, computed here with the saved file) and manifest.json; with
--split also OUT/split, the same model as a split model (its INT8 tables
apart from its dense network, models/README.md), checked against model.pt's
golden scores, and OUT/extracted, the split form models/extract_split.py
makes from model.pt alone; with --pt2 too, both forms' dense networks are
also compiled by AOTInductor (dense.pt2, and dense_bf16.pt2 on a CPU with
bf16 instructions); with --int8 (dlrm_dcn) also OUT/split/dense_int8.pt2, the
dense network with INT8 GEMMs, and its quality against FP32 in
OUT/split/int8_quality.json (models/int8_package.py).
"""

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Dict, List

import torch
from torch import nn

import fbgemm_gpu  # noqa: F401  (registers FBGEMM's operators)
from torchrec.fx import symbolic_trace as torchrec_symbolic_trace
from torchrec.inference.dlrm_predict import DLRMPredictModule
from torchrec.inference.modules import quantize_inference_model
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import int8_package
import mlperf_traffic
from export_common import (begin_export, embedding_flags, int_list, logger, parser, uniform_table, write_json_files,
                           write_manifest)
from extract_split import extract
from split_model import DcnDenseNetwork, DenseNetwork, Int8DcnDenseNetwork, write_torchrec_split
from torchrec_predict_modules import DcnPredictModule, MultiTaskPredictModule, TwoTaskDense, TwoTowerTasks

# Raised when what is written changes: scripts/lib.sh re-exports older ones.
EXPORT_FORMAT = 9


log = logger("export_torchrec")


def tables(names: List[str], args: argparse.Namespace, varied: bool = False) -> List[EmbeddingBagConfig]:
    """One sum-pooled table per feature (`args.rows` rows: --num-rows, or
    per feature for --shape); `varied`: the first two features share one
    table and the last is mean-pooled."""
    groups = [[name] for name in names]
    if varied:
        groups = [names[:2]] + groups[2:]
    rows = dict(zip(names, args.rows)) if len(args.rows) == len(names) else {}
    return [uniform_table("t_" + "_".join(group), group, rows.get(group[0], args.num_rows), args,
                          PoolingType.MEAN if varied and group[-1] == names[-1] else PoolingType.SUM)
            for group in groups]


def package(module: nn.Module, sample: Dict[str, torch.Tensor]):
    """TorchRec's packaging: quantize the tables, FX-trace with TorchRec's
    tracer (lookups and jagged tensors stay leaves), script. Returns the
    quantized module and the scripted one."""
    quantized = quantize_inference_model(module)
    quantized(sample)
    return quantized, torch.jit.script(torchrec_symbolic_trace(quantized))


def golden_requests(args: argparse.Namespace, unweighted: List[str], weighted: List[str]) -> List[dict]:
    """Fixed random requests, sample-major as on Narsil's wire (multi-hot
    with empty bags every other request), with a weight per id of the
    weighted features."""
    g = torch.Generator().manual_seed(args.seed + 1)
    requests = []
    names = unweighted + weighted
    if args.shape == "mlperf-dlrm-v2":
        return mlperf_golden_requests(args, g)
    for i, batch_size in enumerate([1, 7, 32, 3]):
        top = 5 if i % 2 else 2
        lengths = torch.randint(0 if i % 2 else 1, top, (batch_size, len(names)), generator=g, dtype=torch.int32)
        ids = torch.randint(0, args.num_rows, (int(lengths.sum()),), generator=g, dtype=torch.int32)
        weighted_ids = int(lengths[:, len(unweighted):].sum())
        requests.append({
            "batch_size": batch_size,
            "dense": torch.randn(batch_size, args.num_dense, generator=g),
            "lengths": lengths,
            "ids": ids,
            "weights": torch.rand(weighted_ids, generator=g) * 2.0,
        })
    return requests


def mlperf_golden_requests(args: argparse.Namespace, g: torch.Generator) -> List[dict]:
    """Fixed random requests at MLPerf's multi-hot sizes, every id uniform
    in its feature's table."""
    requests = []
    sizes = torch.tensor(mlperf_traffic.MULTI_HOT_SIZES, dtype=torch.int32)
    for batch_size in [1, 7, 32, 3]:
        lengths = sizes.repeat(batch_size, 1)
        rows = torch.tensor(args.rows, dtype=torch.float64).repeat_interleave(sizes.long()).repeat(batch_size)
        ids = (torch.rand(len(rows), generator=g, dtype=torch.float64) * rows).long()
        requests.append({"batch_size": batch_size, "dense": torch.randn(batch_size, args.num_dense, generator=g),
                         "lengths": lengths, "ids": ids.to(torch.int32), "weights": torch.zeros(0)})
    return requests


def write_loadgen_golden(out: Path, loaded, args: argparse.Namespace, num_unweighted: int) -> None:
    """`out/loadgen_golden.npz`: --loadgen-golden-queries MLPerf-shaped
    queries (models/mlperf_traffic.py, seed --seed + 7) and the saved
    model's scores: `pairs` i64[Q], `dense` f32[sum P, 13], `ids`
    i64[sum P, 214] (sample-major), `scores` f32[sum P], and the traffic's
    `zipf` exponent and `rows` per table."""
    import numpy as np

    drawn = mlperf_traffic.queries(args.loadgen_golden_queries, args.rows, args.zipf, args.seed + 7)
    sizes = torch.tensor(mlperf_traffic.MULTI_HOT_SIZES, dtype=torch.int32)
    scores = []
    with torch.inference_mode():
        for dense, ids in drawn:
            request = {"batch_size": len(dense), "dense": torch.from_numpy(dense), "lengths": sizes.repeat(len(dense), 1),
                       "ids": torch.from_numpy(ids.reshape(-1)).to(torch.int32), "weights": torch.zeros(0)}
            scores.append(loaded(batch_of(request, num_unweighted))["default"].reshape(-1).numpy())
    np.savez(out / "loadgen_golden.npz", pairs=np.array([len(d) for d, _ in drawn], dtype=np.int64),
             dense=np.concatenate([d for d, _ in drawn]), ids=np.concatenate([i for _, i in drawn]),
             scores=np.concatenate(scores).astype(np.float32), zipf=np.float64(args.zipf),
             rows=np.array(args.rows, dtype=np.int64))
    log(f"wrote loadgen_golden.npz ({len(drawn)} MLPerf-shaped queries, {sum(len(d) for d, _ in drawn)} pairs)")


def batch_of(request: dict, num_unweighted: int) -> Dict[str, torch.Tensor]:
    """A sample-major request as TorchRec's input dict: each feature group
    key-major, ids int32 (what TorchRec's server sends)."""
    lengths = request["lengths"]  # [B, F]
    b, f = lengths.shape
    bags = torch.split(request["ids"], lengths.reshape(-1).tolist())
    batch = {"float_features": request["dense"]}
    weights = iter(torch.split(request["weights"], lengths[:, num_unweighted:].reshape(-1).tolist()))
    weight_of_bag = {}
    for s in range(b):
        for j in range(num_unweighted, f):
            weight_of_bag[(s, j)] = next(weights)
    for group, features in (("id_list_features", range(num_unweighted)),
                            ("id_score_list_features", range(num_unweighted, f))):
        features = list(features)
        if not features:
            continue
        order = [(s, j) for j in features for s in range(b)]
        batch[f"{group}.lengths"] = torch.stack([lengths[s, j] for s, j in order]).to(torch.int32)
        batch[f"{group}.values"] = torch.cat([bags[s * f + j] for s, j in order]).to(torch.int32)
        if group == "id_score_list_features":
            batch[f"{group}.weights"] = torch.cat([weight_of_bag[o] for o in order]).float()
    return batch


def write_split(out: Path, quantized: nn.Module, args: argparse.Namespace, unweighted: List[str],
                weighted: List[str], outputs: List[str], requests: List[dict], golden: List[dict]) -> None:
    """The packaged model's split form: its quantized collections' tables
    and its layers after the lookups, checked against `golden`."""
    model = quantized.predict_module
    if args.kind == "dlrm":
        ebcs = [model.sparse_arch.embedding_bag_collection]
        dense_network = DenseNetwork(model, len(unweighted))
    elif args.kind == "dlrm_dcn":
        ebcs = [model.sparse_arch.embedding_bag_collection]
        dense_network = DcnDenseNetwork(model)
    else:
        ebcs = [model.ebc, model.weighted_ebc]
        dense_network = TwoTaskDense(model)

    def pooled_of(request: dict):
        batch = batch_of(request, len(unweighted))
        groups = [KeyedJaggedTensor(keys=unweighted, lengths=batch["id_list_features.lengths"],
                                    values=batch["id_list_features.values"])]
        if weighted:
            groups.append(KeyedJaggedTensor(keys=weighted, lengths=batch["id_score_list_features.lengths"],
                                            values=batch["id_score_list_features.values"],
                                            weights=batch["id_score_list_features.weights"]))
        pooled = {}
        for collection, features in zip(ebcs, groups):
            pooled.update(collection(features).to_dict())
        return batch["float_features"], pooled

    log("writing the split model (tables apart from the dense network)")
    write_torchrec_split(out, ebcs, dense_network, unweighted + weighted, f"torchrec-{args.kind}", "1",
                         args.num_dense, outputs, list(zip(requests, golden)), pooled_of, log, pt2=args.pt2)


def sampled_requests(args: argparse.Namespace, seed: int, pairs: int) -> List[dict]:
    """Requests of about `pairs` pairs from their own seed, never the golden
    ones: MLPerf-shaped queries (models/mlperf_traffic.py) for --shape
    mlperf-dlrm-v2, else requests of 100 samples with 0-4 uniform ids a bag."""
    if args.shape == "mlperf-dlrm-v2":
        sizes = torch.tensor(mlperf_traffic.MULTI_HOT_SIZES, dtype=torch.int32)
        drawn = mlperf_traffic.queries(max(1, pairs // 270), args.rows, args.zipf, seed)
        return [{"batch_size": len(dense), "dense": torch.from_numpy(dense), "lengths": sizes.repeat(len(dense), 1),
                 "ids": torch.from_numpy(ids.reshape(-1)).to(torch.int32), "weights": torch.zeros(0)}
                for dense, ids in drawn]
    g = torch.Generator().manual_seed(seed)
    requests = []
    for _ in range(max(1, pairs // 100)):
        lengths = torch.randint(0, 5, (100, args.num_sparse), generator=g, dtype=torch.int32)
        requests.append({"batch_size": 100, "dense": torch.randn(100, args.num_dense, generator=g),
                         "lengths": lengths, "weights": torch.zeros(0),
                         "ids": torch.randint(0, args.num_rows, (int(lengths.sum()),), generator=g,
                                              dtype=torch.int32)})
    return requests


def write_int8(split_dir: Path, quantized: nn.Module, args: argparse.Namespace, keys: List[str],
               golden: List[dict]) -> None:
    """`split_dir/dense_int8.pt2` and `int8_quality.json` for a DLRM_DCN
    (models/int8_package.py): every GEMM in INT8, the cross layers as linear
    layers (Int8DcnDenseNetwork), calibrated on sampled requests pooled from
    the model's own INT8 tables."""
    model = quantized.predict_module
    collection = model.sparse_arch.embedding_bag_collection

    def pooled(requests: List[dict]) -> List[tuple]:
        inputs = []
        with torch.inference_mode():
            for request in requests:
                batch = batch_of(request, len(keys))
                features = KeyedJaggedTensor(keys=keys, lengths=batch["id_list_features.lengths"],
                                             values=batch["id_list_features.values"])
                inputs.append((batch["float_features"].clone(), collection(features).values().clone()))
        return inputs

    traffic = (f"MLPerf-shaped queries (models/mlperf_traffic.py, Zipf {args.zipf} first ids)"
               if args.shape == "mlperf-dlrm-v2" else "requests of 100 samples, dense N(0, 1), 0-4 uniform ids a bag")
    log("compiling the INT8 dense package (dense_int8.pt2)")
    fields = int8_package.write_int8_package(
        split_dir, DcnDenseNetwork(model).eval(), Int8DcnDenseNetwork(model).eval(),
        (torch.randn(8, args.num_dense), torch.rand(8, len(keys) * args.embedding_dim)),
        calibration=pooled(sampled_requests(args, args.seed + 1_000, int8_package.INT8_CALIBRATION_SAMPLES)),
        golden=pooled(golden), sampled=pooled(sampled_requests(args, args.seed + 2_000, int8_package.INT8_SAMPLED)),
        seed=args.seed + 3_000, log=log,
        described={"distribution": f"{traffic}, seed {args.seed + 2_000}",
                   "calibration": f"{traffic}, seed {args.seed + 1_000}, pooled from the model's INT8 tables",
                   "quantization": "torchao PT2E, X86InductorQuantizer default static config: INT8 weights per "
                                   "channel, uint8 activations per tensor; every linear layer of the dense arch, "
                                   "the cross layers and the over arch; the cross layers' products and sums FP32"})
    int8_package.add_to_schema(split_dir, fields)


def main() -> int:
    p = parser(__doc__, None)
    p.add_argument("--kind", choices=["dlrm", "dlrm_dcn", "multitask"], default="dlrm")
    p.add_argument("--num-dense", type=int, default=13)
    p.add_argument("--num-sparse", type=int, default=26, help="unweighted features")
    p.add_argument("--num-weighted", type=int, default=4, help="weighted features (multitask)")
    p.add_argument("--num-rows", type=int, default=1000, help="rows per embedding table")
    embedding_flags(p, 16, 0.5)
    p.add_argument("--split", action="store_true",
                   help="also write the split form (INT8 tables apart from the dense network) into OUT/split, "
                        "and the one extracted from model.pt into OUT/extracted")
    p.add_argument("--pt2", action="store_true",
                   help="with --split, also compile OUT/split's and OUT/extracted's dense networks with "
                        "AOTInductor (dense.pt2, and dense_bf16.pt2 on a CPU with bf16 instructions; needs a "
                        "C++ compiler)")
    p.add_argument("--int8", action="store_true",
                   help="dlrm_dcn, with --split --pt2: also compile split/dense_int8.pt2, the dense network with "
                        "INT8 GEMMs (PT2E static quantization calibrated on sampled traffic), for narsil serve "
                        "--dense-precision int8, and write its quality against FP32 into split/int8_quality.json; "
                        "needs torchao and an x86 CPU with AVX2 (activations in 7 bits there, 8 with AVX512-VNNI, AVX-VNNI "
                        "or AMX-INT8)")
    p.add_argument("--dense-arch", type=int_list, default=None,
                   help="dlrm, dlrm_dcn: the dense arch's layer sizes, comma-separated, the last the embedding "
                        "dimension (default 64,DIM)")
    p.add_argument("--over-arch", type=int_list, default=[64, 1],
                   help="dlrm, dlrm_dcn: the over arch's layer sizes, comma-separated, the last 1 (default 64,1)")
    p.add_argument("--dcn-layers", type=int, default=2, help="dlrm_dcn: DCNv2 cross layers")
    p.add_argument("--dcn-rank", type=int, default=8, help="dlrm_dcn: the cross layers' low rank")
    p.add_argument("--shape", choices=["custom", "mlperf-dlrm-v2"], default="custom",
                   help="mlperf-dlrm-v2: MLPerf's DLRM-v2 (see above); sets --kind, the layer, feature and table "
                        "sizes, and ignores those flags")
    p.add_argument("--max-rows", type=int, default=mlperf_traffic.DEFAULT_MAX_ROWS,
                   help="--shape mlperf-dlrm-v2: the most rows a table keeps (default 1M fits a 24 GiB machine)")
    p.add_argument("--zipf", type=float, default=1.05,
                   help="--shape mlperf-dlrm-v2: exponent of the first ids' Zipf law in loadgen_golden.npz")
    p.add_argument("--loadgen-golden-queries", type=int, default=4,
                   help="--shape mlperf-dlrm-v2: MLPerf-shaped queries in loadgen_golden.npz")
    args = p.parse_args()
    args.rows = [args.num_rows] * args.num_sparse
    if args.shape == "mlperf-dlrm-v2":
        args.kind, args.num_dense, args.num_sparse = "dlrm_dcn", mlperf_traffic.NUM_DENSE, 26
        args.embedding_dim, args.dense_arch, args.over_arch = (mlperf_traffic.EMBEDDING_DIM, mlperf_traffic.DENSE_ARCH,
                                                               mlperf_traffic.OVER_ARCH)
        args.dcn_layers, args.dcn_rank = mlperf_traffic.DCN_LAYERS, mlperf_traffic.DCN_RANK
        args.rows = mlperf_traffic.capped_rows(args.max_rows)
        args.num_rows = max(args.rows)
    args.dense_arch = args.dense_arch or [64, args.embedding_dim]
    if args.dense_arch[-1] != args.embedding_dim:
        p.error(f"--dense-arch must end with the embedding dimension ({args.embedding_dim})")
    if args.over_arch[-1] != 1:
        p.error("--over-arch must end with 1 (one logit)")
    out: Path = args.out
    if args.int8 and not (args.kind == "dlrm_dcn" and args.split and args.pt2):
        p.error("--int8 compiles a package of a DLRM_DCN's split dense network: it needs --kind dlrm_dcn (or "
                "--shape mlperf-dlrm-v2), --split and --pt2 (the DLRM's: models/export_dlrm.py --split --int8)")
    if args.int8 and not int8_package.int8_cpu_flags():
        p.error("--int8 needs an x86 CPU with AVX2 or INT8 dot-product instructions (/proc/cpuinfo flags avx2, "
                "avx512_vnni, avx_vnni or amx_int8), and this one has none: serve --dense-precision fp32")
    if args.kind == "multitask" and args.num_sparse < 3:
        p.error("--kind multitask needs --num-sparse of at least 3 (a shared table and a mean-pooled feature)")
    started = begin_export(args, log, args.split and "split/schema.json", args.split and "extracted/schema.json",
                           args.int8 and "split/dense_int8.pt2")
    if started is None:
        return 0

    unweighted = [f"cat_{i}" for i in range(args.num_sparse)]
    weighted = [f"wcat_{i}" for i in range(args.num_weighted)] if args.kind == "multitask" else []
    ebc = EmbeddingBagCollection(tables=tables(unweighted, args, varied=args.kind == "multitask"),
                                 device=torch.device("cpu"))
    if args.kind == "dlrm":
        module = DLRMPredictModule(
            embedding_bag_collection=ebc,
            dense_in_features=args.num_dense,
            dense_arch_layer_sizes=args.dense_arch,
            over_arch_layer_sizes=args.over_arch,
            id_list_features_keys=unweighted,
            dense_device=torch.device("cpu"),
        )
        outputs = ["default"]
    elif args.kind == "dlrm_dcn":
        module = DcnPredictModule(ebc, args.num_dense, unweighted, args.dense_arch, args.over_arch,
                                  args.dcn_layers, args.dcn_rank)
        outputs = ["default"]
    else:
        weighted_ebc = EmbeddingBagCollection(tables=tables(weighted, args), is_weighted=True,
                                              device=torch.device("cpu"))
        model = TwoTowerTasks(ebc, weighted_ebc, args.num_dense, args.embedding_dim, len(unweighted) + len(weighted))
        module = MultiTaskPredictModule(model, unweighted, weighted)
        outputs = ["click", "conversion"]
    module.eval()

    requests = golden_requests(args, unweighted, weighted)
    log(f"packaging a TorchRec-signature {args.kind} model ({len(unweighted)} + {len(weighted)} weighted "
        f"features x {args.num_rows:,} rows x {args.embedding_dim})")
    quantized, scripted = package(module, batch_of(requests[1], len(unweighted)))
    scripted.save(str(out / "model.pt"))

    config = {
        "dense_features": args.num_dense,
        "sparse_features": [{"name": n, "num_rows": (args.rows[i] if i < len(args.rows) else args.num_rows),
                             "weighted": n in weighted} for i, n in enumerate(unweighted + weighted)],
        "outputs": outputs,
    }
    (out / "model.json").write_text(json.dumps(config, indent=2) + "\n")

    log("computing golden scores with the saved TorchScript file")
    loaded = torch.jit.load(str(out / "model.pt"))
    golden = []
    with torch.inference_mode():
        for request in requests:
            predictions = loaded(batch_of(request, len(unweighted)))
            golden.append({
                "batch_size": request["batch_size"],
                "dense": request["dense"].reshape(-1).tolist(),
                "lengths": request["lengths"].reshape(-1).tolist(),
                "ids": request["ids"].tolist(),
                "weights": request["weights"].tolist(),
                "outputs": {name: predictions[name].reshape(-1).tolist() for name in outputs},
            })
    goldens = {"golden.json": {"config": config, "requests": golden}}
    write_json_files(out, goldens)
    if args.shape == "mlperf-dlrm-v2":
        write_loadgen_golden(out, loaded, args, len(unweighted))
    if args.split:
        write_split(out / "split", quantized, args, unweighted, weighted, outputs, requests, golden)
        write_json_files(out / "split", goldens)
        if args.int8:
            write_int8(out / "split", quantized, args, unweighted, requests)
        if args.shape == "mlperf-dlrm-v2":
            shutil.copyfile(out / "loadgen_golden.npz", out / "split" / "loadgen_golden.npz")
        log("extracting a split model from model.pt alone (models/extract_split.py)")
        extract(out, out / "extracted", pt2=args.pt2)
    mlperf = args.shape == "mlperf-dlrm-v2"
    write_manifest(out, EXPORT_FORMAT, {"kind": args.kind, "seed": args.seed, "shape": args.shape,
                                        "int8": args.int8, **({"max_rows": args.max_rows} if mlperf else {})},
                   ["model.pt", "model.json", "golden.json"] + (["loadgen_golden.npz"] if mlperf else []) + (["split/", "extracted/"] if args.split else []),
                   started, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
