// Python bindings of the host core: command encoding, FIFOs, proxies (over loopback or verbs), shared host memory and
// the loopback self-test doctor runs.
// Torch-free: buffers cross as raw pointers or numpy views.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "proxy/errors.hpp"
#include "proxy/host_memory.hpp"
#include "proxy/ordering.hpp"
#include "proxy/proxy.hpp"
#include "proxy/selftest.hpp"
#include "proxy/transport_factory.hpp"
#include "transport/loopback_copy_agent.hpp"
#include "bindings/proxy_stats_dict.hpp"
#include "bindings/wire_log.hpp"
#include "uccl_ep/command.hpp"

#ifdef UCCL_EP_WITH_CUDA
#include "kernels/fifo_bench.hpp"
#endif

namespace py = pybind11;

namespace uccl_ep::bindings {
namespace {

using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

void raise_encode(int err, py::ssize_t index) {
  std::string msg = std::string("command does not fit: ") + command_error_name(err);
  if (index >= 0) msg += " (entry " + std::to_string(index) + ")";
  throw py::value_error(msg);
}

py::tuple as_tuple(const Command& c) { return py::make_tuple(c.lo, c.hi); }

// Holds the data buffer alive as long as the proxy.
struct PyProxy {
  std::shared_ptr<SharedHostMemory> data;
  std::unique_ptr<Proxy> proxy;
  std::shared_ptr<LoopbackWire> wire;  // the loopback's capped wire (its log), else null
  ~PyProxy() {
    if (!proxy) return;
    proxy->stop();
    if (proxy->detached_threads()) {  // a stuck thread may still return into both: leak them (Proxy::stop)
      (void)proxy.release();
      (void)new std::shared_ptr<SharedHostMemory>(data);
    }
  }
};

Command from_pair(uint64_t lo, uint64_t hi) { return Command{lo, hi}; }

}  // namespace

void bind_host_core(py::module_& m) {
  py::register_exception<ProxyError>(m, "ProxyError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const TimeoutError& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    }
  });

  // ---- command format
  py::module_ c = m.def_submodule("command", "16-byte command encoding shared with the device code");
  c.attr("EMPTY") = int(kCmdEmpty);
  c.attr("WRITE") = int(kCmdWrite);
  c.attr("WRITE_SIGNAL") = int(kCmdWriteSignal);
  c.attr("ATOMIC") = int(kCmdAtomic);
  c.attr("QUIET") = int(kCmdQuiet);
  c.attr("BARRIER") = int(kCmdBarrier);
  c.attr("MAX_RANKS") = cmd::kMaxRanks;
  c.attr("MAX_SLOTS") = cmd::kMaxSlots;
  c.attr("MAX_VALUE") = cmd::kMaxValue;
  c.attr("MAX_BYTES") = cmd::kMaxBytes;
  c.attr("MAX_OFFSET") = cmd::kMaxOffset;
  c.attr("MAX_ATOMIC") = cmd::kMaxAtomic;
  c.attr("MIN_ATOMIC") = cmd::kMinAtomic;
  c.attr("UNIT") = cmd::kUnit;
  c.def("error_name", &command_error_name);
  // try_* return (error code, (lo, hi)); the plain versions raise ValueError naming the field.
  c.def("try_write", [](uint32_t dst, uint64_t bytes, uint64_t lo, uint64_t ro) {
    Command x{0, 0};
    int e = encode_write(&x, dst, bytes, lo, ro);
    return py::make_tuple(e, as_tuple(x));
  });
  c.def("try_write_signal", [](uint32_t dst, uint64_t bytes, uint64_t lo, uint64_t ro, uint32_t slot, uint32_t value) {
    Command x{0, 0};
    int e = encode_write_signal(&x, dst, bytes, lo, ro, slot, value);
    return py::make_tuple(e, as_tuple(x));
  });
  c.def("try_atomic", [](uint32_t dst, uint32_t slot, int64_t add) {
    Command x{0, 0};
    int e = encode_atomic(&x, dst, slot, add);
    return py::make_tuple(e, as_tuple(x));
  });
  c.def("try_control", [](uint32_t type) {
    Command x{0, 0};
    int e = encode_control(&x, type);
    return py::make_tuple(e, as_tuple(x));
  });
  c.def("write", [](uint32_t dst, uint64_t bytes, uint64_t lo, uint64_t ro) {
    Command x{0, 0};
    if (int e = encode_write(&x, dst, bytes, lo, ro)) raise_encode(e, -1);
    return as_tuple(x);
  }, py::arg("dst_rank"), py::arg("bytes"), py::arg("local_offset"), py::arg("remote_offset"));
  c.def("write_signal", [](uint32_t dst, uint64_t bytes, uint64_t lo, uint64_t ro, uint32_t slot, uint32_t value) {
    Command x{0, 0};
    if (int e = encode_write_signal(&x, dst, bytes, lo, ro, slot, value)) raise_encode(e, -1);
    return as_tuple(x);
  }, py::arg("dst_rank"), py::arg("bytes"), py::arg("local_offset"), py::arg("remote_offset"), py::arg("slot"),
     py::arg("value"));
  c.def("atomic", [](uint32_t dst, uint32_t slot, int64_t add) {
    Command x{0, 0};
    if (int e = encode_atomic(&x, dst, slot, add)) raise_encode(e, -1);
    return as_tuple(x);
  }, py::arg("dst_rank"), py::arg("slot"), py::arg("add"));
  c.def("quiet", [] { Command x{0, 0}; encode_control(&x, kCmdQuiet); return as_tuple(x); });
  c.def("barrier", [] { Command x{0, 0}; encode_control(&x, kCmdBarrier); return as_tuple(x); });
  c.def("decode", [](uint64_t lo, uint64_t hi) {
    CommandFields f = decode(Command{lo, hi});
    py::dict d;
    d["type"] = f.type;
    d["dst_rank"] = f.dst_rank;
    d["slot"] = f.slot;
    d["value"] = f.value;
    d["atomic_add"] = f.atomic_add;
    d["bytes"] = f.bytes;
    d["local_offset"] = f.local_offset;
    d["remote_offset"] = f.remote_offset;
    return d;
  });
  // Vectorised encoder for tests and CPU producers: arrays of equal length -> uint64[n, 2]. value < 0 marks a plain
  // write; quiet_every > 0 inserts a quiet after every that many commands.
  c.def("encode_writes", [](U64Array dst, U64Array bytes, U64Array lo, U64Array ro, U64Array slot, I64Array value) {
    const py::ssize_t n = dst.size();
    if (bytes.size() != n || lo.size() != n || ro.size() != n || slot.size() != n || value.size() != n)
      throw py::value_error("encode_writes: all arrays must have the same length");
    U64Array out({n, py::ssize_t(2)});
    auto o = out.mutable_unchecked<2>();
    auto d = dst.unchecked<1>(), b = bytes.unchecked<1>(), l = lo.unchecked<1>(), r = ro.unchecked<1>(),
         s = slot.unchecked<1>();
    auto v = value.unchecked<1>();
    for (py::ssize_t i = 0; i < n; ++i) {
      Command x{0, 0};
      int e;
      if (d(i) > UINT32_MAX || s(i) > UINT32_MAX) e = d(i) > UINT32_MAX ? kCmdRankRange : kCmdSlotRange;
      else if (v(i) < 0) e = encode_write(&x, uint32_t(d(i)), b(i), l(i), r(i));
      else if (v(i) > UINT32_MAX) e = kCmdValueRange;
      else e = encode_write_signal(&x, uint32_t(d(i)), b(i), l(i), r(i), uint32_t(s(i)), uint32_t(v(i)));
      if (e) raise_encode(e, i);
      o(i, 0) = x.lo;
      o(i, 1) = x.hi;
    }
    return out;
  });

  // ---- immediate codec (exposed so tests can check the split and sequence arithmetic)
  py::class_<ImmCodec>(m, "ImmCodec")
      .def(py::init<bool, int>(), py::arg("ordered"), py::arg("window"))
      .def_property_readonly("seq_bits", &ImmCodec::seq_bits)
      .def_property_readonly("max_magnitude", &ImmCodec::max_magnitude);

  // ---- registrable host memory
  py::class_<SharedHostMemory, std::shared_ptr<SharedHostMemory>>(m, "HostBuffer", py::buffer_protocol())
      .def(py::init<size_t>(), py::arg("nbytes"))
      .def_property_readonly("ptr", [](const SharedHostMemory& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("nbytes", &SharedHostMemory::bytes)
      .def_buffer([](SharedHostMemory& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1, {py::ssize_t(b.bytes())},
                               {py::ssize_t(1)});
      });
  m.def("unlink_shared_host_memory_names", &unlink_shared_host_memory_names,
        "Remove this process's shm names once every peer mapped them (after the connect barrier).");

  // ---- a bare FIFO, for tests of the ring protocol without a proxy
  py::class_<Fifo>(m, "Fifo")
      .def(py::init<uint32_t, int, int>(), py::arg("depth"), py::arg("rank") = 0, py::arg("fifo_id") = 0)
      .def_property_readonly("depth", &Fifo::depth)
      .def_property_readonly("device_mapped", &Fifo::device_mapped)
      .def("push", [](Fifo& f, py::tuple cmd, double timeout) {
        Command c = from_pair(cmd[0].cast<uint64_t>(), cmd[1].cast<uint64_t>());
        py::gil_scoped_release nogil;
        return f.push(c, timeout);
      }, py::arg("command"), py::arg("timeout_secs"))
      .def("pop", [](Fifo& f) -> py::object {
        Command c;
        if (!f.peek(&c)) return py::none();
        f.pop();
        return as_tuple(c);
      }, "Take the command at the tail, or None when the slot is still empty.")
      .def("push_as_device", [](Fifo& f, py::tuple cmd, double timeout) {
        Command c = from_pair(cmd[0].cast<uint64_t>(), cmd[1].cast<uint64_t>());
        py::gil_scoped_release nogil;
        return f.push_as_device(c, timeout);
      }, py::arg("command"), py::arg("timeout_secs"),
         "Push the way a kernel does (its own head, not `head`; the FIFO becomes GPU-fed), for tests without a GPU.")
      .def_property_readonly("tail", &Fifo::tail)
      .def_property_readonly("head", &Fifo::host_head)
      .def_property_readonly("drained", &Fifo::drained,
                             "No published command waits for the consumer (what Proxy.wait_idle checks per FIFO).")
      .def_property_readonly("producer", [](const Fifo& f) { return fifo_producer_name(f.producer()); },
                             "'none', 'host' or 'device': which kind of producer uses this FIFO")
      .def("bind_producer", [](Fifo& f, const std::string& kind) {
        if (kind == "host") return f.bind_producer(FifoProducer::kHost);
        if (kind == "device") return f.bind_producer(FifoProducer::kDevice);
        throw py::value_error("bind_producer: kind must be 'host' or 'device'");
      }, py::arg("kind"), "Claim the FIFO for host or device producers (what push / a kernel's device view do); "
         "raises ProxyError when the other kind already uses it.");

  // Stress the ring: `producers` threads push `per_producer` commands each (producer id in dst_rank, sequence in
  // remote_offset) while one consumer pops, pausing now and then so the ring fills. Returns what the consumer saw.
  m.def("fifo_stress", [](uint32_t depth, int producers, uint64_t per_producer, uint64_t pause_every,
                          double timeout_secs) {
    if (producers < 1 || producers > int(cmd::kMaxRanks)) throw py::value_error("producers must be 1..4096");
    Fifo f(depth, 0, 0);
    std::vector<uint64_t> next(producers, 0);
    uint64_t received = 0, out_of_order = 0, bad = 0, pauses = 0;
    std::string err;
    {
      py::gil_scoped_release nogil;
      std::vector<std::thread> th;
      std::vector<std::string> errs(producers);
      for (int p = 0; p < producers; ++p)
        th.emplace_back([&, p] {
          try {
            for (uint64_t i = 0; i < per_producer; ++i) {
              Command c;
              encode_write(&c, uint32_t(p), 16, 0, (i % (cmd::kMaxOffset / 16)) * 16);
              f.push(c, timeout_secs);
            }
          } catch (const std::exception& e) {
            errs[p] = e.what();
          }
        });
      const uint64_t total = per_producer * uint64_t(producers);
      const auto t0 = std::chrono::steady_clock::now();
      Command c;
      while (received < total) {
        if (!f.peek(&c)) {
          if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_secs) break;
          std::this_thread::yield();
          continue;
        }
        const CommandFields fl = decode(c);
        f.pop();
        ++received;
        if (fl.type != kCmdWrite || fl.dst_rank >= uint32_t(producers)) {
          ++bad;
        } else {
          const uint64_t seq = fl.remote_offset / 16;
          if (seq != next[fl.dst_rank] % (cmd::kMaxOffset / 16)) ++out_of_order;
          ++next[fl.dst_rank];
        }
        if (pause_every && received % pause_every == 0) {  // let producers hit the full ring
          ++pauses;
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
      }
      for (auto& t : th) t.join();
      for (auto& e : errs)
        if (!e.empty()) err = e;
    }
    py::dict d;
    d["received"] = received;
    d["out_of_order"] = out_of_order;
    d["bad"] = bad;
    d["per_producer"] = next;
    d["pauses"] = pauses;
    d["tail"] = f.tail();
    d["head"] = f.host_head();
    d["error"] = err;
    return d;
  }, py::arg("depth"), py::arg("producers"), py::arg("per_producer"), py::arg("pause_every") = 0,
     py::arg("timeout_secs") = 60.0);

  // ---- the loopback's copy agent (transport/loopback_copy_agent.hpp)
  py::class_<CopyAgentSegment, std::shared_ptr<CopyAgentSegment>>(
      m, "CopyAgentSegment", "the shared memory between a rank's loopback endpoints and its copy agent process")
      .def_static("create", &CopyAgentSegment::create, py::arg("lanes"), py::arg("device"),
                  "a segment for `lanes` proxy threads of the rank on `device` (-1: host memory only)")
      .def_property_readonly("name", &CopyAgentSegment::name)
      .def_property_readonly("lanes", &CopyAgentSegment::lanes)
      .def_property_readonly("device", &CopyAgentSegment::device)
      .def_property_readonly("agent_pid", &CopyAgentSegment::agent_pid)
      .def_property_readonly("state", [](const CopyAgentSegment& s) {
        switch (s.state()) {
          case CopyAgentState::kStarting: return "starting";
          case CopyAgentState::kReady: return "ready";
          case CopyAgentState::kClosing: return "closing";
          case CopyAgentState::kFailed: return "failed";
        }
        return "unknown";
      })
      .def_property_readonly("agent_message", &CopyAgentSegment::agent_message)
      .def("request_close", &CopyAgentSegment::request_close);
  m.def("run_copy_agent", &run_copy_agent, py::arg("name"), py::call_guard<py::gil_scoped_release>(),
        "the copy agent's loop, in its own process: 0 once closed on request, 1 when the client is gone, 2 when it "
        "could not start (the segment says why)");

  // ---- proxy
  py::class_<PyProxy>(m, "Proxy")
      .def(py::init([](std::shared_ptr<SharedHostMemory> data, int rank, int world, int num_threads,
                       int fifos_per_thread, uint32_t fifo_depth, std::vector<int> cpus, int idle_backoff_us,
                       double timeout_secs, uint64_t max_inflight_writes, uint64_t max_inflight_bytes,
                       int reorder_window, uint32_t num_signal_slots, std::string transport, int loopback_reorder,
                       uint64_t loopback_delay_us, double loopback_bandwidth_gbps, uint64_t loopback_seed,
                       std::vector<std::string> ib_devices, std::vector<int> ib_gid_index, int ib_port, int ib_sl,
                       int ib_tc, int ib_sq_depth, int ib_rq_depth, std::string dump_trigger,
                       std::string loopback_copy_agent) {
             ProxyConfig cfg;
             cfg.rank = rank;
             cfg.world = world;
             cfg.num_threads = num_threads;
             cfg.fifos_per_thread = fifos_per_thread;
             cfg.fifo_depth = fifo_depth;
             cfg.cpus = cpus;
             cfg.idle_backoff_us = idle_backoff_us;
             cfg.timeout_secs = timeout_secs;
             cfg.max_inflight_writes = max_inflight_writes;
             cfg.max_inflight_bytes = max_inflight_bytes;
             cfg.reorder_window = reorder_window;
             cfg.num_signal_slots = num_signal_slots;
             cfg.dump_trigger = dump_trigger;
             TransportSpec spec;
             spec.name = transport;
             spec.loopback.reorder = loopback_reorder;
             spec.loopback.delay_us = loopback_delay_us;
             spec.loopback.bandwidth_gbps = loopback_bandwidth_gbps;
             spec.loopback.seed = loopback_seed;
             if (transport == "loopback" && !loopback_copy_agent.empty())
               spec.loopback.copy_agent = CopyAgentSegment::open(loopback_copy_agent);
             spec.verbs.devices = ib_devices;
             spec.verbs.gid_index = ib_gid_index;
             spec.verbs.port = ib_port;
             spec.verbs.sl = ib_sl;
             spec.verbs.tc = ib_tc;
             spec.verbs.sq_depth = ib_sq_depth;
             spec.verbs.rq_depth = ib_rq_depth;
             auto p = std::make_unique<PyProxy>();
             if (transport == "loopback" && loopback_bandwidth_gbps > 0)
               spec.loopback.wire = p->wire = std::make_shared<LoopbackWire>();
             const Proxy::TransportFactory factory = make_transport_factory(spec, rank, world, num_threads, "Proxy");
             p->data = data;
             p->proxy = std::make_unique<Proxy>(cfg, factory, data->data(), data->bytes(), MemoryKind::kHost);
             return p;
           }),
           py::arg("data"), py::arg("rank"), py::arg("world"), py::arg("num_threads") = 1,
           py::arg("fifos_per_thread") = 1, py::arg("fifo_depth") = 1024, py::arg("cpus") = std::vector<int>{},
           py::arg("idle_backoff_us") = 0, py::arg("timeout_secs") = 100.0, py::arg("max_inflight_writes") = 8,
           py::arg("max_inflight_bytes") = 2ull << 20, py::arg("reorder_window") = 256,
           py::arg("num_signal_slots") = 1024, py::arg("transport") = "loopback", py::arg("loopback_reorder") = 0,
           py::arg("loopback_delay_us") = 0, py::arg("loopback_bandwidth_gbps") = 0.0, py::arg("loopback_seed") = 0,
           py::arg("ib_devices") = std::vector<std::string>{}, py::arg("ib_gid_index") = std::vector<int>{},
           py::arg("ib_port") = 1, py::arg("ib_sl") = -1, py::arg("ib_tc") = -1, py::arg("ib_sq_depth") = 1024,
           py::arg("ib_rq_depth") = 1024, py::arg("dump_trigger") = "", py::arg("loopback_copy_agent") = "",
           "loopback_copy_agent: the segment name of a copy agent (uccl_ep_train.loopback_copy_agent) that moves the "
           "loopback's bytes in a process of its own; empty: the proxy threads copy")
      .def_property_readonly("num_fifos", [](PyProxy& p) { return p.proxy->num_fifos(); })
      .def_property_readonly("caps", [](PyProxy& p) {
        TransportCaps c = p.proxy->caps();
        py::dict d;
        d["name"] = c.name;
        d["in_order"] = c.in_order;
        d["native_atomics"] = c.native_atomics;
        d["imm_bits"] = c.imm_bits;
        return d;
      })
      .def("local_info", [](PyProxy& p, int t) {
        auto v = p.proxy->local_info(t);
        return py::bytes(reinterpret_cast<const char*>(v.data()), v.size());
      })
      .def("connect", [](PyProxy& p, const std::vector<std::vector<std::string>>& infos) {
        std::vector<std::vector<std::vector<uint8_t>>> conv;
        for (auto& per_thread : infos) {
          conv.emplace_back();
          for (auto& s : per_thread) conv.back().emplace_back(s.begin(), s.end());
        }
        p.proxy->connect(conv);
      }, py::arg("infos"), "infos[thread][rank] = that rank's local_info(thread)")
      .def("start", [](PyProxy& p) { p.proxy->start(); })
      .def("stop", [](PyProxy& p) {
        py::gil_scoped_release nogil;
        p.proxy->stop();
      })
      .def_property_readonly("threads_in_loop", [](PyProxy& p) { return p.proxy->threads_in_loop(); },
                             "proxy threads that have not left their loop (a detached stuck one counts until its "
                             "call returns)")
      .def("check", [](PyProxy& p) { p.proxy->check(); })
      .def_property_readonly("failed", [](PyProxy& p) { return p.proxy->failed(); })
      .def_property_readonly("error", [](PyProxy& p) { return p.proxy->error(); })
      .def_property_readonly("timed_out", [](PyProxy& p) { return p.proxy->timed_out(); },
                             "The recorded failure is the watchdog's (UCCL_EP_CPU_TIMEOUT_SECS passed without progress)")
      .def("push", [](PyProxy& p, int fifo, py::tuple cmd) {
        Command c = from_pair(cmd[0].cast<uint64_t>(), cmd[1].cast<uint64_t>());
        py::gil_scoped_release nogil;
        return p.proxy->push(fifo, c);
      }, py::arg("fifo"), py::arg("command"))
      .def("push_array", [](PyProxy& p, int fifo, U64Array cmds) {
        if (cmds.ndim() != 2 || cmds.shape(1) != 2) throw py::value_error("push_array: expected uint64[n, 2]");
        const Command* c = reinterpret_cast<const Command*>(cmds.data());
        const size_t n = size_t(cmds.shape(0));
        py::gil_scoped_release nogil;
        p.proxy->push_many(fifo, c, n);
      }, py::arg("fifo"), py::arg("commands"), "Push uint64[n, 2] commands in order (GIL released).")
      .def("fifo_tail", [](PyProxy& p, int fifo) { return p.proxy->fifo(fifo).tail(); })
      .def("fifo_push_as_device", [](PyProxy& p, int fifo, py::tuple cmd) {
        Command c = from_pair(cmd[0].cast<uint64_t>(), cmd[1].cast<uint64_t>());
        Fifo& f = p.proxy->fifo(fifo);
        const double timeout = p.proxy->config().timeout_secs;
        py::gil_scoped_release nogil;
        return f.push_as_device(c, timeout);
      }, py::arg("fifo"), py::arg("command"),
         "Push onto `fifo` the way a kernel does (Fifo.push_as_device): tests of GPU-fed FIFOs on machines without a "
         "GPU.")
      .def("describe", [](PyProxy& p) {
        py::gil_scoped_release nogil;
        return p.proxy->describe();
      }, "One line per proxy thread: queued operations, writes and bytes in flight, per-FIFO outstanding operations "
         "and barriers, signals held for order, and the transport's debug state. Safe while the proxy runs.")
      .def("wait_done", [](PyProxy& p, int fifo, uint64_t index) {
        py::gil_scoped_release nogil;
        p.proxy->wait_done(fifo, index);
      })
      .def("wait_idle", [](PyProxy& p, double timeout) {
        py::gil_scoped_release nogil;
        p.proxy->wait_idle(timeout);
      }, py::arg("timeout_secs"))
      .def("wait_signal", [](PyProxy& p, uint32_t slot, int64_t expected, double timeout) {
        py::gil_scoped_release nogil;
        return p.proxy->wait_signal(slot, expected, timeout);
      }, py::arg("slot"), py::arg("expected"), py::arg("timeout_secs"))
      .def("signals", [](py::object self) {
        PyProxy& p = self.cast<PyProxy&>();
        return py::array_t<int64_t>({py::ssize_t(p.proxy->config().num_signal_slots)}, {py::ssize_t(8)},
                                    p.proxy->signals(), self);
      }, "A live int64 view of this rank's signal counters.")
      .def_property_readonly("signals_ptr", [](PyProxy& p) { return reinterpret_cast<uintptr_t>(p.proxy->signals()); })
      .def("stats", [](PyProxy& p, int t) { return proxy_stats_dict(p.proxy->stats(t)); })
      .def("start_wire_log", [](PyProxy& p, size_t capacity) {
        if (!p.wire) throw py::value_error("start_wire_log: no emulated wire (loopback with loopback_bandwidth_gbps > 0)");
        p.wire->start_log(capacity);
      }, py::arg("capacity"), "record the emulated wire's busy runs afresh, at most capacity of them")
      .def("stop_wire_log", [](PyProxy& p) {
        if (!p.wire) throw py::value_error("stop_wire_log: no emulated wire");
        uint64_t dropped = 0;
        std::vector<WireRun> runs = p.wire->stop_log(&dropped);
        return wire_log_dict(runs, dropped);
      }, "stop recording: {'runs': [(start_ns, end_ns, bytes, writes)], 'dropped': n}, on the steady clock");
  m.def("steady_clock_ns", [] {
    return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now().time_since_epoch()).count());
  }, "the steady clock the proxies and the emulated wire stamp with (ns), for windows to compare against them");

  // Both selftest entry points run the same thing; the GIL is released while the proxies work.
  auto run_selftest = [](uint64_t commands, int reorder, uint64_t seed, double timeout_secs,
                         std::string inject_fault) {
    SelftestOptions o;
    o.commands = commands;
    o.reorder = reorder;
    o.seed = seed;
    o.timeout_secs = timeout_secs;
    o.inject_fault = std::move(inject_fault);
    py::gil_scoped_release nogil;
    return loopback_selftest(o);
  };
  m.def("loopback_selftest", [run_selftest](uint64_t commands, int reorder, uint64_t seed, double timeout_secs) {
    return run_selftest(commands, reorder, seed, timeout_secs, "").summary;
  }, py::arg("commands") = 4096, py::arg("reorder") = 8, py::arg("seed") = 1, py::arg("timeout_secs") = 30.0,
     "Two proxies in this process over loopback (reordering injected) exchange `commands` write+signal commands each "
     "way; verifies every byte and counter and returns a one-line summary with commands/s. Raises ProxyError "
     "(wrong byte or counter) or TimeoutError.");
  m.def("loopback_selftest_details", [run_selftest](uint64_t commands, int reorder, uint64_t seed,
                                                    double timeout_secs, std::string inject_fault) {
    const SelftestResult r = run_selftest(commands, reorder, seed, timeout_secs, std::move(inject_fault));
    py::dict d;
    d["commands"] = r.commands;
    d["bytes"] = r.bytes;
    d["signals"] = r.signals;
    d["max_reorder_held"] = r.max_reorder_held;
    d["seconds"] = r.seconds;
    d["summary"] = r.summary;
    return d;
  }, py::arg("commands") = 4096, py::arg("reorder") = 8, py::arg("seed") = 1, py::arg("timeout_secs") = 30.0,
     py::arg("inject_fault") = "",
     "loopback_selftest, returning its counts as a dict (tests); inject_fault='byte'|'signal' damages what rank 1 "
     "received before the verification, which must then raise.");

#ifdef UCCL_EP_WITH_CUDA
  m.def("fifo_bench_gpu", [](PyProxy& p, int first_fifo, int num_fifos, uint64_t commands_per_fifo, int dst_rank,
                             double timeout_secs, const std::string& push) {
    const PushVariant variant = parse_push_variant(push);
    std::vector<DeviceFifo> views;
    for (int i = 0; i < num_fifos; ++i) views.push_back(p.proxy->fifo(first_fifo + i).device_view());
    py::gil_scoped_release nogil;
    return launch_fifo_bench(views.data(), num_fifos, commands_per_fifo, dst_rank, uint64_t(timeout_secs * 1e9),
                             variant);
  }, py::arg("proxy"), py::arg("first_fifo"), py::arg("num_fifos"), py::arg("commands_per_fifo"),
     py::arg("dst_rank"), py::arg("timeout_secs") = 100.0, py::arg("push") = push_variant_name(kDefaultPushVariant),
     "A GPU kernel pushes commands_per_fifo write+signal commands (then a quiet) into each FIFO with the push variant "
     "`push` ('push', 'warp', 'writer', 'writer-warp'); returns seconds. The FIFOs become GPU-fed: host pushes to "
     "them raise ProxyError from then on.");
  m.def("fifo_latency_gpu", [](PyProxy& p, int fifo, uint32_t slot, int samples, double timeout_secs,
                               const std::string& push, int poll_warps) {
    const PushVariant variant = parse_push_variant(push);
    const DeviceFifo view = p.proxy->fifo(fifo).device_view();
    std::vector<uint64_t> ns;
    {
      py::gil_scoped_release nogil;
      ns = launch_fifo_latency(view, p.proxy->signals(), p.proxy->config().num_signal_slots, slot, samples,
                               p.proxy->config().rank, uint64_t(timeout_secs * 1e9), variant, poll_warps);
    }
    return ns;
  }, py::arg("proxy"), py::arg("fifo"), py::arg("slot"), py::arg("samples"), py::arg("timeout_secs") = 100.0,
     py::arg("push") = push_variant_name(kDefaultPushVariant), py::arg("poll_warps") = 1,
     "A GPU kernel pushes one write+signal to this rank (increment 1 on `slot`) at a time onto `fifo` and waits until "
     "the proxy applied it to this rank's counter, watched by `poll_warps` warps with staggered loads; returns the "
     "nanoseconds of every sample (GPU global timer).");
  m.def("pcie_echo_gpu", [](int samples, double timeout_secs, int poll_warps) {
    py::gil_scoped_release nogil;
    return launch_pcie_echo(samples, uint64_t(timeout_secs * 1e9), poll_warps);
  }, py::arg("samples"), py::arg("timeout_secs") = 10.0, py::arg("poll_warps") = 1,
     "The floor under fifo_latency_gpu: a kernel stores a word into host memory, a spinning host thread copies it "
     "back, `poll_warps` warps watch for it; returns nanoseconds per round trip.");
#endif
}

}  // namespace uccl_ep::bindings
