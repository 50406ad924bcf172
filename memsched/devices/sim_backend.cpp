// The stand-in accelerator as a PyTorch device: PrivateUse1, renamed "sim" from Python
// (memsched/devices/sim_backend.py). Its memory is ordinary host memory, but tensors on it are
// torch.device("sim") tensors: mixing them with CPU tensors raises torch's device error, as CUDA does.
//
// Parts (the shape of PyTorch's OpenReg example backend, written for memsched):
//   * a counting device allocator: bytes rounded and blocks aligned like CUDA's caching allocator (512 B),
//     a capacity whose excess raises memsched's SimOutOfMemoryError, a torch.OutOfMemoryError ([Note: the
//     stand-in's out-of-memory error]), live and peak bytes, the statistics torch.accelerator reads;
//   * a pinned host allocator: host memory whose pointers (and views into it) report is_pinned();
//   * a device guard with one device, streams and events as no-ops (copies are synchronous);
//   * kernels for allocation, views, resize, copies and scalars, and a boxed fallback that runs every
//     other op with its CPU kernel on CPU aliases of the same memory (no copy). Outputs the CPU kernel
//     allocated are adopted as device memory and counted.
//
// Only torch's C++ API is used (no pybind, no Python.h), so the build is short; the functions Python calls
// are operators in the memsched_sim namespace.

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/AutogradState.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <sys/mman.h>
#include <unistd.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <unordered_map>

// [Note: the stand-in's allocator and torch.accelerator]
// From torch 2.9 torch.accelerator's memory functions (memory_allocated, empty_cache, memory_stats, ...) ask
// the device's allocator, which must be a c10::DeviceAllocator; before, it is a plain c10::Allocator and
// those functions do not exist.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
#define MEMSCHED_SIM_DEVICE_ALLOCATOR 1
#include <c10/core/CachingDeviceAllocator.h>
#endif

namespace {

constexpr c10::DeviceType kSim = c10::DeviceType::PrivateUse1;
const c10::Device kSimDevice(kSim, 0);

// ---- byte accounting ------------------------------------------------------------------------------
// CUDA's caching allocator hands out blocks in multiples of 512 bytes (kMinBlockSize); a zero-byte
// request takes no block. The stand-in counts the same figure, so its peaks are those CUDA reports as
// allocated bytes (segments and fragmentation are reserved, not allocated).
int64_t g_round = 512;
std::atomic<int64_t> g_capacity{INT64_MAX};
std::atomic<int64_t> g_host_capacity{INT64_MAX};
std::mutex g_mu;  // guards the counters below
int64_t g_live = 0, g_peak = 0, g_allocs = 0;
// Bytes of the live ones that are model data coming and going within a step (memsched's fetched
// parameters), and the peak of live minus those: the peak of what stays.
int64_t g_moving = 0, g_peak_fixed = 0;
int64_t g_pinned_live = 0, g_pinned_peak = 0;
// What torch.accelerator.memory_stats reports besides: live blocks and their peak, running totals of blocks
// and bytes allocated and freed, the bytes requested (not rounded), out-of-memory errors.
int64_t g_blocks = 0, g_peak_blocks = 0, g_blocks_total = 0, g_blocks_freed = 0;
int64_t g_bytes_total = 0, g_bytes_freed = 0;
int64_t g_req_live = 0, g_req_peak = 0, g_req_total = 0, g_req_freed = 0;
int64_t g_ooms = 0;

// Allocations made inside begin_uncounted()/end_uncounted() are not counted (a reference computation kept
// beside a scheduler's data on the stand-in). The mark is thread-local debug info, which autograd carries to
// the device thread that runs the stand-in's backward, so a backward started inside is not counted either.
struct UncountedMark final : c10::DebugInfoBase {};
thread_local std::vector<std::unique_ptr<c10::DebugInfoGuard>> g_uncounted_guards;

bool uncounted_now() {
  return c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::TEST_INFO_2) != nullptr;
}

// [Note: a backward on the calling thread]
// torch's autograd engine makes its per-device ready queues once, at the process's first backward, for the
// device types that have a device guard then (Engine::start_device_threads). A stand-in loaded after that
// has no queue, and a backward over its tensors fails inside the engine (an internal assert on
// device_ready_queues_). memsched avoids it by registering a placeholder PrivateUse1 guard early
// (sim_backend.reserve_autograd_queue); where that was too late, the stand-in runs its backward on the
// thread that calls it, as torch does for the CPU: every thread that allocates on the stand-in or runs an op
// on it turns off autograd's multithreading for itself (torch.autograd.set_multithreading_enabled(False),
// thread-local), so the engine puts the stand-in's nodes on that thread's CPU queue. A thread that computes
// nothing on the stand-in before its backward (a graph made on another thread, with a gradient made there
// too) is not covered: see sim_backend.run_backward_on_this_thread.
std::atomic<bool> g_backward_on_caller{false};

inline void backward_here() {
  if (g_backward_on_caller.load(std::memory_order_relaxed)) {
    auto& tls = c10::AutogradState::get_tls_state();
    if (tls.get_multithreading_enabled()) tls.set_multithreading_enabled(false);
  }
}

int64_t rounded(int64_t n) {
  if (n <= 0) return 0;
  return (n + g_round - 1) / g_round * g_round;
}

// [Note: no iostreams here]
// Every message this file raises is formatted with snprintf and passed to TORCH_CHECK as one std::string,
// which torch's c10::str returns as is: no std::ostream is built in this library. On the GPU image's build
// (torch 2.11, an H200, bench/results/gpu_sim_oom_backtrace_h200.log) streaming a number in this library
// crashed inside libstdc++'s locale code, so the first out-of-memory error killed the process.
std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  std::vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

std::string fmt_bytes(int64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  return fmt(u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
}

// "1.5 GiB (1610612736 bytes)"
std::string fmt_both(int64_t n) {
  return fmt("%s (%lld bytes)", fmt_bytes(n).c_str(), static_cast<long long>(n));
}

// [Note: the stand-in's out-of-memory error]
// An allocation beyond the capacity raises memsched's SimOutOfMemoryError (memsched/devices/simdevice.py), a
// torch.OutOfMemoryError whose attributes give the bytes requested, in use and the capacity, and whose message
// adds memsched's explanation: this file calls the operator memsched_sim::raise_out_of_memory, which
// sim_backend.load() implements in Python. The Python exception travels through the dispatcher and autograd's
// threads back to the caller unchanged (as a hook's does), in a forward, a backward or at attach. Python's
// dispatch modes (memsched's warmup tracer) do not see that call. Where the Python side is not registered
// (a library that loads this file alone) the error is torch's OutOfMemoryError with the same numbers.
std::atomic<bool> g_python_oom{false};

[[noreturn]] void raise_out_of_memory(int64_t requested, int64_t in_use, int64_t cap) {
  if (g_python_oom.load()) {
    static const auto op = c10::Dispatcher::singleton()
                               .findSchemaOrThrow("memsched_sim::raise_out_of_memory", "")
                               .typed<void(int64_t, int64_t, int64_t)>();
    c10::impl::ExcludeDispatchKeyGuard no_modes(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
    try {
      op.call(requested, in_use, cap);  // raises memsched's error
    } catch (const c10::NotImplementedError&) {
      // no Python kernel for this dispatch key: torch's error below
    }
  }
  const int64_t free = cap - in_use < 0 ? 0 : cap - in_use;
  TORCH_CHECK_WITH(OutOfMemoryError, false,
      fmt("sim out of memory: tried to allocate %s on the stand-in device sim:0 with %s allocated of a "
          "capacity of %s: %s requested with %s in use, %s free", fmt_both(requested).c_str(),
          fmt_both(in_use).c_str(), fmt_both(cap).c_str(), fmt_bytes(requested).c_str(),
          fmt_bytes(in_use).c_str(), fmt_bytes(free).c_str()));
}

// Counts `bytes` (already rounded) more on the device; over capacity, raises the out-of-memory error ([Note:
// the stand-in's out-of-memory error]) with `requested` (the bytes asked for) and the bytes in use before.
void count(int64_t bytes, int64_t requested) {
  if (bytes == 0) return;
  int64_t in_use = 0, cap = 0;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    cap = g_capacity.load();
    if (g_live + bytes <= cap) {
      g_live += bytes;
      ++g_allocs;
      if (g_live > g_peak) g_peak = g_live;
      if (g_live - g_moving > g_peak_fixed) g_peak_fixed = g_live - g_moving;
      ++g_blocks;
      ++g_blocks_total;
      if (g_blocks > g_peak_blocks) g_peak_blocks = g_blocks;
      g_bytes_total += bytes;
      g_req_live += requested;
      g_req_total += requested;
      if (g_req_live > g_req_peak) g_req_peak = g_req_live;
      return;
    }
    ++g_ooms;
    in_use = g_live;
  }
  raise_out_of_memory(requested, in_use, cap);  // without the lock: it runs Python
}

// `bytes` (as counted) and `requested` (as asked for) fewer on the device.
void uncount(int64_t bytes, int64_t requested) {
  if (bytes == 0) return;
  std::lock_guard<std::mutex> lock(g_mu);
  g_live -= bytes;
  --g_blocks;
  ++g_blocks_freed;
  g_bytes_freed += bytes;
  g_req_live -= requested;
  g_req_freed += requested;
}

// Large buffers (device and pinned) are mapped pages of their own, given back to the OS when freed, as GPU
// memory and registered host memory are: the process's RSS then shows live stand-in memory, not what the C
// heap kept after the warmup's buffers were freed.
constexpr size_t kMapAbove = size_t{1} << 20;

// Smaller ones start on a 512-byte boundary, as every block of CUDA's caching allocator does: kernels choose
// their code by a tensor's address (vectorised loads, cuBLASLt's algorithms), so an address memsched makes
// ([Note: parameter alignment in chunks] in memsched/chunks/sizing.py) is aligned as torch's own would be.
constexpr size_t kBlockAlign = 512;

void* host_alloc(size_t n) {
  if (n < kMapAbove) {
    void* p = nullptr;
    TORCH_CHECK_WITH(OutOfMemoryError, posix_memalign(&p, kBlockAlign, n == 0 ? 1 : n) == 0,
                     fmt("sim: could not allocate %s of host memory",
                         fmt_both(static_cast<int64_t>(n)).c_str()));
    return p;
  }
  void* p = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK_WITH(OutOfMemoryError, p != MAP_FAILED,
                   fmt("sim: could not map %s of host memory", fmt_both(static_cast<int64_t>(n)).c_str()));
  return p;
}

void host_free(void* p, size_t n) {
  if (n < kMapAbove) {
    std::free(p);
  } else {
    munmap(p, n);
  }
}

struct Block {
  void* ptr;
  size_t n;
  int64_t counted;
};

void free_block(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  host_free(b->ptr, b->n);
  uncount(b->counted, b->counted == 0 ? 0 : static_cast<int64_t>(b->n));
  delete b;
}

#ifdef MEMSCHED_SIM_DEVICE_ALLOCATOR
using SimAllocatorBase = c10::DeviceAllocator;
#else
using SimAllocatorBase = c10::Allocator;
#endif

struct SimAllocator final : SimAllocatorBase {
  c10::DataPtr allocate(size_t n) override {
    backward_here();
    int64_t counted = uncounted_now() ? 0 : rounded(static_cast<int64_t>(n));
    count(counted, static_cast<int64_t>(n));
    void* p = nullptr;
    try {
      p = host_alloc(n);
    } catch (...) {
      uncount(counted, counted == 0 ? 0 : static_cast<int64_t>(n));
      throw;
    }
    return {p, new Block{p, n, counted}, &free_block, kSimDevice};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
#ifdef MEMSCHED_SIM_DEVICE_ALLOCATOR
  // [Note: the stand-in's allocator and torch.accelerator]. Nothing is cached: a freed block goes back at
  // once, so reserved bytes are allocated bytes and empty_cache has nothing to release.
  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}
  void recordStream(const c10::DataPtr&, c10::Stream) override {}  // one synchronous stream
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex) override;
  void resetAccumulatedStats(c10::DeviceIndex) override;
  void resetPeakStats(c10::DeviceIndex) override;
  // (free, total) bytes: the capacity less what is allocated (torch.accelerator.get_memory_info, newer torch)
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex) {
    std::lock_guard<std::mutex> lock(g_mu);
    const int64_t cap = g_capacity.load();
    return {static_cast<size_t>(cap > g_live ? cap - g_live : 0), static_cast<size_t>(cap)};
  }
#endif
};
SimAllocator g_alloc;

#ifdef MEMSCHED_SIM_DEVICE_ALLOCATOR
c10::CachingDeviceAllocator::DeviceStats SimAllocator::getDeviceStats(c10::DeviceIndex) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto set = [](auto& st, int64_t current, int64_t peak, int64_t allocated, int64_t freed) {
    st.current = current;
    st.peak = peak;
    st.allocated = allocated;
    st.freed = freed;
  };
  c10::CachingDeviceAllocator::DeviceStats out;
  constexpr size_t all = 0;  // StatType::AGGREGATE, "all" in memory_stats (no small and large pools here)
  for (auto* counts : {&out.allocation, &out.segment, &out.active}) {
    set((*counts)[all], g_blocks, g_peak_blocks, g_blocks_total, g_blocks_freed);
  }
  for (auto* bytes : {&out.allocated_bytes, &out.reserved_bytes, &out.active_bytes}) {
    set((*bytes)[all], g_live, g_peak, g_bytes_total, g_bytes_freed);
  }
  set(out.requested_bytes[all], g_req_live, g_req_peak, g_req_total, g_req_freed);
  out.num_ooms = g_ooms;
  out.num_device_alloc = g_blocks_total;
  out.num_device_free = g_blocks_freed;
  return out;
}

void reset_accumulated();
void SimAllocator::resetAccumulatedStats(c10::DeviceIndex) { reset_accumulated(); }

void SimAllocator::resetPeakStats(c10::DeviceIndex) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_peak = g_live;
  g_peak_fixed = g_live - g_moving;
  g_peak_blocks = g_blocks;
  g_req_peak = g_req_live;
}
#endif

// Memory a CPU kernel allocated, now owned by a device tensor: counted from adoption to release.
struct Adopted {
  c10::Storage cpu;
  int64_t counted;
  int64_t requested;
};
void free_adopted(void* ctx) {
  auto* a = static_cast<Adopted*>(ctx);
  uncount(a->counted, a->requested);
  delete a;
}

// ---- pinned host memory ----------------------------------------------------------------------------
std::map<uintptr_t, std::pair<size_t, size_t>> g_pinned;  // base -> (bytes, counted bytes), guarded by g_mu

// Pinned memory is counted in whole pages, as cudaHostRegister pins it (memsched/devices/pinned.py).
int64_t page_rounded(size_t n) {
  static const int64_t page = sysconf(_SC_PAGESIZE);
  int64_t b = static_cast<int64_t>(n == 0 ? 1 : n);
  return (b + page - 1) / page * page;
}

void free_pinned(void* ptr) {
  size_t n = 0;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_pinned.find(reinterpret_cast<uintptr_t>(ptr));
    if (it != g_pinned.end()) {
      n = it->second.first;
      g_pinned_live -= static_cast<int64_t>(it->second.second);
      g_pinned.erase(it);
    }
  }
  host_free(ptr, n);
}

bool is_pinned_ptr(const void* data) {
  auto p = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_pinned.upper_bound(p);
  if (it == g_pinned.begin()) return false;
  --it;
  return p < it->first + (it->second.first == 0 ? 1 : it->second.first);
}

// Pinned bytes are exact up to the page (no power-of-two rounding, unlike torch's CachingHostAllocator):
// the stand-in models the host memory memsched pins (memsched/devices/pinned.py).
struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = host_alloc(n);
    {
      std::lock_guard<std::mutex> lock(g_mu);
      int64_t cap = g_host_capacity.load();
      int64_t counted = page_rounded(n);
      if (g_pinned_live + counted > cap) {
        int64_t live = g_pinned_live;
        host_free(p, n);
        TORCH_CHECK_WITH(OutOfMemoryError, false,
            fmt("sim host out of memory: tried to pin %s with %s pinned of the stand-in host's %s",
                fmt_both(static_cast<int64_t>(n)).c_str(), fmt_both(live).c_str(), fmt_both(cap).c_str()));
      }
      g_pinned[reinterpret_cast<uintptr_t>(p)] = {n, static_cast<size_t>(counted)};
      g_pinned_live += counted;
      if (g_pinned_live > g_pinned_peak) g_pinned_peak = g_pinned_live;
    }
    return {p, p, &free_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};
PinnedAllocator g_pinned_alloc;

// ---- device guard: one device, streams and events are no-ops ---------------------------------------
struct SimGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kSim; }
  c10::Device exchangeDevice(c10::Device) const override { return kSimDevice; }
  c10::Device getDevice() const override { return kSimDevice; }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.index() <= 0, fmt("the stand-in has one device, sim:0; got %s", d.str().c_str()));
  }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, kSimDevice);
  }
  c10::Stream getDefaultStream(c10::Device) const override {
    return c10::Stream(c10::Stream::DEFAULT, kSimDevice);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device, bool) const override {
    return c10::Stream(c10::Stream::DEFAULT, kSimDevice);
  }
  c10::Stream getNewStream(c10::Device, int) const override {
    return c10::Stream(c10::Stream::DEFAULT, kSimDevice);
  }
  c10::Stream exchangeStream(c10::Stream) const noexcept override {
    return c10::Stream(c10::Stream::DEFAULT, kSimDevice);
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void*, void*, const c10::DeviceIndex) const override { return 0.0; }
  // torch.accelerator.synchronize (newer torch; no `override`, so older torch, without it, builds too)
  void synchronizeDevice(const c10::DeviceIndex) const {}
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, SimGuard);

// ---- hooks: pinned memory, generator, context -------------------------------------------------------
struct SimHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  bool isPinnedPtr(const void* data) const override { return is_pinned_ptr(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_alloc; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    // Random ops run on the CPU's generator (the fallback runs CPU kernels), so torch.manual_seed
    // seeds the stand-in as it seeds the CPU.
    return at::detail::getDefaultCPUGenerator();
  }
  at::Device getDeviceFromPtr(void*) const override { return kSimDevice; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override;
};

// ---- CPU aliases of device tensors ------------------------------------------------------------------
void noop_delete(void*) {}

// A CPU tensor over the same memory as device tensor `t` (same sizes, strides, offset); no copy.
at::Tensor cpu_alias(const at::Tensor& t) {
  const c10::Storage& st = t.storage();
  c10::Storage alias(c10::Storage::use_byte_size_t(), st.nbytes(),
                     c10::DataPtr(st.mutable_data(), st.mutable_data(), &noop_delete,
                                  c10::Device(c10::DeviceType::CPU)),
                     c10::GetDefaultCPUAllocator(), true);  // an out= argument may be resized
  auto out = at::detail::make_tensor<c10::TensorImpl>(std::move(alias), c10::DispatchKeySet(c10::DispatchKey::CPU),
                                                      t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides());
  out.unsafeGetTensorImpl()->set_storage_offset(t.storage_offset());
  return out;
}

at::Tensor with_geometry(c10::Storage storage, const at::Tensor& like) {
  auto out = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                      like.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(like.sizes(), like.strides());
  out.unsafeGetTensorImpl()->set_storage_offset(like.storage_offset());
  return out;
}

// A device tensor owning the memory of CPU tensor `cpu` (an output a CPU kernel allocated); counted.
at::Tensor adopt(const at::Tensor& cpu) {
  const c10::Storage& st = cpu.storage();
  int64_t nbytes = static_cast<int64_t>(st.nbytes());
  int64_t counted = uncounted_now() ? 0 : rounded(nbytes);
  count(counted, nbytes);
  auto* a = new Adopted{st, counted, counted == 0 ? 0 : nbytes};
  c10::Storage dev(c10::Storage::use_byte_size_t(), st.nbytes(),
                   c10::DataPtr(st.mutable_data(), a, &free_adopted, kSimDevice), &g_alloc, true);
  return with_geometry(std::move(dev), cpu);
}

void SimHooks::resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
  c10::DataPtr fresh = g_alloc.allocate(newsize);
  size_t keep = std::min(newsize, impl->nbytes());
  if (keep > 0) std::memcpy(fresh.get(), impl->data(), keep);
  impl->set_data_ptr_noswap(std::move(fresh));
  impl->set_nbytes(newsize);
}

bool is_sim(const at::Tensor& t) { return t.defined() && t.device().type() == kSim; }

// [Note: the stand-in's device check] CUDA kernels refuse CPU operands, except zero-dim CPU tensors
// (scalars), with "Expected all tensors to be on the same device". The fallback runs CPU kernels, which
// would accept them; it refuses them the same way, so code that would fail on a GPU fails here first.
void check_device(const at::Tensor& t, const c10::OperatorHandle& op) {
  if (!t.defined() || is_sim(t)) return;
  if (t.device().is_cpu() && t.dim() == 0) return;
  TORCH_CHECK(false, fmt("Expected all tensors to be on the same device, but found at least two devices, "
                         "%s and %s! (when checking arguments of %s)", kSimDevice.str().c_str(),
                         t.device().str().c_str(), op.schema().name().c_str()));
}

// ---- the boxed fallback -----------------------------------------------------------------------------
void sim_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  backward_here();
  const auto& schema = op.schema();
  const size_t nargs = schema.arguments().size();
  const size_t base = stack->size() - nargs;
  // Original device tensors by the CPU alias storage made for them, to map aliasing outputs back.
  std::unordered_map<const c10::StorageImpl*, c10::Storage> alias_of;
  std::vector<c10::IValue> originals(stack->begin() + base, stack->end());

  std::vector<std::pair<at::Tensor, at::Tensor>> tensor_args;  // (device tensor, its alias)
  auto to_cpu = [&](const at::Tensor& t) -> at::Tensor {
    if (!is_sim(t)) {
      check_device(t, op);
      return t;
    }
    at::Tensor a = cpu_alias(t);
    alias_of.emplace(a.storage().unsafeGetStorageImpl(), t.storage());
    return a;
  };
  for (size_t i = base; i < stack->size(); ++i) {
    c10::IValue& v = (*stack)[i];
    if (v.isTensor()) {
      at::Tensor t = v.toTensor();
      v = to_cpu(t);
      if (is_sim(t)) tensor_args.emplace_back(t, v.toTensor());
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) list[j] = to_cpu(list[j]);
      v = list;
    } else if (v.isList() && v.toListRef().size() > 0 && !v.isTensorList()) {
      // Tensor?[] (index, index_put_)
      auto generic = v.toList();
      bool any = false;
      for (size_t j = 0; j < generic.size(); ++j) {
        c10::IValue e = generic.get(j);
        if (e.isTensor()) {
          generic.set(j, to_cpu(e.toTensor()));
          any = true;
        }
      }
      if (any) v = generic;
    } else if (v.isDevice() && v.toDevice().type() == kSim) {
      v = c10::Device(c10::DeviceType::CPU);
    }
  }
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);

  // An out= argument the CPU kernel resized: its device tensor takes the new geometry, and new memory.
  for (auto& [t, a] : tensor_args) {
    c10::TensorImpl* ti = t.unsafeGetTensorImpl();
    if (a.storage().data() != t.storage().data() || a.storage().nbytes() != t.storage().nbytes()) {
      c10::StorageImpl* si = ti->storage().unsafeGetStorageImpl();
      const size_t n = a.storage().nbytes();
      c10::DataPtr fresh = g_alloc.allocate(n);
      if (n > 0) std::memcpy(fresh.get(), a.storage().data(), n);
      si->set_data_ptr_noswap(std::move(fresh));
      si->set_nbytes(n);
    }
    if (a.sizes() != t.sizes() || a.strides() != t.strides() || a.storage_offset() != t.storage_offset()) {
      ti->set_sizes_and_strides(a.sizes(), a.strides());
      ti->set_storage_offset(a.storage_offset());
    }
  }

  const auto& returns = schema.returns();
  const size_t nret = returns.size();
  const size_t rbase = stack->size() - nret;
  auto to_sim = [&](const at::Tensor& r) -> at::Tensor {
    if (!r.defined() || !r.device().is_cpu()) return r;
    auto it = alias_of.find(r.storage().unsafeGetStorageImpl());
    if (it != alias_of.end()) return with_geometry(it->second, r);  // a view of a device input
    return adopt(r);
  };
  for (size_t i = 0; i < nret; ++i) {
    c10::IValue& v = (*stack)[rbase + i];
    const c10::AliasInfo* info = returns[i].alias_info();
    if (info != nullptr && info->isWrite()) {
      // In-place and out= results are the argument itself.
      for (size_t a = 0; a < nargs; ++a) {
        const c10::AliasInfo* ai = schema.arguments()[a].alias_info();
        if (ai != nullptr && ai->isWrite() && ai->beforeSets() == info->beforeSets()) {
          v = originals[a];
          break;
        }
      }
      continue;
    }
    if (v.isTensor()) {
      v = to_sim(v.toTensor());
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      for (size_t j = 0; j < list.size(); ++j) list[j] = to_sim(list[j]);
      v = list;
    }
  }
}

// Convolutions run the CPU's, without oneDNN: autograd runs the stand-in's backward on a device thread of its
// own, and oneDNN's thread pool started from there aborts the process at exit ("terminate called without
// an active exception"). The flag is the process's, set around the call.
void sim_conv_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  auto& ctx = at::globalContext();
  const bool was = ctx.userEnabledMkldnn();
  ctx.setUserEnabledMkldnn(false);
  try {
    sim_fallback(op, stack);
  } catch (...) {
    ctx.setUserEnabledMkldnn(was);
    throw;
  }
  ctx.setUserEnabledMkldnn(was);
}

// ---- explicit kernels -------------------------------------------------------------------------------
at::Tensor sim_empty(c10::IntArrayRef size, std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
                     std::optional<c10::Device>, std::optional<bool>,
                     std::optional<c10::MemoryFormat> memory_format) {
  return at::detail::empty_generic(size, &g_alloc, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor sim_empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<at::ScalarType> dtype,
                             std::optional<at::Layout>, std::optional<c10::Device>, std::optional<bool>) {
  return at::detail::empty_strided_generic(size, stride, &g_alloc, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor sim_as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                          std::optional<int64_t> offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, offset);
}

at::Tensor sim_view(const at::Tensor& self, c10::IntArrayRef size) { return at::native::view(self, size); }

at::Tensor sim_reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::_reshape_alias(self, size, stride);
}

const at::Tensor& sim_resize(const at::Tensor& self, c10::IntArrayRef size,
                             std::optional<c10::MemoryFormat> memory_format) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  const int64_t needed = (impl->storage_offset() + impl->numel()) * static_cast<int64_t>(self.itemsize());
  if (impl->numel() > 0 && needed > static_cast<int64_t>(impl->storage().nbytes())) {
    at::detail::getPrivateUse1Hooks().resizePrivateUse1Bytes(impl->storage(), static_cast<size_t>(needed));
  }
  if (memory_format.has_value()) impl->empty_tensor_restride(*memory_format);
  return self;
}

at::Tensor sim_copy_from(const at::Tensor& self, const at::Tensor& dst, bool) {
  backward_here();
  at::Tensor d = is_sim(dst) ? cpu_alias(dst) : dst;
  at::Tensor s = is_sim(self) ? cpu_alias(self) : self;
  d.copy_(s);
  return dst;
}

at::Tensor sim_copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  sim_resize(dst, self.sizes(), std::nullopt);
  return sim_copy_from(self, dst, false);
}

at::Scalar sim_local_scalar_dense(const at::Tensor& self) { return cpu_alias(self).item(); }

at::Tensor& sim_set_storage(at::Tensor& self, c10::Storage source, int64_t offset, c10::IntArrayRef size,
                            c10::IntArrayRef stride) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  impl->set_storage_keep_dtype(std::move(source));
  impl->set_sizes_and_strides(size, stride);
  impl->set_storage_offset(offset);
  return self;
}

at::Tensor& sim_set_source_storage(at::Tensor& self, c10::Storage source) {
  const int64_t n = static_cast<int64_t>(source.nbytes()) / static_cast<int64_t>(self.itemsize());
  return sim_set_storage(self, std::move(source), 0, {n}, {1});
}

at::Tensor& sim_set_tensor(at::Tensor& self, const at::Tensor& src) {
  return sim_set_storage(self, src.storage(), src.storage_offset(), src.sizes(), src.strides());
}

// [Note: the stand-in and `p.data = ...`]
// torch lets `var.data = tensor` (and nn.Module._apply's in-place move) swap storage between dense CPU and
// dense CUDA tensors, but lists only its own backends as compatible; PrivateUse1 answers through this op.
// The stand-in answers as CUDA does: dense CPU and dense stand-in tensors are compatible, so a parameter
// can move between host and device in place (memsched binds parameters this way, as on CUDA) and
// module.to("sim") keeps tied weights tied.
bool sim_compatible(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && (t.device().is_cpu() || t.device().type() == kSim);
  };
  if (dense(self) && dense(from)) return true;
  return self.unsafeGetTensorImpl()->has_compatible_shallow_copy_type(from.key_set());
}

// ---- what Python calls (memsched_sim::*) ------------------------------------------------------------
std::vector<int64_t> stats() {
  std::lock_guard<std::mutex> lock(g_mu);
  return {g_live, g_peak, g_capacity.load(), g_allocs, g_pinned_live, g_pinned_peak, g_host_capacity.load(),
          g_round, g_moving, g_peak_fixed, g_blocks, g_peak_blocks, g_blocks_total, g_blocks_freed,
          g_bytes_total, g_bytes_freed, g_req_live, g_req_peak, g_req_total, g_req_freed, g_ooms};
}
void reset_accumulated() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_blocks_total = g_blocks_freed = g_bytes_total = g_bytes_freed = g_req_total = g_req_freed = 0;
  g_ooms = 0;
}
void begin_uncounted() {
  g_uncounted_guards.push_back(std::make_unique<c10::DebugInfoGuard>(c10::DebugInfoKind::TEST_INFO_2,
                                                                      std::make_shared<UncountedMark>()));
}
void end_uncounted() {
  if (!g_uncounted_guards.empty()) g_uncounted_guards.pop_back();
}
void move(int64_t bytes) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_moving += bytes;
}
void set_capacity(int64_t bytes) {
  TORCH_CHECK(bytes > 0,
              fmt("the stand-in's capacity must be > 0 bytes, got %lld", static_cast<long long>(bytes)));
  g_capacity.store(bytes);
}
void set_host_capacity(int64_t bytes) {
  TORCH_CHECK(bytes > 0,
              fmt("the stand-in host's capacity must be > 0 bytes, got %lld", static_cast<long long>(bytes)));
  g_host_capacity.store(bytes);
}
void reset_peak() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_peak = g_live;
  g_peak_fixed = g_live - g_moving;
  g_pinned_peak = g_pinned_live;
  g_peak_blocks = g_blocks;
  g_req_peak = g_req_live;
}
int64_t counted_bytes(int64_t nbytes) { return rounded(nbytes); }
// [Note: a backward on the calling thread]: from now on, in every thread that touches the stand-in.
void use_python_out_of_memory_errors() { g_python_oom.store(true); }
void run_backward_on_caller_threads() {
  g_backward_on_caller.store(true);
  backward_here();
}
bool backward_on_caller_threads() { return g_backward_on_caller.load(); }

// A CPU tensor of nbytes bytes of the stand-in's pinned host memory. Where CUDA is available,
// torch.empty(..., pin_memory=True) pins with CUDA's allocator, which the stand-in neither counts nor reports
// as pinned (torch 2.11 on a GPU host): memsched/devices/pinned.py asks here.
at::Tensor pinned_empty(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, fmt("pinned_empty of %lld bytes: the size must be >= 0",
                               static_cast<long long>(nbytes)));
  return at::detail::empty_generic({nbytes}, &g_pinned_alloc, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   at::kByte, std::nullopt);
}

void route_cpu_kernels_to_fallback();
bool g_routed = false;
void use_cpu_numerics() {  // after the aten IMPL block below is registered (explicit kernels skipped)
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_routed) return;
  route_cpu_kernels_to_fallback();
  g_routed = true;
}

// [Note: CPU numerics on the stand-in]
// An op with both a CPU kernel and a CompositeExplicitAutograd decomposition (native_layer_norm, the
// fused-attention choice, ...) would run the decomposition on PrivateUse1, not the fallback, and round
// differently from the CPU. Routing each such op to the fallback too makes the stand-in compute what the
// CPU computes, bit for bit, so a run on device="sim" can be checked against a plain CPU run.
std::unique_ptr<torch::Library> g_cpu_numerics;

void route_cpu_kernels_to_fallback() {
  auto& d = c10::Dispatcher::singleton();
  g_cpu_numerics = std::make_unique<torch::Library>(torch::Library::IMPL, "aten",
                                                    c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  for (const c10::OperatorName& name : d.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = d.findOp(name);
    if (!op.has_value() || !op->hasKernelForDispatchKey(c10::DispatchKey::CPU) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::PrivateUse1)) {
      continue;
    }
    if (!op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) &&
        !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional)) {
      continue;
    }
    std::string full = name.name.substr(6);
    if (!name.overload_name.empty()) full += "." + name.overload_name;
    g_cpu_numerics->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&sim_fallback>());
  }
}

struct Registrations {
  Registrations() {
    c10::SetAllocator(kSim, &g_alloc);
    at::RegisterPrivateUse1HooksInterface(new SimHooks());
  }
};
Registrations g_registrations;

}  // namespace

TORCH_LIBRARY(memsched_sim, m) {
  m.def("stats() -> int[]", &stats);
  m.def("set_capacity(int bytes) -> ()", &set_capacity);
  m.def("set_host_capacity(int bytes) -> ()", &set_host_capacity);
  m.def("reset_peak() -> ()", &reset_peak);
  m.def("reset_accumulated() -> ()", &reset_accumulated);
  m.def("move(int bytes) -> ()", &move);
  m.def("begin_uncounted() -> ()", &begin_uncounted);
  m.def("end_uncounted() -> ()", &end_uncounted);
  m.def("counted_bytes(int nbytes) -> int", &counted_bytes);
  m.def("pinned_empty(int nbytes) -> Tensor", &pinned_empty);
  m.def("use_cpu_numerics() -> ()", &use_cpu_numerics);
  m.def("run_backward_on_caller_threads() -> ()", &run_backward_on_caller_threads);
  // [Note: the stand-in's out-of-memory error]: implemented in Python (sim_backend.load)
  m.def("raise_out_of_memory(int requested, int in_use, int capacity) -> ()");
  m.def("use_python_out_of_memory_errors() -> ()", &use_python_out_of_memory_errors);
  m.def("backward_on_caller_threads() -> bool", &backward_on_caller_threads);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&sim_fallback>());
}

// [Note: autocast on the stand-in]
// torch.autocast("sim", dtype=...) casts as torch.autocast("cuda", ...) does: the same op lists (ATen's
// AT_FORALL_* lists, which torch registers for AutocastCUDA) under AutocastPrivateUse1: matrix products and
// convolutions in the low-precision dtype, reductions, norms and losses in fp32, the rest promoted or passed
// through. CUDA's lists, not the CPU's, because the stand-in stands for a GPU: a model that mixes dtypes under
// CUDA's autocast (nn.TransformerEncoder's fast path beside a decoder) behaves here as it would there. Ops
// without an autocast kernel pass through.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

#if defined(AT_FORALL_LOWER_PRECISION_FP) && defined(KERNEL_PRIVATEUSEONE)
namespace at::autocast {  // the lists name ATen's types unqualified, as torch's own registrations do
TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define MEMSCHED_SIM_LOW_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
  AT_FORALL_LOWER_PRECISION_FP(MEMSCHED_SIM_LOW_PRECISION_FP)
#define MEMSCHED_SIM_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_FP32(MEMSCHED_SIM_FP32)
#define MEMSCHED_SIM_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
  AT_FORALL_FP32_SET_OPT_DTYPE(MEMSCHED_SIM_FP32_SET_OPT_DTYPE)
#ifndef ADD_NS
#define ADD_NS(RAW_OP) at::RAW_OP
#endif
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
#define MEMSCHED_SIM_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_PROMOTE(MEMSCHED_SIM_PROMOTE)
}
}  // namespace at::autocast
#endif

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  // Convolutions dispatch to convolution_overrideable on PrivateUse1 (no kernel): the CPU's instead.
  m.impl("convolution", torch::CppFunction::makeFromBoxedFunction<&sim_conv_fallback>());
  m.impl("convolution_backward", torch::CppFunction::makeFromBoxedFunction<&sim_conv_fallback>());
  m.impl("empty.memory_format", &sim_empty);
  m.impl("empty_strided", &sim_empty_strided);
  m.impl("as_strided", &sim_as_strided);
  m.impl("view", &sim_view);
  m.impl("_reshape_alias", &sim_reshape_alias);
  m.impl("resize_", &sim_resize);
  m.impl("_copy_from", &sim_copy_from);
  m.impl("_copy_from_and_resize", &sim_copy_from_and_resize);
  m.impl("_local_scalar_dense", &sim_local_scalar_dense);
  m.impl("set_.source_Storage", &sim_set_source_storage);
  m.impl("set_.source_Storage_storage_offset", &sim_set_storage);
  m.impl("set_.source_Tensor", &sim_set_tensor);
  m.impl("_has_compatible_shallow_copy_type", &sim_compatible);
}
