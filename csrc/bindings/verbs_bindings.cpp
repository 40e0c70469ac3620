// Python face of the verbs layer: GID choice and sysfs GID tables (used by topology/doctor tests to cross-check the
// Python implementation), the verbs transport, and `verbs.fake`, the recording ibv table used only by tests.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>

#include "transport/gid.hpp"
#include "transport/ibv_api.hpp"
#include "transport/verbs.hpp"

namespace py = pybind11;

namespace uccl_ep::bindings {
namespace {

py::dict table_to_dict(const GidTable& t) {
  py::dict d;
  d["device"] = t.device;
  d["port"] = t.port;
  d["link_layer"] = t.link_layer;
  py::list entries;
  for (const auto& e : t.entries) {
    py::dict x;
    x["index"] = e.index;
    x["gid"] = gid_to_string(e.raw);
    x["type"] = gid_type_name(e.type);
    x["netdev"] = e.netdev;
    entries.append(x);
  }
  d["gids"] = entries;
  return d;
}

// Accepts the dict shape of table_to_dict and of uccl_ep_train.topology (type: "RoCE v2", "IB/RoCE v1", "IB", ...).
GidTable table_from_dict(const py::dict& d) {
  GidTable t;
  t.device = d.contains("device") ? d["device"].cast<std::string>() : "";
  t.port = d.contains("port") ? d["port"].cast<int>() : 1;
  t.link_layer = d.contains("link_layer") ? d["link_layer"].cast<std::string>() : "Ethernet";
  for (auto item : d["gids"].cast<py::list>()) {
    auto x = item.cast<py::dict>();
    GidEntry e;
    e.index = x["index"].cast<int>();
    e.raw = gid_from_string(x["gid"].cast<std::string>());
    std::string type = x.contains("type") ? x["type"].cast<std::string>() : "";
    e.type = type == "IB" ? GidType::kIB : gid_type_from_sysfs(type, t.link_layer);
    if (x.contains("netdev") && !x["netdev"].is_none()) e.netdev = x["netdev"].cast<std::string>();
    t.entries.push_back(e);
  }
  return t;
}

#ifdef UCCL_EP_WITH_VERBS
py::dict completion_to_dict(const Completion& c) {
  py::dict d;
  static const char* const kinds[] = {"local_write", "local_atomic", "remote_imm"};
  d["kind"] = kinds[static_cast<int>(c.kind)];
  d["wr_id"] = c.wr_id;
  d["src_rank"] = c.src_rank;
  d["imm"] = c.imm;
  d["status"] = c.status;
  d["error"] = c.error;
  return d;
}

template <typename T>
T get_or(const py::dict& d, const char* k, T dflt) {
  return d.contains(k) ? d[k].cast<T>() : dflt;
}

py::list records_to_list(const std::vector<fake_verbs::Record>& recs) {
  py::list out;
  for (const auto& r : recs) {
    py::dict d;
    d["fn"] = r.fn;
    for (const auto& kv : r.args) d[kv.first.c_str()] = kv.second;
    for (const auto& kv : r.text) d[kv.first.c_str()] = kv.second;
    if (!r.wrs.empty() || r.fn == "ibv_post_send" || r.fn == "ibv_wr_complete") {
      py::list wrs;
      for (const auto& w : r.wrs) {
        py::dict x;
        for (const auto& kv : w) x[kv.first.c_str()] = kv.second;
        wrs.append(x);
      }
      d["wrs"] = wrs;
    }
    out.append(d);
  }
  return out;
}
#endif

}  // namespace

void bind_verbs(py::module_& m) {
  auto v = m.def_submodule("verbs", "verbs transport, GID choice, and the recording fake ibv table for tests");
#ifdef UCCL_EP_WITH_VERBS
  v.attr("available") = true;
#else
  v.attr("available") = false;
#endif
#ifdef UCCL_EP_WITH_EFADV
  v.attr("efadv") = true;
#else
  v.attr("efadv") = false;
#endif

  v.def(
      "choose_gid",
      [](const py::dict& table, int override_index, bool is_efa) {
        try {
          GidChoice c = choose_gid(table_from_dict(table), override_index, is_efa);
          return py::make_tuple(c.index, c.reason);
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
      },
      py::arg("table"), py::arg("override_index") = -1, py::arg("is_efa") = false,
      "GID index for a port's table (dict: device, port, link_layer, gids=[{index, gid, type, netdev}]) -> "
      "(index, reason); ValueError when nothing usable exists");
  v.def(
      "read_gid_table",
      [](const std::string& root, const std::string& dev, int port) { return table_to_dict(read_gid_table(root, dev, port)); },
      py::arg("sysfs_root"), py::arg("device"), py::arg("port") = 1);

#ifdef UCCL_EP_WITH_VERBS
  v.def("library_status", [] {
    py::dict d;
    try {
      system_ibv_api();
      d["libibverbs"] = true;
      d["error"] = "";
    } catch (const std::exception& e) {
      d["libibverbs"] = false;
      d["error"] = e.what();
    }
    d["libefa"] = libefa_available();
    return d;
  });
  // The table a transport built now would call: "fake" while a test installed the recording fake, else the loaded
  // system libibverbs. Raises RuntimeError (naming the package) when neither is usable. UCCL_EP_TRANSPORT=auto
  // asks this before choosing verbs.
  v.def("active_api", [] { return std::string(ibv_api().name); });

  py::class_<VerbsTransport>(v, "VerbsTransport")
      .def(py::init([](int rank, int world_size, std::vector<std::string> devices, int port, std::vector<int> gid_index,
                       int sl, int tc, int sq_depth, int rq_depth, int cq_depth, int max_chain) {
             VerbsConfig c;
             c.rank = rank;
             c.world_size = world_size;
             c.devices = std::move(devices);
             c.port = port;
             c.gid_index = std::move(gid_index);
             c.sl = sl;
             c.tc = tc;
             c.sq_depth = sq_depth;
             c.rq_depth = rq_depth;
             c.cq_depth = cq_depth;
             c.max_chain = max_chain;
             return make_verbs_transport(c);
           }),
           py::arg("rank"), py::arg("world_size"), py::arg("devices"), py::arg("port") = 1,
           py::arg("gid_index") = std::vector<int>{}, py::arg("sl") = -1, py::arg("tc") = -1,
           py::arg("sq_depth") = 1024, py::arg("rq_depth") = 1024, py::arg("cq_depth") = 8192,
           py::arg("max_chain") = 64)
      .def("caps",
           [](const VerbsTransport& t) {
             TransportCaps c = t.caps();
             py::dict d;
             d["in_order"] = c.in_order;
             d["native_atomics"] = c.native_atomics;
             d["imm_bits"] = c.imm_bits;
             d["max_write_bytes"] = c.max_write_bytes;
             d["max_writes_per_post"] = c.max_writes_per_post;
             d["name"] = c.name;
             return d;
           })
      .def("describe", &VerbsTransport::describe)
      .def("debug_state", &VerbsTransport::debug_state)
      .def(
          "register_memory",
          [](VerbsTransport& t, uint64_t base, size_t bytes, bool device) {
            return t.register_memory(reinterpret_cast<void*>(base), bytes,
                                     device ? MemoryKind::kDevice : MemoryKind::kHost).id;
          },
          py::arg("base"), py::arg("bytes"), py::arg("device") = false)
      .def(
          "register_dmabuf",
          [](VerbsTransport& t, uint64_t base, size_t bytes, int fd, uint64_t offset) {
            return t.register_dmabuf(reinterpret_cast<void*>(base), bytes, fd, offset).id;
          },
          py::arg("base"), py::arg("bytes"), py::arg("fd"), py::arg("offset") = 0)
      .def("local_info",
           [](VerbsTransport& t) {
             auto b = t.local_info();
             return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
           })
      .def("connect",
           [](VerbsTransport& t, const std::vector<py::bytes>& infos) {
             std::vector<std::vector<uint8_t>> raw;
             for (const auto& b : infos) {
               std::string s = b;
               raw.emplace_back(s.begin(), s.end());
             }
             t.connect(raw);
           })
      .def(
          "post_writes",
          [](VerbsTransport& t, const std::vector<py::dict>& reqs) {
            std::vector<WriteRequest> w(reqs.size());
            for (size_t i = 0; i < reqs.size(); ++i) {
              const auto& d = reqs[i];
              w[i].dst_rank = d["dst_rank"].cast<int>();
              w[i].local_region = get_or<int>(d, "local_region", 0);
              w[i].local_offset = get_or<uint64_t>(d, "local_offset", 0);
              w[i].remote_region = get_or<int>(d, "remote_region", 0);
              w[i].remote_offset = get_or<uint64_t>(d, "remote_offset", 0);
              w[i].bytes = get_or<uint64_t>(d, "bytes", 0);
              w[i].has_imm = d.contains("imm");
              w[i].imm = get_or<uint32_t>(d, "imm", 0);
              w[i].wr_id = get_or<uint64_t>(d, "wr_id", i);
            }
            return t.post_writes(w.data(), w.size());
          },
          "list of dicts: dst_rank, local_region, local_offset, remote_region, remote_offset, bytes, imm (optional), "
          "wr_id -> number accepted")
      .def("post_atomics",
           [](VerbsTransport& t, const std::vector<py::dict>& reqs) {
             std::vector<AtomicRequest> a(reqs.size());
             for (size_t i = 0; i < reqs.size(); ++i) {
               const auto& d = reqs[i];
               a[i].dst_rank = d["dst_rank"].cast<int>();
               a[i].remote_region = get_or<int>(d, "remote_region", 0);
               a[i].remote_offset = get_or<uint64_t>(d, "remote_offset", 0);
               a[i].add = get_or<int64_t>(d, "add", 1);
               a[i].wr_id = get_or<uint64_t>(d, "wr_id", i);
             }
             return t.post_atomics(a.data(), a.size());
           })
      .def(
          "poll",
          [](VerbsTransport& t, size_t max) {
            std::vector<Completion> out;
            t.poll(out, max);
            py::list l;
            for (const auto& c : out) l.append(completion_to_dict(c));
            return l;
          },
          py::arg("max") = 64);

  auto f = v.def_submodule("fake", "recording ibv_* table: tests only (install before building a VerbsTransport)");
  f.def(
      "install",
      [](const std::vector<py::dict>& devices, bool dmabuf) {
        std::vector<fake_verbs::FakeDevice> devs;
        for (const auto& d : devices) {
          fake_verbs::FakeDevice x;
          x.name = d["name"].cast<std::string>();
          x.link_layer = get_or<std::string>(d, "link_layer", "Ethernet");
          x.vendor_id = get_or<uint32_t>(d, "vendor_id", 0x02c9);
          x.atomics = get_or<bool>(d, "atomics", true);
          x.lid = get_or<uint16_t>(d, "lid", 0);
          x.active_mtu = get_or<int>(d, "active_mtu", 5);
          x.port_active = get_or<bool>(d, "port_active", true);
          x.max_qp_wr = get_or<int>(d, "max_qp_wr", 32768);
          x.max_cqe = get_or<int>(d, "max_cqe", x.max_cqe);
          x.max_qp_rd_atom = get_or<int>(d, "max_qp_rd_atom", x.max_qp_rd_atom);
          x.max_qp_init_rd_atom = get_or<int>(d, "max_qp_init_rd_atom", x.max_qp_init_rd_atom);
          x.efa_device_caps = get_or<uint32_t>(d, "efa_device_caps", x.efa_device_caps);
          x.efa_max_rdma_size = get_or<uint32_t>(d, "efa_max_rdma_size", x.efa_max_rdma_size);
          if (d.contains("gids"))
            for (auto g : d["gids"].cast<py::list>()) {
              auto gd = g.cast<py::dict>();
              fake_verbs::FakeGid e;
              e.index = gd["index"].cast<int>();
              e.gid = gd["gid"].cast<std::string>();
              e.type = get_or<std::string>(gd, "type", "");
              if (gd.contains("netdev") && !gd["netdev"].is_none()) e.netdev = gd["netdev"].cast<std::string>();
              x.gids.push_back(e);
            }
          devs.push_back(x);
        }
        fake_verbs::install(devs, dmabuf);
      },
      py::arg("devices"), py::arg("dmabuf") = false);
  f.def("uninstall", &fake_verbs::uninstall);
  f.def("calls", [] { return records_to_list(fake_verbs::calls()); });
  f.def("clear_calls", &fake_verbs::clear_calls);
  f.def("fail_next", &fake_verbs::fail_next, py::arg("fn"), py::arg("errno"));
  f.def("fail_next_completion", &fake_verbs::fail_next_completion, py::arg("status"), py::arg("vendor_err") = 0);
  f.def("set_auto_complete", &fake_verbs::set_auto_complete);
  f.def("block_next_post_send", &fake_verbs::block_next_post_send, py::arg("seconds"));
  f.def("inject_recv", &fake_verbs::inject_recv, py::arg("qp_num"), py::arg("src_qp") = 0, py::arg("slid") = 0xffff,
        py::arg("imm") = 0, py::arg("status") = 0);
  f.def("posted_recvs", &fake_verbs::posted_recvs);
  f.def("inject_async_event", &fake_verbs::inject_async_event, py::arg("event_type"), py::arg("qp_num") = 0,
        py::arg("device") = "", py::arg("port") = 1,
        "queue an ibv async event: QP events and CQ_ERR on the context of QP qp_num, others on every open context of "
        "`device` (port events carry `port`); -> number of contexts that got it");
  f.def("async_counts", [] {
    const auto c = fake_verbs::async_counts();
    py::dict d;
    d["injected"] = c.injected;
    d["delivered"] = c.delivered;
    d["acked"] = c.acked;
    d["bad_acks"] = c.bad_acks;
    d["blocking_reads"] = c.blocking_reads;
    return d;
  });
  f.def("async_fds", &fake_verbs::async_fds, py::arg("device"));
  // ibv enum values tests compare against (from the headers this module was built with)
  py::dict c;
  c["IBV_WR_RDMA_WRITE"] = static_cast<int>(IBV_WR_RDMA_WRITE);
  c["IBV_WR_RDMA_WRITE_WITH_IMM"] = static_cast<int>(IBV_WR_RDMA_WRITE_WITH_IMM);
  c["IBV_WR_ATOMIC_FETCH_AND_ADD"] = static_cast<int>(IBV_WR_ATOMIC_FETCH_AND_ADD);
  c["IBV_QPT_RC"] = static_cast<int>(IBV_QPT_RC);
  c["IBV_QPT_DRIVER"] = static_cast<int>(IBV_QPT_DRIVER);
  c["IBV_QPS_INIT"] = static_cast<int>(IBV_QPS_INIT);
  c["IBV_QPS_RTR"] = static_cast<int>(IBV_QPS_RTR);
  c["IBV_QPS_RTS"] = static_cast<int>(IBV_QPS_RTS);
  c["IBV_ACCESS_LOCAL_WRITE"] = static_cast<int>(IBV_ACCESS_LOCAL_WRITE);
  c["IBV_ACCESS_REMOTE_WRITE"] = static_cast<int>(IBV_ACCESS_REMOTE_WRITE);
  c["IBV_ACCESS_REMOTE_ATOMIC"] = static_cast<int>(IBV_ACCESS_REMOTE_ATOMIC);
  c["IBV_WC_RETRY_EXC_ERR"] = static_cast<int>(IBV_WC_RETRY_EXC_ERR);
  c["IBV_WC_REM_ACCESS_ERR"] = static_cast<int>(IBV_WC_REM_ACCESS_ERR);
  c["IBV_WC_WR_FLUSH_ERR"] = static_cast<int>(IBV_WC_WR_FLUSH_ERR);
  c["IBV_QP_EX_WITH_RDMA_WRITE"] = static_cast<int>(IBV_QP_EX_WITH_RDMA_WRITE);
  c["IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM"] = static_cast<int>(IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM);
  for (auto [k, e] : {std::pair<const char*, ibv_event_type>{"IBV_EVENT_CQ_ERR", IBV_EVENT_CQ_ERR},
                      {"IBV_EVENT_QP_FATAL", IBV_EVENT_QP_FATAL},
                      {"IBV_EVENT_QP_REQ_ERR", IBV_EVENT_QP_REQ_ERR},
                      {"IBV_EVENT_QP_ACCESS_ERR", IBV_EVENT_QP_ACCESS_ERR},
                      {"IBV_EVENT_COMM_EST", IBV_EVENT_COMM_EST},
                      {"IBV_EVENT_SQ_DRAINED", IBV_EVENT_SQ_DRAINED},
                      {"IBV_EVENT_DEVICE_FATAL", IBV_EVENT_DEVICE_FATAL},
                      {"IBV_EVENT_PORT_ACTIVE", IBV_EVENT_PORT_ACTIVE},
                      {"IBV_EVENT_PORT_ERR", IBV_EVENT_PORT_ERR},
                      {"IBV_EVENT_LID_CHANGE", IBV_EVENT_LID_CHANGE},
                      {"IBV_EVENT_PKEY_CHANGE", IBV_EVENT_PKEY_CHANGE},
                      {"IBV_EVENT_SM_CHANGE", IBV_EVENT_SM_CHANGE},
                      {"IBV_EVENT_CLIENT_REREGISTER", IBV_EVENT_CLIENT_REREGISTER},
                      {"IBV_EVENT_GID_CHANGE", IBV_EVENT_GID_CHANGE}})
    c[k] = static_cast<int>(e);
  f.attr("consts") = c;
#endif
}

}  // namespace uccl_ep::bindings
