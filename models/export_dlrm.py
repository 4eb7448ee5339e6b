#!/usr/bin/env python3
"""Exports a TorchRec DLRM for Narsil.

Builds `torchrec.models.dlrm.DLRM` with seeded random weights, quantizes its
embedding tables to row-wise INT8 (TorchRec's inference quantization, FBGEMM
table-batched embeddings), scripts it and writes, into --out:

  model_default.pt          TorchScript, INT8 tables, FP32 dense/over arch
  model_fp32.pt             TorchScript, the same weights before quantization
  weights_fp32.safetensors  the FP32 weights by name (see models/README.md)
  golden.json               fixed random requests and their scores computed here
  golden_ranking.json       fixed ranking requests (a user and its candidates) and the scores
                            TorchRec's eager DLRM gives the user tiled onto each candidate
  split/                    (--split) the split model; with --int8 also dense_int8.pt2 (INT8 GEMMs)
                            and int8_quality.json (its scores against FP32)
  manifest.json             the shape, seed and files written

With --publish REPOSITORY it also publishes the INT8 model into a model
repository (`narsil serve --model-repository`) as
REPOSITORY/<--name>/<--version>/model.pt (with --split: the split model, its
schema.json, tables/ and dense.pt, the tables hard-linked where the file
system allows), written under a dot-name and renamed into place.

Both TorchScript files take, in TorchRec's key-major KeyedJaggedTensor layout,
  forward(dense: f32[B, D], lengths: i32[T*B], ids: i64[N]) -> f32[B]
(probabilities: the DLRM logit through a sigmoid), and describe their inputs
through an exported method `narsil_schema() -> str` (JSON).
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import List

import torch
from torch import nn

import fbgemm_gpu  # noqa: F401  (registers FBGEMM's operators)
from torchrec.fx import symbolic_trace as torchrec_symbolic_trace
from torchrec.inference.modules import quantize_embeddings
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import int8_package
from dense_packages import cpu_flags, cpu_has_bf16
from int8_package import add_to_schema
from export_common import (WithSchema, begin_export, embedding_flags, int_list, key_major, logger, parser,
                           uniform_table, write_manifest)
from model_files import link_or_copy
from split_model import DenseNetwork, DlrmPredictor, dense_flops_per_sample, write_split


# Raised when the exported interface or forward changes: scripts/lib.sh
# re-exports models written by an older format.
EXPORT_FORMAT = 13


log = logger("export_dlrm")


def build_dlrm(args: argparse.Namespace) -> DLRM:
    tables = [uniform_table(f"t_cat_{i}", [f"cat_{i}"], args.num_rows, args) for i in range(args.num_sparse)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=args.num_dense,
        dense_arch_layer_sizes=args.dense_arch,
        over_arch_layer_sizes=args.over_arch,
    ).eval()


def fp32_weights(dlrm: DLRM, args: argparse.Namespace) -> dict:
    """The FP32 weights under the names documented in models/README.md."""
    out = {}
    state = dlrm.state_dict()
    for i in range(args.num_sparse):
        out[f"embedding.cat_{i}"] = state[f"sparse_arch.embedding_bag_collection.embedding_bags.t_cat_{i}.weight"]
    dense_linears = [m for m in dlrm.dense_arch.modules() if isinstance(m, nn.Linear)]
    over_linears = [m for m in dlrm.over_arch.modules() if isinstance(m, nn.Linear)]
    assert len(dense_linears) == len(args.dense_arch), "dense arch layer count"
    assert len(over_linears) == len(args.over_arch), "over arch layer count"
    for prefix, linears in (("dense", dense_linears), ("over", over_linears)):
        for i, lin in enumerate(linears):
            out[f"{prefix}.{i}.weight"] = lin.weight.detach()
            out[f"{prefix}.{i}.bias"] = lin.bias.detach()
    return {k: v.contiguous().clone() for k, v in out.items()}


def golden_requests(args: argparse.Namespace) -> List[dict]:
    """Fixed random requests, sample-major as on Narsil's wire: one-hot,
    multi-hot (0 to 4 ids per bag, empty bags included) and B = 1."""
    seed = args.seed if args.golden_seed is None else args.golden_seed
    g = torch.Generator().manual_seed(seed + 1)
    requests = []
    for i, batch_size in enumerate(args.golden_batch_sizes):
        requests.append(random_request(args, g, batch_size, multi_hot=i % 2 == 1))
    return requests


def random_request(args: argparse.Namespace, g: torch.Generator, rows: int, multi_hot: bool) -> dict:
    """One request of `rows` samples drawn from `g`: dense features N(0,
    2^2), one id per bag or (`multi_hot`) 0-4, uniform ids."""
    dense = torch.randn(rows, args.num_dense, generator=g) * 2.0
    if multi_hot:
        lengths = torch.randint(0, 5, (rows, args.num_sparse), generator=g, dtype=torch.int32)
    else:
        lengths = torch.ones(rows, args.num_sparse, dtype=torch.int32)
    ids = torch.randint(0, args.num_rows, (int(lengths.sum()),), generator=g, dtype=torch.int64)
    return {"batch_size": rows, "dense": dense, "lengths": lengths, "ids": ids}


def golden_ranking_requests(args: argparse.Namespace, request_level: List[str]) -> List[dict]:
    """Fixed random ranking requests: one user (the request-level features:
    dense features N(0, 2^2) when `dense` is among them, 0 to 20 ids per
    request-level bag) and 1 to 130 candidates (0 to 4 ids per candidate
    bag), each with the user tiled onto every candidate row here, as the
    flat sample-major request the same call would have been."""
    seed = args.seed if args.golden_seed is None else args.golden_seed
    g = torch.Generator().manual_seed(seed + 2)
    keys = [f"cat_{i}" for i in range(args.num_sparse)]
    user_features = [f for f, k in enumerate(keys) if k in request_level]
    dense_per_user = "dense" in request_level
    requests = []
    for candidates in (1, 3, 40, 130):
        user_dense = torch.randn(args.num_dense, generator=g) * 2.0
        user_lengths = torch.randint(0, 21, (len(user_features),), generator=g, dtype=torch.int32)
        user_ids = torch.randint(0, args.num_rows, (int(user_lengths.sum()),), generator=g, dtype=torch.int64)
        user_bags = dict(zip(user_features, torch.split(user_ids, user_lengths.tolist())))
        flat = random_request(args, g, candidates, multi_hot=True)
        own_bags = torch.split(flat["ids"], flat["lengths"].reshape(-1).tolist())
        lengths, ids, candidate_lengths, candidate_ids = [], [], [], []
        for row in range(candidates):
            for f in range(args.num_sparse):
                bag = user_bags.get(f)
                if bag is None:
                    bag = own_bags[row * args.num_sparse + f]
                    candidate_lengths.append(len(bag))
                    candidate_ids.append(bag)
                lengths.append(len(bag))
                ids.append(bag)
        dense = user_dense.repeat(candidates, 1) if dense_per_user else flat["dense"]
        requests.append({
            "user": {"dense": user_dense.tolist() if dense_per_user else [], "lengths": user_lengths.tolist(),
                     "ids": user_ids.tolist()},
            "candidates": candidates,
            "dense": [] if dense_per_user else flat["dense"].reshape(-1).tolist(),
            "lengths": candidate_lengths,
            "ids": torch.cat(candidate_ids).tolist() if candidate_ids else [],
            "tiled": {"batch_size": candidates, "dense": dense,
                      "lengths": torch.tensor(lengths, dtype=torch.int32).reshape(candidates, args.num_sparse),
                      "ids": torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64)},
        })
    return requests


def check_against_torchrec(dlrm: DLRM, quantized: nn.Module, keys: List[str], args: argparse.Namespace) -> None:
    """The predictor must compute what `DLRM.forward` computes: the golden
    requests through both, FP32 and INT8, within 1e-6."""
    with torch.inference_mode():
        for model in (dlrm, quantized):
            predictor = DlrmPredictor(model, keys)
            for request in golden_requests(args):
                dense, lengths, ids = key_major(request)
                sparse = KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths)
                expected = torch.sigmoid(model(dense, sparse)).reshape(-1)
                diff = (predictor(dense, lengths, ids) - expected).abs().max().item()
                if diff > 1e-6:
                    raise SystemExit(f"export check failed: predictor differs from DLRM.forward by {diff}")


def script(dlrm: nn.Module, keys: List[str], schema_json: str) -> torch.jit.ScriptModule:
    """TorchRec's inference export: FX-trace with TorchRec's tracer (which
    keeps KeyedJaggedTensor and FBGEMM calls as leaves), then script."""
    traced = torchrec_symbolic_trace(DlrmPredictor(dlrm, keys))
    return torch.jit.script(WithSchema(torch.jit.script(traced), schema_json))


# --- INT8 dense arithmetic (--int8; the package: models/int8_package.py) ------

class Int8DenseNetwork(nn.Module):
    """The split model's DenseNetwork as the INT8 package computes it: the
    same layers and interaction, the interaction's batched dot products in
    `interaction_dtype` (bf16 where the CPU has bf16 instructions: an FP32
    `bmm` of 27 x 64 x 27 per sample took about as long as all the INT8
    GEMMs together on a Zen 4 core; INT8 quantization leaves it alone, as
    the dot products of raw embeddings are where a per-tensor scale would
    lose most)."""

    def __init__(self, network: nn.Module, interaction_dtype: torch.dtype) -> None:
        super().__init__()
        self.dense_arch = network.dense_arch
        self.over_arch = network.over_arch
        self.num_vectors = network.num_vectors
        self.dim = network.dim
        self.register_buffer("upper_triangle", network.upper_triangle.clone())
        self.interaction_dtype = interaction_dtype

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        dense_embedding = self.dense_arch(dense)
        batch = dense_embedding.shape[0]
        vectors = torch.cat([dense_embedding, pooled], dim=1).view(batch, self.num_vectors, self.dim)
        vectors = vectors.to(self.interaction_dtype)
        products = torch.bmm(vectors, vectors.transpose(1, 2)).view(batch, -1)
        interactions = torch.index_select(products, 1, self.upper_triangle).float()
        logits = self.over_arch(torch.cat([dense_embedding, interactions], dim=1))
        return torch.sigmoid(logits).reshape(-1)


def sampled_requests(args: argparse.Namespace, seed: int, samples: int, batch_size: int = 100) -> List[dict]:
    """Random requests of the golden requests' distribution (dense features
    N(0, 2^2), one-hot and 0-4 ids per bag alternately, uniform ids) from
    their own seed: traffic for calibration and for the quality contract,
    never the golden requests themselves."""
    g = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(0, samples, batch_size):
        requests.append(random_request(args, g, min(batch_size, samples - i), multi_hot=(i // batch_size) % 2 == 1))
    return requests


def pooled_inputs(quantized: nn.Module, keys: List[str], requests: List[dict]) -> List[tuple]:
    """(dense, pooled) per request, pooled by FBGEMM from the model's own
    INT8 tables: what the split model's dense network receives."""
    embeddings = quantized.sparse_arch.embedding_bag_collection
    inputs = []
    with torch.inference_mode():
        for request in requests:
            dense, lengths, ids = key_major(request)
            pooled = embeddings(KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths)).values()
            inputs.append((dense.clone(), pooled.clone()))
    return inputs


def write_int8_package(split_dir: Path, dlrm: DLRM, quantized: nn.Module, keys: List[str],
                       args: argparse.Namespace) -> dict:
    """Writes `split_dir/dense_int8.pt2` and `int8_quality.json`
    (int8_package.py) for the DLRM: its GEMMs in INT8, the interaction's dot
    products in bf16 where the CPU has bf16 instructions, calibrated on
    sampled requests pooled from the model's own INT8 tables. Returns the
    schema fields to add."""
    bf16_interaction = cpu_has_bf16()
    interaction_dtype = torch.bfloat16 if bf16_interaction else torch.float32
    fp32_network = DenseNetwork(dlrm, len(keys)).eval()
    network = Int8DenseNetwork(fp32_network, interaction_dtype).eval()
    example = (torch.randn(8, args.num_dense), torch.rand(8, len(keys) * args.embedding_dim))
    interaction = str(interaction_dtype).replace("torch.", "")
    return int8_package.write_int8_package(
        split_dir, fp32_network, network, example,
        calibration=pooled_inputs(quantized, keys, sampled_requests(args, args.seed + 1_000,
                                                                    int8_package.INT8_CALIBRATION_SAMPLES)),
        golden=pooled_inputs(quantized, keys, golden_requests(args)),
        sampled=pooled_inputs(quantized, keys, sampled_requests(args, args.seed + 2_000, int8_package.INT8_SAMPLED)),
        seed=args.seed + 3_000, log=log,
        described={
            "distribution": "requests of 100 samples, dense N(0, 2^2), one-hot or 0-4 ids per bag "
                            f"(alternately), uniform ids, seed {args.seed + 2_000}",
            "calibration": f"sampled requests pooled from the model's INT8 tables (not the golden requests), "
                           f"seed {args.seed + 1_000}",
            "quantization": "torchao PT2E, X86InductorQuantizer default static config: INT8 weights per channel, "
                            "uint8 activations per tensor; the interaction's dot products unquantized",
            "interaction": interaction,
        },
        extra_cpu_flags=["avx512_bf16"] if bf16_interaction and "avx512_bf16" in cpu_flags() else [],
        metadata={"narsil_interaction": interaction})


def main() -> int:
    p = parser(__doc__, "default", name="dlrm")
    p.add_argument("--num-dense", type=int, default=13)
    p.add_argument("--num-sparse", type=int, default=26)
    p.add_argument("--num-rows", type=int, default=100_000, help="rows per embedding table")
    embedding_flags(p, 64, 0.1)
    p.add_argument("--dense-arch", type=int_list, default=[512, 256, 64])
    p.add_argument("--over-arch", type=int_list, default=[512, 512, 256, 1])
    p.add_argument("--golden-seed", type=int, default=None,
                   help="seed of the golden requests (default: --seed); the same one gives two models the same inputs")
    p.add_argument("--golden-batch-sizes", type=int_list, default=[1, 100, 7, 100, 16, 3, 64, 100])
    p.add_argument("--request-level", default=None,
                   help="comma-separated features that are the same for every candidate of a ranking request "
                        "(`dense` for the dense features; `none` for none), declared in the schemas so requests "
                        "may send them once (default: the first half of the sparse features and the dense "
                        "features, e.g. cat_0..cat_12 and dense for the default DLRM)")
    p.add_argument("--split", action="store_true",
                   help="also write the split form (INT8 tables apart from the dense network) into OUT/split")
    p.add_argument("--no-pt2", dest="pt2", action="store_false",
                   help="with --split, do not compile the dense network into dense.pt2 (AOTInductor; compiling "
                        "needs a C++ compiler and about a minute)")
    p.add_argument("--int8", action="store_true",
                   help="with --split, also compile dense_int8.pt2: the dense network with INT8 GEMMs (PT2E static "
                        "quantization calibrated on sampled traffic, AOTInductor's x86 path with freezing), for "
                        "narsil serve --dense-precision int8, and write its quality against FP32 into "
                        "int8_quality.json; needs torchao and an x86 CPU with AVX2 (activations in 7 bits there, 8 with "
                        "AVX512-VNNI, AVX-VNNI or AMX-INT8)")
    p.add_argument("--split-fp32", action="store_true",
                   help="also write the split form with the FP32 tables (before quantization) into OUT/split_fp32")
    p.add_argument("--publish", type=Path, metavar="REPOSITORY",
                   help="also publish the INT8 model into this model repository (narsil serve "
                        "--model-repository) as REPOSITORY/<--name>/<--version>/model.pt, or the split "
                        "model with --split")
    args = p.parse_args()
    if args.publish and not args.version.isdigit():
        p.error(f"--publish needs a numeric --version (a repository version directory), got {args.version!r}")

    if args.dense_arch[-1] != args.embedding_dim:
        p.error(f"--dense-arch must end with --embedding-dim ({args.embedding_dim})")
    if args.over_arch[-1] != 1:
        p.error("--over-arch must end with 1 (one logit per sample)")
    if args.int8 and not (args.split and args.pt2):
        p.error("--int8 compiles a package of the split model's dense network: it needs --split (and not --no-pt2)")
    if args.int8 and not int8_package.int8_cpu_flags():
        p.error("--int8 needs an x86 CPU with AVX2 or INT8 dot-product instructions (/proc/cpuinfo flags avx2, "
                "avx512_vnni, avx_vnni or amx_int8), and this one has none: serve --dense-precision fp32")
    out: Path = args.out
    started = begin_export(args, log, args.split and "split/schema.json", args.split_fp32 and "split_fp32/schema.json",
                           args.int8 and "split/dense_int8.pt2")
    if started is None:
        if args.publish:
            publish(out, args.publish, args.name, args.version, args.split)
        return 0
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    log(f"building DLRM: {args.num_sparse} tables x {args.num_rows:,} rows x {args.embedding_dim}, "
        f"dense {args.num_dense}->{args.dense_arch}, over {args.over_arch}")
    dlrm = build_dlrm(args)
    keys = [f"cat_{i}" for i in range(args.num_sparse)]
    if args.request_level is None:
        request_level = keys[:args.num_sparse // 2] + ["dense"]
    else:
        request_level = [n for n in args.request_level.split(",") if n and n != "none"]
    unknown = [n for n in request_level if n not in keys and n != "dense"]
    if unknown:
        p.error(f"--request-level names {unknown}, not features of the model ({keys[0]}..{keys[-1]}, dense)")
    dense_flops = dense_flops_per_sample(DenseNetwork(dlrm, len(keys)).eval(), args.num_dense,
                                         len(keys) * args.embedding_dim)
    schema = json.dumps({
        "name": args.name,
        "version": args.version,
        "num_dense": args.num_dense,
        "sparse": [{"name": k, "num_rows": args.num_rows} for k in keys],
        "dense_flops_per_sample": dense_flops,
        "request_level": request_level,
    })

    log("writing FP32 weights (safetensors)")
    from safetensors.torch import save_file
    weights = fp32_weights(dlrm, args)
    dense_weights = {k: v for k, v in weights.items() if not k.startswith("embedding.")}
    save_file(weights, str(out / "weights_fp32.safetensors"), metadata={"narsil_schema": schema})

    log("scripting the FP32 model")
    fp32 = script(dlrm, keys, schema)
    fp32.save(str(out / "model_fp32.pt"))

    log("quantizing embedding tables to row-wise INT8 (FBGEMM TBE)")
    quantized = quantize_embeddings(dlrm, dtype=torch.qint8, inplace=False)
    log("scripting the INT8 model")
    int8 = script(quantized, keys, schema)
    int8.save(str(out / "model_default.pt"))

    log("checking the export against TorchRec's own DLRM forward")
    check_against_torchrec(dlrm, quantized, keys, args)

    log("computing golden scores with the saved TorchScript files")
    int8_loaded = torch.jit.load(str(out / "model_default.pt"))
    fp32_loaded = torch.jit.load(str(out / "model_fp32.pt"))
    golden = []
    with torch.inference_mode():
        for request in golden_requests(args):
            inputs = key_major(request)
            golden.append({
                "batch_size": request["batch_size"],
                "dense": request["dense"].reshape(-1).tolist(),
                "lengths": request["lengths"].reshape(-1).tolist(),
                "ids": request["ids"].tolist(),
                "scores_int8": int8_loaded(*inputs).tolist(),
                "scores_fp32": fp32_loaded(*inputs).tolist(),
            })
    (out / "golden.json").write_text(json.dumps({"schema": json.loads(schema), "requests": golden}))

    log("scoring golden ranking requests with TorchRec's eager DLRM forward (the user tiled onto each candidate)")
    ranking = []
    with torch.inference_mode():
        for request in golden_ranking_requests(args, request_level):
            dense, lengths, ids = key_major(request.pop("tiled"))
            sparse = KeyedJaggedTensor(keys=keys, values=ids, lengths=lengths)
            request["scores_int8"] = torch.sigmoid(quantized(dense, sparse)).reshape(-1).tolist()
            request["scores_fp32"] = torch.sigmoid(dlrm(dense, sparse)).reshape(-1).tolist()
            ranking.append(request)
    (out / "golden_ranking.json").write_text(json.dumps({"request_level": request_level, "requests": ranking}))

    if args.split:
        log("writing the split model (tables apart from the dense network)")
        write_split(out / "split", dlrm, quantized, keys, args.name, args.version, args.num_dense,
                    golden_requests(args), key_major, log, dense_weights, pt2=args.pt2, request_level=request_level)
        add_to_schema(out / "split", {"request_level": request_level})
        if args.int8:
            log("quantizing the dense network to INT8 (PT2E, calibrated on sampled traffic) and compiling it")
            add_to_schema(out / "split", write_int8_package(out / "split", dlrm, quantized, keys, args))
    if args.split_fp32:
        log("writing the split model with FP32 tables")
        write_split(out / "split_fp32", dlrm, quantized, keys, args.name, args.version, args.num_dense,
                    golden_requests(args), key_major, log, dense_weights, storage="fp32", pt2=False,
                    request_level=request_level)
        add_to_schema(out / "split_fp32", {"request_level": request_level})

    fields = {"name": args.name, "version": args.version, "seed": args.seed, "num_dense": args.num_dense,
              "num_sparse": args.num_sparse, "num_rows": args.num_rows, "embedding_dim": args.embedding_dim,
              "dense_arch": args.dense_arch, "over_arch": args.over_arch}
    files = ["model_default.pt", "model_fp32.pt", "weights_fp32.safetensors", "golden.json", "golden_ranking.json"] \
        + (["split/"] if args.split else []) + (["split_fp32/"] if args.split_fp32 else [])
    write_manifest(out, EXPORT_FORMAT, fields, files, started, log)
    if args.publish:
        publish(out, args.publish, args.name, args.version, args.split)
    return 0


def publish(out: Path, repository: Path, name: str, version: str, split: bool):
    """Copies the INT8 model (or its split form) into a model repository as
    `name` version `version`, the way the repository expects a version to
    appear: written under a dot-name (ignored by the server), then renamed
    into place."""
    final = repository / name / version
    if final.exists():
        log(f"{final} already exists; not published again")
        return
    staging = repository / name / f".{version}.publishing"
    shutil.rmtree(staging, ignore_errors=True)
    if split:
        staging.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(out / "split", staging, copy_function=link_or_copy)
        os.rename(staging, final)
        log(f"published the split model {final}")
        return
    staging.mkdir(parents=True)
    shutil.copy2(out / "model_default.pt", staging / "model.pt")
    os.rename(staging, final)
    log(f"published {final / 'model.pt'}")


if __name__ == "__main__":
    sys.exit(main())
