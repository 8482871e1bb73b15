// The replay of a captured forward in C++: the host side of a module call or
// of torch.ops.persistrnn.forward without Python.
//
// Measured on the H100's host (perf notes §20, §56): a call's Python (checks,
// plan and graph keys, the captured call's copies and replay) took 40-60 us,
// torch.compile's own per-call path adds ~40 us, and the device work of a
// small model is ~60-80 us, so the calls were host-bound. Here a call is a
// hash of its arguments, two multi-tensor copies, output allocations and one
// cuGraphLaunch. Everything that needs Python (the plan, the capture itself,
// a reported kernel failure, a call inside someone's capture, batch 0) takes
// the Python path: this file only replays what the Python side captured and
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

// One replay of `entry` on `given` on the current stream; nullopt once the
// entry is retired (the caller takes the Python path).
std::optional<std::vector<at::Tensor>> replay_entry(Entry& entry, const std::vector<at::Tensor>& given,
                                                    void* stream) {
  std::vector<at::Tensor> results;
  results.reserve(entry.outputs.size());
  for (const auto& out : entry.outputs) results.push_back(at::empty_like(out));
  std::lock_guard<std::mutex> hold(entry.lock);
  if (entry.retired) return std::nullopt;
  if (!given.empty()) copy_tensors(entry.inputs, given, entry.spread, entry.large_copy);
  GraphLaunch launch = graph_launch.load();
  TORCH_CHECK(launch != nullptr, "persistrnn: the native replay is not configured");
  int rc = launch(entry.exec, stream);
  TORCH_CHECK(rc == 0, "persistrnn: cuGraphLaunch failed with CUresult ", rc);
  copy_tensors(results, entry.outputs, entry.spread, entry.large_copy);
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

// torch.ops.persistrnn.forward on CUDA tensors: a replay of the forward
// bound to these arguments, or the Python implementation
// (persistrnn::forward_capture), which captures and binds it.
Outputs forward_cuda(const at::Tensor& x, const std::optional<at::Tensor>& h0, const std::optional<at::Tensor>& c0,
                     at::TensorList weights, c10::string_view cell, int64_t num_layers, bool bidirectional,
                     bool has_biases) {
  const c10::Device device = x.device();
  const int index = device.index();
  int32_t* report = index >= 0 && index < kMaxDevices ? report_words[index].load() : nullptr;
  if (x.dim() == 3 && x.size(1) > 0 && (report == nullptr || *reinterpret_cast<volatile int32_t*>(report) == 0)) {
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

int64_t add_entry(at::TensorList inputs, at::TensorList outputs, int64_t exec, bool spread, int64_t large_copy) {
  auto entry = std::make_shared<Entry>();
  entry->inputs = inputs.vec();
  entry->outputs = outputs.vec();
  entry->exec = reinterpret_cast<void*>(exec);
  entry->spread = spread;
  entry->large_copy = large_copy;
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
  m.def("add_entry(Tensor[] inputs, Tensor[] outputs, int graph_exec, bool spread, int large_copy) -> int", &add_entry);
  m.def("bind(int id, Tensor x, Tensor? h0, Tensor? c0, Tensor[] weights, str cell, int num_layers, "
        "bool bidirectional, bool has_biases) -> bool", &bind);
  m.def("replay(int id, Tensor[] given) -> Tensor[]", &replay);
  m.def("retire(int id) -> ()", &retire);
  m.def("unbind_all() -> ()", &unbind_all);
  m.def("bound_count() -> int", &bound_count);
}

TORCH_LIBRARY_IMPL(persistrnn, CUDA, m) {
  m.impl("forward", TORCH_FN(forward_cuda));
}
