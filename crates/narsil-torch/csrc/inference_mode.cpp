// Puts the calling thread in c10::InferenceMode for the rest of its life.
// tch has no binding for it; lanes call this once on their own thread.
#include <c10/core/InferenceMode.h>

extern "C" void narsil_enter_inference_mode() {
  // The guard restores the previous mode when destroyed: it is never
  // destroyed, so the mode lasts until the thread exits.
  new c10::InferenceMode(true);
}
