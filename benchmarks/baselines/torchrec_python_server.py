#!/usr/bin/env python3
"""A TorchRec model served the way most teams serve one today: a Python gRPC
server (grpcio, thread pool) speaking TorchRec's inference protocol
(`predictor.Predictor/Predict`, proto/predictor/predictor.proto), one
TorchScript forward per request, no batching.

The model is the same TorchScript file Narsil serves (models/export_dlrm.py:
`forward(dense f32[B,D], lengths i32[T*B], ids i64[N]) -> f32[B]`), run under
torch.inference_mode with --intra-op-threads threads. Reports SERVING on
grpc.health.v1 once the model is loaded and warmed up.

Run it with the project venv: .venv/bin/python benchmarks/baselines/torchrec_python_server.py --model M
"""

import argparse
import os
import subprocess
import sys
import time
from concurrent import futures

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GENERATED = os.path.join(HERE, "_generated")


def generated_stubs():
    """predictor_pb2 / predictor_pb2_grpc, generated once with grpcio-tools."""
    proto_dir = os.path.join(ROOT, "proto", "predictor")
    proto = os.path.join(proto_dir, "predictor.proto")
    stub = os.path.join(GENERATED, "predictor_pb2_grpc.py")
    if not os.path.exists(stub) or os.path.getmtime(stub) < os.path.getmtime(proto):
        os.makedirs(GENERATED, exist_ok=True)
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{proto_dir}", f"--python_out={GENERATED}",
                        f"--grpc_python_out={GENERATED}", proto], check=True)
    sys.path.insert(0, GENERATED)
    import predictor_pb2  # noqa: E402
    import predictor_pb2_grpc  # noqa: E402
    return predictor_pb2, predictor_pb2_grpc


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="TorchScript file (model_default.pt)")
    p.add_argument("--addr", default="127.0.0.1:50061")
    p.add_argument("--intra-op-threads", type=int, default=1)
    p.add_argument("--workers", type=int, default=16, help="gRPC thread-pool size (requests in progress)")
    args = p.parse_args()

    import grpc
    import numpy as np
    import torch
    import fbgemm_gpu  # noqa: F401  (FBGEMM operators for the INT8 tables)
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    pb, pb_grpc = generated_stubs()
    torch.set_num_threads(args.intra_op_threads)
    model = torch.jit.load(args.model)
    model.eval()
    schema = __import__("json").loads(model.narsil_schema())
    num_dense, num_sparse = schema["num_dense"], len(schema["sparse"])

    def forward(dense, lengths, ids):
        with torch.inference_mode():
            return model(dense, lengths, ids)

    for rows in (1, 100, 1600):  # the profiling executor's first calls are slow
        for _ in range(3):
            forward(torch.zeros(rows, num_dense), torch.ones(rows * num_sparse, dtype=torch.int32),
                    torch.zeros(rows * num_sparse, dtype=torch.int64))

    class Predictor(pb_grpc.PredictorServicer):
        def Predict(self, request, context):
            floats = np.frombuffer(request.float_features.values, dtype="<f4")
            batch = len(floats) // num_dense
            dense = torch.from_numpy(floats.copy()).reshape(batch, num_dense)
            lengths = torch.from_numpy(np.frombuffer(request.id_list_features.lengths, dtype="<i4").copy())
            ids = torch.from_numpy(np.frombuffer(request.id_list_features.values, dtype="<i4").astype(np.int64))
            if lengths.numel() != batch * num_sparse or int(lengths.sum()) != ids.numel():
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lengths do not match the batch")
            scores = forward(dense, lengths, ids)
            response = pb.PredictionResponse()
            response.predictions["default"].data.extend(scores.tolist())
            return response

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=args.workers),
                         options=[("grpc.max_receive_message_length", 64 << 20)])
    pb_grpc.add_PredictorServicer_to_server(Predictor(), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(args.addr)
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"python baseline serving {args.model} on {args.addr}", file=sys.stderr, flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        pass
    server.stop(grace=5)
    time.sleep(0)


if __name__ == "__main__":
    sys.exit(main())
