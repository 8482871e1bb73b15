// The replay of a captured forward in C++: the host side of a module call or
// of torch.ops.persistrnn.forward without Python.
//
// Measured on the H100's host (perf notes §20, §56): a call's Python (checks,
// plan and graph keys, the captured call's copies and replay) took 40-60 us,
// torch.compile's own per-call path adds ~40 us, and the device work of a
// small model is ~60-80 us, so the calls were host-bound. Here a call is a
// hash of its arguments, output allocations, and one cuGraphLaunch of a graph
// whose first and last nodes copy from the caller's inputs and into the
// outputs: their addresses are set per call (cuGraphExecMemcpyNodeSetParams),
// where two multi-tensor copies around the launch took 7 us each; measured
// as a whole, 10-13 us less host time per call (perf notes §60). Everything
// that needs Python (the plan, the capture itself, a reported kernel
// failure, a call inside someone's capture, batch 0) takes the Python path: this file only replays what the Python side captured and
// bound to a key here (persistrnn/runtime/native.py).
//
// Built without CUDA headers (the driver entry points come from Python as
// addresses), so the one source compiles against every torch build,
// CPU-only ones included.

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>
#include <torch/version.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

using GraphLaunch = int (*)(void* exec, void* stream);             // cuGraphLaunch
using StreamIsCapturing = int (*)(void* stream, int* status);      // cuStreamIsCapturing
using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The driver's CUDA_MEMCPY3D (cuda.h; its layout has not changed since CUDA 3.2).
struct Memcpy3D {
  size_t srcXInBytes, srcY, srcZ, srcLOD;
  int srcMemoryType;
  const void* srcHost;
  uint64_t srcDevice;
  void* srcArray;
  void* reserved0;
  size_t srcPitch, srcHeight;
  size_t dstXInBytes, dstY, dstZ, dstLOD;
  int dstMemoryType;
  void* dstHost;
  uint64_t dstDevice;
  void* dstArray;
  void* reserved1;
  size_t dstPitch, dstHeight;
  size_t WidthInBytes, Height, Depth;
};
static_assert(sizeof(Memcpy3D) == 200, "CUDA_MEMCPY3D is 200 bytes");
constexpr int kMemcpyNode = 1;  // CU_GRAPH_NODE_TYPE_MEMCPY

struct CopyDriver {  // the driver entry points that find and retarget a graph's copy nodes
  int (*graph_get_nodes)(void* graph, void** nodes, size_t* count) = nullptr;          // cuGraphGetNodes
  int (*node_get_type)(void* node, int* type) = nullptr;                                // cuGraphNodeGetType
  int (*memcpy_node_get_params)(void* node, Memcpy3D* params) = nullptr;                // cuGraphMemcpyNodeGetParams
  int (*exec_memcpy_node_set_params)(void* exec, void* node, const Memcpy3D* params,
                                     void* context) = nullptr;                          // cuGraphExecMemcpyNodeSetParams
  int (*context_get_current)(void** context) = nullptr;                                 // cuCtxGetCurrent
};

// A copy node of a captured graph: its node handle and the parameters it was
// captured with, whose source or destination address a call replaces.
struct CopyNode {
  void* node = nullptr;  // none: the tensor is copied around the launch instead
  Memcpy3D params{};
  at::Tensor standin;    // what the node was captured copying from (an input's) or to (an output's)
};

// One captured forward: its static inputs and outputs, its executable graph,
// and the lock that orders the copy in, the launch and the copy out of the
// threads that replay it on one stream (runtime/graphs.py says why that is
// enough).
struct Entry {
  std::mutex lock;
  bool retired = false;
  std::vector<at::Tensor> inputs;
  std::vector<at::Tensor> outputs;
  void* exec = nullptr;
  bool spread = false;
  int64_t large_copy = 0;
  std::vector<CopyNode> copy_in;   // per input: the node that copies the caller's tensor into it
  std::vector<CopyNode> copy_out;  // per output: the node that copies it into the caller's new tensor
  void* context = nullptr;
};

// What a captured forward depends on beside the plan: the arguments'
// shapes and addresses, the stream, and the settings a capture fixes
// (ops.launch_settings in Python).
struct Key {
  std::string cell;
  std::vector<int64_t> values;
  bool operator==(const Key& other) const { return values == other.values && cell == other.cell; }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    size_t h = std::hash<std::string>()(key.cell);
    for (int64_t v : key.values) {
      h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    }
    return h;
  }
};

constexpr int kMaxDevices = 64;

std::shared_mutex table_lock;  // guards entries and bound; a call takes it shared
std::unordered_map<int64_t, std::shared_ptr<Entry>> entries;
std::unordered_map<Key, std::shared_ptr<Entry>, KeyHash> bound;
int64_t next_id = 1;
std::atomic<GraphLaunch> graph_launch{nullptr};
CopyDriver copy_driver;  // set once, when the library loads, before any entry is added

std::atomic<StreamIsCapturing> stream_is_capturing{nullptr};
std::atomic<int32_t*> report_words[kMaxDevices];
std::atomic<int64_t> wait_timeout_ns{0};
std::atomic<int64_t> failure_hook{-1};

void copy_tensors(std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src, bool spread, int64_t large) {
  // runtime.copy_tensors: spread copies each large tensor by itself (the
  // least device time), otherwise one multi-tensor launch (the least host time)
  if (!spread) {
    at::_foreach_copy_(dst, src);
    return;
  }
  std::vector<at::Tensor> small_dst, small_src;
  for (size_t i = 0; i < dst.size(); ++i) {
    if (dst[i].numel() >= large) {
      dst[i].copy_(src[i]);
    } else {
      small_dst.push_back(dst[i]);
      small_src.push_back(src[i]);
    }
  }
  if (!small_dst.empty()) at::_foreach_copy_(small_dst, small_src);
}

void* current_stream(const c10::Device& device) {
  // (no stream on the CPU, where the tests run an entry with a stand-in launch)
  return device.is_cuda() ? c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle() : nullptr;
}

// Point `node` at `address` (its source if `source`, else its destination)
// for the next launches of `exec`; launches already queued keep the old one.
int retarget(void* exec, const CopyNode& node, void* context, const void* address, bool source) {
  Memcpy3D params = node.params;
  if (source) {
    params.srcDevice = reinterpret_cast<uint64_t>(address);
    params.srcXInBytes = 0;
  } else {
    params.dstDevice = reinterpret_cast<uint64_t>(address);
    params.dstXInBytes = 0;
  }
  return copy_driver.exec_memcpy_node_set_params(exec, node.node, &params, context);
}

// Copy `i` of a call: where the graph has a copy node for it that takes
// `address` (the caller's tensor as its source, or a new output as its
// destination), nothing is left to do. Otherwise `tensor` is copied around the
// launch from or into the buffer the graph copies from or into: the node's
// stand-in (the driver refused the address, or found no node), or the static
// tensor `fixed` of a graph captured without copy nodes.
void route(const Entry& entry, const std::vector<CopyNode>& nodes, size_t i, const at::Tensor& tensor,
           const void* address, const at::Tensor& fixed, bool source, std::vector<at::Tensor>& dst,
           std::vector<at::Tensor>& src) {
  const CopyNode* node = i < nodes.size() ? &nodes[i] : nullptr;
  if (node != nullptr && node->node != nullptr) {
    if (retarget(entry.exec, *node, entry.context, address, source) == 0) return;
    int rc = retarget(entry.exec, *node, entry.context, node->standin.data_ptr(), source);
    TORCH_CHECK(rc == 0, "persistrnn: cuGraphExecMemcpyNodeSetParams failed with CUresult ", rc);
  }
  const at::Tensor& buffer = node != nullptr && node->standin.defined() ? node->standin : fixed;
  dst.push_back(source ? buffer : tensor);
  src.push_back(source ? tensor : buffer);
}

// One replay of `entry` on `given` on the current stream; nullopt once the
// entry is retired (the caller takes the Python path).
std::optional<std::vector<at::Tensor>> replay_entry(Entry& entry, const std::vector<at::Tensor>& given,
                                                    void* stream) {
  std::vector<at::Tensor> results;
  results.reserve(entry.outputs.size());
  for (const auto& out : entry.outputs) results.push_back(at::empty_like(out));
  // A copy node copies bytes: a caller's tensor laid out otherwise than the
  // static input (device, dtype, shape, strides) is made like it first. These
  // live to the end of the call, by which the launch that reads them is queued.
  std::vector<at::Tensor> sources(given.begin(), given.end());
  for (size_t i = 0; i < given.size() && i < entry.copy_in.size(); ++i) {
    const at::Tensor& target = entry.inputs[i];
    if (entry.copy_in[i].node != nullptr &&
        !(sources[i].device() == target.device() && sources[i].scalar_type() == target.scalar_type() &&
          sources[i].sizes() == target.sizes() && sources[i].is_contiguous())) {
      sources[i] = at::empty_like(target);
      sources[i].copy_(given[i]);
    }
  }
  std::lock_guard<std::mutex> hold(entry.lock);
  if (entry.retired) return std::nullopt;
  std::vector<at::Tensor> before_to, before_from, after_to, after_from;
  for (size_t i = 0; i < given.size(); ++i) {
    route(entry, entry.copy_in, i, given[i], sources[i].data_ptr(), entry.inputs[i], true, before_to, before_from);
  }
  for (size_t i = 0; i < results.size(); ++i) {
    route(entry, entry.copy_out, i, results[i], results[i].data_ptr(), entry.outputs[i], false, after_to,
          after_from);
  }
  if (!before_to.empty()) copy_tensors(before_to, before_from, entry.spread, entry.large_copy);
  GraphLaunch launch = graph_launch.load();
  TORCH_CHECK(launch != nullptr, "persistrnn: the native replay is not configured");
  int rc = launch(entry.exec, stream);
  TORCH_CHECK(rc == 0, "persistrnn: cuGraphLaunch failed with CUresult ", rc);
  if (!after_to.empty()) copy_tensors(after_to, after_from, entry.spread, entry.large_copy);
  return results;
}

// torch's fp32 precision settings that a captured cuBLAS GEMM or cuDNN RNN
// fixes: the CUDA backend's for matmuls, RNNs and all ops, and the global
// one they inherit (raw values: a key only needs to change when one does).
// torch's single-flag getters (allowTF32CuDNN() and the like) refuse to
// answer once a program mixed the legacy and the new API.
std::vector<int64_t> precisions() {
  auto& context = at::globalContext();
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10)
  using at::Float32Backend;
  using at::Float32Op;
  std::vector<int64_t> codes;
  for (auto [backend, op] : {std::pair{Float32Backend::CUDA, Float32Op::MATMUL},
                             std::pair{Float32Backend::CUDA, Float32Op::RNN},
                             std::pair{Float32Backend::CUDA, Float32Op::ALL},
                             std::pair{Float32Backend::GENERIC, Float32Op::ALL}}) {
    codes.push_back(static_cast<int64_t>(context.float32Precision(backend, op)));
  }
  return codes;
#else
  std::vector<int64_t> codes;
  for (auto [backend, op] : {std::pair{"cuda", "matmul"}, std::pair{"cuda", "rnn"}, std::pair{"cuda", "all"},
                             std::pair{"generic", "all"}}) {
    codes.push_back(static_cast<int64_t>(std::hash<std::string>()(context.float32Precision(backend, op))));
  }
  return codes;
#endif
}

std::vector<int64_t> settings() {
  auto& context = at::globalContext();
  std::vector<int64_t> values = precisions();
  values.push_back(context.userEnabledCuDNN());
  values.push_back(static_cast<int64_t>(context.blasPreferredBackend()));
  values.push_back(wait_timeout_ns.load());
  values.push_back(failure_hook.load());
  return values;
}

Key key_of(const at::Tensor& x, const std::optional<at::Tensor>& h0, const std::optional<at::Tensor>& c0,
           at::TensorList weights, c10::string_view cell, int64_t num_layers, bool bidirectional, bool has_biases,
           void* stream) {
  Key key{std::string(cell), {}};
  auto& v = key.values;
  v.reserve(32 + weights.size());
  v.push_back(x.get_device());
  v.push_back(reinterpret_cast<int64_t>(stream));
  v.push_back(static_cast<int64_t>(x.scalar_type()));
  v.push_back(x.dim());
  for (int64_t s : x.sizes()) v.push_back(s);
  for (const auto* state : {&h0, &c0}) {
    bool given = state->has_value() && (*state)->defined();
    v.push_back(given ? (*state)->dim() : -1);
    if (given) {
      for (int64_t s : (*state)->sizes()) v.push_back(s);
      v.push_back(static_cast<int64_t>((*state)->scalar_type()));
    }
  }
  v.push_back(num_layers);
  v.push_back(bidirectional);
  v.push_back(has_biases);
  for (int64_t s : settings()) v.push_back(s);
  v.push_back(static_cast<int64_t>(weights.size()));
  for (const auto& w : weights) {  // a model freed and another made may reuse the addresses, not the shapes
    v.push_back(reinterpret_cast<int64_t>(w.data_ptr()));
    v.push_back(static_cast<int64_t>(w.scalar_type()));
    for (int64_t s : w.sizes()) v.push_back(s);
  }
  return key;
}

std::vector<at::Tensor> given_of(const at::Tensor& x, const std::optional<at::Tensor>& h0,
                                 const std::optional<at::Tensor>& c0) {
  std::vector<at::Tensor> given{x};
  for (const auto* state : {&h0, &c0}) {
    if (state->has_value() && (*state)->defined()) given.push_back(**state);
  }
  return given;
}

// Whether a call would record gradients. The operator has no autograd
// kernel (torch's fallback would give such tensors no gradient from it), so
// these calls go to the Python implementation, which refuses them by name.
bool records_gradients(const at::Tensor& x, const std::optional<at::Tensor>& h0,
                       const std::optional<at::Tensor>& c0, at::TensorList weights) {
  if (!c10::GradMode::is_enabled()) return false;
  if (x.requires_grad()) return true;
  for (const auto* state : {&h0, &c0}) {
    if (state->has_value() && (*state)->defined() && (*state)->requires_grad()) return true;
  }
  for (const auto& w : weights) {
    if (w.requires_grad()) return true;
  }
  return false;
}

// torch.ops.persistrnn.forward on CUDA tensors: a replay of the forward
// bound to these arguments, or the Python implementation
// (persistrnn::forward_capture), which captures and binds it (or refuses
// a call that records gradients).
Outputs forward_cuda(const at::Tensor& x, const std::optional<at::Tensor>& h0, const std::optional<at::Tensor>& c0,
                     at::TensorList weights, c10::string_view cell, int64_t num_layers, bool bidirectional,
                     bool has_biases) {
  const c10::Device device = x.device();
  const int index = device.index();
  int32_t* report = index >= 0 && index < kMaxDevices ? report_words[index].load() : nullptr;
  if (x.dim() == 3 && x.size(1) > 0 && (report == nullptr || *reinterpret_cast<volatile int32_t*>(report) == 0) &&
      !records_gradients(x, h0, c0, weights)) {
    c10::DeviceGuard guard(device);
    void* stream = current_stream(device);
    int capturing = 1;
    StreamIsCapturing is_capturing = stream_is_capturing.load();
    if (is_capturing != nullptr && is_capturing(stream, &capturing) == 0 && capturing == 0) {
      std::shared_ptr<Entry> entry;
      {
        std::shared_lock<std::shared_mutex> read(table_lock);
        auto found = bound.find(key_of(x, h0, c0, weights, cell, num_layers, bidirectional, has_biases, stream));
        if (found != bound.end()) entry = found->second;
      }
      if (entry) {
        auto results = replay_entry(*entry, given_of(x, h0, c0), stream);
        if (results) {
          auto& r = *results;
          return {r[0], r[1], r.size() > 2 ? r[2] : at::empty({0}, x.options())};
        }
      }
    }
  }
  static auto capture = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("persistrnn::forward_capture", "")
                            .typed<Outputs(const at::Tensor&, const std::optional<at::Tensor>&,
                                           const std::optional<at::Tensor>&, at::TensorList, c10::string_view,
                                           int64_t, bool, bool)>();
  return capture.call(x, h0, c0, weights, cell, num_layers, bidirectional, has_biases);
}

// ---- what the Python side calls ------------------------------------------

void configure(int64_t launch, int64_t is_capturing) {
  graph_launch.store(reinterpret_cast<GraphLaunch>(launch));
  stream_is_capturing.store(reinterpret_cast<StreamIsCapturing>(is_capturing));
}

void set_report_word(int64_t device, int64_t address) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "persistrnn: device index ", device, " out of range");
  report_words[device].store(reinterpret_cast<int32_t*>(address));
}

void set_launch_state(int64_t timeout_ns, int64_t hook) {
  wait_timeout_ns.store(timeout_ns);
  failure_hook.store(hook);
}

std::vector<int64_t> settings_key() { return settings(); }

void configure_copy_nodes(std::vector<int64_t> addresses) {
  TORCH_CHECK(addresses.size() == 5, "persistrnn: configure_copy_nodes takes 5 driver entry points, got ",
              addresses.size());
  copy_driver.graph_get_nodes = reinterpret_cast<decltype(copy_driver.graph_get_nodes)>(addresses[0]);
  copy_driver.node_get_type = reinterpret_cast<decltype(copy_driver.node_get_type)>(addresses[1]);
  copy_driver.memcpy_node_get_params = reinterpret_cast<decltype(copy_driver.memcpy_node_get_params)>(addresses[2]);
  copy_driver.exec_memcpy_node_set_params =
      reinterpret_cast<decltype(copy_driver.exec_memcpy_node_set_params)>(addresses[3]);
  copy_driver.context_get_current = reinterpret_cast<decltype(copy_driver.context_get_current)>(addresses[4]);
}

// For each of `from[i]` -> `to[i]` (a stand-in and the static tensor it was
// captured copying into, or a static output and its stand-in), the node of
// `graph` that copies it as a plain 1-D copy of the whole tensor (what torch
// captures for a copy between contiguous tensors of one dtype). A node not
// found (or no driver to find it with) is left empty: the graph still
// copies through the stand-in, and a call copies to or from the stand-in.
std::vector<CopyNode> find_copy_nodes(void* graph, at::TensorList from, at::TensorList to, bool standin_is_source) {
  std::vector<CopyNode> found(from.size());
  for (size_t i = 0; i < from.size(); ++i) found[i].standin = standin_is_source ? from[i] : to[i];
  if (graph == nullptr || from.empty() || copy_driver.graph_get_nodes == nullptr ||
      copy_driver.context_get_current == nullptr) {
    return found;
  }
  size_t count = 0;
  TORCH_CHECK(copy_driver.graph_get_nodes(graph, nullptr, &count) == 0, "persistrnn: cuGraphGetNodes failed");
  std::vector<void*> nodes(count);
  TORCH_CHECK(copy_driver.graph_get_nodes(graph, nodes.data(), &count) == 0, "persistrnn: cuGraphGetNodes failed");
  for (void* node : nodes) {
    int type = -1;
    Memcpy3D params{};
    if (copy_driver.node_get_type(node, &type) != 0 || type != kMemcpyNode ||
        copy_driver.memcpy_node_get_params(node, &params) != 0 || params.Height != 1 || params.Depth != 1) {
      continue;
    }
    for (size_t i = 0; i < from.size(); ++i) {
      if (params.srcDevice + params.srcXInBytes == reinterpret_cast<uint64_t>(from[i].data_ptr()) &&
          params.dstDevice + params.dstXInBytes == reinterpret_cast<uint64_t>(to[i].data_ptr()) &&
          params.WidthInBytes == from[i].nbytes() && from[i].nbytes() > 0) {
        found[i] = CopyNode{node, params, standin_is_source ? from[i] : to[i]};
      }
    }
  }
  return found;
}

int64_t add_entry(at::TensorList inputs, at::TensorList outputs, int64_t exec, bool spread, int64_t large_copy,
                  int64_t graph, at::TensorList sources, at::TensorList sinks) {
  auto entry = std::make_shared<Entry>();
  entry->inputs = inputs.vec();
  entry->outputs = outputs.vec();
  entry->exec = reinterpret_cast<void*>(exec);
  entry->spread = spread;
  entry->large_copy = large_copy;
  TORCH_CHECK(sources.empty() || sources.size() == inputs.size(), "persistrnn: ", sources.size(),
              " copy sources for ", inputs.size(), " inputs");
  TORCH_CHECK(sinks.empty() || sinks.size() == outputs.size(), "persistrnn: ", sinks.size(), " copy sinks for ",
              outputs.size(), " outputs");
  void* raw_graph = reinterpret_cast<void*>(graph);
  if (!sources.empty() || !sinks.empty()) {
    c10::DeviceGuard guard(outputs.at(0).device());
    if (copy_driver.context_get_current == nullptr || copy_driver.context_get_current(&entry->context) != 0) {
      raw_graph = nullptr;  // no node is retargeted: every copy goes through its stand-in
    }
    entry->copy_in = find_copy_nodes(raw_graph, sources, inputs, true);
    entry->copy_out = find_copy_nodes(raw_graph, outputs, sinks, false);
  }
  std::unique_lock<std::shared_mutex> write(table_lock);
  int64_t id = next_id++;
  entries.emplace(id, std::move(entry));
  return id;
}

bool bind(int64_t id, const at::Tensor& x, const std::optional<at::Tensor>& h0, const std::optional<at::Tensor>& c0,
          at::TensorList weights, c10::string_view cell, int64_t num_layers, bool bidirectional, bool has_biases) {
  c10::DeviceGuard guard(x.device());
  Key key = key_of(x, h0, c0, weights, cell, num_layers, bidirectional, has_biases, current_stream(x.device()));
  std::unique_lock<std::shared_mutex> write(table_lock);
  auto found = entries.find(id);
  if (found == entries.end()) return false;  // retired meanwhile
  bound[std::move(key)] = found->second;
  return true;
}

std::vector<at::Tensor> replay(int64_t id, at::TensorList given) {
  std::shared_ptr<Entry> entry;
  {
    std::shared_lock<std::shared_mutex> read(table_lock);
    auto found = entries.find(id);
    if (found != entries.end()) entry = found->second;
  }
  if (!entry) return {};
  const c10::Device device = entry->outputs.at(0).device();
  c10::DeviceGuard guard(device);
  auto results = replay_entry(*entry, given.vec(), current_stream(device));
  return results ? *results : std::vector<at::Tensor>{};
}

void retire(int64_t id) {
  std::shared_ptr<Entry> entry;
  {
    std::unique_lock<std::shared_mutex> write(table_lock);
    auto found = entries.find(id);
    if (found == entries.end()) return;
    entry = found->second;
    entries.erase(found);
    for (auto it = bound.begin(); it != bound.end();) {
      it = it->second == entry ? bound.erase(it) : std::next(it);
    }
  }
  std::lock_guard<std::mutex> hold(entry->lock);  // a replay in progress ends before this returns
  entry->retired = true;
}

void unbind_all() {
  std::unique_lock<std::shared_mutex> write(table_lock);
  bound.clear();
}

std::vector<int64_t> copy_nodes(int64_t id) {  // (inputs, outputs) with a copy node: what the tests check
  std::shared_lock<std::shared_mutex> read(table_lock);
  auto found = entries.find(id);
  TORCH_CHECK(found != entries.end(), "persistrnn: no entry ", id);
  int64_t in = 0, out = 0;
  for (const auto& n : found->second->copy_in) in += n.node != nullptr;
  for (const auto& n : found->second->copy_out) out += n.node != nullptr;
  return {in, out};
}

int64_t bound_count() {
  std::shared_lock<std::shared_mutex> read(table_lock);
  return static_cast<int64_t>(bound.size());
}

}  // namespace

TORCH_LIBRARY(persistrnn_native, m) {
  m.def("configure(int graph_launch, int stream_is_capturing) -> ()", &configure);
  m.def("set_report_word(int device, int address) -> ()", &set_report_word);
  m.def("set_launch_state(int wait_timeout_ns, int failure_hook) -> ()", &set_launch_state);
  m.def("settings_key() -> int[]", &settings_key);
  m.def("configure_copy_nodes(int[] addresses) -> ()", &configure_copy_nodes);
  m.def("add_entry(Tensor[] inputs, Tensor[] outputs, int graph_exec, bool spread, int large_copy, int graph, "
        "Tensor[] sources, Tensor[] sinks) -> int", &add_entry);
  m.def("bind(int id, Tensor x, Tensor? h0, Tensor? c0, Tensor[] weights, str cell, int num_layers, "
        "bool bidirectional, bool has_biases) -> bool", &bind);
  m.def("replay(int id, Tensor[] given) -> Tensor[]", &replay);
  m.def("retire(int id) -> ()", &retire);
  m.def("unbind_all() -> ()", &unbind_all);
  m.def("bound_count() -> int", &bound_count);
  m.def("copy_nodes(int id) -> int[]", &copy_nodes);
}

TORCH_LIBRARY_IMPL(persistrnn, CUDA, m) {
  m.impl("forward", TORCH_FN(forward_cuda));
}
