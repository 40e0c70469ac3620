#include "proxy/proxy.hpp"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
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

struct PendingOp {
  bool atomic = false;
  WriteRequest w;
  AtomicRequest a;
};

void update_max(std::atomic<uint64_t>& m, uint64_t v) {
  if (v > m.load(std::memory_order_relaxed)) m.store(v, std::memory_order_relaxed);
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
  std::deque<PendingOp> pending;
  uint64_t inflight_writes = 0, inflight_bytes = 0;
  std::vector<uint64_t> remote_data_bytes;
  std::thread th;
  std::atomic<uint64_t> busy{0};  // queued + in flight, all FIFOs (read by wait_idle)
  std::atomic<uint64_t> commands{0}, writes_posted{0}, signals_applied{0};
  std::atomic<uint64_t> max_inflight_writes{0}, max_inflight_bytes{0}, max_reorder_held{0};
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
    threads_.push_back(std::move(ts));
  }
}

Proxy::~Proxy() {
  stop();
  threads_.clear();  // closes transports (deregisters) before the signal buffer goes away
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
  for (auto& ts : threads_) {
    ThreadState* p = ts.get();
    p->th = std::thread([this, p] { run(p); });
    if (!cfg_.cpus.empty()) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cfg_.cpus[p->index % cfg_.cpus.size()], &set);
      pthread_setaffinity_np(p->th.native_handle(), sizeof(set), &set);  // best effort: a bad CPU leaves it unpinned
    }
  }
}

void Proxy::stop() {
  running_.store(false);
  for (auto& ts : threads_)
    if (ts->th.joinable()) ts->th.join();
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
    for (auto& f : fifos_)
      if (f->tail() != f->host_head()) {
        idle = false;
        what = "fifo " + std::to_string(f->fifo_id()) + " tail " + std::to_string(f->tail()) + " != head " +
               std::to_string(f->host_head());
        break;
      }
    if (idle)
      for (auto& ts : threads_)
        if (uint64_t b = ts->busy.load()) {
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
  s.commands = ts.commands.load();
  s.writes_posted = ts.writes_posted.load();
  s.signals_applied = ts.signals_applied.load();
  s.max_inflight_writes = ts.max_inflight_writes.load();
  s.max_inflight_bytes = ts.max_inflight_bytes.load();
  s.max_reorder_held = ts.max_reorder_held.load();
  return s;
}

// ------------------------------------------------------------------------------------------------ the proxy loop

void Proxy::run(ThreadState* ts) {
  const int world = cfg_.world;
  const uint32_t nslots = cfg_.num_signal_slots;
  const size_t max_chain = size_t(std::max(1, ts->caps.max_writes_per_post));
  const size_t pending_limit = std::max<size_t>(2 * max_chain, 2 * cfg_.max_inflight_writes);
  const std::string who = "rank " + std::to_string(cfg_.rank) + " proxy thread " + std::to_string(ts->index);
  std::vector<Completion> comps;
  std::vector<uint32_t> imms;
  std::vector<WriteRequest> batch, sorted;
  auto last_progress = Clock::now();
  uint64_t idle_rounds = 0;
  size_t rr = 0;
  int64_t* sig = signals();

  auto local_fail = [&](const std::string& s, bool timeout = false) { fail(who + ": " + s, timeout); };

  auto queue_write = [&](int j, const WriteRequest& w) {
    PendingOp op;
    op.w = w;
    op.w.wr_id = (uint64_t(j) << 56) | w.bytes;
    ts->pending.push_back(op);
    ++ts->outstanding[j];
    ts->busy.fetch_add(1, std::memory_order_relaxed);
  };

  // Turns one command into queued operations. Returns an error message for a command that must not run.
  auto expand = [&](int j, uint64_t index, const Command& c) -> std::string {
    const CommandFields f = decode(c);
    auto where = [&] {
      return "fifo " + std::to_string(ts->fifos[j]->fifo_id()) + " command #" + std::to_string(index) + ": ";
    };
    if (int(f.dst_rank) >= world)
      return where() + "dst_rank " + std::to_string(f.dst_rank) + " >= world size " + std::to_string(world);
    if (f.type != kCmdWrite && f.slot >= nslots)
      return where() + "signal slot " + std::to_string(f.slot) + " >= " + std::to_string(nslots) + " slots";
    if (f.type == kCmdAtomic) {
      if (ts->caps.native_atomics) {
        PendingOp op;
        op.atomic = true;
        op.a.dst_rank = int(f.dst_rank);
        op.a.remote_region = kSignalRegion;
        op.a.remote_offset = uint64_t(f.slot) * sizeof(int64_t);
        op.a.add = f.atomic_add;
        op.a.wr_id = uint64_t(j) << 56;
        ts->pending.push_back(op);
        ++ts->outstanding[j];
        ts->busy.fetch_add(1, std::memory_order_relaxed);
        return {};
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
      return {};
    }
    if (f.local_offset + f.bytes > data_bytes_)
      return where() + "local range [" + std::to_string(f.local_offset) + ", " +
             std::to_string(f.local_offset + f.bytes) + ") exceeds the registered " + std::to_string(data_bytes_) +
             "-byte data region";
    if (f.remote_offset + f.bytes > ts->remote_data_bytes[f.dst_rank])
      return where() + "remote range [" + std::to_string(f.remote_offset) + ", " +
             std::to_string(f.remote_offset + f.bytes) + ") exceeds rank " + std::to_string(f.dst_rank) + "'s " +
             std::to_string(ts->remote_data_bytes[f.dst_rank]) + "-byte data region";
    WriteRequest w;
    w.dst_rank = int(f.dst_rank);
    w.local_region = kDataRegion;
    w.remote_region = kDataRegion;
    w.local_offset = f.local_offset;
    w.remote_offset = f.remote_offset;
    w.bytes = f.bytes;
    if (f.type == kCmdWrite) {
      queue_write(j, w);
      return {};
    }
    // The first immediate rides on the data; the rest of a large increment follows as zero-length writes whose
    // higher sequence numbers keep them behind it.
    imms.clear();
    ts->sequencer->encode(int(f.dst_rank), f.slot, int64_t(f.value), &imms);
    w.has_imm = true;
    w.imm = imms[0];
    queue_write(j, w);
    for (size_t i = 1; i < imms.size(); ++i) {
      WriteRequest z;
      z.dst_rank = int(f.dst_rank);
      z.has_imm = true;
      z.imm = imms[i];
      queue_write(j, z);
    }
    return {};
  };

  auto account_post = [&](uint64_t n, uint64_t bytes) {
    ts->inflight_writes += n;
    ts->inflight_bytes += bytes;
    ts->writes_posted.fetch_add(n, std::memory_order_relaxed);
    update_max(ts->max_inflight_writes, ts->inflight_writes);
    update_max(ts->max_inflight_bytes, ts->inflight_bytes);
  };

  // Posts queued operations within the in-flight caps, writes grouped by destination into chains.
  auto post = [&]() -> bool {
    bool progress = false;
    while (!ts->pending.empty() && ts->inflight_writes < cfg_.max_inflight_writes) {
      if (ts->pending.front().atomic) {
        if (ts->transport->post_atomics(&ts->pending.front().a, 1) != 1) break;
        ts->pending.pop_front();
        account_post(1, 0);
        progress = true;
        continue;
      }
      batch.clear();
      uint64_t bytes = 0;
      for (size_t i = 0; i < ts->pending.size() && !ts->pending[i].atomic; ++i) {
        const WriteRequest& w = ts->pending[i].w;
        if (ts->inflight_writes + batch.size() >= cfg_.max_inflight_writes) break;
        // one write larger than the byte cap may go alone, or it could never be posted
        if (ts->inflight_bytes + bytes + w.bytes > cfg_.max_inflight_bytes && (ts->inflight_writes + batch.size()) > 0)
          break;
        batch.push_back(w);
        bytes += w.bytes;
      }
      if (batch.empty()) break;
      sorted = batch;
      std::stable_sort(sorted.begin(), sorted.end(),
                       [](const WriteRequest& a, const WriteRequest& b) { return a.dst_rank < b.dst_rank; });
      std::vector<WriteRequest> rejected;
      uint64_t posted = 0, posted_bytes = 0;
      for (size_t s = 0; s < sorted.size();) {
        size_t e = s;
        while (e < sorted.size() && sorted[e].dst_rank == sorted[s].dst_rank && e - s < max_chain) ++e;
        const size_t ok = ts->transport->post_writes(&sorted[s], e - s);
        for (size_t i = s; i < s + ok; ++i) posted_bytes += sorted[i].bytes;
        posted += ok;
        if (ok < e - s) {
          // keep per-destination order: everything after the first refused one for this destination waits
          size_t k = s + ok;
          const int dst = sorted[s].dst_rank;
          while (k < sorted.size() && sorted[k].dst_rank == dst) rejected.push_back(sorted[k++]);
          s = k;
        } else {
          s = e;
        }
      }
      ts->pending.erase(ts->pending.begin(), ts->pending.begin() + batch.size());
      for (auto it = rejected.rbegin(); it != rejected.rend(); ++it) {
        PendingOp op;
        op.w = *it;
        ts->pending.push_front(op);
      }
      account_post(posted, posted_bytes);
      if (posted) progress = true;
      if (!rejected.empty() || posted == 0) break;
    }
    return progress;
  };

  auto complete_local = [&](uint64_t wr_id) {
    const int j = int(wr_id >> 56);
    const uint64_t bytes = wr_id & kBytesMask;
    --ts->inflight_writes;
    ts->inflight_bytes -= bytes;
    --ts->outstanding[j];
    ts->busy.fetch_sub(1, std::memory_order_relaxed);
  };

  while (running_.load(std::memory_order_relaxed) && !failed()) {
    bool progress = false;
    // 1. completions: ours (free in-flight budget) and peers' (signals, barriers)
    comps.clear();
    ts->transport->poll(comps, 256);
    for (const Completion& c : comps) {
      if (c.status != 0) {
        local_fail("transport error: " + (c.error.empty() ? "status " + std::to_string(c.status) : c.error));
        break;
      }
      progress = true;
      if (c.kind != Completion::Kind::kRemoteImm) {
        complete_local(c.wr_id);
      } else if (ImmCodec::is_control(c.imm)) {
        const uint32_t j = ImmCodec::control_fifo(c.imm);
        if (j >= ts->arrivals.size()) {
          local_fail("barrier message from rank " + std::to_string(c.src_rank) + " names FIFO " + std::to_string(j));
          break;
        }
        ++ts->arrivals[j][ImmCodec::control_epoch(c.imm)];
      } else {
        std::string err = ts->reorder->receive(c.src_rank, c.imm, [&](uint32_t slot, int64_t d) {
          __atomic_fetch_add(sig + slot, d, __ATOMIC_RELEASE);
          ts->signals_applied.fetch_add(1, std::memory_order_relaxed);
        });
        if (!err.empty()) {
          local_fail(err);
          break;
        }
        update_max(ts->max_reorder_held, ts->reorder->held());
      }
    }
    if (failed()) break;
    // 2. post what is queued
    if (post()) progress = true;
    // 3. take new commands, round robin over this thread's FIFOs
    const size_t nf = ts->fifos.size();
    for (size_t k = 0; k < nf && ts->pending.size() < pending_limit; ++k) {
      const int j = int((rr + k) % nf);
      Fifo& q = *ts->fifos[j];
      Command c;
      while (ts->pending.size() < pending_limit && q.peek(&c)) {
        const uint32_t type = command_type(c);
        if (type == kCmdQuiet) {
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
        } else if (type == kCmdWrite || type == kCmdWriteSignal || type == kCmdAtomic) {
          std::string err = expand(j, q.tail(), c);
          if (!err.empty()) {
            local_fail("rejected " + err);
            break;
          }
        } else {
          local_fail("fifo " + std::to_string(q.fifo_id()) + " command #" + std::to_string(q.tail()) +
                     " has unknown type " + std::to_string(type));
          break;
        }
        q.pop();
        ts->commands.fetch_add(1, std::memory_order_relaxed);
        progress = true;
      }
      if (failed()) break;
    }
    rr = (rr + 1) % nf;
    if (failed()) break;
    if (post()) progress = true;

    // 4. watchdog and idle back-off
    if (progress) {
      last_progress = Clock::now();
      idle_rounds = 0;
      continue;
    }
    ++idle_rounds;
    if (idle_rounds % 64 == 0) {
      const bool waiting = ts->inflight_writes || !ts->pending.empty() || ts->reorder->held() ||
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
        local_fail(m.str(), true);
        break;
      }
      if (cfg_.idle_backoff_us == 0) std::this_thread::yield();
    }
    if (cfg_.idle_backoff_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(cfg_.idle_backoff_us));
  }
}

}  // namespace uccl_ep
