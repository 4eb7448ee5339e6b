// Narsil's CUDA shim: what tch lacks for serving on a GPU — per-lane streams
// (a compute stream and a copy stream), events between them, and CUDA graphs
// (at::cuda::CUDAGraph) captured on the stream that replays them.
//
// Built as its own shared library (libnarsil_cuda_shim.so) by build.rs, only
// when the libtorch it builds against has CUDA headers, and opened with
// dlopen only when a model is served on CUDA: the narsil binary itself links
// no CUDA library and starts on machines without one.
//
// It calls only c10/ATen (no CUDA runtime function directly): c10::Event and
// c10::Stream go through libtorch's device guard, CUDAGraph lives in
// libtorch_cuda.
//
// Errors follow csrc/shim_errors.h: every function that can fail takes
// `char** error`, runs its body in `guarded` (a throw becomes a malloc'd
// message there and null or -1 is returned); no exception leaves an
// extern "C" function.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/Event.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "shim_errors.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using narsil_shim::guarded;

}  // namespace

// A lane's two streams.
struct NarsilLaneStreams {
  c10::cuda::CUDAStream compute;
  c10::cuda::CUDAStream copy;
};

struct NarsilEvent {
  c10::Event event{c10::DeviceType::CUDA};
};

// The dense network's forward over the graph's static inputs, run by the
// caller (Rust): returns a new heap at::Tensor (ownership passes here), or
// null with `*error` set (malloc'd).
typedef at::Tensor* (*narsil_forward_fn)(void* context, char** error);

struct NarsilGraph {
  at::cuda::CUDAGraph graph;
  c10::cuda::CUDAStream stream;
  at::Tensor output;
  explicit NarsilGraph(c10::cuda::CUDAStream s) : stream(s) {}
};

extern "C" {

// The shim's interface version (the Rust side checks it).
int narsil_cuda_shim_abi() noexcept { return 2; }

// CUDA devices libtorch sees (0 without a driver).
int narsil_cuda_device_count() noexcept {
  try {
    return static_cast<int>(c10::cuda::device_count());
  } catch (...) {
    return 0;
  }
}

// Two streams from libtorch's pool for one lane on `device`.
NarsilLaneStreams* narsil_cuda_streams_new(int device, char** error) noexcept {
  return guarded(error, static_cast<NarsilLaneStreams*>(nullptr), [&] {
    auto index = static_cast<c10::DeviceIndex>(device);
    return new NarsilLaneStreams{c10::cuda::getStreamFromPool(false, index),
                                 c10::cuda::getStreamFromPool(false, index)};
  });
}

void narsil_cuda_streams_free(NarsilLaneStreams* s) noexcept { delete s; }

static c10::cuda::CUDAStream which_stream(NarsilLaneStreams* s, int which) {
  return which == 0 ? s->compute : s->copy;
}

// Makes stream `which` (0 compute, 1 copy) the calling thread's current
// stream on its device: every libtorch op this thread issues then runs there.
int narsil_cuda_use_stream(NarsilLaneStreams* s, int which, char** error) noexcept {
  return guarded(error, -1, [&] {
    c10::cuda::setCurrentCUDAStream(which_stream(s, which));
    return 0;
  });
}

// Waits (on the host) until stream `which` has run everything issued to it.
int narsil_cuda_stream_synchronize(NarsilLaneStreams* s, int which, char** error) noexcept {
  return guarded(error, -1, [&] {
    c10::Stream(which_stream(s, which)).synchronize();
    return 0;
  });
}

NarsilEvent* narsil_cuda_event_new(char** error) noexcept {
  return guarded(error, static_cast<NarsilEvent*>(nullptr), [] { return new NarsilEvent(); });
}

void narsil_cuda_event_free(NarsilEvent* e) noexcept { delete e; }

// Records `e` on stream `which`: it completes once the stream has run what
// was issued to it so far.
int narsil_cuda_event_record(NarsilEvent* e, NarsilLaneStreams* s, int which, char** error) noexcept {
  return guarded(error, -1, [&] {
    e->event.record(c10::Stream(which_stream(s, which)));
    return 0;
  });
}

// Makes stream `which` wait (on the device, the host goes on) for `e`.
int narsil_cuda_event_block(NarsilEvent* e, NarsilLaneStreams* s, int which, char** error) noexcept {
  return guarded(error, -1, [&] {
    e->event.block(c10::Stream(which_stream(s, which)));
    return 0;
  });
}

// Waits on the host for `e` (a never-recorded event is complete).
int narsil_cuda_event_synchronize(NarsilEvent* e, char** error) noexcept {
  return guarded(error, -1, [&] {
    e->event.synchronize();
    return 0;
  });
}

// Captures `forward(context)` as a CUDA graph on the lane's compute stream,
// the stream that will replay it (graphs captured on one stream and replayed
// on others share its cuBLAS workspace: seen to corrupt memory). `warmups`
// eager forwards first (lazy initialisation: cuBLAS handles, the allocator,
// TorchScript's profiling runs must not happen inside the capture). The
// capture is thread-local, so other lanes' threads may use the device
// meanwhile. The graph allocates from the memory pool of `share` (a graph
// of the same lane, captured before on the same stream: a lane's graphs
// run one at a time, so they may share their intermediates' memory), or
// from a new pool when `share` is null.
NarsilGraph* narsil_cuda_graph_capture(NarsilLaneStreams* s, narsil_forward_fn forward, void* context,
                                       int warmups, NarsilGraph* share, char** error) noexcept {
  return guarded(error, static_cast<NarsilGraph*>(nullptr), [&] {
    c10::cuda::CUDAStreamGuard guard(s->compute);
    auto run = [&]() {
      char* message = nullptr;
      at::Tensor* out = forward(context, &message);
      if (!out) {
        std::string text = message ? message : "the forward failed";
        std::free(message);
        throw std::runtime_error(text);
      }
      at::Tensor result = *out;
      delete out;
      return result;
    };
    for (int i = 0; i < warmups; ++i) run();
    c10::Stream(s->compute).synchronize();
    auto g = std::make_unique<NarsilGraph>(s->compute);
    auto pool = share ? share->graph.pool() : decltype(share->graph.pool()){0, 0};
    g->graph.capture_begin(pool, cudaStreamCaptureModeThreadLocal);
    try {
      g->output = run();
    } catch (...) {
      try {
        g->graph.capture_end();
      } catch (...) {
      }
      throw;
    }
    g->graph.capture_end();
    c10::Stream(s->compute).synchronize();
    return g.release();
  });
}

// The graph's output tensor (a new handle; the caller owns it): rewritten by
// each replay.
at::Tensor* narsil_cuda_graph_output(NarsilGraph* g, char** error) noexcept {
  return guarded(error, static_cast<at::Tensor*>(nullptr), [&] { return new at::Tensor(g->output); });
}

// Replays the graph on the stream it was captured on (asynchronously).
int narsil_cuda_graph_replay(NarsilGraph* g, char** error) noexcept {
  return guarded(error, -1, [&] {
    c10::cuda::CUDAStreamGuard guard(g->stream);
    g->graph.replay();
    return 0;
  });
}

void narsil_cuda_graph_free(NarsilGraph* g) noexcept {
  try {
    delete g;
  } catch (...) {
  }
}

}  // extern "C"
