// Errors at the shims' `extern "C"` edge, one way for every shim
// (script_module.cpp, aoti_package.cpp, cuda_shim.cpp): a failure is a
// malloc'd message in `*error` that the Rust caller frees, or null where
// even that allocation failed (the caller then says so itself); nothing
// here throws, and no exception of any kind crosses into Rust.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>

namespace narsil_shim {

// A malloc'd copy of `text` (the caller frees it), or null if malloc fails.
inline char* copy_string(const char* text) noexcept {
  const size_t size = std::strlen(text) + 1;
  char* out = static_cast<char*>(std::malloc(size));
  if (out) std::memcpy(out, text, size);
  return out;
}

// `e`'s message (a c10::Error's without its backtrace) into `*error`.
inline void set_error(char** error, const std::exception& e) noexcept {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    *error = copy_string(c10_error->what_without_backtrace());
  } else {
    *error = copy_string(e.what());
  }
}

// For a throw of something that is not a std::exception.
inline void set_unknown_error(char** error) noexcept {
  *error = copy_string("libtorch threw an exception that is not a std::exception");
}

// Every shim function's edge: runs `body` and returns what it returns; a
// throw becomes the message in `*error` and `failed` is returned instead.
// `body` runs inside the try, so nothing it throws reaches the caller.
template <typename Result, typename Body>
Result guarded(char** error, Result failed, Body&& body) noexcept {
  try {
    return body();
  } catch (const std::exception& e) {
    set_error(error, e);
  } catch (...) {
    set_unknown_error(error);
  }
  return failed;
}

}  // namespace narsil_shim
