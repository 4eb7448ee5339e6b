"""A stock tritonclient (gRPC) against Narsil's KServe v2 service: health,
metadata, the golden requests sent as raw contents through the client's own
API and as typed contents through its generated stub, a ranking request in
the grouped form (request_* inputs) scoring as the same request sent flat,
and bad inputs.
Run by tests/kserve_e2e.rs against a server whose request-level features
are cat_0..cat_12 and the dense features:
python kserve_tritonclient.py HOST:PORT GOLDEN_JSON
Prints `ok N` after N golden requests matched within 1e-6."""

import json
import sys

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

TOLERANCE = 1e-6
url, golden_path = sys.argv[1], sys.argv[2]
client = grpcclient.InferenceServerClient(url=url)
assert client.is_server_live()
assert client.is_server_ready()
assert client.is_model_ready("dlrm")
meta = client.get_model_metadata("dlrm")
inputs = {t.name: (t.datatype, list(t.shape)) for t in meta.inputs}
assert inputs == {"dense": ("FP32", [-1, 13]), "lengths": ("INT64", [-1, 26]), "ids": ("INT64", [-1]),
                  "request_dense": ("FP32", [1, 13]), "request_lengths": ("INT64", [1, 13]),
                  "request_ids": ("INT64", [1, -1])}, inputs
assert [(t.name, t.datatype, list(t.shape)) for t in meta.outputs] == [("default", "FP32", [-1])], meta.outputs

with open(golden_path) as f:
    requests = json.load(f)["requests"]


def arrays(g):
    b = g["batch_size"]
    return (np.asarray(g["dense"], dtype=np.float32).reshape(b, -1),
            np.asarray(g["lengths"], dtype=np.int64).reshape(b, -1),
            np.asarray(g["ids"], dtype=np.int64))


def check(scores, g, what):
    want = np.asarray(g["scores_int8"], dtype=np.float32)
    assert scores.shape == want.shape, (what, scores.shape, want.shape)
    diff = float(np.max(np.abs(scores - want)))
    assert diff <= TOLERANCE, (what, diff)


stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(url))
for i, g in enumerate(requests):
    dense, lengths, ids = arrays(g)
    # The client's own API: raw_input_contents.
    tensors = []
    for name, array, datatype in (("dense", dense, "FP32"), ("lengths", lengths, "INT64"), ("ids", ids, "INT64")):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    result = client.infer("dlrm", tensors, outputs=[grpcclient.InferRequestedOutput("default")], request_id=f"r{i}")
    check(result.as_numpy("default"), g, f"raw request {i}")
    assert result.get_response().id == f"r{i}"
    # Typed contents through the generated stub.
    request = service_pb2.ModelInferRequest(model_name="dlrm")
    for name, array, datatype, field in (("dense", dense, "FP32", "fp32_contents"),
                                         ("lengths", lengths, "INT64", "int64_contents"),
                                         ("ids", ids, "INT64", "int64_contents")):
        tensor = request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        getattr(tensor.contents, field).extend(array.ravel().tolist())
    response = stub.ModelInfer(request)
    check(np.frombuffer(response.raw_output_contents[0], dtype="<f4"), g, f"typed request {i}")

# A bad input: 12 dense features for a 13-feature model.
bad = grpcclient.InferInput("dense", [1, 12], "FP32")
bad.set_data_from_numpy(np.zeros((1, 12), dtype=np.float32))
ids = grpcclient.InferInput("ids", [26], "INT64")
ids.set_data_from_numpy(np.zeros(26, dtype=np.int64))
try:
    client.infer("dlrm", [bad, ids])
    raise AssertionError("a 12-feature dense input was accepted")
except InferenceServerException as e:
    assert e.status() == "StatusCode.INVALID_ARGUMENT", e.status()
    assert "inputs[dense]" in e.message() and "[1, 12]" in e.message(), e.message()

# A ranking request: one user (the dense features and cat_0..cat_12, bags of
# 1 to 20 ids, sent once) and 50 candidates (cat_13..cat_25, one id each).
# Grouped through the client's own API, B given by dense's [B, 0] (and,
# without dense, by lengths' [B, 13]), it must score as the request sent
# flat, the user repeated on every row.
CANDIDATES, ROWS = 50, 1000
rng = np.random.default_rng(52)
user_dense = rng.random((1, 13), dtype=np.float32)
user_lengths = rng.integers(1, 21, size=13).astype(np.int32)
user_ids = rng.integers(0, ROWS, size=int(user_lengths.sum())).astype(np.int64)
candidate_ids = rng.integers(0, ROWS, size=(CANDIDATES, 13)).astype(np.int64)


def infer(named):
    tensors = []
    for name, array, datatype in named:
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return client.infer("dlrm", tensors).as_numpy("default")


bags = np.split(user_ids, np.cumsum(user_lengths)[:-1])
flat_ids = np.concatenate([np.concatenate(bags + [row]) for row in candidate_ids])
flat = infer([("dense", np.repeat(user_dense, CANDIDATES, axis=0), "FP32"),
              ("lengths", np.concatenate([np.tile(user_lengths, (CANDIDATES, 1)),
                                          np.ones((CANDIDATES, 13), np.int32)], axis=1).astype(np.int64), "INT64"),
              ("ids", flat_ids, "INT64")])
assert flat.shape == (CANDIDATES,), flat.shape
request_level = [("request_dense", user_dense, "FP32"),
                 ("request_lengths", user_lengths, "INT32"),
                 ("request_ids", user_ids.reshape(1, -1), "INT64")]
candidates = [("lengths", np.ones((CANDIDATES, 13), np.int64), "INT64"), ("ids", candidate_ids.ravel(), "INT64")]
for form, named in (("dense [B, 0]", [("dense", np.zeros((CANDIDATES, 0), np.float32), "FP32")] + candidates),
                    ("B from lengths", candidates),
                    ("one id per candidate bag", [("dense", np.zeros((CANDIDATES, 0), np.float32), "FP32"),
                                                  candidates[1]])):
    grouped = infer(named + request_level)
    assert grouped.shape == flat.shape, (form, grouped.shape)
    diff = float(np.max(np.abs(grouped - flat)))
    assert diff <= TOLERANCE, (form, diff)

# Bad request-level inputs: INVALID_ARGUMENT naming them.
bad_cases = (
    ("request_dense", [("request_dense", user_dense[:, :12].copy(), "FP32")] + request_level[1:], "[1, 12]"),
    ("request_lengths", [request_level[0], ("request_lengths", user_lengths[:12].copy(), "INT32"),
                         request_level[2]], "[12]"),
    ("request_ids", request_level[:2] + [("request_ids", np.full((1, len(user_ids)), ROWS, np.int64), "INT64")],
     "outside [0, 1000)"),
    ("dense", [("dense", np.zeros((CANDIDATES, 13), np.float32), "FP32")] + request_level, "[B, 0]"),
)
for name, named, says in bad_cases:
    try:
        infer(candidates + named)
        raise AssertionError(f"a bad {name} was accepted")
    except InferenceServerException as e:
        assert e.status() == "StatusCode.INVALID_ARGUMENT", (name, e.status())
        assert f"inputs[{name}]" in e.message() and says in e.message(), (name, e.message())
print("ok", len(requests))
