#include "proxy/proxy.hpp"

#include <pthread.h>
#include <sched.h>
#include <sys/stat.h>

#include <cstdio>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "proxy/errors.hpp"
#include "proxy/ordering.hpp"

namespace uccl_ep {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kProxyInfoMagic = 0x7563636c70727879ull;
constexpr int kDataRegion = 0, kSignalRegion = 1;
constexpr uint64_t kBytesMask = (1ull << 56) - 1;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct ProxyInfo {
  uint64_t magic, data_bytes;
  int32_t rank, world, num_slots, window, fifos_per_thread, in_order;
};

// Queued operations are WriteRequests so that a run of them can go to post_writes() straight from the queue. An
// atomic shares the queue (one FIFO's operations keep their order) and is told apart by local_region ==
// kAtomicMarker; it carries its addend in local_offset, which an atomic has no other use for.
constexpr int kAtomicMarker = -1;

bool is_atomic(const WriteRequest& w) { return w.local_region == kAtomicMarker; }

WriteRequest queued_atomic(const AtomicRequest& a) {
  WriteRequest w;
  w.dst_rank = a.dst_rank;
  w.local_region = kAtomicMarker;
  w.local_offset = uint64_t(a.add);
  w.remote_region = a.remote_region;
  w.remote_offset = a.remote_offset;
  w.wr_id = a.wr_id;
  return w;
}

AtomicRequest as_atomic(const WriteRequest& w) {
  AtomicRequest a;
  a.dst_rank = w.dst_rank;
  a.remote_region = w.remote_region;
  a.remote_offset = w.remote_offset;
  a.add = int64_t(w.local_offset);
  a.wr_id = w.wr_id;
  return a;
}

// Operations waiting for in-flight budget. A ring rather than std::deque: a refused tail goes back to the front, the
// front run is contiguous for post_writes() (up to the wrap), and after warm-up nothing is allocated.
class OpQueue {
 public:
  explicit OpQueue(size_t capacity) {
    size_t c = 16;
    while (c < capacity) c <<= 1;
    buf_.resize(c);
    mask_ = c - 1;
  }
  size_t size() const { return n_; }
  bool empty() const { return n_ == 0; }
  WriteRequest& front() { return buf_[head_]; }
  const WriteRequest& operator[](size_t i) const { return buf_[(head_ + i) & mask_]; }
  // Operations from the front that lie one after another in memory.
  size_t contiguous() const { return std::min(n_, buf_.size() - head_); }
  void push_back(const WriteRequest& w) {
    if (n_ == buf_.size()) grow();
    buf_[(head_ + n_) & mask_] = w;
    ++n_;
  }
  // The new back slot, left as it was: the caller sets every field.
  WriteRequest& emplace_back() {
    if (n_ == buf_.size()) grow();
    return buf_[(head_ + n_++) & mask_];
  }
  void push_front(const WriteRequest& w) {
    if (n_ == buf_.size()) grow();
    head_ = (head_ - 1) & mask_;
    buf_[head_] = w;
    ++n_;
  }
  void pop_front(size_t k) {
    head_ = (head_ + k) & mask_;
    n_ -= k;
  }

 private:
  void grow() {
    std::vector<WriteRequest> b(buf_.size() * 2);
    for (size_t i = 0; i < n_; ++i) b[i] = (*this)[i];
    buf_.swap(b);
    head_ = 0;
    mask_ = buf_.size() - 1;
  }
  std::vector<WriteRequest> buf_;
  size_t head_ = 0, n_ = 0, mask_ = 0;
};

void update_max(std::atomic<uint64_t>& m, uint64_t v) {
  if (v > m.load(std::memory_order_relaxed)) m.store(v, std::memory_order_relaxed);
}

// What describe() reads of one FIFO; written by its proxy thread only.
struct FifoView {
  std::atomic<uint64_t> outstanding{0};
  std::atomic<uint32_t> barrier{0};  // 0: no barrier announced; else its epoch + 1
};

}  // namespace

namespace {
// The dump trigger's modification time in ns, -1 when there is none (no path set, or no such file).
int64_t file_mtime_ns(const std::string& path) {
  struct stat st;
  if (path.empty() || ::stat(path.c_str(), &st) != 0) return -1;
  return int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

enum Activity : int { kInLoop = 0, kInTransportPoll = 1, kInTransportPost = 2, kInBackoff = 3 };
const char* activity_name(int a) {
  switch (a) {
    case kInTransportPoll: return "the transport's poll()";
    case kInTransportPost: return "a transport post (post_writes / post_atomics)";
    case kInBackoff: return "the idle back-off";
    default: return "the proxy loop itself";
  }
}
}  // namespace

struct Proxy::ThreadState {
  int index = 0;
  std::unique_ptr<Transport> transport;
  TransportCaps caps;
  std::unique_ptr<ImmCodec> codec;
  std::unique_ptr<SignalSequencer> sequencer;
  std::unique_ptr<ReorderBuffer> reorder;
  std::vector<Fifo*> fifos;
  std::vector<uint64_t> outstanding;                       // per local FIFO: ops queued or in flight
  std::vector<int> barrier_phase;                          // 0 none, 1 announced
  std::vector<uint32_t> barrier_epoch;
  std::vector<std::unordered_map<uint32_t, int>> arrivals;  // per local FIFO: epoch -> ranks arrived
  OpQueue pending{256};
  uint64_t inflight_writes = 0, inflight_bytes = 0;
  uint64_t n_commands = 0, n_writes_posted = 0, n_signals_applied = 0;  // the thread's own counts
  std::vector<uint64_t> remote_data_bytes;
  std::thread th;
  // Published by the proxy thread for other threads, with plain (relaxed) stores: one writer, and an atomic
  // read-modify-write per command was a measurable part of the per-command cost.
  // busy = queued + in flight, all FIFOs; stored before the FIFO slots whose commands it counts are given back, so
  // wait_idle, seeing a slot given back (Fifo::drained), sees the operations it turned into.
  std::atomic<uint64_t> busy{0};
  std::atomic<uint64_t> commands{0}, writes_posted{0}, signals_applied{0};
  std::atomic<uint64_t> max_inflight_writes{0}, max_inflight_bytes{0}, max_reorder_held{0};
  std::atomic<uint64_t> queued{0}, writes_in_flight{0}, bytes_in_flight{0}, reorder_held{0};
  std::unique_ptr<FifoView[]> fifo_view;
  // describe() asks for the transport's debug_state(); the proxy thread answers between rounds, since a transport
  // is not made for two threads. `in_loop`: the thread may touch the transport (set by start(), cleared on exit).
  std::atomic<bool> in_loop{false};
  std::atomic<uint64_t> state_asked{0}, state_answered{0};
  // Liveness, read by monitor(): loop rounds started, and what the thread is doing (Activity) when it is inside a
  // call that may block. Relaxed stores of thread-local values: no read-modify-write on the hot path.
  std::atomic<uint64_t> rounds{0};
  std::atomic<int> activity{0};
  bool detached = false;                    // stop() gave up waiting for it (stuck in a call)
  std::atomic<bool> reported_stuck{false};  // the monitor failed the proxy because of it
  mutable std::mutex state_mu;
  std::string state;
};

Proxy::Proxy(const ProxyConfig& c, const TransportFactory& factory, void* data, size_t data_bytes, MemoryKind kind)
    : cfg_(c), data_(data), data_bytes_(data_bytes) {
  auto bad = [](const std::string& s) { throw ProxyError("ProxyConfig: " + s); };
  if (c.world < 1 || c.world > int(cmd::kMaxRanks)) bad("world size must be 1..4096");
  if (c.rank < 0 || c.rank >= c.world) bad("rank outside the world");
  if (c.num_threads < 1 || c.num_threads > 64) bad("num_threads must be 1..64 (UCCL_EP_NUM_PROXY_THREADS)");
  if (c.fifos_per_thread < 1 || c.fifos_per_thread > 64) bad("fifos_per_thread must be 1..64 (UCCL_EP_FIFOS_PER_THREAD)");
  if (c.max_inflight_writes < 1) bad("max_inflight_writes must be >= 1 (UCCL_IB_MAX_INFLIGHT_NORMAL)");
  if (c.max_inflight_bytes < 1) bad("max_inflight_bytes must be >= 1 (UCCL_IB_MAX_INFLIGHT_BYTES)");
  if (c.num_signal_slots < 1 || c.num_signal_slots > cmd::kMaxSlots) bad("num_signal_slots must be 1..16383");
  if (!(c.timeout_secs > 0)) bad("timeout_secs must be > 0 (UCCL_EP_CPU_TIMEOUT_SECS)");
  if (!data || data_bytes == 0) bad("a data region is required");
  signals_ = std::make_unique<SharedHostMemory>(size_t(c.num_signal_slots) * sizeof(int64_t));
  for (int i = 0; i < c.num_threads * c.fifos_per_thread; ++i)
    fifos_.push_back(std::make_unique<Fifo>(c.fifo_depth, c.rank, i));
  for (int t = 0; t < c.num_threads; ++t) {
    auto ts = std::make_unique<ThreadState>();
    ts->index = t;
    ts->transport = factory(t);
    ts->caps = ts->transport->caps();
    ts->transport->register_memory(data, data_bytes, kind);
    ts->transport->register_memory(signals_->data(), signals_->bytes(), MemoryKind::kHost);
    ts->codec = std::make_unique<ImmCodec>(ts->caps.in_order, c.reorder_window);
    if (!ts->caps.in_order && c.max_inflight_writes >= uint64_t(c.reorder_window))
      bad("the reorder window (" + std::to_string(c.reorder_window) + ") must exceed the writes in flight (" +
          std::to_string(c.max_inflight_writes) + ") on an unordered transport");
    ts->sequencer = std::make_unique<SignalSequencer>(*ts->codec, c.world, c.num_signal_slots);
    ts->reorder = std::make_unique<ReorderBuffer>(*ts->codec, c.world, c.num_signal_slots, c.reorder_window);
    for (int j = 0; j < c.fifos_per_thread; ++j) ts->fifos.push_back(fifos_[t * c.fifos_per_thread + j].get());
    ts->outstanding.assign(c.fifos_per_thread, 0);
    ts->barrier_phase.assign(c.fifos_per_thread, 0);
    ts->barrier_epoch.assign(c.fifos_per_thread, 0);
    ts->arrivals.resize(c.fifos_per_thread);
    ts->fifo_view = std::make_unique<FifoView[]>(c.fifos_per_thread);
    threads_.push_back(std::move(ts));
  }
}

Proxy::~Proxy() {
  stop();
  threads_.clear();  // closes transports (deregisters) before the signal buffer goes away
}

bool Proxy::detached_threads() const {
  return std::any_of(threads_.begin(), threads_.end(), [](const auto& ts) { return ts->detached; });
}

int Proxy::threads_in_loop() const {
  return int(std::count_if(threads_.begin(), threads_.end(),
                           [](const auto& ts) { return ts->in_loop.load(std::memory_order_acquire); }));
}

Fifo& Proxy::fifo(int i) {
  if (i < 0 || i >= num_fifos())
    throw ProxyError("fifo index " + std::to_string(i) + " outside 0.." + std::to_string(num_fifos() - 1));
  return *fifos_[i];
}

TransportCaps Proxy::caps() const { return threads_.at(0)->caps; }

std::vector<uint8_t> Proxy::local_info(int thread) {
  if (thread < 0 || thread >= cfg_.num_threads) throw ProxyError("local_info: thread index out of range");
  ProxyInfo pi{kProxyInfoMagic, data_bytes_, cfg_.rank, cfg_.world, int32_t(cfg_.num_signal_slots),
               cfg_.reorder_window, cfg_.fifos_per_thread, threads_[thread]->caps.in_order ? 1 : 0};
  std::vector<uint8_t> out(sizeof(pi));
  std::memcpy(out.data(), &pi, sizeof(pi));
  auto t = threads_[thread]->transport->local_info();
  out.insert(out.end(), t.begin(), t.end());
  return out;
}

void Proxy::connect(const std::vector<std::vector<std::vector<uint8_t>>>& infos) {
  if (int(infos.size()) != cfg_.num_threads)
    throw ProxyError("connect: expected infos for " + std::to_string(cfg_.num_threads) + " threads, got " +
                     std::to_string(infos.size()) + " (every rank must use the same UCCL_EP_NUM_PROXY_THREADS)");
  for (int t = 0; t < cfg_.num_threads; ++t) {
    ThreadState& ts = *threads_[t];
    if (int(infos[t].size()) != cfg_.world) throw ProxyError("connect: infos[thread] must hold one entry per rank");
    std::vector<std::vector<uint8_t>> tinfos;
    ts.remote_data_bytes.assign(cfg_.world, 0);
    for (int r = 0; r < cfg_.world; ++r) {
      const auto& b = infos[t][r];
      ProxyInfo pi;
      if (b.size() < sizeof(pi)) throw ProxyError("connect: info of rank " + std::to_string(r) + " is truncated");
      std::memcpy(&pi, b.data(), sizeof(pi));
      if (pi.magic != kProxyInfoMagic || pi.rank != r || pi.world != cfg_.world)
        throw ProxyError("connect: info " + std::to_string(r) + " does not come from rank " + std::to_string(r) +
                         " of this world");
      if (pi.num_slots != int32_t(cfg_.num_signal_slots) || pi.window != cfg_.reorder_window ||
          pi.fifos_per_thread != cfg_.fifos_per_thread || (pi.in_order != 0) != ts.caps.in_order)
        throw ProxyError("connect: rank " + std::to_string(r) + " runs different proxy settings (signal slots, "
                         "UCCL_EP_REORDER_WINDOW, UCCL_EP_FIFOS_PER_THREAD or transport ordering); use the same "
                         "environment on every rank");
      ts.remote_data_bytes[r] = pi.data_bytes;
      tinfos.emplace_back(b.begin() + sizeof(pi), b.end());
    }
    ts.transport->connect(tinfos);
  }
  connected_ = true;
}

void Proxy::start() {
  if (!connected_) throw ProxyError("Proxy::start before connect()");
  if (running_.exchange(true)) return;
  trigger_mtime_at_start_ = file_mtime_ns(cfg_.dump_trigger);  // before any thread exists (see proxy.hpp)
  for (auto& ts : threads_) {
    ThreadState* p = ts.get();
    p->in_loop.store(true, std::memory_order_release);  // before the thread exists: describe() must not race it
    p->th = std::thread([this, p] { run(p); });
    if (!cfg_.cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cfg_.cpus[p->index % cfg_.cpus.size()], &set);
      pthread_setaffinity_np(p->th.native_handle(), sizeof(set), &set);  // best effort: a bad CPU leaves it unpinned
    }
  }
  monitor_ = std::thread([this] { monitor(); });
  // Said once, so that a log shows the dump was armed (and where) when nothing answers a touch.
  if (!cfg_.dump_trigger.empty())
    std::fprintf(stderr, "uccl-ep: rank %d proxy: touch %s to print the state of its threads\n", cfg_.rank,
                 cfg_.dump_trigger.c_str());
}

void Proxy::stop() {
  running_.store(false);
  if (monitor_.joinable()) monitor_.join();
  // A thread still inside a transport call past the deadline is not waited for: joining it would hang the caller
  // (often the process exit) on a call that may never return. It is detached; the owner must then leak the whole
  // proxy and the memory it registered (detached_threads()), since the call may still return into them. A thread
  // the monitor already reported stuck is not given a second deadline.
  const auto t0 = Clock::now();
  for (auto& ts : threads_) {
    if (!ts->th.joinable()) continue;
    const double wait = ts->reported_stuck ? 0.1 : cfg_.timeout_secs;
    while (ts->in_loop.load(std::memory_order_acquire) && since(t0) < wait)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (!ts->in_loop.load(std::memory_order_acquire)) {
      ts->th.join();
      continue;
    }
    std::fprintf(stderr, "uccl-ep: rank %d proxy thread %d is still inside %s after %.0f s; detached and left "
                 "behind so that stopping does not hang\n", cfg_.rank, ts->index,
                 activity_name(ts->activity.load(std::memory_order_relaxed)), since(t0));
    ts->th.detach();
    ts->detached = true;
  }
}

void Proxy::monitor() {
  const size_t n = threads_.size();
  std::vector<uint64_t> seen(n, 0);
  std::vector<Clock::time_point> turned(n, Clock::now());
  std::vector<bool> reported(n, false);
  auto trigger_mtime = [&] { return file_mtime_ns(cfg_.dump_trigger); };
  int64_t dumped = trigger_mtime_at_start_;
  while (running_.load(std::memory_order_relaxed)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const auto now = Clock::now();
    for (size_t t = 0; t < n; ++t) {
      ThreadState& ts = *threads_[t];
      const uint64_t r = ts.rounds.load(std::memory_order_relaxed);
      if (r != seen[t] || !ts.in_loop.load(std::memory_order_acquire)) {
        seen[t] = r;
        turned[t] = now;
        continue;
      }
      const int a = ts.activity.load(std::memory_order_relaxed);
      const double stuck = std::chrono::duration<double>(now - turned[t]).count();
      // The back-off sleeps at most 1 s (UCCL_EP_PROXY_IDLE_BACKOFF_US) and ends by itself: never a hang.
      if (a != kInBackoff && stuck > cfg_.timeout_secs && !reported[t]) {
        reported[t] = true;
        ts.reported_stuck.store(true, std::memory_order_relaxed);
        std::ostringstream secs;
        secs.precision(2);
        secs << stuck;
        fail("rank " + std::to_string(cfg_.rank) + " proxy thread " + std::to_string(ts.index) + ": its loop has not "
             "turned for " + secs.str() + " s (UCCL_EP_CPU_TIMEOUT_SECS): it is inside " +
             activity_name(a) + ", which has not returned (a stuck NIC driver or GPU copy)", true);
      }
    }
    const int64_t mt = trigger_mtime();
    if (mt >= 0 && mt != dumped) {
      dumped = mt;
      std::ostringstream m;
      for (size_t t = 0; t < n; ++t) {
        ThreadState& ts = *threads_[t];
        m << "uccl-ep proxy monitor: rank " << cfg_.rank << " proxy thread " << ts.index << ": round "
          << ts.rounds.load(std::memory_order_relaxed) << ", last turned "
          << int64_t(std::chrono::duration<double, std::milli>(now - turned[t]).count()) << " ms ago, now inside "
          << activity_name(ts.activity.load(std::memory_order_relaxed))
          << (ts.in_loop.load(std::memory_order_acquire) ? "" : " (loop exited)") << "\n";
      }
      m << describe(false);
      const std::string out = m.str();
      std::fwrite(out.data(), 1, out.size(), stderr);
      std::fflush(stderr);
    }
  }
}

void Proxy::fail(const std::string& what, bool timeout) {
  std::lock_guard<std::mutex> g(err_mu_);
  if (!failed_.load()) {
    error_ = what;
    timed_out_.store(timeout, std::memory_order_release);
    failed_.store(true, std::memory_order_release);
  }
}

std::string Proxy::error() const {
  std::lock_guard<std::mutex> g(err_mu_);
  return error_;
}

void Proxy::check() const {
  if (failed()) throw ProxyError(error());
}

uint64_t Proxy::push(int f, const Command& c) {
  check();
  const uint64_t idx = fifo(f).push(c, cfg_.timeout_secs, &failed_);
  check();
  return idx;
}

void Proxy::push_many(int f, const Command* cmds, size_t n) {
  Fifo& q = fifo(f);
  for (size_t i = 0; i < n; ++i) {
    q.push(cmds[i], cfg_.timeout_secs, &failed_);
    if (failed()) break;
  }
  check();
}

void Proxy::wait_done(int f, uint64_t index) {
  fifo(f).wait_done(index, cfg_.timeout_secs, &failed_);
  check();
}

void Proxy::wait_idle(double timeout_secs) {
  const auto t0 = Clock::now();
  while (true) {
    check();
    bool idle = true;
    std::string what;
    // FIFOs first: a proxy thread publishes its queued operations before it gives their slots back, so a FIFO seen
    // drained here has its commands counted in `busy` below.
    for (auto& f : fifos_)
      if (!f->drained()) {
        idle = false;
        if (f->producer() == FifoProducer::kHost)
          what = "fifo " + std::to_string(f->fifo_id()) + " tail " + std::to_string(f->tail()) + " != head " +
                 std::to_string(f->host_head());
        else
          what = "fifo " + std::to_string(f->fifo_id()) + " (GPU producers) holds command #" +
                 std::to_string(f->tail()) + " not yet taken by its proxy thread";
        break;
      }
    if (idle)
      for (auto& ts : threads_)
        if (uint64_t b = ts->busy.load(std::memory_order_acquire)) {
          idle = false;
          what = "thread " + std::to_string(ts->index) + " has " + std::to_string(b) + " operations outstanding";
          break;
        }
    if (idle) return;
    if (since(t0) > timeout_secs)
      throw TimeoutError("rank " + std::to_string(cfg_.rank) + ": proxy not idle after " +
                         std::to_string(timeout_secs) + " s: " + what + " (expected 0 outstanding)");
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

int64_t Proxy::wait_signal(uint32_t slot, int64_t expected, double timeout_secs) {
  if (slot >= cfg_.num_signal_slots) throw ProxyError("wait_signal: slot out of range");
  const auto t0 = Clock::now();
  int64_t* p = signals() + slot;
  uint32_t spins = 0;
  while (true) {
    const int64_t v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
    if (v >= expected) return v;
    if (++spins % 64 == 0) {
      check();
      const double waited = since(t0);
      if (waited > timeout_secs)
        throw TimeoutError("rank " + std::to_string(cfg_.rank) + ": signal slot " + std::to_string(slot) +
                           " is " + std::to_string(v) + ", expected >= " + std::to_string(expected) + " after " +
                           std::to_string(timeout_secs) + " s");
      // spin (yielding) for the first millisecond: short waits are the common case and sleeping costs ~50 us
      if (waited < 1e-3) std::this_thread::yield();
      else std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

ProxyThreadStats Proxy::stats(int thread) const {
  const ThreadState& ts = *threads_.at(thread);
  ProxyThreadStats s;
  s.commands = ts.commands.load(std::memory_order_relaxed);
  s.writes_posted = ts.writes_posted.load(std::memory_order_relaxed);
  s.signals_applied = ts.signals_applied.load(std::memory_order_relaxed);
  s.max_inflight_writes = ts.max_inflight_writes.load(std::memory_order_relaxed);
  s.max_inflight_bytes = ts.max_inflight_bytes.load(std::memory_order_relaxed);
  s.max_reorder_held = ts.max_reorder_held.load(std::memory_order_relaxed);
  return s;
}

ProxyThreadStats Proxy::totals() const {
  ProxyThreadStats t;
  for (int i = 0; i < cfg_.num_threads; ++i) {
    const ProxyThreadStats s = stats(i);
    t.commands += s.commands;
    t.writes_posted += s.writes_posted;
    t.signals_applied += s.signals_applied;
    t.max_inflight_writes = std::max(t.max_inflight_writes, s.max_inflight_writes);
    t.max_inflight_bytes = std::max(t.max_inflight_bytes, s.max_inflight_bytes);
    t.max_reorder_held = std::max(t.max_reorder_held, s.max_reorder_held);
  }
  return t;
}

std::string Proxy::transport_state(ThreadState& ts) const {
  constexpr double kAnswerSecs = 0.5;
  const uint64_t ticket = ts.state_asked.fetch_add(1, std::memory_order_relaxed) + 1;
  const auto t0 = Clock::now();
  while (ts.state_answered.load(std::memory_order_acquire) < ticket) {
    // Not (or no longer) polling: nothing else touches the transport, so ask it directly.
    if (!ts.in_loop.load(std::memory_order_acquire)) return ts.transport->debug_state();
    if (since(t0) > kAnswerSecs) return "(no answer from the proxy thread within 0.5 s: it is inside a transport call)";
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  std::lock_guard<std::mutex> g(ts.state_mu);
  return ts.state;
}

std::string Proxy::describe(bool ask_transport) const {
  std::ostringstream m;
  for (const auto& p : threads_) {
    ThreadState& ts = *p;
    m << "rank " << cfg_.rank << " proxy thread " << ts.index << ": "
      << ts.queued.load(std::memory_order_relaxed) << " operations queued, "
      << ts.writes_in_flight.load(std::memory_order_relaxed) << " writes / "
      << ts.bytes_in_flight.load(std::memory_order_relaxed) << " bytes in flight (caps " << cfg_.max_inflight_writes
      << " / " << cfg_.max_inflight_bytes << ");";
    for (size_t j = 0; j < ts.fifos.size(); ++j) {
      m << " fifo " << ts.fifos[j]->fifo_id() << " " << ts.fifo_view[j].outstanding.load(std::memory_order_relaxed)
        << " outstanding";
      if (uint32_t b = ts.fifo_view[j].barrier.load(std::memory_order_relaxed)) m << " (barrier epoch " << b - 1 << ")";
      m << ";";
    }
    m << " " << ts.reorder_held.load(std::memory_order_relaxed) << " signals held for order";
    if (ask_transport) {
      const std::string t = transport_state(ts);
      m << "; transport: " << (t.empty() ? "(no debug state)" : t);
    }
    m << "\n";
  }
  return m.str();
}

// ------------------------------------------------------------------------------------------------ the proxy loop

void Proxy::run(ThreadState* ts) {
  const int world = cfg_.world;
  const uint32_t nslots = cfg_.num_signal_slots;
  const uint64_t max_writes = cfg_.max_inflight_writes, max_bytes = cfg_.max_inflight_bytes;
  const size_t max_chain = size_t(std::max(1, ts->caps.max_writes_per_post));
  const size_t pending_limit = std::max<size_t>(2 * max_chain, 2 * cfg_.max_inflight_writes);
  const size_t nf = ts->fifos.size();
  OpQueue& pending = ts->pending;
  std::vector<Completion> comps;
  std::vector<uint32_t> imms;
  // the multi-destination path of post(): writes grouped by destination, and a refused tail to re-queue
  std::vector<WriteRequest> grouped, refused;
  constexpr uint32_t kNoGroup = UINT32_MAX;
  std::vector<uint32_t> group_of(size_t(world), kNoGroup);
  std::vector<int> group_dst;
  std::vector<size_t> group_size, group_fill;
  // Signal increments of one poll batch, summed per slot: one atomic add on the signal buffer per slot and batch
  // instead of one per immediate. Waiters compare against thresholds, and every increment summed here already had
  // its data land, so the sum reaches the same values, only the earlier increments of a batch show a little later.
  struct SlotAdd {
    uint32_t slot;
    int64_t add;
  };
  constexpr int kMaxSlotAdds = 8;
  SlotAdd adds[kMaxSlotAdds];
  int nadds = 0;
  auto last_progress = Clock::now();
  uint64_t idle_rounds = 0, state_answered = 0;
  size_t rr = 0;
  int64_t* sig = signals();

  auto who = [&] { return "rank " + std::to_string(cfg_.rank) + " proxy thread " + std::to_string(ts->index); };
  auto local_fail = [&](const std::string& s, bool timeout = false) { fail(who() + ": " + s, timeout); };

  auto queue_write = [&](int j, WriteRequest& w) {
    w.wr_id = (uint64_t(j) << 56) | w.bytes;
    pending.push_back(w);
    ++ts->outstanding[j];
  };

  // Turns one command into queued operations. False (with `err` set) for a command that must not run.
  std::string err;
  auto expand = [&](int j, uint64_t index, const Command& c) -> bool {
    const CommandFields f = decode(c);
    auto where = [&] {
      return "fifo " + std::to_string(ts->fifos[j]->fifo_id()) + " command #" + std::to_string(index) + ": ";
    };
    if (int(f.dst_rank) >= world) {
      err = where() + "dst_rank " + std::to_string(f.dst_rank) + " >= world size " + std::to_string(world);
      return false;
    }
    if (f.type != kCmdWrite && f.slot >= nslots) {
      err = where() + "signal slot " + std::to_string(f.slot) + " >= " + std::to_string(nslots) + " slots";
      return false;
    }
    if (f.type == kCmdAtomic) {
      if (ts->caps.native_atomics) {
        AtomicRequest a;
        a.dst_rank = int(f.dst_rank);
        a.remote_region = kSignalRegion;
        a.remote_offset = uint64_t(f.slot) * sizeof(int64_t);
        a.add = f.atomic_add;
        a.wr_id = uint64_t(j) << 56;
        pending.push_back(queued_atomic(a));
        ++ts->outstanding[j];
        return true;
      }
      imms.clear();
      ts->sequencer->encode(int(f.dst_rank), f.slot, f.atomic_add, &imms);
      for (uint32_t imm : imms) {
        WriteRequest w;
        w.dst_rank = int(f.dst_rank);
        w.has_imm = true;
        w.imm = imm;
        queue_write(j, w);
      }
      return true;
    }
    if (f.local_offset + f.bytes > data_bytes_) {
      err = where() + "local range [" + std::to_string(f.local_offset) + ", " +
            std::to_string(f.local_offset + f.bytes) + ") exceeds the registered " + std::to_string(data_bytes_) +
            "-byte data region";
      return false;
    }
    if (f.remote_offset + f.bytes > ts->remote_data_bytes[f.dst_rank]) {
      err = where() + "remote range [" + std::to_string(f.remote_offset) + ", " +
            std::to_string(f.remote_offset + f.bytes) + ") exceeds rank " + std::to_string(f.dst_rank) + "'s " +
            std::to_string(ts->remote_data_bytes[f.dst_rank]) + "-byte data region";
      return false;
    }
    // built in its queue slot: this is the one operation nearly every command becomes
    WriteRequest& w = pending.emplace_back();
    w.dst_rank = int(f.dst_rank);
    w.local_region = kDataRegion;
    w.remote_region = kDataRegion;
    w.local_offset = f.local_offset;
    w.remote_offset = f.remote_offset;
    w.bytes = f.bytes;
    w.has_imm = f.type != kCmdWrite;
    w.imm = 0;
    w.wr_id = (uint64_t(j) << 56) | w.bytes;
    ++ts->outstanding[j];
    if (!w.has_imm || ts->sequencer->encode_one(int(f.dst_rank), f.slot, int64_t(f.value), &w.imm)) return true;
    // The first immediate rides on the data; the rest of a large increment follows as zero-length writes whose
    // higher sequence numbers keep them behind it.
    imms.clear();
    ts->sequencer->encode(int(f.dst_rank), f.slot, int64_t(f.value), &imms);
    w.imm = imms[0];
    for (size_t i = 1; i < imms.size(); ++i) {
      WriteRequest z;
      z.dst_rank = int(f.dst_rank);
      z.has_imm = true;
      z.imm = imms[i];
      queue_write(j, z);
    }
    return true;
  };

  auto account_post = [&](uint64_t n, uint64_t bytes) {
    ts->inflight_writes += n;
    ts->inflight_bytes += bytes;
    ts->n_writes_posted += n;
    update_max(ts->max_inflight_writes, ts->inflight_writes);
    update_max(ts->max_inflight_bytes, ts->inflight_bytes);
  };

  // Posts `n` grouped writes of one destination in chains; returns how many were accepted (a refusal ends it).
  auto post_chains = [&](WriteRequest* w, size_t n, uint64_t* bytes) -> size_t {
    size_t done = 0;
    while (done < n) {
      const size_t len = std::min(n - done, max_chain);
      ts->activity.store(kInTransportPost, std::memory_order_relaxed);
      const size_t ok = ts->transport->post_writes(w + done, len);
      ts->activity.store(kInLoop, std::memory_order_relaxed);
      for (size_t i = 0; i < ok; ++i) *bytes += w[done + i].bytes;
      done += ok;
      if (ok < len) break;
    }
    return done;
  };

  // Posts queued operations within the in-flight caps, writes grouped by destination into chains; per-destination
  // order is kept (a refused write and every later one to its destination go back to the front, in order).
  auto post = [&]() -> bool {
    bool progress = false;
    while (!pending.empty() && ts->inflight_writes < max_writes) {
      if (is_atomic(pending.front())) {
        const AtomicRequest a = as_atomic(pending.front());
        ts->activity.store(kInTransportPost, std::memory_order_relaxed);
        const size_t posted_atomics = ts->transport->post_atomics(&a, 1);
        ts->activity.store(kInLoop, std::memory_order_relaxed);
        if (posted_atomics != 1) break;
        pending.pop_front(1);
        account_post(1, 0);
        progress = true;
        continue;
      }
      // the run of writes at the front that fits the caps
      const uint64_t room = max_writes - ts->inflight_writes;
      const int dst0 = pending.front().dst_rank;
      size_t k = 0;
      uint64_t bytes = 0;
      bool one_dst = true;
      while (k < pending.size() && k < room) {
        const WriteRequest& w = pending[k];
        if (is_atomic(w)) break;
        // one write larger than the byte cap may go alone, or it could never be posted
        if (ts->inflight_bytes + bytes + w.bytes > max_bytes && ts->inflight_writes + k > 0) break;
        one_dst = one_dst && w.dst_rank == dst0;
        bytes += w.bytes;
        ++k;
      }
      if (k == 0) break;
      uint64_t posted = 0, posted_bytes = 0;
      bool stopped = false;
      if (one_dst) {
        // The common case: post from the queue in place (in two parts where the ring wraps); what is refused simply
        // stays at the front.
        while (posted < k) {
          const size_t len = std::min<size_t>(k - posted, pending.contiguous());
          const size_t ok = post_chains(&pending.front(), len, &posted_bytes);
          pending.pop_front(ok);
          posted += ok;
          if (ok < len) {
            stopped = true;
            break;
          }
        }
      } else {
        // Stable counting sort by destination, then one chain per destination; ascending destinations keep the
        // posting order deterministic (the verbs tests check the chains a NIC receives).
        group_dst.clear();
        for (size_t i = 0; i < k; ++i) {
          const int d = pending[i].dst_rank;
          if (group_of[d] == kNoGroup) {
            group_of[d] = 0;
            group_dst.push_back(d);
          }
        }
        std::sort(group_dst.begin(), group_dst.end());
        for (size_t g = 0; g < group_dst.size(); ++g) group_of[group_dst[g]] = uint32_t(g);
        group_size.assign(group_dst.size(), 0);
        for (size_t i = 0; i < k; ++i) ++group_size[group_of[pending[i].dst_rank]];
        group_fill.assign(group_dst.size(), 0);
        for (size_t g = 1; g < group_dst.size(); ++g) group_fill[g] = group_fill[g - 1] + group_size[g - 1];
        grouped.resize(k);
        for (size_t i = 0; i < k; ++i) grouped[group_fill[group_of[pending[i].dst_rank]]++] = pending[i];
        for (int d : group_dst) group_of[d] = kNoGroup;
        pending.pop_front(k);
        refused.clear();
        size_t start = 0;
        for (size_t g = 0; g < group_dst.size(); ++g) {
          const size_t ok = post_chains(&grouped[start], group_size[g], &posted_bytes);
          posted += ok;
          refused.insert(refused.end(), grouped.begin() + start + ok, grouped.begin() + start + group_size[g]);
          start += group_size[g];
        }
        for (auto it = refused.rbegin(); it != refused.rend(); ++it) pending.push_front(*it);
        stopped = !refused.empty();
      }
      account_post(posted, posted_bytes);
      if (posted) progress = true;
      if (stopped || posted == 0) break;
    }
    return progress;
  };

  auto flush_signals = [&] {
    for (int i = 0; i < nadds; ++i)
      if (adds[i].add) __atomic_fetch_add(sig + adds[i].slot, adds[i].add, __ATOMIC_RELEASE);
    nadds = 0;
  };
  auto add_signal = [&](uint32_t slot, int64_t d) {
    ++ts->n_signals_applied;
    for (int i = 0; i < nadds; ++i)
      if (adds[i].slot == slot) {
        adds[i].add += d;
        return;
      }
    if (nadds == kMaxSlotAdds) flush_signals();
    adds[nadds++] = SlotAdd{slot, d};
  };

  // What other threads read (wait_idle, stats, describe). `busy` goes out before any FIFO slot is given back, and
  // last (release): whoever sees it at 0 after waiting also sees the counts that led there.
  auto publish_busy = [&] {
    ts->commands.store(ts->n_commands, std::memory_order_relaxed);
    ts->busy.store(pending.size() + ts->inflight_writes, std::memory_order_release);
  };
  auto publish = [&] {
    ts->writes_posted.store(ts->n_writes_posted, std::memory_order_relaxed);
    ts->signals_applied.store(ts->n_signals_applied, std::memory_order_relaxed);
    ts->queued.store(pending.size(), std::memory_order_relaxed);
    ts->writes_in_flight.store(ts->inflight_writes, std::memory_order_relaxed);
    ts->bytes_in_flight.store(ts->inflight_bytes, std::memory_order_relaxed);
    ts->reorder_held.store(ts->reorder->held(), std::memory_order_relaxed);
    for (size_t j = 0; j < nf; ++j) {
      ts->fifo_view[j].outstanding.store(ts->outstanding[j], std::memory_order_relaxed);
      ts->fifo_view[j].barrier.store(ts->barrier_phase[j] ? ts->barrier_epoch[j] + 1 : 0, std::memory_order_relaxed);
    }
    publish_busy();
  };

  // The dump behind cfg_.dump_trigger: only what this thread owns, read by this thread, so it is exact and needs no
  // lock; one write to stderr per thread so the lines of several threads do not interleave.
  auto trigger_mtime = [&] { return file_mtime_ns(cfg_.dump_trigger); };
  int64_t dumped_mtime = trigger_mtime_at_start_;
  auto last_trigger_check = Clock::now();
  auto dump_state = [&] {
    std::ostringstream m;
    m << "uccl-ep proxy dump: " << who() << ": " << pending.size() << " operations queued";
    for (size_t i = 0; i < pending.size() && i < 4; ++i) {
      const WriteRequest& w = pending[i];
      m << (i ? ", " : " (first: ") << "to rank " << w.dst_rank << " " << w.bytes << " B imm 0x" << std::hex << w.imm
        << std::dec;
    }
    m << (pending.size() ? ")" : "") << "; " << ts->inflight_writes << " writes / " << ts->inflight_bytes
      << " bytes in flight; " << ts->reorder->held() << " signals held for order; " << ts->n_commands
      << " commands taken, " << ts->n_writes_posted << " writes posted, " << ts->n_signals_applied
      << " signals applied\n";
    for (size_t j = 0; j < nf; ++j) {
      const Fifo& q = *ts->fifos[j];
      const Fifo::Snapshot snap = q.snapshot();
      m << "  fifo " << q.fifo_id() << ": taken " << q.consumer_index() << ", given back (tail) " << snap.tail
        << ", non-empty slots from the tail " << snap.full;
      if (snap.full) m << " [" << snap.first_full << ".." << snap.last_full << "]";
      m << ", " << ts->outstanding[j] << " operations outstanding\n";
    }
    const std::string t = ts->transport->debug_state();
    m << "  transport: " << (t.empty() ? "(no debug state)" : t) << "\n";
    const std::string out = m.str();
    std::fwrite(out.data(), 1, out.size(), stderr);
    std::fflush(stderr);
  };

  auto transport_debug = [&] {
    std::string s = ts->transport->debug_state();
    return s.empty() ? s : " transport: " + s + ";";
  };

  uint64_t round = 0;
  while (running_.load(std::memory_order_relaxed) && !failed()) {
    ts->rounds.store(++round, std::memory_order_relaxed);
    bool progress = false;
    if (const uint64_t asked = ts->state_asked.load(std::memory_order_relaxed); asked != state_answered) {
      std::string s = ts->transport->debug_state();
      {
        std::lock_guard<std::mutex> g(ts->state_mu);
        ts->state = std::move(s);
      }
      state_answered = asked;
      ts->state_answered.store(asked, std::memory_order_release);
    }
    // 1. completions: ours (free in-flight budget) and peers' (signals, barriers)
    comps.clear();
    ts->activity.store(kInTransportPoll, std::memory_order_relaxed);
    ts->transport->poll(comps, 256);
    ts->activity.store(kInLoop, std::memory_order_relaxed);
    uint64_t completed = 0, completed_bytes = 0;  // summed, not stored to the thread state per completion
    for (const Completion& c : comps) {
      if (c.status != 0) {
        local_fail("transport error: " + (c.error.empty() ? "status " + std::to_string(c.status) : c.error));
        break;
      }
      progress = true;
      if (c.kind != Completion::Kind::kRemoteImm) {
        ++completed;
        completed_bytes += c.wr_id & kBytesMask;
        --ts->outstanding[c.wr_id >> 56];
      } else if (ImmCodec::is_control(c.imm)) {
        const uint32_t j = ImmCodec::control_fifo(c.imm);
        if (j >= ts->arrivals.size()) {
          local_fail("barrier message from rank " + std::to_string(c.src_rank) + " names FIFO " + std::to_string(j));
          break;
        }
        ++ts->arrivals[j][ImmCodec::control_epoch(c.imm)];
      } else {
        std::string e = ts->reorder->receive(c.src_rank, c.imm, add_signal);
        if (!e.empty()) {
          local_fail(e);
          break;
        }
        update_max(ts->max_reorder_held, ts->reorder->held());  // per arrival: the batch's end may hide the peak
      }
    }
    flush_signals();
    ts->inflight_writes -= completed;
    ts->inflight_bytes -= completed_bytes;
    if (failed()) break;
    // 2. post what is queued
    if (post()) progress = true;
    // 3. take new commands, round robin over this thread's FIFOs
    for (size_t k = 0; k < nf && pending.size() < pending_limit; ++k) {
      const int j = int((rr + k) % nf);
      Fifo& q = *ts->fifos[j];
      Command c;
      uint64_t taken = 0;
      while (pending.size() < pending_limit && q.peek(&c)) {
        const uint32_t type = command_type(c);
        if (type == kCmdWrite || type == kCmdWriteSignal || type == kCmdAtomic) {
          if (!expand(j, q.consumer_index(), c)) {
            local_fail("rejected " + err);
            break;
          }
        } else if (type == kCmdQuiet) {
          if (ts->outstanding[j]) break;
        } else if (type == kCmdBarrier) {
          if (ts->outstanding[j]) break;
          if (ts->barrier_phase[j] == 0) {
            for (int r = 0; r < world; ++r) {
              if (r == cfg_.rank) continue;
              WriteRequest w;
              w.dst_rank = r;
              w.has_imm = true;
              w.imm = ImmCodec::barrier(uint32_t(j), ts->barrier_epoch[j]);
              queue_write(j, w);
            }
            ts->barrier_phase[j] = 1;
            progress = true;
            break;
          }
          auto& arr = ts->arrivals[j];
          auto it = arr.find(ts->barrier_epoch[j]);
          if (world > 1 && (it == arr.end() || it->second < world - 1)) break;
          if (it != arr.end()) arr.erase(it);
          ts->barrier_phase[j] = 0;
          ts->barrier_epoch[j] = (ts->barrier_epoch[j] + 1) & ImmCodec::kEpochMask;
        } else {
          local_fail("fifo " + std::to_string(q.fifo_id()) + " command #" + std::to_string(q.consumer_index()) +
                     " has unknown type " + std::to_string(type));
          break;
        }
        q.advance();
        ++taken;
      }
      if (taken) {
        progress = true;
        ts->n_commands += taken;
        publish_busy();
        q.release();
      }
      if (failed()) break;
    }
    rr = (rr + 1) % nf;
    if (failed()) break;
    if (post()) progress = true;

    // 4. watchdog and idle back-off. The clock is read when a quiet spell starts, not after every busy round.
    if (progress) {
      publish();
      idle_rounds = 0;
      continue;
    }
    if (++idle_rounds == 1) last_progress = Clock::now();
    if (idle_rounds % 64 == 0 && !cfg_.dump_trigger.empty() && since(last_trigger_check) > 0.05) {
      last_trigger_check = Clock::now();
      const int64_t mt = trigger_mtime();
      if (mt >= 0 && mt != dumped_mtime) {
        dumped_mtime = mt;
        dump_state();
      }
    }
    if (idle_rounds % 64 == 0) {
      const bool waiting = ts->inflight_writes || !pending.empty() || ts->reorder->held() ||
                           std::any_of(ts->barrier_phase.begin(), ts->barrier_phase.end(), [](int p) { return p; });
      if (waiting && since(last_progress) > cfg_.timeout_secs) {
        std::ostringstream m;
        m << "no progress for " << cfg_.timeout_secs << " s (UCCL_EP_CPU_TIMEOUT_SECS):";
        if (ts->inflight_writes)
          m << " " << ts->inflight_writes << " writes in flight waiting for completion (expected 0);";
        for (size_t j = 0; j < nf; ++j) {
          if (ts->barrier_phase[j]) {
            auto it = ts->arrivals[j].find(ts->barrier_epoch[j]);
            m << " fifo " << ts->fifos[j]->fifo_id() << " barrier epoch " << ts->barrier_epoch[j] << " has "
              << (it == ts->arrivals[j].end() ? 0 : it->second) << " of " << world - 1 << " ranks;";
          } else if (ts->outstanding[j]) {
            m << " fifo " << ts->fifos[j]->fifo_id() << " has " << ts->outstanding[j]
              << " operations outstanding (expected 0);";
          }
        }
        int src;
        uint32_t slot, exp;
        if (ts->reorder->oldest_gap(&src, &slot, &exp))
          m << " signal lane rank " << src << " slot " << slot << " waits for sequence " << exp << " ("
            << ts->reorder->held() << " held);";
        m << transport_debug();
        local_fail(m.str(), true);
        break;
      }
      if (cfg_.idle_backoff_us == 0) std::this_thread::yield();
    }
    if (cfg_.idle_backoff_us > 0) {
      ts->activity.store(kInBackoff, std::memory_order_relaxed);
      std::this_thread::sleep_for(std::chrono::microseconds(cfg_.idle_backoff_us));
      ts->activity.store(kInLoop, std::memory_order_relaxed);
    }
  }
  publish();
  // Stopped (not failed) with work left: those writes are dropped here and their receivers, which see a clean close
  // (not an error), wait until their own deadlines. Say so on the sender's side, where the cause is.
  if (!failed()) {
    uint64_t untaken = 0;
    for (size_t j = 0; j < nf; ++j) {
      Command c;
      if (ts->fifos[j]->peek(&c)) ++untaken;  // at least one command not taken from this FIFO
    }
    if (!pending.empty() || ts->inflight_writes || untaken)
      std::fprintf(stderr, "uccl-ep: %s stopped with %zu operations queued, %llu writes in flight and %llu FIFO(s) "
                   "holding commands not taken: they are dropped, and the ranks waiting for them will time out "
                   "(wait for the proxy to be idle before stopping it)\n", who().c_str(), pending.size(),
                   (unsigned long long)ts->inflight_writes, (unsigned long long)untaken);
  }
  ts->in_loop.store(false, std::memory_order_release);
}

}  // namespace uccl_ep
