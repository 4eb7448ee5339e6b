"""A stock tritonclient (gRPC) against Narsil's KServe v2 service: health,
metadata, the golden requests sent as raw contents through the client's own
API and as typed contents through its generated stub, and a bad input.
Run by tests/kserve_e2e.rs: python kserve_tritonclient.py HOST:PORT GOLDEN_JSON
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
assert inputs == {"dense": ("FP32", [-1, 13]), "lengths": ("INT64", [-1, 26]), "ids": ("INT64", [-1])}, inputs
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
print("ok", len(requests))
