"""A stock tritonclient (gRPC) over TLS against Narsil's KServe v2 service:
live, ready and metadata, then the golden requests (raw contents) scored as
Python's FP32 model did; a plaintext client is refused. Run by
tests/protocols_tls_e2e.rs against `narsil serve --tls-cert` with the small
model's Burn weights:
python kserve_tritonclient_tls.py HOST:PORT CA_PEM GOLDEN_JSON [CERT_PEM KEY_PEM]
(the client certificate for a server with --tls-client-ca). Prints `ok N`
after N golden requests matched within 1e-5."""

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

TOLERANCE = 1e-5
url, ca, golden_path = sys.argv[1:4]
cert, key = (sys.argv[4], sys.argv[5]) if len(sys.argv) > 5 else (None, None)
client = grpcclient.InferenceServerClient(
    url=url, ssl=True, root_certificates=ca, certificate_chain=cert, private_key=key)
assert client.is_server_live()
assert client.is_server_ready()
assert client.is_model_ready("dlrm")
assert client.get_model_metadata("dlrm").name == "dlrm"

with open(golden_path) as f:
    requests = json.load(f)["requests"]
for i, g in enumerate(requests):
    b = g["batch_size"]
    tensors = []
    for name, array, datatype in (
            ("dense", np.asarray(g["dense"], dtype=np.float32).reshape(b, -1), "FP32"),
            ("lengths", np.asarray(g["lengths"], dtype=np.int64).reshape(b, -1), "INT64"),
            ("ids", np.asarray(g["ids"], dtype=np.int64), "INT64")):
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    result = client.infer("dlrm", tensors, outputs=[grpcclient.InferRequestedOutput("default")])
    scores = result.as_numpy("default")
    want = np.asarray(g["scores_fp32"], dtype=np.float32)
    assert scores.shape == want.shape, (i, scores.shape, want.shape)
    diff = float(np.max(np.abs(scores - want)))
    assert diff <= TOLERANCE, (i, diff)

try:
    grpcclient.InferenceServerClient(url=url).is_server_live()
    raise SystemExit("a plaintext client was served")
except InferenceServerException:
    pass
print(f"ok {len(requests)}")
