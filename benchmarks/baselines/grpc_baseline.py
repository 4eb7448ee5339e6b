"""What the Python baseline servers of benchmarks/baselines/ share: a
proto's Python and gRPC modules, generated once with grpcio-tools into
`_generated/`, and a thread-pool gRPC server that reports SERVING on
grpc.health.v1 and runs until stopped."""

import importlib
import os
import subprocess
import sys
from concurrent import futures

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GENERATED = os.path.join(HERE, "_generated")


def generated_stubs(package: str, name: str):
    """`(name_pb2, name_pb2_grpc)` of proto/PACKAGE/NAME.proto, generated
    when missing or older than the proto."""
    proto_dir = os.path.join(ROOT, "proto", package)
    proto = os.path.join(proto_dir, f"{name}.proto")
    stub = os.path.join(GENERATED, f"{name}_pb2_grpc.py")
    if not os.path.exists(stub) or os.path.getmtime(stub) < os.path.getmtime(proto):
        os.makedirs(GENERATED, exist_ok=True)
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{proto_dir}", f"--python_out={GENERATED}",
                        f"--grpc_python_out={GENERATED}", proto], check=True)
    if GENERATED not in sys.path:
        sys.path.insert(0, GENERATED)
    return importlib.import_module(f"{name}_pb2"), importlib.import_module(f"{name}_pb2_grpc")


def serve(add_servicer, servicer, addr: str, workers: int, banner: str) -> None:
    """Serves `servicer` (added by `add_servicer`) on `addr` with `workers`
    threads, SERVING on grpc.health.v1 from the start, until interrupted."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                         options=[("grpc.max_receive_message_length", 64 << 20)])
    add_servicer(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(addr)
    server.start()
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(banner, file=sys.stderr, flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        pass
    server.stop(grace=5)
