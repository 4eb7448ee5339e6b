// A dense network compiled ahead of time by AOTInductor (a `.pt2` package
// from torch.export), loaded with libtorch's AOTIModelPackageLoader and run
// on tensors Rust owns. Same conventions as script_module.cpp: an opaque
// pointer each way, tch's `at::Tensor*` for tensors, errors as a malloc'd
// message in `*error` (the caller frees it), and no exception of any kind
// crosses into Rust.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

namespace {

char* copy_text(const std::string& text) {
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  std::memcpy(out, text.c_str(), text.size() + 1);
  return out;
}

void set_error(char** error, const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) {
    *error = copy_text(c10_error->what_without_backtrace());
  } else {
    *error = copy_text(e.what());
  }
}

}  // namespace

struct NarsilAotiPackage {
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> loader;
};

extern "C" {

// The package's metadata entry `key` (its compile options and what the
// exporter recorded), without loading its kernels: `*value` is null when
// the package has no such entry. Returns 0, or -1 with `*error` set.
int narsil_aoti_package_metadata(const char* path, const char* key, char** value, char** error) {
  *value = nullptr;
  try {
    const auto metadata = torch::inductor::AOTIModelPackageLoader::load_metadata_from_package(path, "model");
    const auto found = metadata.find(key);
    if (found != metadata.end()) *value = copy_text(found->second);
    return 0;
  } catch (const std::exception& e) {
    set_error(error, e);
  } catch (...) {
    *error = copy_text("an unknown C++ exception reading the package's metadata");
  }
  return -1;
}

// Loads the package at `path` for the CPU with `runners` model instances
// (forwards that may run at once; a forward waits for a free one).
NarsilAotiPackage* narsil_aoti_package_load(const char* path, int runners, char** error) {
  try {
    auto loader = std::make_unique<torch::inductor::AOTIModelPackageLoader>(
        path, "model", /*run_single_threaded=*/false, static_cast<size_t>(runners), /*device_index=*/-1);
    return new NarsilAotiPackage{std::move(loader)};
  } catch (const std::exception& e) {
    set_error(error, e);
  } catch (...) {
    *error = copy_text("an unknown C++ exception loading the package");
  }
  return nullptr;
}

// Runs the package on `inputs` and returns its first output as a new tensor
// (the caller takes ownership).
at::Tensor* narsil_aoti_package_run(NarsilAotiPackage* package, int num_inputs, const at::Tensor* const* inputs,
                                    char** error) {
  try {
    std::vector<at::Tensor> values;
    values.reserve(num_inputs);
    for (int i = 0; i < num_inputs; ++i) values.push_back(*inputs[i]);
    auto outputs = package->loader->run(values);
    if (outputs.empty()) throw std::runtime_error("the package returned no output");
    return new at::Tensor(std::move(outputs[0]));
  } catch (const std::exception& e) {
    set_error(error, e);
  } catch (...) {
    *error = copy_text("an unknown C++ exception in the package's forward");
  }
  return nullptr;
}

void narsil_aoti_package_free(NarsilAotiPackage* package) { delete package; }

}  // extern "C"
