// Launch plans: the triton backend's calls on CUDA tensors replayed from C++, with no Python per call.
//
// A Triton call (fastformer/triton/<op>.py) is Python: it allocates the outputs and launches one or more
// compiled kernels through Triton's launcher (and, for attention, its autotuner). What it does depends only
// on the call's configuration: the op and phase, every tensor argument's dtype, device, sizes, strides and
// whether its address is 16-byte aligned (Triton specializes its kernels on that), which tensor arguments
// are the same tensor, which optional ones are None, and every scalar argument's value. So a configuration
// that repeats is recorded: its Python implementation runs under a recorder (fastformer/triton/plans.py)
// that notes each allocation (torch.empty and its kin: sizes, strides, dtype), each view and each kernel
// launch (the compiled function, grid, block, shared memory, and every parameter: a pointer into an input or
// an allocation at a byte offset, or a scalar's bits), and the outputs (an allocation or a view of one). That
// list is the configuration's plan, stored here under a key made from the configuration (KeyBuilder). Every
// later call with that key is replayed in C++: allocate (at::empty_strided on the inputs' device, the caching
// allocator), pack the parameters (addresses read from this call's tensors), launch each kernel with
// cuLaunchKernel on the current stream, and return the outputs. No host synchronization, no host memory, no
// Python: a replay can be captured in a CUDA graph.
//
// When a configuration is recorded: the second time its key is seen. Its first call runs in Python
// unrecorded (counted as a first sight): a run whose shapes vary (every batch a new (B, S, T)) meets most
// configurations once, and a recording costs more than the Python call it would replace. The table is
// bounded (capacity, 4,096 by default): a new configuration that finds it full evicts the least recently
// used eighth (counted), so a run that keeps meeting new shapes keeps its repeating ones and at most
// `capacity` plans. Triton's autotuner benchmarks outside the recording (plans.py suspends it), so what a
// recording holds is the call's own launches.
//
// A configuration whose Python run does anything else (any other ATen op: a copy, a fill, a reduction in
// torch; a launch the recorder cannot describe) is refused: it keeps running in Python, correct by
// construction, and triton_plans_stats() counts it and names the reason.
//
// Where this runs: fastformer::<op>_<phase>_py's kernel for the CUDA dispatch key (registered below, in the
// CUDA build): for backend "triton" it checks and prepares the arguments as the C++ backends' adapters do
// (csrc/ops.h: the same checks, the same layout rule) and replays or records; any other backend (torch on
// CUDA tensors) goes to the Python implementation (the CompositeExplicitAutograd kernel), as before.
// Under TRITON_INTERPRET=1, triton_plans_on_cpu(true) registers the same kernel for the CPU key: the
// interpreter's kernels are then recorded and replayed through a Python callback per launch (test equipment:
// it checks everything here but cuLaunchKernel on CPU tensors in CI).
#include "triton/plans.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/library.h>
#include <torch/python.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ops.h"

#ifdef FASTFORMER_WITH_CUDA
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#endif

namespace fastformer::triton_plans {

// The entry points' signatures (csrc/op_entry_points.h), declared here only for their types.
namespace signatures {
using at::Tensor;
#include "op_entry_points.h"
}  // namespace signatures

namespace {

namespace py = pybind11;
using at::Tensor;

// ---- the op list (csrc/ops.h) by index ----

constexpr const char* kOpNames[] = {
#define FASTFORMER_PLAN_NAME(op, ...) #op,
    FASTFORMER_OPS(FASTFORMER_PLAN_NAME)
#undef FASTFORMER_PLAN_NAME
};
constexpr int kNumOps = static_cast<int>(sizeof(kOpNames) / sizeof(kOpNames[0]));
constexpr const char* kPhaseNames[] = {"fwd", "bwd"};

constexpr bool same_name(const char* a, const char* b) { return *a == *b && (*a == '\0' || same_name(a + 1, b + 1)); }
constexpr int op_index(const char* name, int i = 0) {
  return i == kNumOps ? -1 : same_name(kOpNames[i], name) ? i : op_index(name, i + 1);
}

// ---- a plan ----

// One kernel parameter as the replay packs it: a pointer into input argument `index` or allocation `index`
// plus a byte offset, a scalar's bits (`value`, little-endian in `size` bytes), or a null pointer (Triton's
// trailing scratch parameters when the kernel needs no scratch).
struct Param {
  // Exported to fastformer/triton/plans.py as fastformer._C.TRITON_PLAN_PARAM_KINDS (bind_triton_plans below).
  enum Kind : uint8_t { kInput = 0, kAlloc = 1, kValue = 2, kNull = 3 };
  Kind kind;
  uint8_t size;     // bytes the function reads (from the kernel's PTX; cuFuncGetParamInfo agrees)
  int32_t index;    // kInput: argument position; kAlloc: allocation
  uint64_t value;   // kInput/kAlloc: byte offset (two's complement); kValue: the bits
};

// A compiled kernel (the CUfunction Triton loaded on the recording's device, kept alive by
// fastformer/triton/plans.py) or, under the interpreter, the id of a kernel that plans.py runs.
struct Kernel {
  uint64_t function = 0;
  int64_t interpreted = -1;
  uint32_t threads = 0;  // 32 x num_warps
  uint32_t shared = 0;   // dynamic shared memory, bytes
  std::string name;
};

struct Launch {
  Kernel kernel;
  std::array<uint32_t, 3> grid{};
  std::vector<Param> params;
};

struct Alloc {
  std::vector<int64_t> sizes, strides;
  at::ScalarType dtype;
};

// An output: allocation `alloc` itself (whole) or its view at sizes, strides and storage offset.
struct Output {
  int32_t alloc;
  bool whole;
  std::vector<int64_t> sizes, strides;
  int64_t offset;
};

struct Plan {
  std::vector<Alloc> allocs;
  std::vector<Launch> launches;
  std::vector<Output> outputs;
};

constexpr size_t kMaxParams = 64;

// ---- the key: everything of a call that the Python run's choices depend on ----

class KeyBuilder {
 public:
  KeyBuilder(int op, int phase, c10::Device device, c10::DeviceIndex current) {
    bytes_.reserve(256);  // attention's backward: 11 arguments, about 220 bytes
    put(static_cast<int8_t>(op));
    put(static_cast<int8_t>(phase));
    put(static_cast<int8_t>(device.type()));
    put(static_cast<int8_t>(current));  // the current device: Triton launches there
  }

  void add(const Tensor& t) {
    if (!t.defined()) {
      put('U');
      return;
    }
    put('T');
    put(static_cast<int8_t>(t.scalar_type()));
    put(static_cast<int8_t>(t.device().index()));
    put(static_cast<int8_t>(t.dim()));
    for (int64_t s : t.sizes()) put(s);
    for (int64_t s : t.strides()) put(s);
    put(static_cast<int8_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0));
    int8_t alias = -1;  // the first earlier argument that is this tensor (the recorder maps it there)
    for (size_t i = 0; i < impls_.size() && alias < 0; ++i) {
      if (impls_[i] == t.unsafeGetTensorImpl()) alias = static_cast<int8_t>(i);
    }
    put(alias);
    impls_.push_back(t.unsafeGetTensorImpl());
  }
  void add(const std::optional<Tensor>& t) {
    if (t.has_value()) {
      add(*t);
    } else {
      put('N');
    }
  }
  void add(double v) {
    put('D');
    put(v);
  }
  void add(bool v) {
    put('B');
    put(static_cast<int8_t>(v));
  }
  void add(int64_t v) {
    put('I');
    put(v);
  }
  void add(at::ScalarType v) {
    put('S');
    put(static_cast<int8_t>(v));
  }

  const std::string& bytes() const { return bytes_; }

 private:
  template <typename T>
  void put(T v) {
    bytes_.append(reinterpret_cast<const char*>(&v), sizeof(T));
  }
  std::string bytes_;
  std::vector<const c10::TensorImpl*> impls_;
};

// ---- the cache and the counters ----

// A configuration in the table: seen once (no plan, not refused: the next call records), recorded (its
// plan), or refused (it runs in Python for as long as it stays in the table).
struct Configuration {
  std::shared_ptr<const Plan> plan;
  bool refused = false;
  std::atomic<uint64_t> used{0};  // State::clock at its last call: the least recently used are evicted first
};

constexpr size_t kDefaultCapacity = 4096;

// Per op and phase. Every call is a replay or a Python call; first sights are among the Python calls.
struct Counters {
  std::atomic<int64_t> replays{0}, python{0}, first_sight{0}, recorded{0}, refused{0}, evicted{0};
};

struct State {
  std::shared_mutex mutex;
  std::unordered_map<std::string, Configuration> entries;
  std::map<std::string, int64_t> reasons;  // refusals by reason
  Counters counters[kNumOps][2];
  // Advanced by every call that runs in Python, read by replays: a replay writes its configuration's `used`
  // only when the clock moved since that configuration's last call, so replays of a settled run (every
  // configuration recorded, no Python calls) write nothing shared.
  std::atomic<uint64_t> clock{0};
  size_t capacity = kDefaultCapacity;  // guarded by mutex
  std::atomic<bool> enabled{std::getenv("FASTFORMER_TRITON_PLANS") == nullptr ||
                            std::string(std::getenv("FASTFORMER_TRITON_PLANS")) != "0"};
};

State& state() {
  static State* s = new State();  // lives as long as the process (plans may be used at exit)
  return *s;
}

// Evicts the `count` least recently used configurations (the mutex held exclusively), each counted under its
// op and phase (the key's first two bytes).
void evict(State& s, size_t count) {
  count = std::min(count, s.entries.size());
  if (count == 0) return;
  using Entry = std::unordered_map<std::string, Configuration>::iterator;
  std::vector<std::pair<uint64_t, Entry>> by_use;
  by_use.reserve(s.entries.size());
  for (auto it = s.entries.begin(); it != s.entries.end(); ++it) by_use.emplace_back(it->second.used.load(), it);
  std::nth_element(by_use.begin(), by_use.begin() + (count - 1), by_use.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 0; i < count; ++i) {
    const std::string& key = by_use[i].second->first;
    ++s.counters[static_cast<int>(key[0])][static_cast<int>(key[1])].evicted;
    s.entries.erase(by_use[i].second);
  }
}

// What a call does: replay `plan`, or run in Python (recorded when `record`; `first_sight` when its
// configuration was new).
struct Lookup {
  std::shared_ptr<const Plan> plan;
  bool record = false;
  bool first_sight = false;
};

// A configuration already in the table (the mutex held, shared or exclusive).
Lookup seen(State& s, Configuration& e) {
  if (e.plan) {
    const uint64_t now = s.clock.load(std::memory_order_relaxed);
    if (e.used.load(std::memory_order_relaxed) != now) e.used.store(now, std::memory_order_relaxed);
    return {e.plan};
  }
  e.used.store(s.clock.fetch_add(1) + 1, std::memory_order_relaxed);
  return {nullptr, !e.refused};
}

Lookup lookup(const std::string& key) {
  State& s = state();
  {
    std::shared_lock<std::shared_mutex> lock(s.mutex);
    const auto it = s.entries.find(key);
    if (it != s.entries.end()) return seen(s, it->second);
  }
  std::unique_lock<std::shared_mutex> lock(s.mutex);
  const auto it = s.entries.find(key);
  if (it != s.entries.end()) return seen(s, it->second);  // another thread's call put it there meanwhile
  // A full table evicts an eighth of itself at once: one scan per capacity / 8 new configurations.
  if (s.entries.size() >= s.capacity) evict(s, s.entries.size() - s.capacity + std::max<size_t>(1, s.capacity / 8));
  s.entries[key].used = s.clock.fetch_add(1) + 1;
  return {nullptr, false, true};
}

// The outcome of a recording, stored if its configuration is still in the table (a configuration evicted
// while its call ran in Python is not put back: its next call is a first sight again).
void store(const std::string& key, std::shared_ptr<const Plan> plan, const std::string& reason, Counters& counters) {
  State& s = state();
  std::unique_lock<std::shared_mutex> lock(s.mutex);
  const auto it = s.entries.find(key);
  if (it == s.entries.end() || it->second.refused || it->second.plan) return;
  if (plan) {
    it->second.plan = std::move(plan);
    ++counters.recorded;
  } else {
    it->second.refused = true;
    ++s.reasons[reason];
    ++counters.refused;
  }
}

// ---- the Python side (fastformer/triton/plans.py), looked up once with the GIL held ----

// What _run says of a call (exported to fastformer/triton/plans.py as fastformer._C.TRITON_PLAN_STATUS): it
// recorded a plan (its description follows), refused one (a reason follows), or was not asked to record.
enum class Status : int { kNotRecorded = -1, kPlan = 0, kRefused = 1 };

struct Python {
  py::object run;              // _run(op, phase, record, args) -> (outputs, Status, plan description or reason)
  py::object run_interpreted;  // _run_interpreted(kernel id, grid, parameter bits)
};

std::atomic<Python*> g_python{nullptr};

const Python& python() {  // the GIL is held
  Python* p = g_python.load();
  if (p == nullptr) {
    py::module_ m = py::module_::import("fastformer.triton.plans");
    p = new Python{m.attr("_run"), m.attr("_run_interpreted")};  // kept for the process, as the module is
    g_python.store(p);
  }
  return *p;
}

// ---- launching ----

#ifdef FASTFORMER_WITH_CUDA
// The driver entry points, from libcuda (already loaded by torch's CUDA runtime), so that _C needs no
// -lcuda: cuLaunchKernel, cuCtxGetCurrent, cuGetErrorString, and cuFuncGetParamInfo (driver 12.4+; without
// it the plan's parameter layout is not cross-checked against the function).
struct Driver {
  decltype(&cuLaunchKernel) launch = nullptr;
  decltype(&cuCtxGetCurrent) current_context = nullptr;
  decltype(&cuGetErrorString) error_string = nullptr;
  CUresult (*param_info)(CUfunction, size_t, size_t*, size_t*) = nullptr;
  std::string error;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      d.error = std::string("cannot load libcuda.so.1: ") + dlerror();
      return d;
    }
    d.launch = reinterpret_cast<decltype(d.launch)>(dlsym(lib, "cuLaunchKernel"));
    d.current_context = reinterpret_cast<decltype(d.current_context)>(dlsym(lib, "cuCtxGetCurrent"));
    d.error_string = reinterpret_cast<decltype(d.error_string)>(dlsym(lib, "cuGetErrorString"));
    d.param_info = reinterpret_cast<decltype(d.param_info)>(dlsym(lib, "cuFuncGetParamInfo"));
    if (d.launch == nullptr || d.current_context == nullptr || d.error_string == nullptr) {
      d.error = "libcuda.so.1 lacks cuLaunchKernel, cuCtxGetCurrent or cuGetErrorString";
    }
    return d;
  }();
  return d;
}

std::string cu_error(CUresult r) {
  const char* text = nullptr;
  if (driver().error_string != nullptr) driver().error_string(r, &text);
  return text != nullptr ? text : "CUresult " + std::to_string(static_cast<int>(r));
}

// A compiled kernel's parameter sizes against the function's own (cuFuncGetParamInfo): "" when they agree
// or the driver cannot tell, else what differs. A plan that disagrees is refused.
std::string check_params(const Launch& launch) {
  const Driver& d = driver();
  if (!d.error.empty()) return d.error;
  if (d.param_info == nullptr) return "";
  const auto f = reinterpret_cast<CUfunction>(launch.kernel.function);
  for (size_t i = 0; i <= launch.params.size(); ++i) {
    size_t offset = 0, size = 0;
    const CUresult r = d.param_info(f, i, &offset, &size);
    if (i == launch.params.size()) {
      if (r == CUDA_SUCCESS) {
        return launch.kernel.name + " takes more than the " + std::to_string(i) + " parameters recorded";
      }
    } else if (r != CUDA_SUCCESS || size != launch.params[i].size) {
      return launch.kernel.name + "'s parameter " + std::to_string(i) + " is " +
             (r == CUDA_SUCCESS ? std::to_string(size) + " bytes" : cu_error(r)) + ", recorded " +
             std::to_string(launch.params[i].size);
    }
  }
  return "";
}

// cuLaunchKernel on the current stream of `device` (the current device: the key holds it). A thread that has
// not used CUDA yet gets the primary context first, as torch's jit kernels do.
void launch_compiled(const Launch& launch, void** params, c10::Device device) {
  const Driver& d = driver();
  TORCH_CHECK(d.error.empty(), "fastformer triton: ", d.error);
  CUcontext context = nullptr;
  CUresult r = d.current_context(&context);
  if (r == CUDA_SUCCESS && context == nullptr) C10_CUDA_CHECK(cudaFree(nullptr));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  r = d.launch(reinterpret_cast<CUfunction>(launch.kernel.function), launch.grid[0], launch.grid[1], launch.grid[2],
               launch.kernel.threads, 1, 1, launch.kernel.shared, reinterpret_cast<CUstream>(stream), params, nullptr);
  TORCH_CHECK(r == CUDA_SUCCESS, "fastformer triton: launching ", launch.kernel.name, " (grid ", launch.grid[0], " x ",
              launch.grid[1], " x ", launch.grid[2], ", ", launch.kernel.threads, " threads, ", launch.kernel.shared,
              " bytes of shared memory) failed: ", cu_error(r));
}
#endif

// One launch of a replay; `bits` holds each parameter's value, `params` points at them.
void launch(const Launch& launch, const uint64_t* bits, void** params, c10::Device device) {
  if (launch.kernel.interpreted >= 0) {
    py::gil_scoped_acquire gil;
    py::list values;
    for (size_t i = 0; i < launch.params.size(); ++i) values.append(py::int_(bits[i]));
    python().run_interpreted(launch.kernel.interpreted, py::make_tuple(launch.grid[0], launch.grid[1], launch.grid[2]),
                             values);
    return;
  }
#ifdef FASTFORMER_WITH_CUDA
  launch_compiled(launch, params, device);
#else
  (void)params;
  (void)device;
  TORCH_CHECK(false, "fastformer triton: this fastformer._C was built without CUDA; it cannot launch ",
              launch.kernel.name);
#endif
}

// ---- replay ----

std::vector<Tensor> replay(const Plan& plan, const Tensor* const* inputs, c10::Device device) {
  std::vector<Tensor> allocs;
  allocs.reserve(plan.allocs.size());
  const auto options = at::TensorOptions().device(device);
  for (const Alloc& a : plan.allocs) allocs.push_back(at::empty_strided(a.sizes, a.strides, options.dtype(a.dtype)));
  uint64_t bits[kMaxParams];
  void* params[kMaxParams];
  for (const Launch& l : plan.launches) {
    if (static_cast<uint64_t>(l.grid[0]) * l.grid[1] * l.grid[2] == 0) continue;  // as Triton's launcher
    for (size_t i = 0; i < l.params.size(); ++i) {
      const Param& p = l.params[i];
      switch (p.kind) {
        case Param::kInput:
          bits[i] = reinterpret_cast<uint64_t>(inputs[p.index]->data_ptr()) + p.value;
          break;
        case Param::kAlloc:
          bits[i] = reinterpret_cast<uint64_t>(allocs[p.index].data_ptr()) + p.value;
          break;
        case Param::kValue:
          bits[i] = p.value;
          break;
        case Param::kNull:
          bits[i] = 0;
          break;
      }
      params[i] = &bits[i];  // the function reads p.size bytes: the low ones (little-endian)
    }
    launch(l, bits, params, device);
  }
  std::vector<Tensor> outputs;
  outputs.reserve(plan.outputs.size());
  for (const Output& o : plan.outputs) {
    outputs.push_back(o.whole ? allocs[o.alloc] : allocs[o.alloc].as_strided(o.sizes, o.strides, o.offset));
  }
  return outputs;
}

// ---- the recorder's description -> Plan ----

std::vector<int64_t> int_list(py::handle h) { return h.cast<std::vector<int64_t>>(); }

// The plan described by fastformer/triton/plans.py (its PlanDescription: named tuples, read here by position),
// or a reason to refuse.
std::shared_ptr<Plan> parse(py::handle description, const std::vector<bool>& is_tensor, size_t n_outputs,
                            std::string& reason) {
  auto plan = std::make_shared<Plan>();
  const py::tuple d = description.cast<py::tuple>();
  for (py::handle a : d[0]) {
    const py::tuple t = a.cast<py::tuple>();
    plan->allocs.push_back({int_list(t[0]), int_list(t[1]), t[2].cast<at::ScalarType>()});
  }
  for (py::handle item : d[1]) {
    const py::tuple t = item.cast<py::tuple>();
    Launch l;
    const py::tuple k = t[0].cast<py::tuple>();
    l.kernel = {k[0].cast<uint64_t>(), k[1].cast<int64_t>(), k[2].cast<uint32_t>(), k[3].cast<uint32_t>(),
                k[4].cast<std::string>()};
    const py::tuple g = t[1].cast<py::tuple>();
    for (int i = 0; i < 3; ++i) {
      const int64_t v = g[i].cast<int64_t>();
      if (v < 0 || v > static_cast<int64_t>(UINT32_MAX)) {
        reason = "a grid dimension outside 32 bits";
        return nullptr;
      }
      l.grid[i] = static_cast<uint32_t>(v);
    }
    for (py::handle p : t[2]) {
      const py::tuple q = p.cast<py::tuple>();
      Param param{static_cast<Param::Kind>(q[0].cast<int>()), q[3].cast<uint8_t>(), q[1].cast<int32_t>(),
                  q[2].cast<uint64_t>()};
      const bool bad_input = param.kind == Param::kInput &&
                             (param.index < 0 || static_cast<size_t>(param.index) >= is_tensor.size() ||
                              !is_tensor[param.index]);
      const bool bad_alloc = param.kind == Param::kAlloc &&
                             (param.index < 0 || static_cast<size_t>(param.index) >= plan->allocs.size());
      TORCH_CHECK(param.kind <= Param::kNull && !bad_input && !bad_alloc && param.size >= 1 && param.size <= 8,
                  "fastformer triton: the recorder described a parameter of ", l.kernel.name, " wrongly");
      l.params.push_back(param);
    }
    if (l.params.size() > kMaxParams) {
      reason = l.kernel.name + " takes more than " + std::to_string(kMaxParams) + " parameters";
      return nullptr;
    }
#ifdef FASTFORMER_WITH_CUDA
    if (l.kernel.interpreted < 0) {
      reason = check_params(l);
      if (!reason.empty()) return nullptr;
    }
#endif
    plan->launches.push_back(std::move(l));
  }
  for (py::handle o : d[2]) {
    const py::tuple t = o.cast<py::tuple>();
    Output out{t[0].cast<int32_t>(), t[1].cast<bool>(), int_list(t[2]), int_list(t[3]), t[4].cast<int64_t>()};
    TORCH_CHECK(out.alloc >= 0 && static_cast<size_t>(out.alloc) < plan->allocs.size(),
                "fastformer triton: the recorder described an output wrongly");
    plan->outputs.push_back(std::move(out));
  }
  if (plan->outputs.size() != n_outputs) {
    reason = "the Python run returned " + std::to_string(plan->outputs.size()) + " tensors, the op " +
             std::to_string(n_outputs);
    return nullptr;
  }
  return plan;
}

// ---- the entry points: key, then replay or Python ----

inline const Tensor* tensor_of(const Tensor& t) { return t.defined() ? &t : nullptr; }
inline const Tensor* tensor_of(const std::optional<Tensor>& t) { return t.has_value() && t->defined() ? &*t : nullptr; }
template <typename T>
const Tensor* tensor_of(const T&) {
  return nullptr;
}

template <typename R>
struct Result;
template <>
struct Result<Tensor> {
  static constexpr size_t size = 1;
  static Tensor make(std::vector<Tensor>& v) { return std::move(v[0]); }
};
template <typename... T>
struct Result<std::tuple<T...>> {
  static constexpr size_t size = sizeof...(T);
  static std::tuple<T...> make(std::vector<Tensor>& v) { return make(v, std::index_sequence_for<T...>{}); }
  template <size_t... I>
  static std::tuple<T...> make(std::vector<Tensor>& v, std::index_sequence<I...>) {
    return {std::move(v[I])...};
  }
};

c10::DeviceIndex current_device(c10::Device device) {
  return device.is_cpu() ? -1 : c10::impl::VirtualGuardImpl(device.type()).getDevice().index();
}

// fastformer/triton/<op>.py's <op>_<phase> for this call: replayed from its plan, else run in Python (and
// recorded when its configuration is seen for the second time).
template <typename R, typename... A>
R run(int op, int phase, const A&... args) {
  const std::array<const Tensor*, sizeof...(A)> inputs{tensor_of(args)...};
  const Tensor* first = nullptr;
  for (const Tensor* t : inputs) {
    if (first == nullptr) first = t;
  }
  TORCH_INTERNAL_ASSERT(first != nullptr);
  const c10::Device device = first->device();
  const c10::DeviceIndex current = current_device(device);
  KeyBuilder key(op, phase, device, current);
  (key.add(args), ...);
  Counters& counters = state().counters[op][phase];
  const Lookup found = lookup(key.bytes());
  if (found.plan) {
    ++counters.replays;
    std::vector<Tensor> outputs = replay(*found.plan, inputs.data(), device);
    return Result<R>::make(outputs);
  }
  ++counters.python;
  if (found.first_sight) ++counters.first_sight;
  const bool record = found.record && current == device.index();  // Triton launches on the current device
  py::gil_scoped_acquire gil;
  const py::tuple result = python().run(kOpNames[op], kPhaseNames[phase], record, py::make_tuple(args...));
  R outputs = result[0].cast<R>();
  const Status status = static_cast<Status>(result[1].cast<int>());
  if (status == Status::kNotRecorded) return outputs;
  TORCH_CHECK(status == Status::kPlan || status == Status::kRefused,
              "fastformer triton: the recorder returned an unknown status ", static_cast<int>(status));
  std::string reason = status == Status::kRefused ? result[2].cast<std::string>() : "";
  std::shared_ptr<Plan> plan;
  if (status == Status::kPlan) {
    std::vector<bool> is_tensor;
    for (const Tensor* t : inputs) is_tensor.push_back(t != nullptr);
    plan = parse(result[2], is_tensor, Result<R>::size, reason);
  }
  store(key.bytes(), std::move(plan), reason, counters);
  return outputs;
}

// The triton entry point of an op and phase, with the signature of csrc/op_entry_points.h (Sig).
template <int Op, int Phase, typename Sig>
struct Entry;
template <int Op, int Phase, typename R, typename... A>
struct Entry<Op, Phase, R(A...)> {
  static R call(A... args) { return run<R>(Op, Phase, args...); }
};

// ---- the kernel of fastformer::<op>_<phase>_py for a device key ----

std::atomic<bool> g_on_cpu{false};

// The first defined tensor among the op's n arguments on the stack (its device picks the path).
const Tensor* first_tensor(const torch::jit::Stack& stack, size_t n) {
  for (size_t i = stack.size() - n; i < stack.size(); ++i) {
    if (stack[i].isTensor() && stack[i].toTensor().defined()) return &stack[i].toTensor();
  }
  return nullptr;
}

// Boxed: the last argument is the backend. "triton" (plans on, for this device type) -> Adapter, the
// csrc/ops.h adapter over the triton entry point above; anything else -> the Python implementation.
template <auto Adapter>
void py_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  static const c10::KernelFunction triton = c10::KernelFunction::makeFromUnboxedFunction(TORCH_FN(Adapter));
  const size_t n = op.schema().arguments().size();
  const Tensor* t = first_tensor(*stack, n);
  const bool on = state().enabled.load(std::memory_order_relaxed) && stack->back().toStringRef() == "triton" &&
                  t != nullptr && (t->is_cuda() || (t->is_cpu() && g_on_cpu.load(std::memory_order_relaxed)));
  if (!on) {
    op.callBoxedForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd, *stack);
    return;
  }
  stack->pop_back();  // the backend: the adapter takes the C++ op's arguments
  triton.callBoxed(op, keys, stack);
}

#define FASTFORMER_PLAN_KERNELS(op, ...)                                                       \
  m.impl(#op "_fwd_py", torch::CppFunction::makeFromBoxedFunction<&py_kernel<&::fastformer::op##_fwd_op< \
                            &Entry<op_index(#op), 0, decltype(signatures::op##_fwd)>::call>>>());        \
  m.impl(#op "_bwd_py", torch::CppFunction::makeFromBoxedFunction<&py_kernel<&::fastformer::op##_bwd_op< \
                            &Entry<op_index(#op), 1, decltype(signatures::op##_bwd)>::call>>>());

void register_kernels(torch::Library& m) { FASTFORMER_OPS(FASTFORMER_PLAN_KERNELS) }

std::unique_ptr<torch::Library> g_cpu_library;  // the CPU registration while triton_plans_on_cpu(true)

void set_on_cpu(bool on) {
  if (on && !g_cpu_library) {
    g_cpu_library =
        std::make_unique<torch::Library>(torch::Library::IMPL, "fastformer", c10::DispatchKey::CPU, __FILE__, __LINE__);
    register_kernels(*g_cpu_library);
  } else if (!on && g_cpu_library) {
    g_cpu_library.reset();
  }
  g_on_cpu = on;
}

py::dict stats() {
  State& s = state();
  std::shared_lock<std::shared_mutex> lock(s.mutex);
  py::dict out, reasons;
  for (int op = 0; op < kNumOps; ++op) {
    for (int phase = 0; phase < 2; ++phase) {
      const Counters& c = s.counters[op][phase];
      py::dict d;
      d["replays"] = c.replays.load();
      d["python"] = c.python.load();
      d["first_sight"] = c.first_sight.load();
      d["recorded"] = c.recorded.load();
      d["refused"] = c.refused.load();
      d["evicted"] = c.evicted.load();
      out[py::str(std::string(kOpNames[op]) + "_" + kPhaseNames[phase])] = d;
    }
  }
  for (const auto& [reason, count] : s.reasons) reasons[py::str(reason)] = count;
  out["refused_reasons"] = reasons;
  out["configurations"] = s.entries.size();
  out["capacity"] = s.capacity;
  return out;
}

void clear() {
  State& s = state();
  std::unique_lock<std::shared_mutex> lock(s.mutex);
  s.entries.clear();
  s.reasons.clear();
  s.clock = 0;
  for (auto& per_op : s.counters) {
    for (Counters& c : per_op) c.replays = c.python = c.first_sight = c.recorded = c.refused = c.evicted = 0;
  }
}

size_t set_capacity(size_t capacity) {
  TORCH_CHECK(capacity >= 1, "fastformer triton plans: the capacity must be at least 1, got ", capacity);
  State& s = state();
  std::unique_lock<std::shared_mutex> lock(s.mutex);
  const size_t previous = s.capacity;
  s.capacity = capacity;
  if (s.entries.size() > capacity) evict(s, s.entries.size() - capacity);
  return previous;
}

}  // namespace
}  // namespace fastformer::triton_plans

#ifdef FASTFORMER_WITH_CUDA
TORCH_LIBRARY_IMPL(fastformer, CUDA, m) { fastformer::triton_plans::register_kernels(m); }
#endif

void fastformer::bind_triton_plans(pybind11::module_& m) {
  namespace tp = fastformer::triton_plans;
  using Kind = tp::Param::Kind;
  using tp::Status;
  // The protocol's codes, defined once above and read by fastformer/triton/plans.py.
  py::dict status, kinds;
  status["not_recorded"] = static_cast<int>(Status::kNotRecorded);
  status["plan"] = static_cast<int>(Status::kPlan);
  status["refused"] = static_cast<int>(Status::kRefused);
  kinds["input"] = static_cast<int>(Kind::kInput);
  kinds["alloc"] = static_cast<int>(Kind::kAlloc);
  kinds["value"] = static_cast<int>(Kind::kValue);
  kinds["null"] = static_cast<int>(Kind::kNull);
  m.attr("TRITON_PLAN_STATUS") = status;
  m.attr("TRITON_PLAN_PARAM_KINDS") = kinds;
  m.def("triton_plans_stats", &tp::stats,
        "per op and phase: calls replayed from C++, calls run in Python (first sights among them), configurations "
        "recorded, refused and evicted; the reasons of the refusals; the configurations in the table and its "
        "capacity (csrc/triton/plans.cpp)");
  m.def("triton_plans_clear", &tp::clear, "forgets every configuration and counter (the capacity stays)");
  m.def("triton_plans_set_capacity", &tp::set_capacity, py::arg("capacity"),
        "bounds the table to `capacity` configurations (evicting the least recently used past it); returns the "
        "previous bound");
  m.def("triton_plans_set_enabled", [](bool on) { tp::state().enabled = on; },
        "replays on (the default; FASTFORMER_TRITON_PLANS=0 starts with them off) or off (every triton call runs "
        "its Python implementation)");
  m.def("triton_plans_enabled", [] { return tp::state().enabled.load(); }, "whether plans are replayed");
  m.def("triton_plans_on_cpu", &tp::set_on_cpu, py::arg("on"),
        "registers (True) or removes (False) the plan kernel for CPU tensors: with TRITON_INTERPRET=1, the "
        "interpreter's kernels are then recorded and replayed through Python (test equipment)");
}
