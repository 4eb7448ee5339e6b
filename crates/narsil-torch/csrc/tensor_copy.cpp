// `dst.copy_(src, non_blocking)`: tch binds copy_ without non_blocking, and
// a lane's staging copies pinned host buffers into persistent device buffers
// asynchronously (on the calling thread's current stream). Same error
// contract as script_module.cpp: noexcept, a malloc'd message on failure.
#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>

extern "C" int narsil_tensor_copy(at::Tensor* dst, const at::Tensor* src, int non_blocking, char** error) noexcept {
  auto set = [&](const char* text) noexcept {
    const size_t size = std::strlen(text) + 1;
    *error = static_cast<char*>(std::malloc(size));
    if (*error) std::memcpy(*error, text, size);
  };
  try {
    dst->copy_(*src, non_blocking != 0);
    return 0;
  } catch (const c10::Error& e) {
    set(e.what_without_backtrace());
    return -1;
  } catch (const std::exception& e) {
    set(e.what());
    return -1;
  } catch (...) {
    set("libtorch threw an exception that is not a std::exception");
    return -1;
  }
}
