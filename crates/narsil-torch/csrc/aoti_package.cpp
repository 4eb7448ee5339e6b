// A dense network compiled ahead of time by AOTInductor (a `.pt2` package
// from torch.export), loaded with libtorch's AOTIModelPackageLoader and run
// on tensors Rust owns. Same conventions as script_module.cpp: an opaque
// pointer each way, tch's `at::Tensor*` for tensors.
//
// Errors: every function that can fail takes `char** error`; on failure it
// stores a malloc'd message there (the caller frees it; null if even that
// allocation failed) and returns null (or -1). No exception leaves an
// `extern "C"` function: unwinding into Rust is undefined behaviour, so each
// runs its body in shim_errors.h's `guarded` (or catches the same way where
// it must clean up first: `std::exception`'s message, then anything else),
// and each is `noexcept` besides, so that a throw we missed ends the process
// (std::terminate) instead.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include "shim_errors.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using narsil_shim::guarded;
using narsil_shim::set_error;
using narsil_shim::set_unknown_error;

}  // namespace

struct NarsilAotiPackage {
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
};

extern "C" {

// The package's metadata entry `key` (its compile options and what the
// exporter recorded), without loading its kernels: `*value` is null when
// the package has no such entry. Returns 0, or -1 with `*error` set and
// `*value` null.
int narsil_aoti_package_metadata(const char* path, const char* key, char** value, char** error) noexcept {
  *value = nullptr;
  try {
    const auto metadata = torch::inductor::AOTIModelPackageLoader::load_metadata_from_package(path, "model");
    const auto found = metadata.find(key);
    if (found != metadata.end()) {
      *value = narsil_shim::copy_string(found->second.c_str());
      if (!*value) throw std::bad_alloc();
    }
    return 0;
  } catch (const std::exception& e) {
    std::free(*value);
    *value = nullptr;
    set_error(error, e);
    return -1;
  } catch (...) {
    std::free(*value);
    *value = nullptr;
    set_unknown_error(error);
    return -1;
  }
}

// Loads the package at `path` for the CPU with `runners` model instances
// (forwards that may run at once; a forward waits for a free one).
NarsilAotiPackage* narsil_aoti_package_load(const char* path, int runners, char** error) noexcept {
  return guarded(error, static_cast<NarsilAotiPackage*>(nullptr), [&] {
    auto loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
        path, "model", /*run_single_threaded=*/false, static_cast<size_t>(runners), /*device_index=*/-1);
    return new NarsilAotiPackage{std::move(loader)};
  });
}

// Runs the package on `inputs` and returns its first output as a new tensor
// (the caller takes ownership).
at::Tensor* narsil_aoti_package_run(NarsilAotiPackage* package, int num_inputs, const at::Tensor* const* inputs,
                                    char** error) noexcept {
  return guarded(error, static_cast<at::Tensor*>(nullptr), [&] {
    std::vector<at::Tensor> values;
    values.reserve(num_inputs);
    for (int i = 0; i < num_inputs; ++i) values.push_back(*inputs[i]);
    auto outputs = package->loader->run(values);
    if (outputs.empty()) throw std::runtime_error("the package returned no output");
    return new at::Tensor(std::move(outputs[0]));
  });
}

// Frees a package from narsil_aoti_package_load. Destructors do not throw
// (they are implicitly noexcept: a throw would end the process, not unwind).
void narsil_aoti_package_free(NarsilAotiPackage* package) noexcept { delete package; }

}  // extern "C"
