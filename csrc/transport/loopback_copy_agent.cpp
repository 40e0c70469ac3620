#include "transport/loopback_copy_agent.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "proxy/errors.hpp"
#include "proxy/host_memory.hpp"

#ifdef UCCL_EP_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace uccl_ep {

namespace {

constexpr uint64_t kMagic = 0x7563636c63706167ull;  // "ucclcpag"
constexpr uint32_t kVersion = 1;

enum SlotState : uint32_t { kSlotEmpty = 0, kSlotFilled = 1, kSlotMapped = 2 };
enum SlotKind : uint32_t { kSlotHost = 0, kSlotDevice = 1 };

struct SlotRecord {
  std::atomic<uint32_t> state;  // SlotState: filled by the client, mapped by the agent
  uint32_t kind;
  uint64_t bytes;               // the region (its offset 0 is the slot's offset 0)
  uint8_t ipc[CopyAgentSegment::kIpcHandleBytes];
  char shm_name[96];
  uint64_t shm_offset, shm_object_bytes;
};

struct CopyRequest {
  int32_t src_slot, dst_slot;
  uint64_t src_offset, dst_offset, bytes;
};

struct alignas(64) LaneRecord {
  alignas(64) std::atomic<uint64_t> head;    // requests written (the endpoint)
  alignas(64) std::atomic<uint64_t> landed;  // requests whose bytes landed, in order (the agent)
  alignas(64) std::atomic<uint64_t> failed;  // 0, or the ticket whose copy failed (the agent); error below
  std::atomic<uint32_t> claimed;             // an endpoint holds the lane
  char error[512];
  CopyRequest ring[CopyAgentSegment::kLaneCapacity];
};

uint64_t now_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch()).count());
}

void put_text(char* to, size_t cap, const std::string& s) {
  const size_t n = std::min(cap - 1, s.size());
  std::memcpy(to, s.data(), n);
  to[n] = 0;
}

std::mutex& slot_mutex() {
  static std::mutex* m = new std::mutex();  // endpoints of one process add slots from their threads
  return *m;
}

}  // namespace

struct CopyAgentSegmentLayout {
  uint64_t magic;
  uint32_t version;
  int32_t lanes, device, client_pid;
  std::atomic<int32_t> agent_pid;
  std::atomic<uint32_t> state;  // CopyAgentState
  std::atomic<uint32_t> slots;  // slots filled so far (a prefix)
  char message[512];
  SlotRecord slot[CopyAgentSegment::kMaxSlots];

  LaneRecord* lane(int i) {
    char* first = reinterpret_cast<char*>(this) + (sizeof(CopyAgentSegmentLayout) + 63) / 64 * 64;
    return reinterpret_cast<LaneRecord*>(first) + i;
  }
  static size_t bytes(int lanes) {
    return (sizeof(CopyAgentSegmentLayout) + 63) / 64 * 64 + size_t(lanes) * sizeof(LaneRecord);
  }
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "the copy agent's lanes need lock-free 64-bit atomics");

bool loopback_process_alive(int pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return true;  // no procfs: trust kill()
  std::string line;
  std::getline(f, line);
  const size_t p = line.rfind(')');
  if (p == std::string::npos || p + 2 >= line.size()) return true;
  const char st = line[p + 2];
  if (st == 'Z' || st == 'X') return false;
  // A process inside exit() (PF_EXITING in the flags, field 9 of stat) never writes again, but it can stay in that
  // state for long: a CUDA process's exit tears its contexts down in the driver, which may wait for GPU work. Count it
  // as dead now, so the survivors abort their waits instead of sitting out the GPU deadline.
  std::istringstream rest(line.substr(p + 2));
  std::string field;
  unsigned long long flags = 0;
  for (int i = 3; i <= 9 && (rest >> field); ++i)
    if (i == 9) flags = std::strtoull(field.c_str(), nullptr, 10);
  constexpr unsigned long long kPfExiting = 0x00000004ull;
  return (flags & kPfExiting) == 0;
}

// ------------------------------------------------------------------------------------------------- the segment

std::shared_ptr<CopyAgentSegment> CopyAgentSegment::create(int lanes, int device) {
  if (lanes < 1 || lanes > 1024)
    throw ProxyError("copy agent: " + std::to_string(lanes) + " lanes (one per proxy thread: 1 to 1024)");
  static_assert((kLaneCapacity & (kLaneCapacity - 1)) == 0, "a lane's capacity must be a power of two");
  const size_t bytes = CopyAgentSegmentLayout::bytes(lanes);
  auto mem = std::make_unique<SharedHostMemory>(bytes);  // zero-filled
  auto* l = new (mem->data()) CopyAgentSegmentLayout();
  l->version = kVersion;
  l->lanes = lanes;
  l->device = device;
  l->client_pid = getpid();
  for (int i = 0; i < lanes; ++i) new (l->lane(i)) LaneRecord();
  l->magic = kMagic;
  // The segment outlives this SharedHostMemory's registry entry: map it by name like everyone else, then let the
  // creator's mapping go (its name stays linked until the process unlinks its names after connect).
  std::shared_ptr<CopyAgentSegment> seg = open(mem->name());
  seg->keep_ = std::move(mem);
  return seg;
}

std::shared_ptr<CopyAgentSegment> CopyAgentSegment::open(const std::string& name) {
  // The header first, for the size; then the whole segment.
  CopyAgentSegmentLayout* head = nullptr;
  try {
    head = static_cast<CopyAgentSegmentLayout*>(map_shared_host_memory(name, sizeof(CopyAgentSegmentLayout)));
  } catch (const ProxyError& e) {
    throw ProxyError(std::string("copy agent: cannot map its segment (is the agent's creator alive, and on this "
                                 "host?): ") + e.what());
  }
  const uint64_t magic = head->magic;
  const uint32_t version = head->version;
  const int lanes = head->lanes;
  unmap_shared_host_memory(head, sizeof(CopyAgentSegmentLayout));
  if (magic != kMagic || version != kVersion)
    throw ProxyError("copy agent: shared segment " + name + " is not a copy agent segment of version " +
                     std::to_string(kVersion));
  std::shared_ptr<CopyAgentSegment> seg(new CopyAgentSegment());
  seg->bytes_ = CopyAgentSegmentLayout::bytes(lanes);
  seg->layout_ = static_cast<CopyAgentSegmentLayout*>(map_shared_host_memory(name, seg->bytes_));
  seg->name_ = name;
  return seg;
}

CopyAgentSegment::~CopyAgentSegment() {
  if (layout_) unmap_shared_host_memory(layout_, bytes_);
}

int CopyAgentSegment::lanes() const { return layout_->lanes; }
int CopyAgentSegment::device() const { return layout_->device; }
int CopyAgentSegment::client_pid() const { return layout_->client_pid; }
int CopyAgentSegment::agent_pid() const { return layout_->agent_pid.load(std::memory_order_acquire); }
CopyAgentState CopyAgentSegment::state() const {
  return CopyAgentState(layout_->state.load(std::memory_order_acquire));
}
std::string CopyAgentSegment::agent_message() const {
  return std::string(layout_->message, strnlen(layout_->message, sizeof(layout_->message)));
}
void CopyAgentSegment::request_close() {
  uint32_t st = layout_->state.load(std::memory_order_acquire);
  while (st != uint32_t(CopyAgentState::kFailed) &&
         !layout_->state.compare_exchange_weak(st, uint32_t(CopyAgentState::kClosing), std::memory_order_acq_rel)) {
  }
}

namespace {

// The first slot whose filled record satisfies `same`, else a new one filled by `fill`; throws when none is left.
template <class Same, class Fill>
int find_or_add_slot(CopyAgentSegmentLayout* l, Same same, Fill fill) {
  std::lock_guard<std::mutex> g(slot_mutex());
  const uint32_t n = l->slots.load(std::memory_order_acquire);
  for (uint32_t i = 0; i < n; ++i)
    if (same(l->slot[i])) return int(i);
  if (n >= CopyAgentSegment::kMaxSlots)
    throw ProxyError("copy agent: more than " + std::to_string(CopyAgentSegment::kMaxSlots) +
                     " registered regions over the group's ranks (raise CopyAgentSegment::kMaxSlots)");
  SlotRecord& s = l->slot[n];
  fill(s);
  s.state.store(kSlotFilled, std::memory_order_release);
  l->slots.store(n + 1, std::memory_order_release);
  return int(n);
}

}  // namespace

int CopyAgentSegment::device_slot(const std::vector<uint8_t>& ipc, uint64_t bytes) {
  if (ipc.empty() || ipc.size() > kIpcHandleBytes)
    throw ProxyError("copy agent: a device region needs a CUDA IPC handle of at most 64 bytes, got " +
                     std::to_string(ipc.size()));
  uint8_t key[kIpcHandleBytes] = {};
  std::memcpy(key, ipc.data(), ipc.size());
  return find_or_add_slot(
      layout_,
      [&](const SlotRecord& s) { return s.kind == kSlotDevice && std::memcmp(s.ipc, key, kIpcHandleBytes) == 0; },
      [&](SlotRecord& s) {
        s.kind = kSlotDevice;
        s.bytes = bytes;
        std::memcpy(s.ipc, key, kIpcHandleBytes);
      });
}

int CopyAgentSegment::host_slot(const std::string& shm_name, uint64_t offset, uint64_t object_bytes, uint64_t bytes) {
  if (shm_name.empty() || shm_name.size() >= sizeof(SlotRecord::shm_name))
    throw ProxyError("copy agent: shared host memory name '" + shm_name + "' is empty or too long");
  return find_or_add_slot(
      layout_,
      [&](const SlotRecord& s) {
        return s.kind == kSlotHost && shm_name == s.shm_name && s.shm_offset == offset && s.bytes == bytes;
      },
      [&](SlotRecord& s) {
        s.kind = kSlotHost;
        s.bytes = bytes;
        put_text(s.shm_name, sizeof(s.shm_name), shm_name);
        s.shm_offset = offset;
        s.shm_object_bytes = object_bytes;
      });
}

bool CopyAgentSegment::slots_mapped(const std::vector<int>& slots) const {
  for (int s : slots)
    if (layout_->slot[s].state.load(std::memory_order_acquire) != kSlotMapped) return false;
  return true;
}

// ------------------------------------------------------------------------------------------------- a lane

CopyAgentLane::CopyAgentLane(std::shared_ptr<CopyAgentSegment> segment, int lane)
    : segment_(std::move(segment)), lane_(lane) {
  if (lane < 0 || lane >= segment_->lanes())
    throw ProxyError("copy agent: lane " + std::to_string(lane) + " of a segment with " +
                     std::to_string(segment_->lanes()) + " (one per proxy thread)");
  LaneRecord* r = segment_->layout()->lane(lane);
  uint32_t free = 0;
  if (!r->claimed.compare_exchange_strong(free, 1, std::memory_order_acq_rel))
    throw ProxyError("copy agent: lane " + std::to_string(lane) + " of " + segment_->name() +
                     " is held by another endpoint");
  head_ = r->head.load(std::memory_order_acquire);
}

CopyAgentLane::~CopyAgentLane() { segment_->layout()->lane(lane_)->claimed.store(0, std::memory_order_release); }

bool CopyAgentLane::has_room(uint64_t requests) const {
  return head_ + requests - landed() <= CopyAgentSegment::kLaneCapacity;
}

uint64_t CopyAgentLane::post(int src_slot, uint64_t src_offset, int dst_slot, uint64_t dst_offset, uint64_t bytes) {
  if (!has_room(1)) return 0;
  LaneRecord* r = segment_->layout()->lane(lane_);
  r->ring[head_ & (CopyAgentSegment::kLaneCapacity - 1)] = CopyRequest{src_slot, dst_slot, src_offset, dst_offset,
                                                                       bytes};
  r->head.store(++head_, std::memory_order_release);
  return head_;
}

uint64_t CopyAgentLane::landed() const {
  return segment_->layout()->lane(lane_)->landed.load(std::memory_order_acquire);
}

std::string CopyAgentLane::failure(uint64_t t) const {
  LaneRecord* r = segment_->layout()->lane(lane_);
  const uint64_t failed = r->failed.load(std::memory_order_acquire);
  if (failed && failed <= t)
    return "copy agent (pid " + std::to_string(segment_->agent_pid()) + ") lane " + std::to_string(lane_) +
           ": copy " + std::to_string(failed) + " failed: " + std::string(r->error, strnlen(r->error, sizeof(r->error)));
  if (segment_->state() == CopyAgentState::kFailed)
    return "copy agent (pid " + std::to_string(segment_->agent_pid()) + ") failed: " + segment_->agent_message();
  const uint64_t now = now_ns();
  if (!agent_dead_ && now - liveness_checked_ns_ > 5'000'000) {  // (a /proc read: not on every poll)
    liveness_checked_ns_ = now;
    const int pid = segment_->agent_pid();
    agent_dead_ = pid <= 0 || !loopback_process_alive(pid);
  }
  if (agent_dead_)
    return "copy agent (pid " + std::to_string(segment_->agent_pid()) + ") of segment " + segment_->name() +
           " is gone with copies of lane " + std::to_string(lane_) + " unfinished (" + std::to_string(landed()) +
           " of " + std::to_string(head_) + " landed)";
  return {};
}

std::string CopyAgentLane::describe() const {
  std::ostringstream m;
  m << "copy agent pid " << segment_->agent_pid() << " lane " << lane_ << ": " << landed() << " of " << head_
    << " copies landed";
  return m.str();
}

// ------------------------------------------------------------------------------------------------- the agent

namespace {

class Agent {
 public:
  static constexpr uint64_t kHotNs = 200'000'000;    // spin this long after the last copy
  static constexpr uint64_t kIdleNs = 2'000'000'000;  // then sleep 20 us at a time until this, then 500 us

  explicit Agent(std::shared_ptr<CopyAgentSegment> seg) : seg_(std::move(seg)), l_(seg_->layout()) {
    lanes_.resize(l_->lanes);
  }

  ~Agent() {
    for (const Mapped& m : mapped_)
      if (m.map_base) unmap_shared_host_memory(m.map_base, m.map_bytes);
#ifdef UCCL_EP_WITH_CUDA
    for (Lane& ln : lanes_) {
      for (auto& f : ln.inflight)
        if (f.event) cudaEventDestroy(f.event);
      for (cudaEvent_t e : ln.free_events) cudaEventDestroy(e);
      if (ln.stream) cudaStreamDestroy(ln.stream);
    }
    for (auto& kv : opened_) cudaIpcCloseMemHandle(kv.second);
#endif
  }

  // Device, streams; throws ProxyError on failure.
  void start() {
#ifdef UCCL_EP_WITH_CUDA
    if (l_->device >= 0) {
      check(cudaSetDevice(l_->device), "cudaSetDevice(" + std::to_string(l_->device) + ")");
      for (Lane& ln : lanes_) check(cudaStreamCreateWithFlags(&ln.stream, cudaStreamNonBlocking), "cudaStreamCreate");
    }
#else
    if (l_->device >= 0) throw ProxyError("this build has no CUDA: it cannot copy device memory");
#endif
  }

  // 0: closed on request, every copy landed; 1: the client is gone.
  int serve() {
    uint64_t last_work = now_ns(), last_check = 0;
    for (;;) {
      const bool worked = map_new_slots() | serve_lanes();
      const uint64_t now = now_ns();
      if (worked) last_work = now;
      if (now - last_check > 100'000'000) {
        last_check = now;
        if (!loopback_process_alive(l_->client_pid)) return 1;
      }
      if (!worked && seg_->state() == CopyAgentState::kClosing && idle()) return 0;
      if (worked) continue;
      // Hot (yielding, no sleep) for kHotNs after the last work: a hop's copies come microseconds apart, and a
      // training step's calls milliseconds apart, and a sleeping agent would start the next call's first copy one
      // timer slack (~50-100 us) late. Then light sleeps, and long ones once the run looks idle.
      const uint64_t idle_ns = now - last_work;
      if (idle_ns < kHotNs)
        std::this_thread::yield();
      else
        std::this_thread::sleep_for(std::chrono::microseconds(idle_ns < kIdleNs ? 20 : 500));
    }
  }

 private:
  struct InFlight {
    uint64_t ticket;
#ifdef UCCL_EP_WITH_CUDA
    cudaEvent_t event;  // null: a host copy, done at once (lands when the copies before it have)
#else
    void* event;
#endif
  };
  struct Lane {
    uint64_t next = 0;  // the next request to start
    bool failed = false;
    std::deque<InFlight> inflight;
#ifdef UCCL_EP_WITH_CUDA
    cudaStream_t stream = nullptr;
    std::vector<cudaEvent_t> free_events;
#endif
  };
  struct Mapped {
    char* base = nullptr;
    uint64_t bytes = 0;
    bool device = false;
    void* map_base = nullptr;
    size_t map_bytes = 0;
  };

#ifdef UCCL_EP_WITH_CUDA
  static void check(cudaError_t e, const std::string& what) {
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      throw ProxyError(what + " failed: " + cudaGetErrorString(e));
    }
  }
#endif

  // Nothing left to start or to see land (a failed lane starts nothing more: what its endpoint still posts is
  // answered by the failure, so it does not keep the agent from closing).
  bool idle() const {
    for (int i = 0; i < l_->lanes; ++i) {
      const Lane& ln = lanes_[i];
      if (!ln.inflight.empty() || (!ln.failed && ln.next < l_->lane(i)->head.load(std::memory_order_acquire)))
        return false;
    }
    return true;
  }

  // Map the slots the endpoints added (eagerly: the creator unlinks its shm names once every peer connected).
  bool map_new_slots() {
    const uint32_t n = l_->slots.load(std::memory_order_acquire);
    bool any = false;
    while (mapped_.size() < n) {
      SlotRecord& s = l_->slot[mapped_.size()];
      if (s.state.load(std::memory_order_acquire) < kSlotFilled) break;
      Mapped m;
      m.bytes = s.bytes;
      if (s.kind == kSlotHost) {
        m.map_base = map_shared_host_memory(std::string(s.shm_name, strnlen(s.shm_name, sizeof(s.shm_name))),
                                            s.shm_object_bytes);
        m.map_bytes = s.shm_object_bytes;
        m.base = static_cast<char*>(m.map_base) + s.shm_offset;
      } else {
#ifdef UCCL_EP_WITH_CUDA
        std::string key(reinterpret_cast<const char*>(s.ipc), CopyAgentSegment::kIpcHandleBytes);
        auto it = opened_.find(key);
        if (it == opened_.end()) {
          cudaIpcMemHandle_t h;
          std::memcpy(&h, s.ipc, std::min(sizeof(h), size_t(CopyAgentSegment::kIpcHandleBytes)));
          void* ptr = nullptr;
          check(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess),
                "cudaIpcOpenMemHandle (slot " + std::to_string(mapped_.size()) + ")");
          it = opened_.emplace(key, ptr).first;
        }
        m.base = static_cast<char*>(it->second);
        m.device = true;
#else
        throw ProxyError("a device region, but this build has no CUDA");
#endif
      }
      s.state.store(kSlotMapped, std::memory_order_release);
      mapped_.push_back(m);
      any = true;
    }
    return any;
  }

  bool serve_lanes() {
    bool any = false;
    for (int i = 0; i < l_->lanes; ++i) {
      Lane& ln = lanes_[i];
      LaneRecord* r = l_->lane(i);
      const uint64_t head = r->head.load(std::memory_order_acquire);
      while (!ln.failed && ln.next < head) {
        start_copy(ln, r, r->ring[ln.next & (CopyAgentSegment::kLaneCapacity - 1)], ln.next + 1);
        ++ln.next;
        any = true;
      }
      any |= complete(ln, r);
    }
    return any;
  }

  void fail(Lane& ln, LaneRecord* r, uint64_t ticket, const std::string& why) {
    put_text(r->error, sizeof(r->error), why);
    r->failed.store(ticket, std::memory_order_release);
    ln.failed = true;
  }

  void start_copy(Lane& ln, LaneRecord* r, const CopyRequest& q, uint64_t ticket) {
    // (the endpoint checked the ranges against its regions; checked again here, against what the agent mapped)
    auto range_ok = [&](int slot, uint64_t off) {
      return slot >= 0 && size_t(slot) < mapped_.size() && off <= mapped_[slot].bytes &&
             q.bytes <= mapped_[slot].bytes - off;
    };
    if (!range_ok(q.src_slot, q.src_offset) || !range_ok(q.dst_slot, q.dst_offset))
      return fail(ln, r, ticket,
                  "request out of range: " + std::to_string(q.bytes) + " bytes from slot " +
                      std::to_string(q.src_slot) + " +" + std::to_string(q.src_offset) + " to slot " +
                      std::to_string(q.dst_slot) + " +" + std::to_string(q.dst_offset) + " (" +
                      std::to_string(mapped_.size()) + " slots mapped)");
    const Mapped& from = mapped_[q.src_slot];
    const Mapped& to = mapped_[q.dst_slot];
    if (!from.device && !to.device) {
      std::memcpy(to.base + q.dst_offset, from.base + q.src_offset, q.bytes);
      ln.inflight.push_back(InFlight{ticket, nullptr});
      return;
    }
#ifdef UCCL_EP_WITH_CUDA
    cudaEvent_t ev = nullptr;
    if (!ln.free_events.empty()) {
      ev = ln.free_events.back();
      ln.free_events.pop_back();
    } else if (cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming); e != cudaSuccess) {
      (void)cudaGetLastError();
      return fail(ln, r, ticket, std::string("cudaEventCreate failed: ") + cudaGetErrorString(e));
    }
    cudaError_t e = cudaMemcpyAsync(to.base + q.dst_offset, from.base + q.src_offset, q.bytes, cudaMemcpyDefault,
                                    ln.stream);
    if (e == cudaSuccess) e = cudaEventRecord(ev, ln.stream);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      ln.free_events.push_back(ev);
      return fail(ln, r, ticket,
                  "cudaMemcpyAsync of " + std::to_string(q.bytes) + " bytes failed: " + cudaGetErrorString(e));
    }
    ln.inflight.push_back(InFlight{ticket, ev});
#endif
  }

  // Publish the copies that landed, front to back (a lane's copies complete in order).
  bool complete(Lane& ln, LaneRecord* r) {
    uint64_t landed = 0;
    while (!ln.inflight.empty()) {
      InFlight& f = ln.inflight.front();
#ifdef UCCL_EP_WITH_CUDA
      if (f.event) {
        const cudaError_t q = cudaEventQuery(f.event);
        if (q == cudaErrorNotReady) break;
        if (q != cudaSuccess) {
          (void)cudaGetLastError();
          fail(ln, r, f.ticket, std::string("device copy failed: ") + cudaGetErrorString(q));
          ln.inflight.clear();  // (its events are dropped with the failed lane)
          break;
        }
        ln.free_events.push_back(f.event);
      }
#endif
      landed = f.ticket;
      ln.inflight.pop_front();
    }
    if (landed) r->landed.store(landed, std::memory_order_release);
    return landed != 0;
  }

  std::shared_ptr<CopyAgentSegment> seg_;
  CopyAgentSegmentLayout* l_;
  std::vector<Lane> lanes_;
  std::vector<Mapped> mapped_;
  std::map<std::string, void*> opened_;  // IPC handle -> its mapping (a handle is opened once per process)
};

}  // namespace

int run_copy_agent(const std::string& name) {
  std::shared_ptr<CopyAgentSegment> seg;
  try {
    seg = CopyAgentSegment::open(name);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "uccl-ep copy agent: %s\n", e.what());
    return 2;
  }
  CopyAgentSegmentLayout* l = seg->layout();
  l->agent_pid.store(getpid(), std::memory_order_release);
  try {
    Agent agent(seg);
    agent.start();
    uint32_t starting = uint32_t(CopyAgentState::kStarting);
    l->state.compare_exchange_strong(starting, uint32_t(CopyAgentState::kReady), std::memory_order_acq_rel);
    return agent.serve();
  } catch (const std::exception& e) {
    put_text(l->message, sizeof(l->message), e.what());
    l->state.store(uint32_t(CopyAgentState::kFailed), std::memory_order_release);
    std::fprintf(stderr, "uccl-ep copy agent (pid %d): %s\n", int(getpid()), e.what());
    return 2;
  }
}

}  // namespace uccl_ep
