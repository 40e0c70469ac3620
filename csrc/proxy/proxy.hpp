// CPU proxy: threads that drain command FIFOs, post writes through a Transport, poll completions, apply incoming
// signals, and enforce flow control and deadlines. See docs/host-core.md "Proxy loop".
//
// Layout: thread t owns FIFOs [t * fifos_per_thread, (t + 1) * fifos_per_thread) and its own Transport endpoint,
// which connects to endpoint t of every rank. Region 0 of every endpoint is the rank's data buffer (command offsets
// are relative to it); region 1 is the rank's signal buffer (int64 counters, one per slot).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "proxy/fifo.hpp"
#include "proxy/host_memory.hpp"
#include "transport/transport.hpp"

namespace uccl_ep {

struct ProxyConfig {
  int rank = 0;
  int world = 1;
  int num_threads = 1;
  int fifos_per_thread = 1;
  uint32_t fifo_depth = 1024;
  std::vector<int> cpus;          // pin thread i to cpus[i % size]; empty: no pinning
  int idle_backoff_us = 0;        // sleep after an idle round (0: spin, yielding now and then)
  double timeout_secs = 100.0;    // watchdog deadline of every wait
  uint64_t max_inflight_writes = 8;
  uint64_t max_inflight_bytes = 2ull << 20;
  int reorder_window = 256;
  uint32_t num_signal_slots = 1024;
  // A file whose modification (`touch`) after the proxy started makes every proxy thread print its state to stderr
  // (FIFO positions and ring contents, queued and in-flight operations, the transport's own state): for a stuck job,
  // the view from the side that should have sent. Checked about every 50 ms while a thread is idle; empty: off.
  std::string dump_trigger;
};

struct ProxyThreadStats {
  uint64_t commands = 0;           // commands taken from the FIFOs
  uint64_t writes_posted = 0;      // work requests posted (writes, zero-length signals, atomics)
  uint64_t signals_applied = 0;    // increments applied to our signal buffer
  uint64_t max_inflight_writes = 0;
  uint64_t max_inflight_bytes = 0;
  uint64_t max_reorder_held = 0;
};

class Proxy {
 public:
  using TransportFactory = std::function<std::unique_ptr<Transport>(int thread_index)>;

  // `data` must stay valid for the proxy's lifetime; for the loopback transport host memory must come from
  // SharedHostMemory.
  Proxy(const ProxyConfig& config, const TransportFactory& factory, void* data, size_t data_bytes, MemoryKind kind);
  ~Proxy();
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  const ProxyConfig& config() const { return cfg_; }
  int num_fifos() const { return int(fifos_.size()); }
  Fifo& fifo(int i);
  int64_t* signals() const { return static_cast<int64_t*>(signals_->data()); }
  TransportCaps caps() const;

  // Connection bootstrap: local_info(t) of every rank, gathered as infos[t][rank].
  std::vector<uint8_t> local_info(int thread);
  void connect(const std::vector<std::vector<std::vector<uint8_t>>>& infos);
  void start();
  void stop();  // joins every thread; idempotent

  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // The recorded failure is the watchdog's (nothing progressed for timeout_secs), not a transport or command error.
  bool timed_out() const { return timed_out_.load(std::memory_order_acquire); }
  const std::atomic<bool>& failed_flag() const { return failed_; }
  std::string error() const;
  void check() const;  // throws ProxyError with the first recorded error

  // Push from the host (tests, CPU producers). Returns the slot index; throws on timeout or when the proxy failed.
  uint64_t push(int fifo, const Command& c);
  void push_many(int fifo, const Command* cmds, size_t n);
  void wait_done(int fifo, uint64_t index);

  // Wait until no command published to any FIFO waits to be taken (Fifo::drained: host- and GPU-fed FIFOs alike)
  // and nothing is queued or in flight. A GPU push whose store has not landed yet is not seen: call it after the
  // pushing kernels finished.
  void wait_idle(double timeout_secs);
  // Wait until signals[slot] >= expected; raises TimeoutError naming rank, slot, expected and current value.
  int64_t wait_signal(uint32_t slot, int64_t expected, double timeout_secs);

  ProxyThreadStats stats(int thread) const;
  // Every thread together: counts summed, maxima of the maxima.
  ProxyThreadStats totals() const;

  // One line per proxy thread: operations queued, writes and bytes in flight, per-FIFO outstanding operations and
  // barriers, signals held for order, and the transport's own debug_state(). Safe from any thread while the proxy
  // runs (for a stuck job: what is each thread waiting for). The counters are the ones the thread last published
  // (once per round), so they can lag by one round; the transport part is taken by the proxy thread itself when
  // asked, because a transport is used by one thread only (or directly when the thread does not run).
  // ask_transport = false: only the counters the proxy threads publish (atomics), never the transport; safe from
  // any thread at any time, e.g. a diagnostic dump of a process whose other threads are stuck.
  std::string describe(bool ask_transport = true) const;
  // After stop(): true when a thread stuck inside a transport call was detached instead of joined. Its call may
  // still return and run the rest of a round, which touches this object, the FIFOs, the signal buffer and the data
  // region: the owner must then leak the proxy and the memory it registered rather than free them.
  bool detached_threads() const;
  int threads_in_loop() const;  // proxy threads that have not left their loop (diagnostics, tests)

 private:
  struct ThreadState;
  void run(ThreadState* ts);
  // One thread per proxy, beside the proxy threads: a proxy thread stuck inside a transport call (a driver or NIC
  // that never returns) cannot run its own watchdog, so this one notices that its loop stopped turning and fails the
  // proxy naming the call; it also serves dump_trigger for such a thread.
  void monitor();
  std::string transport_state(ThreadState& ts) const;
  void fail(const std::string& what, bool timeout = false);

  ProxyConfig cfg_;
  std::unique_ptr<SharedHostMemory> signals_;
  std::vector<std::unique_ptr<Fifo>> fifos_;
  std::vector<std::unique_ptr<ThreadState>> threads_;
  std::thread monitor_;
  void* data_;
  size_t data_bytes_;
  bool connected_ = false;
  // dump_trigger's mtime when start() ran: every thread compares against it, so a touch right after start() is
  // answered by every thread, also one the scheduler starts late (each used to read it when it began to run).
  int64_t trigger_mtime_at_start_ = -1;
  std::atomic<bool> running_{false};
  std::atomic<bool> failed_{false};
  std::atomic<bool> timed_out_{false};
  mutable std::mutex err_mu_;
  std::string error_;
};

}  // namespace uccl_ep
