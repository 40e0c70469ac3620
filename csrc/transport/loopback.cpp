#include "transport/loopback.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <random>
#include <sstream>
#include <cstdlib>
#include <string>
#include <thread>

#include "proxy/errors.hpp"
#include "proxy/host_memory.hpp"
#include "transport/loopback_copy_agent.hpp"

#ifdef UCCL_EP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace uccl_ep {
namespace {

constexpr uint64_t kMagic = 0x75636c6c6c6f6f70ull;  // "ucclloop"
constexpr uint32_t kStateRunning = 1, kStateClosed = 2;

struct alignas(64) ControlHeader {
  uint64_t magic;
  int32_t pid, rank, thread, world;
  uint32_t ring_capacity;
  std::atomic<uint32_t> state;
};

struct alignas(64) RingHeader {
  alignas(64) std::atomic<uint64_t> head;  // written by the sender
  alignas(64) std::atomic<uint64_t> tail;  // written by the receiver
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory rings need lock-free 64-bit atomics");

size_t ring_bytes(uint32_t cap) { return sizeof(RingHeader) + size_t(cap) * sizeof(uint32_t); }
size_t control_bytes(int world, uint32_t cap) { return 4096 + size_t(world) * ((ring_bytes(cap) + 63) / 64 * 64); }

RingHeader* ring_at(void* control, int src, uint32_t cap) {
  return reinterpret_cast<RingHeader*>(static_cast<char*>(control) + 4096 + size_t(src) * ((ring_bytes(cap) + 63) / 64 * 64));
}
uint32_t* ring_entries(RingHeader* r) { return reinterpret_cast<uint32_t*>(r + 1); }

uint64_t now_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch()).count());
}

struct Writer {
  std::vector<uint8_t> b;
  template <class T>
  void put(const T& v) {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  void str(const std::string& s) {
    put<uint32_t>(uint32_t(s.size()));
    b.insert(b.end(), s.begin(), s.end());
  }
};

struct Reader {
  const std::vector<uint8_t>& b;
  size_t pos = 0;
  template <class T>
  T get() {
    if (pos + sizeof(T) > b.size()) throw ProxyError("loopback: truncated connection info");
    T v;
    std::memcpy(&v, b.data() + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  std::string str() {
    const uint32_t n = get<uint32_t>();
    if (pos + n > b.size()) throw ProxyError("loopback: truncated connection info");
    std::string s(reinterpret_cast<const char*>(b.data() + pos), n);
    pos += n;
    return s;
  }
};

struct LocalRegion {
  MemoryRegion r;
  std::string shm_name;  // host memory
  size_t shm_offset = 0, shm_bytes = 0;
  std::vector<uint8_t> ipc;  // device memory: CUDA IPC handle
  int slot = -1;             // the copy agent's name for it
};

struct RemoteRegion {
  char* base = nullptr;
  size_t bytes = 0;
  MemoryKind kind = MemoryKind::kHost;
  void* map_base = nullptr;  // to unmap
  size_t map_bytes = 0;
  bool ipc_opened = false;
  int slot = -1;  // the copy agent's name for it
};

struct Peer {
  int pid = 0;
  ControlHeader* control = nullptr;
  size_t control_bytes = 0;
  RingHeader* ring_to_peer = nullptr;  // our ring inside the peer's control segment
  std::vector<RemoteRegion> regions;
  bool dead = false;
};

// Device memory is copied on a stream of the transport's own (non-blocking), never with plain cudaMemcpy on the
// legacy default stream: a device-to-device cudaMemcpy returns before the bytes land (the immediate would then be
// published first and the receiver would read stale bytes), and it is serialized behind every kernel this process
// has queued on the legacy stream of the devices involved -- including its own spinning wait kernel, which only ends
// when a peer's data arrives, which may wait on ours: a deadlock (docs/internode.md, "Transport ordering").
bool is_host(MemoryKind k) { return k == MemoryKind::kHost; }

class LoopbackTransport final : public Transport {
 public:
  explicit LoopbackTransport(const LoopbackOptions& o) : o_(o), rng_(o.seed * 1000003ull + o.rank * 131ull + o.thread_index) {
    if (o.world < 1 || o.rank < 0 || o.rank >= o.world)
      throw ProxyError("loopback: rank " + std::to_string(o.rank) + " outside world " + std::to_string(o.world));
    if (o.ring_capacity < 2 || (o.ring_capacity & (o.ring_capacity - 1)))
      throw ProxyError("loopback: ring capacity must be a power of two");
    control_ = std::make_unique<SharedHostMemory>(control_bytes(o.world, o.ring_capacity));
    auto* h = new (control_->data()) ControlHeader();
    h->magic = kMagic;
    h->pid = getpid();
    h->rank = o.rank;
    h->thread = o.thread_index;
    h->world = o.world;
    h->ring_capacity = o.ring_capacity;
    for (int s = 0; s < o.world; ++s) new (ring_at(control_->data(), s, o.ring_capacity)) RingHeader();
    h->state.store(kStateRunning, std::memory_order_release);
    header_ = h;
    in_order_ = o.reorder <= 1;
    if (o.copy_agent) lane_ = std::make_unique<CopyAgentLane>(o.copy_agent, o.thread_index);
    if (o.bandwidth_gbps > 0) {
      ns_per_byte_ = 1.0 / o.bandwidth_gbps;  // GB/s == bytes/ns
      if (!o_.wire) o_.wire = std::make_shared<LoopbackWire>();  // a wire of its own
    }
  }

  ~LoopbackTransport() override {
    header_->state.store(kStateClosed, std::memory_order_release);
    if (lane_) {  // the agent's copies write through its mappings, not ours: wait for them before peers unmap
      const uint64_t deadline = now_ns() + kDrainDeadlineNs;
      while (lane_->landed() < lane_->posted() && lane_->failure(lane_->posted()).empty() && now_ns() < deadline)
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      if (lane_->landed() < lane_->posted() && lane_->failure(lane_->posted()).empty())
        std::fprintf(stderr, "uccl-ep: loopback rank %d thread %d closed with copies unfinished after %llu s (%s)\n",
                     o_.rank, o_.thread_index, (unsigned long long)(kDrainDeadlineNs / 1000000000ull),
                     lane_->describe().c_str());
      lane_.reset();
    }
    // Device copies still running would write through the mappings closed below: wait for them, with a deadline
    // (a copy engine that never finishes means a wedged GPU; then leak the mappings rather than hang the process).
    bool drained = true;
#ifdef UCCL_EP_WITH_CUDA
    if (stream_) {
      const uint64_t deadline = now_ns() + kDrainDeadlineNs;
      cudaError_t q;
      while ((q = cudaStreamQuery(stream_)) == cudaErrorNotReady && now_ns() < deadline)
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      drained = q != cudaErrorNotReady;
      (void)cudaGetLastError();
    }
    if (drained) {
      for (auto& f : posted_)
        if (f.event && f.owns_event) cudaEventDestroy(f.event);
      for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
      if (stream_) cudaStreamDestroy(stream_);
    }
#endif
    for (auto& p : peers_) {
      for (auto& r : p.regions) {
        if (r.map_base) unmap_shared_host_memory(r.map_base, r.map_bytes);
#ifdef UCCL_EP_WITH_CUDA
        if (r.ipc_opened && drained) cudaIpcCloseMemHandle(r.base);
#endif
      }
      if (p.control) unmap_shared_host_memory(p.control, p.control_bytes);
    }
  }

  TransportCaps caps() const override {
    TransportCaps c;
    c.in_order = in_order_;
    c.native_atomics = in_order_;  // unordered emulation exercises the write-with-immediate path for atomics
    c.imm_bits = 32;
    c.max_write_bytes = 1ull << 32;
    c.max_writes_per_post = 64;
    c.name = "loopback";
    return c;
  }

  MemoryRegion register_memory(void* base, size_t bytes, MemoryKind kind) override {
    if (connected_) throw ProxyError("loopback: register_memory after connect()");
    LocalRegion lr;
    lr.r.id = int(regions_.size());
    lr.r.base = base;
    lr.r.bytes = bytes;
    lr.r.kind = kind;
    if (kind == MemoryKind::kHost) {
      if (!find_shared_host_memory(base, bytes, &lr.shm_name, &lr.shm_offset, &lr.shm_bytes))
        throw ProxyError("loopback: host memory at " + std::to_string(reinterpret_cast<uintptr_t>(base)) + " (" +
                         std::to_string(bytes) + " bytes) was not allocated with SharedHostMemory, so peers "
                         "cannot map it; allocate registrable memory with the proxy's allocator");
    } else {
#ifdef UCCL_EP_WITH_CUDA
      cudaIpcMemHandle_t h;
      if (cudaIpcGetMemHandle(&h, base) != cudaSuccess)
        throw ProxyError(std::string("loopback: cudaIpcGetMemHandle failed (pass the base of a cudaMalloc "
                                     "allocation): ") + cudaGetErrorString(cudaGetLastError()));
      lr.ipc.assign(reinterpret_cast<uint8_t*>(&h), reinterpret_cast<uint8_t*>(&h) + sizeof(h));
      // The device that runs our copies: the one that owns our registered device memory.
      cudaPointerAttributes a{};
      if (cudaPointerGetAttributes(&a, base) != cudaSuccess || a.type != cudaMemoryTypeDevice)
        throw ProxyError(std::string("loopback: cannot tell which device owns the registered device memory: ") +
                         cudaGetErrorString(cudaGetLastError()));
      if (device_ >= 0 && device_ != a.device)
        throw ProxyError("loopback: device regions on two devices (" + std::to_string(device_) + ", " +
                         std::to_string(a.device) + ") in one endpoint; use one endpoint per GPU");
      device_ = a.device;
      if (!lane_) prepare_device_copies();  // (with the copy agent this process makes no copy)
#else
      throw ProxyError("loopback: device memory registration needs a build with CUDA (UCCL_EP_WITH_GPU=CUDA)");
#endif
    }
    regions_.push_back(lr);
    return lr.r;
  }

  std::vector<uint8_t> local_info() override {
    Writer w;
    w.put<uint64_t>(kMagic);
    w.put<int32_t>(o_.rank);
    w.put<int32_t>(o_.thread_index);
    w.put<int32_t>(o_.world);
    w.put<int32_t>(getpid());
    w.put<uint32_t>(o_.ring_capacity);
    w.str(control_->name());
    w.put<uint64_t>(control_->bytes());
    w.put<uint32_t>(uint32_t(regions_.size()));
    for (auto& r : regions_) {
      w.put<uint8_t>(uint8_t(r.r.kind));
      w.put<uint64_t>(r.r.bytes);
      w.str(r.shm_name);
      w.put<uint64_t>(r.shm_offset);
      w.put<uint64_t>(r.shm_bytes);
      w.put<uint32_t>(uint32_t(r.ipc.size()));
      w.b.insert(w.b.end(), r.ipc.begin(), r.ipc.end());
    }
    return w.b;
  }

  void connect(const std::vector<std::vector<uint8_t>>& infos) override {
    if (int(infos.size()) != o_.world)
      throw ProxyError("loopback: connect got " + std::to_string(infos.size()) + " infos for world " +
                       std::to_string(o_.world));
    peers_.resize(o_.world);
    for (int r = 0; r < o_.world; ++r) {
      Reader rd{infos[r]};
      if (rd.get<uint64_t>() != kMagic) throw ProxyError("loopback: rank " + std::to_string(r) + " info is not loopback");
      const int rank = rd.get<int32_t>(), thread = rd.get<int32_t>(), world = rd.get<int32_t>();
      if (rank != r || thread != o_.thread_index || world != o_.world)
        throw ProxyError("loopback: info " + std::to_string(r) + " is from rank " + std::to_string(rank) +
                         " thread " + std::to_string(thread) + " world " + std::to_string(world) +
                         "; expected thread " + std::to_string(o_.thread_index) + " world " + std::to_string(o_.world));
      Peer& p = peers_[r];
      p.pid = rd.get<int32_t>();
      const uint32_t cap = rd.get<uint32_t>();
      if (cap != o_.ring_capacity) throw ProxyError("loopback: ring capacity differs between ranks");
      const std::string cname = rd.str();
      p.control_bytes = rd.get<uint64_t>();
      p.control = static_cast<ControlHeader*>(map_shared_host_memory(cname, p.control_bytes));
      if (p.control->magic != kMagic) throw ProxyError("loopback: control segment " + cname + " is corrupt");
      p.ring_to_peer = ring_at(p.control, o_.rank, cap);
      const uint32_t n = rd.get<uint32_t>();
      for (uint32_t i = 0; i < n; ++i) {
        RemoteRegion rr;
        rr.kind = MemoryKind(rd.get<uint8_t>());
        rr.bytes = rd.get<uint64_t>();
        const std::string name = rd.str();
        const uint64_t off = rd.get<uint64_t>(), obj = rd.get<uint64_t>();
        const uint32_t nipc = rd.get<uint32_t>();
        std::vector<uint8_t> ipc(nipc);
        for (auto& x : ipc) x = rd.get<uint8_t>();
        if (rr.kind == MemoryKind::kHost) {
          rr.map_base = map_shared_host_memory(name, obj);
          rr.map_bytes = obj;
          rr.base = static_cast<char*>(rr.map_base) + off;
        } else if (r == o_.rank) {
          rr.base = static_cast<char*>(regions_.at(i).r.base);
        } else if (lane_) {
          // (the agent maps it; we address it by slot and offset)
        } else {
#ifdef UCCL_EP_WITH_CUDA
          cudaIpcMemHandle_t h;
          std::memcpy(&h, ipc.data(), std::min(ipc.size(), sizeof(h)));
          void* ptr = nullptr;
          if (cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess) != cudaSuccess)
            throw ProxyError("loopback: cudaIpcOpenMemHandle for rank " + std::to_string(r) + " failed: " +
                             cudaGetErrorString(cudaGetLastError()));
          rr.base = static_cast<char*>(ptr);
          rr.ipc_opened = true;
#else
          throw ProxyError("loopback: rank " + std::to_string(r) + " registered device memory; this build has no CUDA");
#endif
        }
        if (lane_)
          rr.slot = rr.kind == MemoryKind::kHost ? o_.copy_agent->host_slot(name, off, obj, rr.bytes)
                                                 : o_.copy_agent->device_slot(ipc, rr.bytes);
        p.regions.push_back(rr);
      }
    }
    if (lane_) {
      for (size_t i = 0; i < regions_.size(); ++i) regions_[i].slot = peers_[o_.rank].regions.at(i).slot;
      wait_for_agent_mappings();
    }
    connected_ = true;
  }

  size_t post_writes(const WriteRequest* reqs, size_t n) override {
    size_t accepted = 0;
    const uint64_t now = now_ns();
    // (an event is taken per copy run: a write is accepted only while one is left for the run it may open; the
    // proxy posts a refused write again once completions have given events back)
    for (; accepted < n && posted_.size() < kMaxPosted && event_left_for_a_new_run(); ++accepted) {
      Op& op = posted_.emplace_back();
      op.w = reqs[accepted];
      op.deliver_at = schedule(now, op.w.bytes);
      start(op, posted_.size() - 1, now);
    }
    flush_run();
    posted_since_poll_ = posted_since_poll_ || accepted > 0;
    return accepted;
  }

  size_t post_atomics(const AtomicRequest* reqs, size_t n) override {
    size_t accepted = 0;
    const uint64_t now = now_ns();
    for (; accepted < n && posted_.size() < kMaxPosted; ++accepted) {
      Op& op = posted_.emplace_back();
      op.atomic = true;
      op.a = reqs[accepted];
      op.deliver_at = schedule(now, 8);
      start(op, posted_.size() - 1, now);
    }
    posted_since_poll_ = posted_since_poll_ || accepted > 0;
    return accepted;
  }

  size_t poll(std::vector<Completion>& out, size_t max) override {
    if (!connected_) return 0;
#ifdef UCCL_EP_WITH_CUDA
    if (!lane_) (void)bind_thread();  // first poll of the thread, before any post; a failure shows at the first post
#endif
    const size_t start = out.size();
    const uint64_t now = now_ns();
    if (now - last_liveness_ns_ > kLivenessPeriodNs) {
      last_liveness_ns_ = now;
      check_peers(out);
    }
    complete(out, max, now);
    // incoming immediates, round robin over senders
    for (int k = 0; k < o_.world && out.size() - start < max; ++k) {
      const int src = (next_src_ + k) % o_.world;
      RingHeader* ring = ring_at(control_->data(), src, o_.ring_capacity);
      uint64_t tail = ring->tail.load(std::memory_order_relaxed);
      const uint64_t head = ring->head.load(std::memory_order_acquire);
      while (tail < head && out.size() - start < max) {
        Completion c;
        c.kind = Completion::Kind::kRemoteImm;
        c.src_rank = src;
        c.imm = ring_entries(ring)[tail & (o_.ring_capacity - 1)];
        out.push_back(c);
        ++tail;
      }
      ring->tail.store(tail, std::memory_order_release);
    }
    next_src_ = (next_src_ + 1) % o_.world;
    return out.size() - start;
  }

  std::string debug_state() const override {
    std::ostringstream m;
    m << "loopback rank " << o_.rank << " thread " << o_.thread_index << ": " << posted_.size() << " posted";
    if (!posted_.empty()) {
      const Op& f = posted_.front();
      const uint64_t now = now_ns();
      size_t copying = 0;
      for (const Op& op : posted_) copying += op.copying() ? 1 : 0;
      m << " (" << copying << " device copies not known finished; oldest: " << (f.atomic ? "atomic" : "write of ")
        << (f.atomic ? 0 : f.w.bytes) << " bytes to rank " << (f.atomic ? f.a.dst_rank : f.w.dst_rank) << ", posted "
        << (now - f.started_ns) / 1000 << " us ago, "
        << (f.deliver_at > now ? "wire time in " + std::to_string((f.deliver_at - now) / 1000) + " us"
                               : std::string("wire time passed"))
        << (f.copying() ? ", its copy still running" : "") << (f.error.empty() ? "" : ", failed: " + f.error) << ")";
    }
    if (ring_full_) m << "; a receiver's immediate ring was full at the last completion";
    if (lane_) m << "; " << lane_->describe();
    m << "; totals: " << runs_ << " copies for " << writes_in_runs_ << " writes; " << copies_
      << (lane_ ? " agent copies, " : " device copies, ") << copy_ns_ / 1000 << " us copying (longest " << max_copy_ns_ / 1000 << " us)";
#ifdef UCCL_EP_WITH_CUDA
    if (device_ >= 0)  // none free: posts are refused until a copy is seen finished
      m << "; " << free_events_.size() << " of " << kCopyEvents << " copy events free";
#endif
    return m.str();
  }

 private:
  static constexpr size_t kMaxPosted = 8192;
  static constexpr uint64_t kLivenessPeriodNs = 5'000'000;
  static constexpr uint64_t kCopyDeadlineNs = 300'000'000'000ull;  // one device copy: a wedged GPU, not a slow one
  static constexpr uint64_t kDrainDeadlineNs = 10'000'000'000ull;  // copies still running when the endpoint closes
  static constexpr uint64_t kReorderHoldNs = 50'000;  // a due write waits at most this long for others to shuffle with
  static constexpr uint64_t kAgentMapDeadlineNs = 60'000'000'000ull;  // the agent opening the group's regions

  // A posted operation. Its bytes start moving at post (host: memcpy at once; device: an async copy on our stream),
  // as a NIC starts DMA at once; what the emulation delays is the *completion*: the immediate (and the local
  // completion) goes out no earlier than the wire time of the bandwidth cap and the delay, and never before the
  // bytes landed. Completions leave in post order, or shuffled in groups when reordering is emulated.
  struct Op {
    bool atomic = false;
    WriteRequest w;
    AtomicRequest a;
    uint64_t deliver_at = 0;
    uint64_t started_ns = 0;
    std::string error;  // set: complete with this error (nothing was copied)
    uint64_t ticket = 0;  // its copy run's ticket with the copy agent, until seen landed
    bool owns_event = false;  // the last write of its copy run: counts the copy (and gives its event back)
#ifdef UCCL_EP_WITH_CUDA
    cudaEvent_t event = nullptr;  // device copy not yet seen finished
    bool copying() const { return event != nullptr || ticket != 0; }
#else
    bool copying() const { return ticket != 0; }
#endif
  };

  uint64_t schedule(uint64_t now, uint64_t bytes) {
    uint64_t t = now;
    // the wire may be shared with the proxy's other endpoints: claim the next slot of it
    if (ns_per_byte_ > 0) t = o_.wire->claim(now, uint64_t(double(bytes) * ns_per_byte_), bytes);
    return t + o_.delay_us * 1000;
  }

  void check_peers(std::vector<Completion>& out) {
    for (int r = 0; r < o_.world; ++r) {
      Peer& p = peers_[r];
      if (r == o_.rank || p.dead) continue;
      const uint32_t st = p.control->state.load(std::memory_order_acquire);
      if (st == kStateClosed) continue;  // closed cleanly: only an error if we still send to it (see start)
      if (!loopback_process_alive(p.pid)) {
        p.dead = true;
        Completion c;
        c.kind = Completion::Kind::kLocalWrite;
        c.wr_id = ~0ull;
        c.status = EPIPE;
        c.error = "loopback: peer rank " + std::to_string(r) + " (pid " + std::to_string(p.pid) +
                  ") died without closing its endpoint";
        out.push_back(c);
      }
    }
  }

  // Adjacent writes of one post whose bytes continue each other (one peer, the same regions, source and destination
  // both contiguous) move as one copy. The proxy posts a hop's chunks in chains that mostly continue each other, and
  // every device copy costs the copy engine ~2 us beside its bytes: on 2x H200, 512 KiB copies reach 0.39 of one
  // large copy's bandwidth, 2 MiB ones 0.75, whatever the streams (scripts/probe_loopback_copies.cu). That is a cost
  // of the emulation -- a NIC streams a chain of writes -- so it is not charged per write. Each write still
  // completes on its own, and none before the whole copy landed.
  struct CopyRun {
    uintptr_t to = 0, from = 0;  // pointers here; with the copy agent, offsets in the regions' slots
    uint64_t bytes = 0;
    int dst = -1, local_region = -1, remote_region = -1;
    bool host = false;         // host to host: a memcpy at the flush
    size_t first = 0, count = 0;  // the writes: posted_[first, first + count)
  };

  void add_to_run(size_t index, uintptr_t to, uintptr_t from, bool host) {
    const WriteRequest& w = posted_[index].w;
    const bool continues = run_.count && run_.dst == w.dst_rank && run_.local_region == w.local_region &&
                           run_.remote_region == w.remote_region && run_.host == host &&
                           run_.to + run_.bytes == to && run_.from + run_.bytes == from &&
                           run_.first + run_.count == index;
    if (!continues) {
      flush_run();
      run_ = CopyRun{to, from, 0, w.dst_rank, w.local_region, w.remote_region, host, index, 0};
    }
    run_.bytes += w.bytes;
    ++run_.count;
  }

  // Whether a write may be accepted now: it may open a copy run, which takes an event at its flush, beside the run
  // still open (host-only endpoints: always).
  bool event_left_for_a_new_run() const {
    if (lane_) return lane_->has_room(run_.count ? 2 : 1);
#ifdef UCCL_EP_WITH_CUDA
    return device_ < 0 || free_events_.size() > (run_.count ? 1u : 0u);
#else
    return true;
#endif
  }

  // Starts the run's copy; its writes learn when it landed from one event (the last write owns it).
  void flush_run() {
    if (!run_.count) return;
    std::string err;
    uint64_t ticket = 0;
#ifdef UCCL_EP_WITH_CUDA
    cudaEvent_t ev = nullptr;
#endif
    if (lane_) {
      ticket = lane_->post(regions_[run_.local_region].slot, run_.from,
                           peers_[run_.dst].regions[run_.remote_region].slot, run_.to, run_.bytes);
      if (!ticket) err = "the copy agent's lane is full (post_writes accepts a write only while it has room)";
    } else if (run_.host) {
      std::memcpy(reinterpret_cast<char*>(run_.to), reinterpret_cast<const char*>(run_.from), run_.bytes);
    } else {
#ifdef UCCL_EP_WITH_CUDA
      err = start_device_copy(reinterpret_cast<char*>(run_.to), reinterpret_cast<const char*>(run_.from), run_.bytes,
                              &ev);
#else
      err = "device memory needs a build with CUDA";
#endif
    }
    for (size_t i = run_.first; i < run_.first + run_.count; ++i) {
      Op& op = posted_[i];
      if (!err.empty()) {
        op.error = "loopback rank " + std::to_string(o_.rank) + " -> rank " + std::to_string(run_.dst) + ": " + err;
        continue;
      }
      op.ticket = ticket;
      op.owns_event = i + 1 == run_.first + run_.count;
#ifdef UCCL_EP_WITH_CUDA
      op.event = ev;
#endif
    }
    ++runs_;
    writes_in_runs_ += run_.count;
    run_ = CopyRun{};
  }

  // Validate, then queue the bytes' copy (flush_run starts it). A failure is kept in the op and reported as its
  // completion. `index`: the op's place in posted_.
  void start(Op& op, size_t index, uint64_t now) {
    op.started_ns = now;
    const int dst = op.atomic ? op.a.dst_rank : op.w.dst_rank;
    auto fail = [&](const std::string& why) {
      op.error = "loopback rank " + std::to_string(o_.rank) + " -> rank " + std::to_string(dst) + ": " + why;
    };
    if (dst < 0 || dst >= o_.world) return fail("destination rank out of range");
    Peer& p = peers_[dst];
    if (p.dead || (dst != o_.rank && p.control->state.load(std::memory_order_acquire) == kStateClosed))
      return fail(std::string("rank ") + std::to_string(dst) + " is gone (" + (p.dead ? "died" : "closed") +
                  ") while rank " + std::to_string(o_.rank) + " still writes to it");
    if (op.atomic) {
      const AtomicRequest& a = op.a;
      if (a.remote_region < 0 || size_t(a.remote_region) >= p.regions.size()) return fail("bad remote region");
      const RemoteRegion& rr = p.regions[a.remote_region];
      if (a.remote_offset % 8 || a.remote_offset + 8 > rr.bytes || rr.kind != MemoryKind::kHost)
        return fail("atomic target outside the registered host region or unaligned");
      return;  // applied when it completes: after every earlier write landed
    }
    const WriteRequest& w = op.w;
    if (!w.bytes) return;
    if (w.local_region < 0 || size_t(w.local_region) >= regions_.size()) return fail("bad local region");
    if (w.remote_region < 0 || size_t(w.remote_region) >= p.regions.size()) return fail("bad remote region");
    const LocalRegion& lr = regions_[w.local_region];
    const RemoteRegion& rr = p.regions[w.remote_region];
    // bounds checked before any byte moves: a bad command must never scribble outside a registered region
    if (w.local_offset > lr.r.bytes || w.bytes > lr.r.bytes - w.local_offset)
      return fail("local range [" + std::to_string(w.local_offset) + ", +" + std::to_string(w.bytes) +
                  ") exceeds region " + std::to_string(w.local_region) + " of " + std::to_string(lr.r.bytes) +
                  " bytes");
    if (w.remote_offset > rr.bytes || w.bytes > rr.bytes - w.remote_offset)
      return fail("remote range [" + std::to_string(w.remote_offset) + ", +" + std::to_string(w.bytes) +
                  ") exceeds region " + std::to_string(w.remote_region) + " of " + std::to_string(rr.bytes) +
                  " bytes");
    if (lane_)  // (the agent knows the regions by slot: a run is contiguous in offsets)
      return add_to_run(index, w.remote_offset, w.local_offset, false);
    add_to_run(index, reinterpret_cast<uintptr_t>(rr.base + w.remote_offset),
               reinterpret_cast<uintptr_t>(static_cast<const char*>(lr.r.base) + w.local_offset),
               is_host(rr.kind) && is_host(lr.r.kind));
  }

#ifdef UCCL_EP_WITH_CUDA
  std::string cuda_error(const char* what, cudaError_t e) {
    (void)cudaGetLastError();
    return std::string(what) + " failed: " + cudaGetErrorString(e);
  }
  std::string cuda_error(const std::string& what, cudaError_t e) { return cuda_error(what.c_str(), e); }

  // Everything a device copy needs besides the copy and its event record -- the stream, the events, the proxy
  // thread's current device -- is made before the first post, while no kernel of ours spins. While another thread
  // of the process sits in a pageable copy that waits behind a running kernel, cudaEventCreate waits for that
  // kernel to end; under UCCL_EP_DRAIN_AFTER_WAITS=never the kernel was ours, spinning for the very bytes the post
  // carried (session 34: 60 s; scripts/probe_blocking_calls.cu PROBE_PROXY=2 against 1; docs/internode.md, "Drains").
  void prepare_device_copies() {
    int prev = -1;
    (void)cudaGetDevice(&prev);
    auto fail = [&](const char* what, cudaError_t e) {
      if (prev >= 0) (void)cudaSetDevice(prev);
      throw ProxyError("loopback: " + cuda_error(what, e));
    };
    if (cudaError_t e = cudaSetDevice(device_); e != cudaSuccess) fail("cudaSetDevice", e);
    if (!stream_)
      if (cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); e != cudaSuccess)
        fail("cudaStreamCreateWithFlags", e);
    while (free_events_.size() < kCopyEvents) {
      cudaEvent_t ev = nullptr;
      if (cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); e != cudaSuccess)
        fail("cudaEventCreateWithFlags", e);
      free_events_.push_back(ev);
    }
    if (prev >= 0) (void)cudaSetDevice(prev);
  }

  // Makes our device the calling proxy thread's current one (its default is device 0), once per thread.
  cudaError_t bind_thread() {
    if (device_ < 0 || bound_ == std::this_thread::get_id()) return cudaSuccess;
    const cudaError_t e = cudaSetDevice(device_);
    if (e == cudaSuccess) bound_ = std::this_thread::get_id();
    return e;
  }

  // The copy runs on a non-blocking stream of our device, so it neither waits for nor is waited on by anything the
  // process queued on the legacy default stream (the spinning wait kernels). Completion is an event the proxy polls.
  std::string start_device_copy(char* to, const char* from, uint64_t bytes, cudaEvent_t* event) {
    if (device_ < 0) return "a device copy, but no device memory was registered on this endpoint";
    // (bound at the thread's first poll; tests post before any poll)
    if (cudaError_t e = bind_thread(); e != cudaSuccess) return cuda_error("cudaSetDevice", e);
    if (free_events_.empty()) return "no copy event left (post_writes accepts a write only while one is)";
    cudaEvent_t ev = free_events_.back();
    free_events_.pop_back();
    if (cudaError_t e = cudaMemcpyAsync(to, from, bytes, cudaMemcpyDefault, stream_); e != cudaSuccess) {
      free_events_.push_back(ev);
      return cuda_error("cudaMemcpyAsync of " + std::to_string(bytes) + " bytes", e);
    }
    if (cudaError_t e = cudaEventRecord(ev, stream_); e != cudaSuccess) {
      free_events_.push_back(ev);
      return cuda_error("cudaEventRecord", e);
    }
    *event = ev;
    return {};
  }
#endif

  // Has the op's device copy finished? false while it runs; on failure or past the copy deadline sets op.error.
  bool landed(Op& op, uint64_t now) {
    if (op.ticket) return landed_by_agent(op, now);
#ifdef UCCL_EP_WITH_CUDA
    if (!op.event) return true;
    const cudaError_t q = cudaEventQuery(op.event);
    if (q == cudaErrorNotReady) {
      if (now - op.started_ns <= kCopyDeadlineNs) return false;
      op.error = "loopback rank " + std::to_string(o_.rank) + " -> rank " + std::to_string(op.w.dst_rank) + ": a " +
                 std::to_string(op.w.bytes) + "-byte device copy did not finish within " +
                 std::to_string(kCopyDeadlineNs / 1000000000ull) + " s (GPU wedged?)";
      op.event = nullptr;  // may still be recorded on the stream: dropped, not reused
      return true;
    }
    if (q != cudaSuccess) {
      op.error = "loopback rank " + std::to_string(o_.rank) + " -> rank " + std::to_string(op.w.dst_rank) + ": " +
                 cuda_error("device copy", q);
      op.event = nullptr;
      return true;
    }
    if (op.owns_event) {  // every earlier write of its run was asked first: completions go front to back
      ++copies_;
      copy_ns_ += now - op.started_ns;
      max_copy_ns_ = std::max(max_copy_ns_, now - op.started_ns);
      free_events_.push_back(op.event);
    }
    op.event = nullptr;
#else
    (void)op;
    (void)now;
#endif
    return true;
  }

  // landed() for a copy the agent makes: its lane's landed count reaches the run's ticket (no CUDA call here).
  bool landed_by_agent(Op& op, uint64_t now) {
    if (lane_->landed() >= op.ticket) {
      if (op.owns_event) {
        ++copies_;
        copy_ns_ += now - op.started_ns;
        max_copy_ns_ = std::max(max_copy_ns_, now - op.started_ns);
      }
      op.ticket = 0;
      return true;
    }
    std::string why = lane_->failure(op.ticket);
    if (why.empty() && now - op.started_ns > kCopyDeadlineNs)
      why = "a " + std::to_string(op.w.bytes) + "-byte copy did not land within " +
            std::to_string(kCopyDeadlineNs / 1000000000ull) + " s (" + lane_->describe() + ")";
    if (why.empty()) return false;
    op.error = "loopback rank " + std::to_string(o_.rank) + " -> rank " + std::to_string(op.w.dst_rank) + ": " + why;
    op.ticket = 0;
    return true;
  }

  // connect(): the agent maps each region as it is added; a copy it cannot resolve would fail later, so wait here,
  // while the regions' names still exist, and raise what went wrong.
  void wait_for_agent_mappings() {
    std::vector<int> slots;
    for (const Peer& p : peers_)
      for (const RemoteRegion& rr : p.regions) slots.push_back(rr.slot);
    const uint64_t deadline = now_ns() + kAgentMapDeadlineNs;
    while (!o_.copy_agent->slots_mapped(slots)) {
      std::string why = lane_->failure(~0ull);
      if (why.empty() && now_ns() > deadline)
        why = "did not map this endpoint's " + std::to_string(slots.size()) + " regions within " +
              std::to_string(kAgentMapDeadlineNs / 1000000000ull) + " s (" + lane_->describe() + ")";
      if (!why.empty()) throw ProxyError("loopback rank " + std::to_string(o_.rank) + ": copy agent: " + why);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // A write that is not due yet (NIC cap or delay) is not asked about: every cudaEventQuery takes the driver's lock,
  // which the process's own kernel launches and copies then wait for. Polled as soon as posted, the proxy threads
  // made ~1 query per microsecond under a 50 GB/s cap and the main thread's launches took ~15 us each (session 10
  // profile on 2x H200): a cost of the emulation, not of a NIC, whose proxy polls completion queues.
  bool ready(Op& op, uint64_t now) {
    if (op.error.empty() && op.deliver_at > now) return false;
    return landed(op, now) && (op.deliver_at <= now || !op.error.empty());
  }

  // Complete posted operations: publish the immediate (after the bytes landed), return the local completion.
  // In order: from the front, each waiting for the one before it. Unordered: a group of ready ones is shuffled first.
  void complete(std::vector<Completion>& out, size_t max, uint64_t now) {
    size_t n = 0;
    const size_t group = in_order_ ? 1 : size_t(o_.reorder);
    while (n < posted_.size() && n < group && ready(posted_[n], now)) ++n;
    if (n == 0) {
      posted_since_poll_ = false;
      return;
    }
    if (!in_order_) {
      // Let a group build up: complete it shuffled once it is full, or once its oldest write has been due for
      // kReorderHoldNs. Without the hold a proxy polling faster than writes become due completes them one at a time,
      // in order, and the receiver's sequence numbers are never exercised (seen on 2x H200, 2 nodes x 1 GPU).
      if (n < group && (posted_since_poll_ || now < posted_[0].deliver_at + kReorderHoldNs)) {
        posted_since_poll_ = false;
        return;
      }
      for (size_t i = n; i > 1; --i) std::swap(posted_[i - 1], posted_[rng_() % i]);
    }
    posted_since_poll_ = false;
    ring_full_ = false;
    const size_t start = out.size();
    while (!posted_.empty() && out.size() - start < max) {
      Op& f = posted_.front();
      if (in_order_ ? !ready(f, now) : n == 0) break;
      Completion c;
      c.kind = f.atomic ? Completion::Kind::kLocalAtomic : Completion::Kind::kLocalWrite;
      c.wr_id = f.atomic ? f.a.wr_id : f.w.wr_id;
      const int dst = f.atomic ? f.a.dst_rank : f.w.dst_rank;
      if (!f.error.empty()) {
        c.status = EINVAL;
        c.error = f.error;
      } else if (f.atomic) {
        const RemoteRegion& rr = peers_[dst].regions[f.a.remote_region];
        __atomic_fetch_add(reinterpret_cast<int64_t*>(rr.base + f.a.remote_offset), f.a.add, __ATOMIC_RELEASE);
      } else if (f.w.has_imm) {
        RingHeader* ring = peers_[dst].ring_to_peer;
        const uint64_t head = ring->head.load(std::memory_order_relaxed);
        if (head - ring->tail.load(std::memory_order_acquire) >= o_.ring_capacity) {  // receiver's ring full
          ring_full_ = true;
          break;
        }
        ring_entries(ring)[head & (o_.ring_capacity - 1)] = f.w.imm;
        ring->head.store(head + 1, std::memory_order_release);  // publishes the bytes (host copies) too
      }
      out.push_back(c);
      posted_.pop_front();
      if (n) --n;
    }
  }

  LoopbackOptions o_;
  std::mt19937_64 rng_;
  std::unique_ptr<SharedHostMemory> control_;
  ControlHeader* header_ = nullptr;
  bool in_order_ = true;
  bool connected_ = false;
  double ns_per_byte_ = 0;
  uint64_t last_liveness_ns_ = 0;
  bool posted_since_poll_ = false;
  int next_src_ = 0;
  std::vector<LocalRegion> regions_;
  std::vector<Peer> peers_;
  std::deque<Op> posted_;           // bytes moving or landed, completion not yet returned
  bool ring_full_ = false;
  CopyRun run_;                     // writes of the current post whose copy is not started yet
  uint64_t runs_ = 0, writes_in_runs_ = 0;  // copies started, and the writes they carried
  uint64_t copies_ = 0, copy_ns_ = 0, max_copy_ns_ = 0;  // finished device copies (for debug_state)
  int device_ = -1;                 // owner of our registered device memory (-1: none)
  std::unique_ptr<CopyAgentLane> lane_;  // with a copy agent: where our copies go
#ifdef UCCL_EP_WITH_CUDA
  // Copy runs in flight at once (an event each): the proxy's in-flight caps are far below it by default
  // (UCCL_IB_MAX_INFLIGHT_NORMAL); above it, posts are refused until a copy is seen finished.
  static constexpr size_t kCopyEvents = 64;
  std::thread::id bound_;           // the thread whose current device we set
  cudaStream_t stream_ = nullptr;
  std::vector<cudaEvent_t> free_events_;
#endif
};

}  // namespace

uint64_t LoopbackWire::claim(uint64_t now_ns, uint64_t cost_ns, uint64_t bytes) {
  // The claim itself is lock-free either way (a claim that skipped the mutex while the log was being turned on
  // must not be overwritten); the mutex only keeps the log in the order the claims succeed.
  auto take = [&](uint64_t* start) {
    uint64_t busy = busy_.load(std::memory_order_relaxed), next;
    do {
      *start = std::max(busy, now_ns);
      next = *start + cost_ns;
    } while (!busy_.compare_exchange_weak(busy, next, std::memory_order_relaxed));
    return next;
  };
  uint64_t start = 0;
  if (!logging_.load(std::memory_order_relaxed)) return take(&start);
  std::lock_guard<std::mutex> g(mu_);
  const uint64_t next = take(&start);
  if (!runs_.empty() && runs_.back().end_ns == start) {  // no pause: the same run goes on
    runs_.back().end_ns = next;
    runs_.back().bytes += bytes;
    ++runs_.back().writes;
  } else if (runs_.size() < capacity_) {
    runs_.push_back(WireRun{start, next, bytes, 1});
  } else {
    if (start != dropped_end_) ++dropped_;  // a run, not each of its writes
    dropped_end_ = next;
  }
  return next;
}

void LoopbackWire::start_log(size_t capacity) {
  std::lock_guard<std::mutex> g(mu_);
  runs_.clear();
  runs_.reserve(capacity);
  capacity_ = capacity;
  dropped_ = dropped_end_ = 0;
  logging_.store(capacity > 0, std::memory_order_relaxed);
}

std::vector<WireRun> LoopbackWire::stop_log(uint64_t* dropped) {
  std::lock_guard<std::mutex> g(mu_);
  logging_.store(false, std::memory_order_relaxed);
  if (dropped) *dropped = dropped_;
  std::vector<WireRun> out;
  out.swap(runs_);
  return out;
}

std::unique_ptr<Transport> make_loopback_transport(const LoopbackOptions& options) {
  return std::make_unique<LoopbackTransport>(options);
}

}  // namespace uccl_ep
