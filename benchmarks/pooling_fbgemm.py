#!/usr/bin/env python3
"""FBGEMM's INT8 row-wise lookup on one thread, in the shape of Narsil's
pooling bench (`cargo bench -p narsil-embedding --bench pooling`): one table
of 100,000 rows x 64 values (80-byte rows), 1,600 bags of 1 id, or of 0-7
ids (~3.5), uniform random ids, sum pooling, FP32 output. Prints ids pooled
per second, to set beside the criterion bench's `thrpt`.

  .venv/bin/python benchmarks/pooling_fbgemm.py
"""

import time

import torch
import fbgemm_gpu  # noqa: F401
from fbgemm_gpu.split_embedding_configs import SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_inference import IntNBitTableBatchedEmbeddingBagsCodegen

ROWS, DIM, BAGS = 100_000, 64, 1600


def main():
    torch.set_num_threads(1)
    torch.manual_seed(7)
    tbe = IntNBitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[("t", ROWS, DIM, SparseType.INT8, EmbeddingLocation.HOST)],
        pooling_mode=PoolingMode.SUM, device="cpu", output_dtype=SparseType.FP32)
    tbe.fill_random_weights()
    for ids_per_bag in (1, 4):
        if ids_per_bag == 1:
            lengths = torch.ones(BAGS, dtype=torch.int64)
        else:
            lengths = torch.randint(0, 8, (BAGS,), dtype=torch.int64)
        ids = torch.randint(0, ROWS, (int(lengths.sum()),), dtype=torch.int32)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).int()
        with torch.inference_mode():
            for _ in range(200):
                tbe(ids, offsets)
            runs, started = 0, time.perf_counter()
            while time.perf_counter() - started < 3.0:
                tbe(ids, offsets)
                runs += 1
            elapsed = (time.perf_counter() - started) / runs
        print(f"fbgemm ids_per_bag {ids_per_bag}: {elapsed * 1e6:.1f} us per call, "
              f"{len(ids) / elapsed / 1e6:.1f} M ids/s")


if __name__ == "__main__":
    main()
