// The scheduler of the CPU SIMT execution model (see simt.h for what it models and why).
//
// One block at a time per OpenMP thread. The block's CUDA threads are fibers (ucontext) on stacks of
// kStackBytes, allocated once per OpenMP thread and reused. The scheduler runs in rounds: each round
// visits the warps in an order drawn from the schedule seed, and in each warp the lanes in a drawn
// order, switching into every runnable fiber until it blocks at a barrier or returns; a warp whose 32
// lanes all wait at the same warp collective is released at once (shuffle values exchanged) and runs on,
// so each warp runs ahead until a __syncthreads or its end. After a round every fiber waits at a block
// barrier or is finished: the block barrier is released when every thread waits at the same
// __syncthreads; otherwise nothing can progress (a divergent barrier or a deadlock), raised as an error.
#include "simt.h"

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace fastformer {
namespace sim {
namespace {

constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 4096;  // PROT_NONE page under each stack: an overflow faults, never corrupts
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

enum class State { kRunnable, kBlockBarrier, kWarpCollective, kDone };

struct Site {
  const char* file = nullptr;
  int line = 0;
  bool operator==(const Site& o) const { return line == o.line && std::strcmp(file, o.file) == 0; }
};

std::string where(const Site& s) {
  const char* base = std::strrchr(s.file, '/');
  return std::string(base ? base + 1 : s.file) + ":" + std::to_string(s.line);
}

// A cp.async copy queued on its thread; group -1 until committed.
struct AsyncCopy {
  void* dst;
  const void* src;
  int bytes, src_bytes;
  long group;
};

enum class Collective { kSyncWarp, kShuffle, kCompute };

struct Fiber {
  ucontext_t context;
  Coords coords;
  State state = State::kRunnable;
  Site site;
  // warp collective in progress
  Collective kind = Collective::kSyncWarp;
  ShuffleMode mode = ShuffleMode::kIndex;
  int lane_arg = 0, width = kWarp;
  uint64_t value = 0, result = 0;
  void* record = nullptr;  // kCompute: this lane's operand record
  CollectiveFn compute = nullptr;
  // cp.async copies not yet retired, and the number of groups committed so far
  std::vector<AsyncCopy> copies;
  long groups = 0;
  uint64_t issued = 0;  // cp.async calls so far
};

// Per OpenMP thread: the fibers of the block being run and their stacks.
struct Scheduler {
  ucontext_t main_context;
  std::vector<Fiber> fibers;
  char* stacks = nullptr;
  size_t stack_count = 0;
  Fiber* current = nullptr;
  const std::function<void()>* body = nullptr;
  std::exception_ptr error;

  ~Scheduler() {
    if (stacks != nullptr) munmap(stacks, stack_count * (kStackBytes + kGuardBytes));
  }

  char* stack(size_t i) { return stacks + i * (kStackBytes + kGuardBytes) + kGuardBytes; }

  void reserve_stacks(size_t n) {
    if (n <= stack_count) return;
    if (stacks != nullptr) munmap(stacks, stack_count * (kStackBytes + kGuardBytes));
    const size_t bytes = n * (kStackBytes + kGuardBytes);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("cuda_sim: cannot allocate fiber stacks");
    stacks = static_cast<char*>(p);
    stack_count = n;
    for (size_t i = 0; i < n; ++i) mprotect(stacks + i * (kStackBytes + kGuardBytes), kGuardBytes, PROT_NONE);
  }

  void run_block(dim3 grid, dim3 block, dim3 block_idx, uint64_t seed);

 private:
  void resume(Fiber& f);
  bool release_warp(int w, const std::string& block_name);
  bool release_block(const std::string& block_name);
  [[noreturn]] void stuck(const std::string& block_name);
};

thread_local Scheduler* tls_scheduler = nullptr;
uint64_t g_schedule_seed = 0;
std::string g_deleted_file;  // mutation testing: the barrier treated as deleted (empty: none)
int g_deleted_line = 0;
std::atomic<uint64_t> g_deleted_hits{0};

bool is_deleted(const char* file, int line) {
  if (g_deleted_file.empty() || line != g_deleted_line) return false;
  const size_t n = std::strlen(file), m = g_deleted_file.size();
  return n >= m && g_deleted_file.compare(0, m, file + n - m) == 0;
}

Scheduler& scheduler() {
  if (tls_scheduler == nullptr) {
    static thread_local std::unique_ptr<Scheduler> owned(new Scheduler());
    tls_scheduler = owned.get();
  }
  return *tls_scheduler;
}

Fiber& running_fiber() {
  Scheduler* s = tls_scheduler;
  if (s == nullptr || s->current == nullptr) {
    throw std::logic_error("cuda_sim: a CUDA built-in was used outside a kernel launched by sim::launch");
  }
  return *s->current;
}

void fiber_entry() {
  Scheduler& s = *tls_scheduler;
  try {
    (*s.body)();
    if (!s.current->copies.empty()) {
      throw std::runtime_error("cuda_sim: a thread exited with " + std::to_string(s.current->copies.size()) +
                               " cp.async copies never waited for (cp.async.wait_group missing)");
    }
  } catch (...) {
    if (!s.error) s.error = std::current_exception();
  }
  s.current->state = State::kDone;
  // returning resumes uc_link = the scheduler's context
}

// Switch from the running fiber back to the scheduler (after it recorded why it blocks).
void yield_to_scheduler() {
  Scheduler& s = *tls_scheduler;
  Fiber* f = s.current;
  swapcontext(&f->context, &s.main_context);
}

void Scheduler::resume(Fiber& f) {
  current = &f;
  swapcontext(&main_context, &f.context);
  current = nullptr;
  if (error) std::rethrow_exception(error);
}

std::string thread_list(const std::vector<int>& ids) {
  std::ostringstream out;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i == 8) { out << ", ... (" << ids.size() << " threads)"; break; }
    out << (i ? ", " : "") << ids[i];
  }
  return out.str();
}

// Groups thread ids by what they are doing, e.g. "threads 0, 1 wait at __syncthreads (softmax.cuh:40)".
std::string describe(const std::vector<Fiber>& fibers, const std::vector<int>& ids) {
  std::map<std::string, std::vector<int>> groups;
  for (int t : ids) {
    const Fiber& f = fibers[t];
    std::string what;
    switch (f.state) {
      case State::kDone: what = "exited"; break;
      case State::kBlockBarrier: what = "wait at __syncthreads (" + where(f.site) + ")"; break;
      case State::kWarpCollective:
        what = std::string("wait at ") +
               (f.kind == Collective::kShuffle ? "a warp shuffle"
                : f.kind == Collective::kCompute ? "a warp-collective instruction" : "__syncwarp") +
               " (" + where(f.site) + ")";
        break;
      case State::kRunnable: what = "runnable"; break;
    }
    groups[what].push_back(t);
  }
  std::ostringstream out;
  bool first = true;
  for (auto& [what, group] : groups) {
    out << (first ? "" : "; ") << "threads " << thread_list(group) << " " << what;
    first = false;
  }
  return out.str();
}

// Warp collectives: when the 32 lanes of warp w all wait at the same collective, it is released (shuffle
// values exchanged) and the warp runs on at once: warps advance independently between block barriers,
// so one that runs ahead can overwrite shared memory another has not read yet (a missing barrier shows).
bool Scheduler::release_warp(int w, const std::string& block_name) {
  Fiber* lanes = &fibers[static_cast<size_t>(w) * kWarp];
  int waiting = 0;
  for (int l = 0; l < kWarp; ++l) waiting += lanes[l].state == State::kWarpCollective;
  if (waiting == 0) return false;
  bool same_site = waiting == kWarp;
  for (int l = 1; l < kWarp && same_site; ++l) same_site = lanes[l].site == lanes[0].site;
  if (!same_site) {
    // The lanes are all blocked (none runnable), some at a collective the others never reach: they
    // wait at another one, at a block barrier that needs these lanes too, or exited.
    std::vector<int> ids(kWarp);
    for (int l = 0; l < kWarp; ++l) ids[l] = w * kWarp + l;
    throw std::runtime_error("cuda_sim: divergent warp collective in block " + block_name + ", warp " +
                             std::to_string(w) + ": " + describe(fibers, ids) +
                             " (all 32 lanes must reach the same __syncwarp/__shfl_*_sync)");
  }
  if (lanes[0].kind == Collective::kCompute) {
    void* records[kWarp];
    for (int l = 0; l < kWarp; ++l) records[l] = lanes[l].record;
    lanes[0].compute(records);
  } else if (lanes[0].kind == Collective::kShuffle) {
    for (int l = 0; l < kWarp; ++l) {
      Fiber& f = lanes[l];
      const int width = f.width, segment = (l / width) * width, lane_in = l % width;
      int src = l;
      switch (f.mode) {
        case ShuffleMode::kIndex: src = segment + ((f.lane_arg % width) + width) % width; break;
        case ShuffleMode::kXor: src = (l ^ f.lane_arg) < segment + width ? (l ^ f.lane_arg) : l; break;
        case ShuffleMode::kDown: src = lane_in + f.lane_arg < width ? l + f.lane_arg : l; break;
        case ShuffleMode::kUp: src = lane_in - f.lane_arg >= 0 ? l - f.lane_arg : l; break;
      }
      f.result = lanes[src].value;
    }
  }
  for (int l = 0; l < kWarp; ++l) lanes[l].state = State::kRunnable;
  return true;
}

// The block barrier: released when every thread waits at the same __syncthreads.
bool Scheduler::release_block(const std::string& block_name) {
  int waiting = 0;
  for (const Fiber& f : fibers) waiting += f.state == State::kBlockBarrier;
  if (waiting == 0) return false;
  if (waiting < static_cast<int>(fibers.size())) return false;  // others exited or wait elsewhere: stuck()
  for (const Fiber& f : fibers) {
    if (!(f.site == fibers[0].site)) {
      std::vector<int> ids(fibers.size());
      for (size_t t = 0; t < fibers.size(); ++t) ids[t] = static_cast<int>(t);
      throw std::runtime_error("cuda_sim: divergent __syncthreads in block " + block_name +
                               ": threads wait at different barriers: " + describe(fibers, ids));
    }
  }
  for (Fiber& f : fibers) f.state = State::kRunnable;
  return true;
}

void Scheduler::stuck(const std::string& block_name) {
  std::vector<int> ids(fibers.size());
  for (size_t t = 0; t < fibers.size(); ++t) ids[t] = static_cast<int>(t);
  throw std::runtime_error("cuda_sim: deadlock in block " + block_name + " (a barrier not reached by every "
                           "thread of the block; on a GPU this hangs or is undefined): " + describe(fibers, ids));
}

void Scheduler::run_block(dim3 grid, dim3 block, dim3 block_idx, uint64_t seed) {
  const int n = static_cast<int>(block.x * block.y * block.z);
  const int n_warps = n / kWarp;
  reserve_stacks(n);
  fibers.assign(n, Fiber());
  error = nullptr;
  for (int t = 0; t < n; ++t) {
    Fiber& f = fibers[t];
    f.coords.thread_idx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
    f.coords.block_idx = block_idx;
    f.coords.block_dim = block;
    f.coords.grid_dim = grid;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = stack(t);
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = &main_context;
    makecontext(&f.context, fiber_entry, 0);
  }
  const std::string block_name = "(" + std::to_string(block_idx.x) + ", " + std::to_string(block_idx.y) + ", " +
                                 std::to_string(block_idx.z) + ")";
  const uint64_t linear = (static_cast<uint64_t>(block_idx.z) * grid.y + block_idx.y) * grid.x + block_idx.x;
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + linear);
  std::vector<int> warp_order(n_warps), lane_order(kWarp);
  for (int w = 0; w < n_warps; ++w) warp_order[w] = w;
  for (int l = 0; l < kWarp; ++l) lane_order[l] = l;
  tls_scheduler = this;
  while (true) {
    if (seed != 0) std::shuffle(warp_order.begin(), warp_order.end(), rng);
    for (int w : warp_order) {
      do {  // the warp runs until its lanes block at a __syncthreads or exit
        if (seed != 0) std::shuffle(lane_order.begin(), lane_order.end(), rng);
        for (int l : lane_order) {
          Fiber& f = fibers[static_cast<size_t>(w) * kWarp + l];
          if (f.state == State::kRunnable) resume(f);
        }
      } while (release_warp(w, block_name));
    }
    bool all_done = true;
    for (const Fiber& f : fibers) all_done &= f.state == State::kDone;
    if (all_done) return;
    if (release_block(block_name)) continue;
    stuck(block_name);
  }
}

}  // namespace

const Coords& coords() { return running_fiber().coords; }

void set_schedule_seed(uint64_t seed) { g_schedule_seed = seed; }
uint64_t schedule_seed() { return g_schedule_seed; }

void delete_barrier(const char* file, int line) {
  g_deleted_file = file;
  g_deleted_line = line;
  g_deleted_hits = 0;
}

uint64_t deleted_barrier_hits() { return g_deleted_hits; }

void syncthreads(const char* file, int line) {
  if (is_deleted(file, line)) {
    ++g_deleted_hits;
    return;
  }
  Fiber& f = running_fiber();
  f.state = State::kBlockBarrier;
  f.site = Site{file, line};
  yield_to_scheduler();
}

void syncwarp(unsigned mask, const char* file, int line) {
  if (mask != kFullMask) throw std::runtime_error("cuda_sim: only full-mask __syncwarp is modeled (" + where(Site{file, line}) + ")");
  Fiber& f = running_fiber();
  f.state = State::kWarpCollective;
  f.site = Site{file, line};
  f.kind = Collective::kSyncWarp;
  yield_to_scheduler();
}

void warp_collective(void* record, CollectiveFn compute, const char* file, int line) {
  Fiber& f = running_fiber();
  f.state = State::kWarpCollective;
  f.site = Site{file, line};
  f.kind = Collective::kCompute;
  f.record = record;
  f.compute = compute;
  yield_to_scheduler();
}

static void land(const AsyncCopy& c) {
  if (c.src_bytes > 0) std::memcpy(c.dst, c.src, static_cast<size_t>(c.src_bytes));
  std::memset(static_cast<char*>(c.dst) + c.src_bytes, 0, static_cast<size_t>(c.bytes - c.src_bytes));
}

void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
  if (src_bytes < 0 || src_bytes > bytes) throw std::runtime_error("cuda_sim: cp.async src_bytes out of [0, bytes]");
  const auto misaligned = [bytes](const void* p) { return reinterpret_cast<uintptr_t>(p) % bytes != 0; };
  if (misaligned(dst) || (src_bytes > 0 && misaligned(src))) {
    throw std::runtime_error("cuda_sim: cp.async of " + std::to_string(bytes) + " bytes needs " +
                             std::to_string(bytes) + "-byte aligned addresses");
  }
  Fiber& f = running_fiber();
  const AsyncCopy copy{dst, src, bytes, src_bytes, -1};
  // A copy may land at any moment between its issue and its wait: under a nonzero schedule seed, a
  // draw from (seed, block, thread, copy number) lands it at once, else it lands at the wait. Landing
  // late exposes a tile read before its wait; landing early exposes a buffer refilled while another
  // warp still reads it (a missing __syncthreads before the refill).
  if (g_schedule_seed != 0) {
    const Coords& c = f.coords;
    const uint64_t block = (static_cast<uint64_t>(c.block_idx.z) * c.grid_dim.y + c.block_idx.y) * c.grid_dim.x +
                           c.block_idx.x;
    const uint64_t thread = (static_cast<uint64_t>(c.thread_idx.z) * c.block_dim.y + c.thread_idx.y) * c.block_dim.x +
                            c.thread_idx.x;
    uint64_t h = g_schedule_seed * 0x9E3779B97F4A7C15ull ^ (block << 20) ^ (thread << 8) ^ f.issued++;
    h = (h ^ (h >> 31)) * 0xBF58476D1CE4E5B9ull;  // splitmix64's finalizer
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
    if ((h ^ (h >> 31)) & 1) {
      land(copy);
      return;
    }
  }
  f.copies.push_back(copy);
}

void cp_async_commit() {
  Fiber& f = running_fiber();
  for (AsyncCopy& c : f.copies) {
    if (c.group < 0) c.group = f.groups;
  }
  ++f.groups;
}

void cp_async_wait(int pending_groups) {
  Fiber& f = running_fiber();
  const long retire_below = f.groups - pending_groups;  // groups [0, retire_below) must be complete
  std::vector<AsyncCopy> left;
  for (const AsyncCopy& c : f.copies) {
    if (c.group >= 0 && c.group < retire_below) {
      land(c);
    } else {
      left.push_back(c);
    }
  }
  f.copies.swap(left);
}

int g_compute_capability = 80;
void set_compute_capability(int major_minor) { g_compute_capability = major_minor; }
int compute_capability() { return g_compute_capability; }

uint64_t shuffle(unsigned mask, uint64_t bits, ShuffleMode mode, int lane_arg, int width, const char* file, int line) {
  if (mask != kFullMask) throw std::runtime_error("cuda_sim: only full-mask shuffles are modeled (" + where(Site{file, line}) + ")");
  if (width <= 0 || width > kWarp || (width & (width - 1)) != 0) {
    throw std::runtime_error("cuda_sim: shuffle width must be a power of two <= 32 (" + where(Site{file, line}) + ")");
  }
  Fiber& f = running_fiber();
  f.state = State::kWarpCollective;
  f.site = Site{file, line};
  f.mode = mode;
  f.lane_arg = lane_arg;
  f.width = width;
  f.value = bits;
  f.kind = Collective::kShuffle;
  yield_to_scheduler();
  return running_fiber().result;
}

void launch(dim3 grid, dim3 block, const std::function<void()>& body) {
  const long long threads = static_cast<long long>(block.x) * block.y * block.z;
  if (threads <= 0 || threads > 1024 || threads % kWarp != 0) {
    throw std::runtime_error("cuda_sim: a block must have a multiple of 32 threads, at most 1024; got " +
                             std::to_string(block.x) + "x" + std::to_string(block.y) + "x" + std::to_string(block.z));
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
    throw std::runtime_error("cuda_sim: invalid grid " + std::to_string(grid.x) + "x" + std::to_string(grid.y) + "x" +
                             std::to_string(grid.z));
  }
  const long long blocks = static_cast<long long>(grid.x) * grid.y * grid.z;
  const uint64_t seed = g_schedule_seed;
  std::exception_ptr first_error;
#pragma omp parallel for schedule(dynamic, 1)
  for (long long b = 0; b < blocks; ++b) {
    try {
      Scheduler& s = scheduler();
      s.body = &body;
      const dim3 idx(static_cast<unsigned>(b % grid.x), static_cast<unsigned>((b / grid.x) % grid.y),
                     static_cast<unsigned>(b / (static_cast<long long>(grid.x) * grid.y)));
      s.run_block(grid, block, idx, seed);
    } catch (...) {
#pragma omp critical(fastformer_sim_error)
      if (!first_error) first_error = std::current_exception();
    }
  }
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace sim
}  // namespace fastformer
