"""Reading a generative-recommenders (GR) `DlrmHSTU` checkpoint as GR's
`save_dmp_checkpoint` writes it (dlrm_v3/checkpoint.py), with torch's own
readers (GR is not imported): the dense weights from `non_sparse.ckpt`'s
`dense_dict`, each embedding table from the torch.distributed.checkpoint
under `sparse/`, written into a split model's `tables/` as FP32 or FBGEMM's
row-wise INT8 (models/import_gr.py)."""

import hashlib
import re
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from export_common import logger

log = logger("import_gr")

# FBGEMM's INT8 row: fp16 scale and bias, then the values, padded to this.
ROW_ALIGNMENT = 16
TABLE_KEY = re.compile(r"(?:^|\.)embeddings\.([^.]+)\.weight$")


def checkpoint_dir(path: Path) -> Path:
    """`path` itself when it holds `non_sparse.ckpt`, else its numbered
    subfolder of the highest batch index that does."""
    if (path / "non_sparse.ckpt").is_file():
        return path
    batches = [p for p in path.iterdir() if p.is_dir() and p.name.isdigit() and (p / "non_sparse.ckpt").is_file()] \
        if path.is_dir() else []
    if not batches:
        raise SystemExit(f"{path}: no non_sparse.ckpt here nor in a numbered subfolder (GR's save_dmp_checkpoint "
                         "writes PATH/<batch>/non_sparse.ckpt and PATH/<batch>/sparse/)")
    return max(batches, key=lambda p: int(p.name))


def read_dense(path: Path) -> Dict[str, torch.Tensor]:
    """`non_sparse.ckpt`'s `dense_dict` (tensors only). It also holds the
    optimizer's and metrics' states, which a weights-only load may refuse:
    then it is read in full (it is the user's own checkpoint)."""
    file = path / "non_sparse.ckpt"
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # metric states of classes the weights-only unpickler does not know
        log(f"{file}: a weights-only load refused it ({type(e).__name__}); reading it in full")
        saved = torch.load(file, map_location="cpu", weights_only=False)
    if "dense_dict" not in saved:
        raise SystemExit(f"{file} has no dense_dict (keys: {sorted(saved)}): not GR's save_dmp_checkpoint output")
    return {k: (v.data if isinstance(v, torch.nn.Parameter) else v) for k, v in saved["dense_dict"].items()
            if isinstance(v, torch.Tensor)}


def sparse_tables(path: Path) -> Dict[str, Tuple[str, list, torch.dtype]]:
    """The tables in `sparse/`'s metadata: table name -> (checkpoint key,
    size, dtype)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path / "sparse")).read_metadata()
    tables = {}
    for key, meta in metadata.state_dict_metadata.items():
        found = TABLE_KEY.search(key)
        if found and isinstance(meta, TensorStorageMetadata):
            tables[found.group(1)] = (key, list(meta.size), meta.properties.dtype)
    return tables


def read_table(path: Path, key: str, size: list, dtype: torch.dtype) -> torch.Tensor:
    """One table of `sparse/`, loaded alone with torch.distributed.checkpoint
    (no process group)."""
    import torch.distributed.checkpoint as dcp

    state = {key: torch.empty(size, dtype=dtype)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path / "sparse")), no_dist=True)
    return state[key]


def int8_rows(table: torch.Tensor) -> torch.Tensor:
    """FBGEMM's row-wise INT8 rows as Narsil stores them (`[rows,
    row_bytes]` uint8: fp16 scale, fp16 bias, the values, padding), from
    FBGEMM's own quantizer (what TorchRec's inference quantization calls)."""
    import fbgemm_gpu  # noqa: F401  (registers FBGEMM's operators)

    fused = torch.ops.fbgemm.FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf(table.float().contiguous(), 8)
    dim = table.shape[1]
    row_bytes = (dim + 4 + ROW_ALIGNMENT - 1) // ROW_ALIGNMENT * ROW_ALIGNMENT
    rows = torch.zeros(table.shape[0], row_bytes, dtype=torch.uint8)
    rows[:, :4] = fused[:, dim:dim + 4]
    rows[:, 4:4 + dim] = fused[:, :dim]
    return rows


def write_tables(out: Path, path: Path, tables: List[dict], int8: bool) -> List[dict]:
    """Every table of `sparse/` into `out/tables/`, one at a time; their
    schema entries."""
    found = sparse_tables(path)
    described = []
    for table in tables:
        name = table["name"]
        if name not in found:
            raise SystemExit(f"table {name} is not in {path / 'sparse'} (found: {sorted(found)})")
        key, size, dtype = found[name]
        if size != [table["num_embeddings"], table["embedding_dim"]]:
            raise SystemExit(f"table {name}: {size} in the checkpoint, hparams say "
                             f"[{table['num_embeddings']}, {table['embedding_dim']}]")
        weights = read_table(path, key, size, dtype)
        if int8:
            rows, storage = int8_rows(weights), "int8_rowwise"
        else:
            rows, storage = weights.float().contiguous().view(torch.uint8), "fp32"
        data = rows.numpy().tobytes()
        file = f"tables/{name}.bin"
        (out / file).write_bytes(data)
        described.append({"name": name, "rows": size[0], "dim": size[1], "storage": storage,
                          "row_bytes": rows.shape[1], "file": file, "sha256": hashlib.sha256(data).hexdigest()})
        log(f"table {name}: {size[0]:,} x {size[1]} {str(dtype).replace('torch.', '')} -> {storage}")
    return described
