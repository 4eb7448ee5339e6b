#!/usr/bin/env python3
"""Exports a TorchRec DLRM for Narsil.

Builds `torchrec.models.dlrm.DLRM` with seeded random weights, quantizes its
embedding tables to row-wise INT8 (TorchRec's inference quantization, FBGEMM
table-batched embeddings), scripts it and writes, into --out:

  model_default.pt          TorchScript, INT8 tables, FP32 dense/over arch
  model_fp32.pt             TorchScript, the same weights before quantization
  weights_fp32.safetensors  the FP32 weights by name (see models/README.md)
  golden.json               fixed random requests and their scores computed here
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
import time
from pathlib import Path
from typing import List

import torch
from torch import nn

import fbgemm_gpu  # noqa: F401  (registers FBGEMM's operators)
from torchrec.fx import symbolic_trace as torchrec_symbolic_trace
from torchrec.inference.modules import quantize_embeddings
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from split_model import DenseNetwork, DlrmPredictor, write_split


# Raised when the exported interface or forward changes: scripts/lib.sh
# re-exports models written by an older format.
EXPORT_FORMAT = 8


def log(msg: str) -> None:
    print(f"[export_dlrm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def int_list(text: str) -> List[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text}") from e
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"need positive integers: {text}")
    return values


class WithSchema(nn.Module):
    """Adds `narsil_schema()` to a scripted predictor."""

    def __init__(self, predictor: torch.jit.ScriptModule, schema_json: str) -> None:
        super().__init__()
        self.predictor = predictor
        self.schema_json = schema_json

    def forward(self, dense: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.predictor(dense, lengths, ids)

    @torch.jit.export
    def narsil_schema(self) -> str:
        return self.schema_json


def build_dlrm(args: argparse.Namespace) -> DLRM:
    bound = args.embedding_init
    tables = [
        EmbeddingBagConfig(
            name=f"t_cat_{i}",
            embedding_dim=args.embedding_dim,
            num_embeddings=args.num_rows,
            feature_names=[f"cat_{i}"],
            pooling=PoolingType.SUM,
            init_fn=lambda w: nn.init.uniform_(w, -bound, bound),
        )
        for i in range(args.num_sparse)
    ]
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
        multi_hot = i % 2 == 1
        dense = torch.randn(batch_size, args.num_dense, generator=g) * 2.0
        if multi_hot:
            lengths = torch.randint(0, 5, (batch_size, args.num_sparse), generator=g, dtype=torch.int32)
        else:
            lengths = torch.ones(batch_size, args.num_sparse, dtype=torch.int32)
        ids = torch.randint(0, args.num_rows, (int(lengths.sum()),), generator=g, dtype=torch.int64)
        requests.append({"batch_size": batch_size, "dense": dense, "lengths": lengths, "ids": ids})
    return requests


def key_major(request: dict) -> tuple:
    """Sample-major request -> the model's (dense, lengths, ids), key-major."""
    lengths = request["lengths"]  # [B, T]
    batch_size, num_sparse = lengths.shape
    bags = torch.split(request["ids"], lengths.reshape(-1).tolist())  # sample-major bags
    ordered = [bags[b * num_sparse + f] for f in range(num_sparse) for b in range(batch_size)]
    ids = torch.cat(ordered) if ordered else torch.empty(0, dtype=torch.int64)
    return request["dense"], lengths.t().contiguous().reshape(-1), ids


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "generated" / "default")
    p.add_argument("--name", default="dlrm", help="model name reported by ModelInfo")
    p.add_argument("--version", default="1")
    p.add_argument("--num-dense", type=int, default=13)
    p.add_argument("--num-sparse", type=int, default=26)
    p.add_argument("--num-rows", type=int, default=100_000, help="rows per embedding table")
    p.add_argument("--embedding-dim", type=int, default=64)
    p.add_argument("--dense-arch", type=int_list, default=[512, 256, 64])
    p.add_argument("--over-arch", type=int_list, default=[512, 512, 256, 1])
    p.add_argument("--embedding-init", type=float, default=0.1,
                   help="embedding weights are uniform in [-x, x]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--golden-seed", type=int, default=None,
                   help="seed of the golden requests (default: --seed); the same one gives two models the same inputs")
    p.add_argument("--golden-batch-sizes", type=int_list, default=[1, 100, 7, 100, 16, 3, 64, 100])
    p.add_argument("--force", action="store_true", help="overwrite an existing export")
    p.add_argument("--split", action="store_true",
                   help="also write the split form (INT8 tables apart from the dense network) into OUT/split")
    p.add_argument("--no-pt2", dest="pt2", action="store_false",
                   help="with --split, do not compile the dense network into dense.pt2 (AOTInductor; compiling "
                        "needs a C++ compiler and about a minute)")
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
    out: Path = args.out
    split_missing = (args.split and not (out / "split" / "schema.json").exists()) or (
        args.split_fp32 and not (out / "split_fp32" / "schema.json").exists())
    if (out / "manifest.json").exists() and not args.force and not split_missing:
        log(f"{out} already holds an export; pass --force to overwrite")
        if args.publish:
            publish(out, args.publish, args.name, args.version, args.split)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    started = time.time()
    log(f"building DLRM: {args.num_sparse} tables x {args.num_rows:,} rows x {args.embedding_dim}, "
        f"dense {args.num_dense}->{args.dense_arch}, over {args.over_arch}")
    dlrm = build_dlrm(args)
    keys = [f"cat_{i}" for i in range(args.num_sparse)]
    over_in = args.embedding_dim + (args.num_sparse + 1) * args.num_sparse // 2
    mlp_macs = sum(i * o for i, o in zip([args.num_dense] + args.dense_arch, args.dense_arch))
    mlp_macs += sum(i * o for i, o in zip([over_in] + args.over_arch, args.over_arch))
    schema = json.dumps({
        "name": args.name,
        "version": args.version,
        "num_dense": args.num_dense,
        "sparse": [{"name": k, "num_rows": args.num_rows} for k in keys],
        "mlp_flops_per_sample": 2 * mlp_macs,
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

    if args.split:
        log("writing the split model (tables apart from the dense network)")
        write_split(out / "split", dlrm, quantized, keys, args.name, args.version, args.num_dense,
                    golden_requests(args), key_major, log, dense_weights, pt2=args.pt2)
    if args.split_fp32:
        log("writing the split model with FP32 tables")
        write_split(out / "split_fp32", dlrm, quantized, keys, args.name, args.version, args.num_dense,
                    golden_requests(args), key_major, log, dense_weights, storage="fp32", pt2=False)

    manifest = {
        "export_format": EXPORT_FORMAT, "name": args.name, "version": args.version, "seed": args.seed,
        "num_dense": args.num_dense, "num_sparse": args.num_sparse, "num_rows": args.num_rows,
        "embedding_dim": args.embedding_dim, "dense_arch": args.dense_arch, "over_arch": args.over_arch,
        "torch": torch.__version__,
        "files": ["model_default.pt", "model_fp32.pt", "weights_fp32.safetensors", "golden.json"]
        + (["split/"] if args.split else []) + (["split_fp32/"] if args.split_fp32 else []),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"wrote {out} in {time.time() - started:.1f} s")
    if args.publish:
        publish(out, args.publish, args.name, args.version, args.split)
    return 0


def link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


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
