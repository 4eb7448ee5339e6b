"""Narsil's request messages for the LoadGen harness: the narsil.v1 Python
messages (generated once from proto/narsil/v1/predict.proto with
grpcio-tools into benchmarks/loadgen/_generated, as the other Python gRPC
clients of benchmarks/ do), a query's PredictRequest serialized once, and
the queries themselves: DLRM-v2's MLPerf-shaped ones
(models/mlperf_traffic.py) or DLRMv3's (models/dlrmv3_traffic.py: one
user's history and candidates, a grouped request)."""

import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GENERATED = os.path.join(HERE, "_generated")
PREDICT_METHOD = "/narsil.v1.Predictor/Predict"
MODEL_INFO_METHOD = "/narsil.v1.Predictor/ModelInfo"

sys.path.insert(0, os.path.join(ROOT, "models"))
import dlrmv3_traffic  # noqa: E402
import mlperf_traffic  # noqa: E402


def predict_pb2():
    """The generated narsil.v1 message module (generated when missing or
    older than the proto)."""
    proto_dir = os.path.join(ROOT, "proto", "narsil", "v1")
    proto = os.path.join(proto_dir, "predict.proto")
    module = os.path.join(GENERATED, "predict_pb2.py")
    if not os.path.exists(module) or os.path.getmtime(module) < os.path.getmtime(proto):
        os.makedirs(GENERATED, exist_ok=True)
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{proto_dir}", f"--python_out={GENERATED}",
                        proto], check=True)
    if GENERATED not in sys.path:
        sys.path.insert(0, GENERATED)
    import predict_pb2 as pb  # noqa: E402

    return pb


def serialized(pb, dense: np.ndarray, ids: np.ndarray, model: str = "") -> bytes:
    """One query (dense f32[P, 13], ids i64[P, 214] sample-major at MLPerf's
    multi-hot sizes) as PredictRequest bytes, sent as they are."""
    pairs = len(dense)
    request = pb.PredictRequest(batch_size=pairs, model=model)
    request.dense.extend(dense.astype(np.float32).ravel())
    request.sparse_lengths.extend(np.tile(np.asarray(mlperf_traffic.MULTI_HOT_SIZES, dtype=np.uint32), pairs))
    request.sparse_ids.extend(ids.astype(np.int64).ravel())
    return request.SerializeToString()


class Queries:
    """The harness's queries: MLPerf-shaped traffic drawn for the model's
    table sizes (performance), or the golden queries of the export's
    loadgen_golden.npz with their scores (accuracy)."""

    def __init__(self, dense, ids, golden_scores=None):
        self.dense, self.ids, self.golden_scores = dense, ids, golden_scores

    @classmethod
    def drawn(cls, count: int, rows, zipf: float, seed: int) -> "Queries":
        drawn = mlperf_traffic.queries(count, rows, zipf, seed)
        return cls([d for d, _ in drawn], [i for _, i in drawn])

    @classmethod
    def golden(cls, path: str) -> "Queries":
        data = np.load(path)
        bounds = np.concatenate([[0], np.cumsum(data["pairs"])])
        cut = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        return cls([data["dense"][c] for c in cut], [data["ids"][c] for c in cut], [data["scores"][c] for c in cut])

    def __len__(self) -> int:
        return len(self.dense)

    def pairs(self, index: int) -> int:
        return len(self.dense[index])

    def serialize(self, pb, index: int, model: str) -> bytes:
        return serialized(pb, self.dense[index], self.ids[index], model)


class Dlrmv3Queries:
    """DLRMv3 queries (models/dlrmv3_traffic.py) for a served GR import:
    each one user's grouped request; its pairs are its candidates."""

    golden_scores = None

    def __init__(self, queries, features):
        self.queries, self.features = queries, features

    @classmethod
    def drawn(cls, info, count: int, history, candidates, seed: int) -> "Dlrmv3Queries":
        rows = {f.name: f.num_rows for f in info.sparse_features}
        return cls(dlrmv3_traffic.queries(count, rows, history, candidates, seed),
                   [(f.name, f.request_level) for f in info.sparse_features])

    def __len__(self) -> int:
        return len(self.queries)

    def pairs(self, index: int) -> int:
        return len(next(iter(self.queries[index]["candidates"].values())))

    def serialize(self, pb, index: int, model: str) -> bytes:
        return dlrmv3_traffic.grouped_request(pb, self.queries[index], self.features, model).SerializeToString()
