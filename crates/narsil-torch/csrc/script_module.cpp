// Narsil's TorchScript module: load, choose the dense precision, freeze, run.
//
// tch has no binding for torch::jit::freeze or for editing a graph, so the
// module lives here and Rust holds an opaque pointer to it. Tensors cross as
// tch does it: an `at::Tensor*` each way (tch's `C_tensor`).
//
// Errors: every function that can fail takes `char** error`; on failure it
// stores a malloc'd message there (the caller frees it; null if even that
// allocation failed) and returns null (or -1). No exception leaves an
// `extern "C"` function: unwinding into Rust is undefined behaviour, so each
// runs its body in shim_errors.h's `guarded` (or catches the same way where
// it must clean up first: `std::exception`'s message, then anything else),
// and each is `noexcept` besides, so that a throw we missed ends the process
// (std::terminate) instead.
#include <torch/csrc/jit/ir/constants.h>
#include <torch/csrc/jit/runtime/graph_iterator.h>
#include <torch/script.h>

#include "shim_errors.h"

#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <string>
#include <vector>

namespace {

using narsil_shim::copy_string;
using narsil_shim::guarded;
using narsil_shim::set_error;
using narsil_shim::set_unknown_error;

// fbgemm_gpu's SparseType::BF16.
constexpr int64_t kSparseTypeBf16 = 5;

// TorchRec's traced INT8 embedding lookups carry their output dtype as a
// constant argument (FP32 when exported). In bf16 the pooled embeddings are
// asked for in bf16 directly: FBGEMM dequantizes each row straight into bf16,
// which halves the output written and removes a cast of the whole block.
int pooled_embeddings_in_bf16(std::shared_ptr<torch::jit::Graph> graph) {
  int rewritten = 0;
  torch::jit::DepthFirstGraphNodeIterator nodes(graph);
  while (auto* node = nodes.next()) {
    if (std::strcmp(node->kind().toQualString(), "fbgemm::int_nbit_split_embedding_codegen_lookup_function") != 0) {
      continue;
    }
    auto index = node->schema().argumentIndexWithName("output_dtype");
    if (!index) continue;
    torch::jit::WithInsertPoint guard(node);
    node->replaceInput(*index, graph->insertConstant(kSparseTypeBf16));
    ++rewritten;
  }
  return rewritten;
}

// Casts floating-point parameters and buffers to bf16 and leaves the others
// (INT8 tables, offsets, ids) alone. `Module::to(dtype)` would cast every
// tensor, integer buffers included.
void floating_point_to_bf16(torch::jit::Module& module) {
  auto cast = [](const at::Tensor& tensor) {
    if (tensor.is_floating_point()) tensor.set_data(tensor.to(c10::kBFloat16));
  };
  for (const auto& parameter : module.named_parameters(/*recurse=*/true)) cast(parameter.value);
  for (const auto& buffer : module.named_buffers(/*recurse=*/true)) cast(buffer.value);
}

// In bf16 a layer's input arrives in whatever precision its producer had:
// FP32 for the float features a TorchRec-packaged model passes straight to
// its dense arch (`mat1 and mat2 must have the same dtype`), bf16 after a
// bf16 layer. Every linear layer (and matmul) whose weight is a bf16
// constant of the frozen graph gets its input cast to bf16 (a no-op when it
// is bf16 already); models that cast their inputs themselves are unchanged.
int layer_inputs_to_bf16(std::shared_ptr<torch::jit::Graph> graph) {
  std::vector<torch::jit::Node*> layers;
  torch::jit::DepthFirstGraphNodeIterator nodes(graph);
  while (auto* node = nodes.next()) {
    if (node->kind() != c10::aten::linear && node->kind() != c10::aten::matmul) continue;
    const auto weight = torch::jit::toIValue(node->input(1));
    if (weight && weight->isTensor() && weight->toTensor().scalar_type() == c10::kBFloat16) {
      layers.push_back(node);
    }
  }
  for (auto* layer : layers) {
    torch::jit::WithInsertPoint guard(layer);
    auto* cast = graph->insert(c10::aten::to, {layer->input(0), c10::kBFloat16});
    layer->replaceInput(0, cast);
  }
  return static_cast<int>(layers.size());
}

// TorchRec's managed-collision modules (`MCHManagedCollisionModule`) that
// remap raw ids to rows inside the model, by their buffer
// `<path>.<table>._mch_sorted_raw_ids`: their table names, one a line (empty
// when there are none). Read before freezing, which folds buffers away.
std::string managed_collision_tables(const torch::jit::Module& module) {
  static const std::string kSuffix = "._mch_sorted_raw_ids";
  std::string tables;
  for (const auto& buffer : module.named_buffers(/*recurse=*/true)) {
    const auto& name = buffer.name;
    if (name.size() <= kSuffix.size() || name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) != 0) {
      continue;
    }
    const auto path = name.substr(0, name.size() - kSuffix.size());
    const auto dot = path.rfind('.');
    tables += (dot == std::string::npos ? path : path.substr(dot + 1)) + "\n";
  }
  return tables;
}

}  // namespace

struct NarsilScriptModule {
  torch::jit::Module module;
};

extern "C" {

// Loads `path` onto the CPU (`cuda_index` < 0) or CUDA device `cuda_index`.
// `*schema_json` receives the result of the module's `narsil_schema()`
// method, or null when it has none. With `bf16`, floating-point parameters
// are cast to bf16 and the module is frozen (weights and attributes become
// constants, so the graph optimizer can fold them); then INT8 embedding
// lookups return bf16 (`*bf16_lookups` counts them) and linear layers cast
// their inputs to bf16. In FP32 the module is frozen as it is.
// `*dict_signature` is set to 1 when forward takes one `Dict[str, Tensor]`
// (TorchRec's inference signature), 0 otherwise. `*managed_collision`
// receives the tables of TorchRec's managed-collision modules the module
// holds, one a line, or null when it holds none.
NarsilScriptModule* narsil_script_module_load(const char* path, int cuda_index, int bf16, char** schema_json,
                                              int* bf16_lookups, int* dict_signature, char** managed_collision,
                                              char** error) noexcept {
  *schema_json = nullptr;
  *bf16_lookups = 0;
  *dict_signature = 0;
  *managed_collision = nullptr;
  // On failure, no string is left behind.
  auto no_strings = [&]() noexcept {
    std::free(*schema_json);
    *schema_json = nullptr;
    std::free(*managed_collision);
    *managed_collision = nullptr;
  };
  try {
    const auto device = cuda_index < 0 ? c10::Device(c10::kCPU) : c10::Device(c10::kCUDA, cuda_index);
    auto module = torch::jit::load(path, device);
    module.eval();
    const auto& arguments = module.get_method("forward").function().getSchema().arguments();
    *dict_signature = arguments.size() == 2 && arguments[1].type()->kind() == c10::TypeKind::DictType;
    if (module.find_method("narsil_schema")) {
      const auto schema = module.run_method("narsil_schema");
      if (schema.isString()) {
        *schema_json = copy_string(schema.toStringRef().c_str());
        if (!*schema_json) throw std::bad_alloc();
      }
    }
    const auto tables = managed_collision_tables(module);
    if (!tables.empty()) {
      *managed_collision = copy_string(tables.c_str());
      if (!*managed_collision) throw std::bad_alloc();
    }
    if (bf16) floating_point_to_bf16(module);
    auto frozen = torch::jit::freeze(module);
    if (bf16) {
      const auto graph = frozen.get_method("forward").graph();
      *bf16_lookups = pooled_embeddings_in_bf16(graph);
      layer_inputs_to_bf16(graph);
    }
    return new NarsilScriptModule{std::move(frozen)};
  } catch (const std::exception& e) {
    no_strings();
    set_error(error, e);
    return nullptr;
  } catch (...) {
    no_strings();
    set_unknown_error(error);
    return nullptr;
  }
}

// forward(dense, lengths, ids) -> a new tensor (tch takes ownership).
at::Tensor* narsil_script_module_forward(NarsilScriptModule* m, const at::Tensor* dense, const at::Tensor* lengths,
                                         const at::Tensor* ids, char** error) noexcept {
  return guarded(error, static_cast<at::Tensor*>(nullptr), [&] {
    std::vector<c10::IValue> inputs{*dense, *lengths, *ids};
    auto output = m->module.forward(std::move(inputs));
    if (!output.isTensor()) {
      throw std::runtime_error("the model's forward returned " + output.tagKind() + ", not a tensor");
    }
    return new at::Tensor(std::move(output).toTensor());
  });
}

// forward(inputs[0], ..., inputs[num_inputs - 1]) -> a new tensor (the
// caller takes ownership): a split model's dense network, forward(dense, pooled).
at::Tensor* narsil_script_module_forward_tensors(NarsilScriptModule* m, int num_inputs,
                                                 const at::Tensor* const* inputs, char** error) noexcept {
  return guarded(error, static_cast<at::Tensor*>(nullptr), [&] {
    std::vector<c10::IValue> values;
    values.reserve(num_inputs);
    for (int i = 0; i < num_inputs; ++i) values.emplace_back(*inputs[i]);
    auto output = m->module.forward(std::move(values));
    if (!output.isTensor()) {
      throw std::runtime_error("the model's forward returned " + output.tagKind() + ", not a tensor");
    }
    return new at::Tensor(std::move(output).toTensor());
  });
}

// forward(batch: Dict[str, Tensor]) -> Dict[str, Tensor]: the batch holds
// `inputs[i]` under `names[i]`; `outputs[o]` (null on entry) receives a new
// tensor (the caller takes ownership) for the result's `output_names[o]`.
// Returns 0, or -1 with `*error` set and every output null.
int narsil_script_module_forward_dict(NarsilScriptModule* m, int num_inputs, const char* const* names,
                                      const at::Tensor* const* inputs, int num_outputs,
                                      const char* const* output_names, at::Tensor** outputs,
                                      char** error) noexcept {
  // On failure, no output is left behind (an allocation may fail midway).
  auto no_outputs = [&]() noexcept {
    for (int o = 0; o < num_outputs; ++o) {
      delete outputs[o];
      outputs[o] = nullptr;
    }
  };
  try {
    c10::Dict<std::string, at::Tensor> batch;
    for (int i = 0; i < num_inputs; ++i) batch.insert(names[i], *inputs[i]);
    auto result = m->module.forward({c10::IValue(batch)});
    if (!result.isGenericDict()) {
      throw std::runtime_error("the model's forward returned " + result.tagKind() + ", not Dict[str, Tensor]");
    }
    auto dict = result.toGenericDict();
    for (int o = 0; o < num_outputs; ++o) {
      auto found = dict.find(c10::IValue(std::string(output_names[o])));
      if (found == dict.end() || !found->value().isTensor()) {
        std::string returned;
        for (const auto& entry : dict) {
          if (!returned.empty()) returned += ", ";
          returned += entry.key().isString() ? entry.key().toStringRef() : entry.key().tagKind();
        }
        throw std::runtime_error("the model returned no tensor named `" + std::string(output_names[o]) +
                                 "` (it returned: " + returned + ")");
      }
    }
    for (int o = 0; o < num_outputs; ++o) {
      outputs[o] = new at::Tensor(dict.at(c10::IValue(std::string(output_names[o]))).toTensor());
    }
    return 0;
  } catch (const std::exception& e) {
    no_outputs();
    set_error(error, e);
    return -1;
  } catch (...) {
    no_outputs();
    set_unknown_error(error);
    return -1;
  }
}

// Frees a module from narsil_script_module_load. Destructors do not throw
// (they are implicitly noexcept: a throw would end the process, not unwind).
void narsil_script_module_free(NarsilScriptModule* m) noexcept { delete m; }

}  // extern "C"
