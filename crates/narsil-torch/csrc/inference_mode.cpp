// Puts the calling thread in c10::InferenceMode for the rest of its life.
// tch has no binding for it; lanes call this once on their own thread.
//
// No exception may unwind into Rust (undefined behaviour): only the
// allocation can throw, and then the thread stays in its normal mode, which
// computes the same results with autograd's bookkeeping. There is no error
// to return, so a failure is reported on stderr.
#include <c10/core/InferenceMode.h>

#include <cstdio>
#include <exception>

extern "C" void narsil_enter_inference_mode() noexcept {
  try {
    // The guard restores the previous mode when destroyed: it is never
    // destroyed, so the mode lasts until the thread exits.
    new c10::InferenceMode(true);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "narsil: cannot enter libtorch's inference mode on this thread: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "narsil: cannot enter libtorch's inference mode on this thread: unknown exception\n");
  }
}
