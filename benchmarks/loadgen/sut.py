"""LoadGen's system under test for a running Narsil: a query sample
library (QSL) whose samples are MLPerf-shaped queries and a SUT that
forwards each one to Narsil's Predict over gRPC.

* Requests are built when LoadGen loads samples (`load_query_samples`,
  untimed): each query's PredictRequest serialized once, sent as bytes.
* LoadGen's issue callback only hands the query samples to an asyncio loop
  (its own thread) with several gRPC channels, round robin.
* Every answer is a `QuerySampleResponse`; the answers that arrive in one
  turn of the loop go back in one `QuerySamplesComplete` call.
* `max_inflight` bounds the calls in flight (Offline issues every sample at
  once; Server is open loop, unbounded by default).
* A failed call (any gRPC status but OK) is still completed, so LoadGen does
  not wait for it, and counted: a run with failures is not VALID.
"""

import asyncio
import threading
import time

import grpc
import mlperf_loadgen as lg
import numpy as np

from queries import MODEL_INFO_METHOD, PREDICT_METHOD, Queries, predict_pb2


class NarsilSut:
    """The SUT and QSL of one LoadGen test against the server at `addr`."""

    def __init__(self, addr: str, queries: Queries, channels: int = 4, max_inflight: int = 0, model: str = "",
                 keep_scores: bool = False, timeout_s: float = 120.0):
        self.pb = predict_pb2()
        self.queries, self.model, self.keep_scores, self.timeout_s = queries, model, keep_scores, timeout_s
        self.loaded = {}  # sample index -> request bytes
        self.scores = {}  # sample index -> scores (keep_scores)
        self.failures = {}  # gRPC status name -> count
        self.completed = 0
        self.pairs_done = 0  # pairs of the completed queries
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="narsil-sut-loop", daemon=True)
        self.thread.start()
        self._run(self._open(addr, channels, max_inflight))
        self.sut = lg.ConstructSUT(self.issue_queries, self.flush_queries)
        self.qsl = lg.ConstructQSL(len(queries), len(queries), self.load_samples, self.unload_samples)

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    async def _open(self, addr: str, channels: int, max_inflight: int):
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        self.channels = [grpc.aio.insecure_channel(addr, options=options + [("grpc.channel_id", i)])
                         for i in range(channels)]
        identity = (lambda b: b)
        self.calls = [c.unary_unary(PREDICT_METHOD, request_serializer=identity,
                                    response_deserializer=self.pb.PredictResponse.FromString) for c in self.channels]
        self.next_channel = 0
        self.limit = asyncio.Semaphore(max_inflight) if max_inflight > 0 else None
        self.pending = []
        self.flush_scheduled = False

    async def model_info(self):
        call = self.channels[0].unary_unary(MODEL_INFO_METHOD, request_serializer=lambda m: m.SerializeToString(),
                                            response_deserializer=self.pb.ModelInfoResponse.FromString)
        return await call(self.pb.ModelInfoRequest(model=self.model), timeout=30)

    # --- QSL: requests built while LoadGen loads samples (untimed) ---
    def load_samples(self, indices):
        for i in indices:
            if i not in self.loaded:
                self.loaded[i] = self.queries.serialize(self.pb, i, self.model)

    def unload_samples(self, indices):
        for i in indices:
            self.loaded.pop(i, None)

    # --- SUT: the issue callback hands queries to the loop, nothing more ---
    def issue_queries(self, samples):
        work = [(s.id, s.index) for s in samples]
        self.loop.call_soon_threadsafe(self._start, work)

    def flush_queries(self):
        pass

    def _start(self, work):
        for query_id, index in work:
            self.loop.create_task(self._predict(query_id, index))

    async def _predict(self, query_id: int, index: int):
        if self.limit is not None:
            await self.limit.acquire()
        call = self.calls[self.next_channel]
        self.next_channel = (self.next_channel + 1) % len(self.calls)
        scores = None
        try:
            response = await call(self.loaded[index], timeout=self.timeout_s)
            scores = np.asarray(response.scores, dtype=np.float32)
        except grpc.aio.AioRpcError as e:
            name = e.code().name
            self.failures[name] = self.failures.get(name, 0) + 1
        finally:
            if self.limit is not None:
                self.limit.release()
        self._complete(query_id, index, scores)

    def _complete(self, query_id: int, index: int, scores):
        self.pairs_done += self.queries.pairs(index)
        if self.keep_scores and scores is not None:
            self.scores[index] = scores
            self.pending.append((lg.QuerySampleResponse(query_id, scores.ctypes.data, scores.nbytes), scores))
        else:
            self.pending.append((lg.QuerySampleResponse(query_id, 0, 0), None))
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self):
        """Every answer of this turn of the loop back to LoadGen at once."""
        batch, self.pending, self.flush_scheduled = self.pending, [], False
        lg.QuerySamplesComplete([response for response, _ in batch])
        self.completed += len(batch)

    # --- a test ---
    def run(self, settings, log_settings):
        started = time.time()
        lg.StartTestWithLogSettings(self.sut, self.qsl, settings, log_settings)
        return time.time() - started

    def close(self):
        lg.DestroyQSL(self.qsl)
        lg.DestroySUT(self.sut)

        async def shut():
            for channel in self.channels:
                await channel.close()

        self._run(shut())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
