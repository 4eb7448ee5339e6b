#!/usr/bin/env python3
"""A generative-recommenders (GR) DlrmHSTU checkpoint served the way GR
serves it on a CPU: a Python gRPC server (grpcio) around GR's own eager
forward (its PyTorch kernels, `is_inference`, eval, FP32 dense, FP16
tables), one request per forward, one forward at a time, speaking Narsil's
protocol (`narsil.v1.Predictor`, proto/narsil/v1/predict.proto) so that
`narsil load` and the LoadGen harness drive it exactly as they drive
Narsil.

The checkpoint is loaded through GR's inference loading path
(models/gr/make_gr_golden.py's `load_model`: `get_hstu_model`,
`load_sparse_checkpoint`, `load_nonsparse_checkpoint`), with the scaled
configs of the set that wrote it (`--set`). A request is one user: its
contexts and history (the request-level features: in the request block,
or on every row of a flat request, read from its first row) and one
candidate per row, under GR's KJT names, as Narsil's imported model
(models/import_gr.py) declares them. A GR feature the request does not
carry is sent to GR as zeros. The scores are GR's, per task (`outputs`, by
task name; `scores`: the first task's).

`--no-forward` reads each request and answers zeros at once (a load
generator's ceiling). ModelInfo answers with the bytes of `--model-info` (a serialized
`ModelInfoResponse`, as Narsil answers for the imported model; the
comparison script writes it), so a load generator builds the same
requests for both servers.

Needs GR_CHECKOUT (a generative-recommenders checkout, commit db1bf8f) and
GR's extra dependencies (gin-config, pandas, tensorboard) in the project
venv; see models/gr/README.md.

  GR_CHECKOUT=... .venv/bin/python benchmarks/baselines/gr_eager_server.py --set dlrmv3-cpu \\
      --checkpoint models/generated/gr/dlrmv3-cpu/checkpoint --model-info info.bin --addr 127.0.0.1:50062
"""

import argparse
import contextlib
import os
import sys
import threading

from grpc_baseline import ROOT, generated_stubs, serve

sys.path.insert(0, os.path.join(ROOT, "models", "gr"))


class RequestReader:
    """A narsil.v1 `PredictRequest` read back into one GR user
    (`{"uih": {feature: [ints]}, "candidates": {feature: [ints]}}`, GR's
    feature order), by the feature list of the model's ModelInfo."""

    def __init__(self, info, hc) -> None:
        self.features = [f.name for f in info.sparse_features]
        self.user_features = [f.name for f in info.sparse_features if f.request_level]
        self.row_features = [f.name for f in info.sparse_features if not f.request_level]
        self.uih_names = list(hc.hstu_uih_feature_names)
        self.candidate_names = list(hc.hstu_candidate_feature_names)
        self.contexts = set(hc.contextual_feature_to_max_length)

    def user(self, request) -> dict:
        import numpy as np

        rows, grouped = request.batch_size, request.HasField("request")
        ids = np.asarray(request.sparse_ids, dtype=np.int64)
        values, at = {}, 0
        if grouped:
            block_ids, block_at = request.request.sparse_ids, 0
            for name, length in zip(self.user_features, request.request.sparse_lengths):
                values[name] = list(block_ids[block_at:block_at + length])
                block_at += length
        row_features = self.row_features if grouped else self.features
        lengths = list(request.sparse_lengths) or [1] * (rows * len(row_features))
        per_row = {name: [] for name in row_features}
        for r in range(rows):
            for f, name in enumerate(row_features):
                length = lengths[r * len(row_features) + f]
                bag = ids[at:at + length]
                at += length
                if name in self.user_features:  # a flat request's user features: its first row's
                    if r == 0:
                        values[name] = bag.tolist()
                    continue
                per_row[name].append(int(bag[0]) if length else 0)
        values.update({k: v for k, v in per_row.items() if v})
        history = max((len(values[n]) for n in self.uih_names if n in values and n not in self.contexts), default=0)
        uih = {n: values.get(n, [0] * (1 if n in self.contexts else history)) for n in self.uih_names}
        candidates = {n: values.get(n, [0] * rows) for n in self.candidate_names}
        return {"uih": uih, "candidates": candidates}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", required=True, help="make_gr_golden.py's set that wrote the checkpoint")
    p.add_argument("--checkpoint", required=True, help="what GR's save_dmp_checkpoint wrote")
    p.add_argument("--model-info", required=True, help="a serialized narsil.v1 ModelInfoResponse")
    p.add_argument("--clamp", choices=("pytorch", "triton"), default="pytorch")
    p.add_argument("--addr", default="127.0.0.1:50062")
    p.add_argument("--intra-op-threads", type=int, default=1)
    p.add_argument("--workers", type=int, default=32, help="gRPC thread-pool size (requests waiting or running)")
    p.add_argument("--no-forward", action="store_true",
                   help="answer every request as soon as it is read, scores 0, no forward: a load generator's "
                        "own ceiling (this server's, which is lower than Narsil's)")
    args = p.parse_args()

    import grpc
    import torch

    import make_gr_golden as gr

    pb, pb_grpc = generated_stubs("narsil/v1", "predict")
    torch.set_num_threads(args.intra_op_threads)
    gr.import_gr()
    model, hc = gr.load_model(args.set, args.checkpoint, None)
    with open(args.model_info, "rb") as f:
        info = pb.ModelInfoResponse.FromString(f.read())
    reader = RequestReader(info, hc)
    tasks = [t.task_name for t in hc.multitask_configs]
    clamp = gr.triton_clamp() if args.clamp == "triton" else contextlib.nullcontext()
    one_at_a_time = threading.Lock()

    class Predictor(pb_grpc.PredictorServicer):
        def Predict(self, request, context):
            try:
                user = reader.user(request)
            except (IndexError, ValueError) as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request not readable as one GR user: {e}")
            if args.no_forward:
                rows = len(user["candidates"][reader.candidate_names[0]])
                scores = {task: [0.0] * rows for task in tasks}
            else:
                with one_at_a_time:
                    scores = gr.gr_scores(model, hc, [user])[0]
            response = pb.PredictResponse(scores=scores[tasks[0]], request_id=request.request_id,
                                          fused_rows=request.batch_size, fused_requests=1, forwards=1)
            for task in tasks:
                response.outputs[task].scores.extend(scores[task])
            return response

        def ModelInfo(self, request, context):
            return info

    with clamp:
        # Warm-up: one small request.
        warm = {"uih": {n: [0] * (1 if n in reader.contexts else 64) for n in hc.hstu_uih_feature_names},
                "candidates": {n: [0] * 8 for n in hc.hstu_candidate_feature_names}}
        gr.gr_scores(model, hc, [warm])
        serve(pb_grpc.add_PredictorServicer_to_server, Predictor(), args.addr, args.workers,
              f"GR eager server ({args.set}, clamp {args.clamp}) on {args.addr}")


if __name__ == "__main__":
    main()
