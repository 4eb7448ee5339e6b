"""What every exporter (models/export_*.py) shares, so that none imports
another: the flags they all take (`--out`, `--name`/`--version`, `--seed`,
`--force`), the `--force` guard that keeps an export already there, the
manifest writer (`manifest.json`, whose `export_format` scripts/lib.sh
reads), the log line, the comma-separated integer lists of layer sizes,
`narsil_schema()` on a scripted predictor, an embedding table's config
with uniform weights, and a sample-major request laid out key-major.
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

# Where the exporters write by default: models/generated/NAME.
GENERATED = Path(__file__).resolve().parent / "generated"


def logger(tool: str) -> Callable[[str], None]:
    """A log function for `tool`: `[tool HH:MM:SS] message` on stderr."""

    def log(msg: str) -> None:
        print(f"[{tool} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    return log


def int_list(text: str) -> List[int]:
    """`--flag 512,256,64`: positive integers, comma-separated."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text}") from e
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"need positive integers: {text}")
    return values


def parser(doc: str, out: Optional[str], name: Optional[str] = None) -> argparse.ArgumentParser:
    """The exporter's flags parser with the flags every exporter takes:
    `--out` (default models/generated/OUT; required when `out` is None),
    `--name` (default `name`) and `--version` when `name` is given, `--seed`
    and `--force`."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if out is None:
        p.add_argument("--out", type=Path, required=True)
    else:
        p.add_argument("--out", type=Path, default=GENERATED / out)
    if name is not None:
        p.add_argument("--name", default=name, help="model name reported by ModelInfo")
        p.add_argument("--version", default="1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="overwrite an existing export")
    return p


def embedding_flags(p: argparse.ArgumentParser, dim: int, init: float) -> None:
    """`--embedding-dim` (default `dim`) and `--embedding-init` (default
    `init`), which `uniform_table` reads."""
    p.add_argument("--embedding-dim", type=int, default=dim, help="every table's dimension D")
    p.add_argument("--embedding-init", type=float, default=init, help="embedding weights uniform in [-x, x]")


def begin_export(args: argparse.Namespace, log, *needs) -> Optional[float]:
    """None (said in the log) when `args.out` holds an export already, with
    every file of `needs` the flags ask for (each relative to it, or a
    false value for one not asked for), and `--force` is not given; else
    makes `args.out`, seeds torch with `args.seed` and returns the export's
    start time."""
    out: Path = args.out
    missing = [need for need in needs if need and not (out / need).exists()]
    if (out / "manifest.json").exists() and not args.force and not missing:
        log(f"{out} already holds an export; pass --force to overwrite")
        return None
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    return time.time()


def write_manifest(out: Path, export_format: int, fields: dict, files: List[str], started: float, log,
                   checks: Optional[dict] = None) -> None:
    """`out/manifest.json`: `export_format`, then `fields`, PyTorch's
    version, `checks` if any and the `files` written; and the export's
    last log line."""
    manifest = {"export_format": export_format, **fields, "torch": torch.__version__}
    if checks is not None:
        manifest["checks"] = checks
    manifest["files"] = files
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"wrote {out} in {time.time() - started:.1f} s")


def write_json_files(directory: Path, files: dict) -> None:
    """Each of `files` (name: value) as compact JSON into `directory` (the
    golden files an export writes beside its model and into its split
    form)."""
    for name, value in files.items():
        (directory / name).write_text(json.dumps(value))


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


def uniform_table(name: str, features: List[str], rows: int, args: argparse.Namespace,
                  pooling: PoolingType = PoolingType.SUM) -> EmbeddingBagConfig:
    """A pooled table of `rows` x `args.embedding_dim` for `features`, its
    weights uniform in [-args.embedding_init, args.embedding_init]."""
    bound = args.embedding_init
    return EmbeddingBagConfig(
        name=name,
        embedding_dim=args.embedding_dim,
        num_embeddings=rows,
        feature_names=features,
        pooling=pooling,
        init_fn=lambda w: nn.init.uniform_(w, -bound, bound),
    )


def key_major(request: dict) -> tuple:
    """Sample-major request -> the model's (dense, lengths, ids), key-major."""
    lengths = request["lengths"]  # [B, T]
    batch_size, num_sparse = lengths.shape
    bags = torch.split(request["ids"], lengths.reshape(-1).tolist())  # sample-major bags
    ordered = [bags[b * num_sparse + f] for f in range(num_sparse) for b in range(batch_size)]
    ids = torch.cat(ordered) if ordered else torch.empty(0, dtype=torch.int64)
    return request["dense"], lengths.t().contiguous().reshape(-1), ids
