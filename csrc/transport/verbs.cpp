// The verbs transport: RC queue pairs on InfiniBand/RoCE (ConnectX, Broadcom bnxt_re, AMD Pollara) and SRD queue
// pairs on AWS EFA, every call through IbvApi (ibv_api.hpp) so tests can record them.
//
// Shape (docs/transports.md has the long form):
//  - One Transport may drive several NICs. Traffic between ranks A and B uses A's device (B % ndev_A) and B's device
//    (A % ndev_B): destinations are striped over NICs, and each destination stays on one QP so RC keeps its order.
//  - RC: one QP per peer. SRD: one QP per device, an address handle per peer.
//  - Memory is registered on every device; local_info carries each region's rkey per device.
//  - A batch is posted as one linked ibv_send_wr chain per destination (at most max_chain WRs). On RC only the last
//    WR of a chain is signalled (RC completes a send queue in order, so one CQE retires the whole chain) and its
//    completion is expanded into one local completion per write. SRD completes out of order, so every WR there is
//    signalled. Either way the proxy sees exactly one local completion per WriteRequest / AtomicRequest.
//  - Immediates travel in network byte order (htonl on post, ntohl on receipt). Each write-with-immediate consumes
//    a pre-posted receive WR at the target; they are re-posted as their completions are polled. Receives carry one
//    SGE (a small scratch buffer nothing is written to): libefa writes no RX descriptor for a zero-SGE receive.
//  - One CQ per device holds every completion its QPs can have outstanding (signalled sends + posted receives), so
//    a proxy that polls late never overruns it (an overrun is an asynchronous error that kills every QP on it).
//  - Asynchronous events (ibv_get_async_event) are read from each context's async fd, made O_NONBLOCK when the
//    device is opened: every kAsyncCheckEvery-th poll() (one poll(2) with timeout 0 over all devices) and at once
//    when a CQ returns an error. Each event is acknowledged as soon as it is read. Fatal ones (QP/CQ/device errors,
//    our port going down) become an error completion naming the device, the event and the peer rank, placed first
//    so the proxy reports the cause rather than the flushes that follow it; the others are counted in debug_state().
#include "transport/verbs.hpp"

#include <stdexcept>

#ifdef UCCL_EP_WITH_VERBS
#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstring>
#include <deque>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "transport/ibv_api.hpp"

namespace uccl_ep {
namespace {

constexpr uint32_t kMagic = 0x55455056;  // "UEPV"
constexpr uint32_t kWireVersion = 1;
constexpr uint32_t kQkey = 0x11111111;   // SRD QPs of this library accept only each other's traffic
constexpr uint64_t kRecvTag = 1ull << 63;
constexpr uint16_t kAmazonVendorId = 0x1d0f;
constexpr uint32_t kRecvScratchBytes = 64;  // the one SGE of every receive WR (see post_recvs)
// Async events are looked for on every kAsyncCheckEvery-th poll() (a power of two); one poll(2) syscall each time.
constexpr uint32_t kAsyncCheckEvery = 64;
// Completion::status of the error completion a fatal asynchronous event becomes (not an ibv_wc_status).
constexpr int kAsyncEventStatus = -2;

// efadv.h's device attributes in the layout of rdma-core >= 46 (older headers call inline_buf_size_ex `reserved`
// and lack the RDMA write bit; the offsets are the same, so one struct serves every libefa).
struct EfaDeviceAttr {
  uint64_t comp_mask;
  uint32_t max_sq_wr;
  uint32_t max_rq_wr;
  uint16_t max_sq_sge;
  uint16_t max_rq_sge;
  uint16_t inline_buf_size;
  uint16_t inline_buf_size_ex;
  uint32_t device_caps;
  uint32_t max_rdma_size;
};
constexpr uint32_t kEfaCapRdmaRead = 1u << 0;   // EFADV_DEVICE_ATTR_CAPS_RDMA_READ
constexpr uint32_t kEfaCapRdmaWrite = 1u << 3;  // EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE (rdma-core >= 46)

struct Device {
  std::string name;
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_device_attr attr{};
  ibv_port_attr port{};
  bool efa = false;
  bool atomics = false;
  int gid_index = 0;
  std::string gid_reason;
  ibv_gid gid{};
  int sl = 0, tc = 0;
  std::string sl_note;
  ibv_qp* srd_qp = nullptr;  // EFA: the one QP of this device
  ibv_qp_ex* srd_qpx = nullptr;
  ibv_mr* scratch_mr = nullptr;  // fetch-add results land here (never read)
  ibv_mr* recv_mr = nullptr;     // the SGE of every posted receive (never written by write-with-immediate)
  int qp_sq = 0, qp_rq = 0;      // per-QP send/receive depths after device caps and the CQ budget
  int cqe = 0;                   // the CQ's size as requested
  uint32_t efa_caps = 0;         // efadv_query_device device_caps (EFA only)
  uint64_t max_rdma = 0;         // EFA: largest RDMA write (efadv max_rdma_size)
  bool async_watch = false;      // async_fd made non-blocking: its events are read in poll()
  std::string async_note;        // why not, when not
};

struct RemoteRegion {
  uint64_t base = 0, bytes = 0;
  std::vector<uint32_t> rkeys;  // per remote device
};

struct Peer {
  int dev = 0;                 // our device carrying traffic with this peer
  ibv_qp* qp = nullptr;        // RC
  uint32_t remote_qpn = 0;
  int remote_dev = 0;
  ibv_ah* ah = nullptr;        // SRD
  std::vector<RemoteRegion> regions;  // indexed by remote region id
  bool connected = false;
  bool failed = false;
};

struct Region {
  MemoryRegion pub;
  std::vector<ibv_mr*> mrs;  // per device
};

struct Chain {
  int peer = 0;
  int slot = 0;
  int wrs = 0;
  Completion::Kind kind = Completion::Kind::kLocalWrite;
  std::vector<uint64_t> wr_ids;
};

class Writer {
 public:
  template <typename T>
  void put(const T& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    buf.insert(buf.end(), p, p + sizeof(T));
  }
  std::vector<uint8_t> buf;
};

class Reader {
 public:
  Reader(const std::vector<uint8_t>& b, int rank) : buf_(b), rank_(rank) {}
  template <typename T>
  T get() {
    if (pos_ + sizeof(T) > buf_.size())
      throw std::runtime_error("verbs: connection info of rank " + std::to_string(rank_) +
                               " is truncated (mismatched uccl-ep-train versions across ranks?)");
    T v;
    std::memcpy(&v, buf_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

 private:
  const std::vector<uint8_t>& buf_;
  size_t pos_ = 0;
  int rank_;
};

struct RemoteInfo {
  bool efa = false;
  struct Dev {
    ibv_gid gid{};
    uint16_t lid = 0;
    uint32_t mtu = 0;
  };
  std::vector<Dev> devs;
  std::vector<std::pair<uint32_t, uint32_t>> peers;  // per rank: (device, qpn)
  std::vector<RemoteRegion> regions;
};

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

// What a failed completion most likely means, and what to change.
std::string status_hint(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_RETRY_EXC_ERR:
      return "the peer's NIC never acknowledged: usually a wrong GID index (RoCE v2 vs v1, IPv4 vs IPv6; compare "
             "`uccl-ep-train doctor` on both nodes, set UCCL_IB_GID_INDEX), a link or switch problem, or more writes "
             "in flight than this NIC handles (lower UCCL_IB_MAX_INFLIGHT_NORMAL / UCCL_IB_MAX_INFLIGHT_BYTES; "
             "Broadcom Thor-2 and AMD Pollara want 1 write and about 1.5 MiB)";
    case IBV_WC_RNR_RETRY_EXC_ERR:
      return "the peer had no receive posted: its process exited or stopped polling (look at that rank's log)";
    case IBV_WC_REM_ACCESS_ERR:
      return "the write fell outside the peer's registered buffer or used a stale rkey: ranks disagree on buffer "
             "sizes or the peer re-registered";
    case IBV_WC_LOC_PROT_ERR:
    case IBV_WC_LOC_LEN_ERR:
      return "the local source is not inside a registered region";
    case IBV_WC_WR_FLUSH_ERR:
      return "the queue pair was already in error after an earlier failure; the first error is the cause";
    case IBV_WC_REM_OP_ERR:
    case IBV_WC_REM_INV_REQ_ERR:
      return "the peer rejected the operation (atomics on a NIC without them, or a misaligned atomic)";
    default:
      return "run `uccl-ep-train doctor` on both nodes";
  }
}

// The enumerator's name, so an error can be searched for whatever text the installed libibverbs prints.
const char* event_name(ibv_event_type t) {
  switch (t) {
    case IBV_EVENT_CQ_ERR: return "IBV_EVENT_CQ_ERR";
    case IBV_EVENT_QP_FATAL: return "IBV_EVENT_QP_FATAL";
    case IBV_EVENT_QP_REQ_ERR: return "IBV_EVENT_QP_REQ_ERR";
    case IBV_EVENT_QP_ACCESS_ERR: return "IBV_EVENT_QP_ACCESS_ERR";
    case IBV_EVENT_COMM_EST: return "IBV_EVENT_COMM_EST";
    case IBV_EVENT_SQ_DRAINED: return "IBV_EVENT_SQ_DRAINED";
    case IBV_EVENT_PATH_MIG: return "IBV_EVENT_PATH_MIG";
    case IBV_EVENT_PATH_MIG_ERR: return "IBV_EVENT_PATH_MIG_ERR";
    case IBV_EVENT_DEVICE_FATAL: return "IBV_EVENT_DEVICE_FATAL";
    case IBV_EVENT_PORT_ACTIVE: return "IBV_EVENT_PORT_ACTIVE";
    case IBV_EVENT_PORT_ERR: return "IBV_EVENT_PORT_ERR";
    case IBV_EVENT_LID_CHANGE: return "IBV_EVENT_LID_CHANGE";
    case IBV_EVENT_PKEY_CHANGE: return "IBV_EVENT_PKEY_CHANGE";
    case IBV_EVENT_SM_CHANGE: return "IBV_EVENT_SM_CHANGE";
    case IBV_EVENT_SRQ_ERR: return "IBV_EVENT_SRQ_ERR";
    case IBV_EVENT_SRQ_LIMIT_REACHED: return "IBV_EVENT_SRQ_LIMIT_REACHED";
    case IBV_EVENT_QP_LAST_WQE_REACHED: return "IBV_EVENT_QP_LAST_WQE_REACHED";
    case IBV_EVENT_CLIENT_REREGISTER: return "IBV_EVENT_CLIENT_REREGISTER";
    case IBV_EVENT_GID_CHANGE: return "IBV_EVENT_GID_CHANGE";
    case IBV_EVENT_WQ_FATAL: return "IBV_EVENT_WQ_FATAL";
    default: return "IBV_EVENT_(unknown)";
  }
}

// What a fatal asynchronous event most likely means, and what to do.
std::string async_hint(ibv_event_type t) {
  switch (t) {
    case IBV_EVENT_QP_FATAL:
      return "the NIC moved this queue pair to error (a malformed work request, or a NIC/driver fault); every write "
             "to that rank fails from here: look for the NIC driver's message in `dmesg`, and at that rank's log";
    case IBV_EVENT_QP_REQ_ERR:
      return "the NIC saw a request on this queue pair that violates the transport protocol (an opcode or state it "
             "does not allow): ranks running different uccl-ep-train builds, or a NIC/driver fault (`dmesg`)";
    case IBV_EVENT_QP_ACCESS_ERR:
      return "a peer's RDMA operation hit memory outside a registered region or carried a wrong rkey: ranks "
             "disagree on buffer sizes, or a buffer was re-registered after connecting";
    case IBV_EVENT_CQ_ERR:
      return "the completion queue overflowed or failed, and every queue pair on it is in error; the CQ is sized for "
             "every outstanding completion, so this is a NIC/driver fault or a bug: report it with `uccl-ep-train "
             "doctor --json` and the UCCL_IB_* settings";
    case IBV_EVENT_DEVICE_FATAL:
      return "the NIC or its driver failed (firmware fault, PCIe error, reset): check `dmesg` and `ibv_devinfo`; the "
             "job must restart, after the NIC recovers or without it (UCCL_IB_HCA=^name)";
    case IBV_EVENT_PORT_ERR:
      return "the link went down: check the cable/transceiver and the switch port, `ibv_devinfo` (state "
             "PORT_ACTIVE) and `ip link`; to run without this NIC exclude it with UCCL_IB_HCA=^name";
    default:
      return "run `uccl-ep-train doctor` on this node";
  }
}

class VerbsTransportImpl final : public VerbsTransport {
 public:
  explicit VerbsTransportImpl(const VerbsConfig& cfg) : cfg_(cfg), api_(ibv_api()) {
    if (cfg_.world_size < 1 || cfg_.rank < 0 || cfg_.rank >= cfg_.world_size)
      throw std::invalid_argument("verbs: rank " + std::to_string(cfg_.rank) + " out of range for world size " +
                                  std::to_string(cfg_.world_size));
    if (cfg_.devices.empty())
      throw std::invalid_argument("verbs: no RDMA device given (UCCL_IB_HCA empty and none discovered); run "
                                  "`uccl-ep-train doctor`");
    if (cfg_.max_chain < 1 || cfg_.sq_depth < 1 || cfg_.rq_depth < 1)
      throw std::invalid_argument("verbs: max_chain, sq_depth and rq_depth must be >= 1");
    try {
      open_devices();
      for (size_t i = 0; i < devs_.size(); ++i)
        if (devs_[i].async_watch) {
          async_pfds_.push_back(pollfd{devs_[i].ctx->async_fd, POLLIN, 0});
          async_pfd_dev_.push_back(static_cast<int>(i));
        }
      create_queue_pairs();
    } catch (...) {
      teardown();
      throw;
    }
  }
  ~VerbsTransportImpl() override { teardown(); }

  TransportCaps caps() const override {
    TransportCaps c;
    c.in_order = !efa_;
    c.native_atomics = !efa_;
    for (const auto& d : devs_) c.native_atomics = c.native_atomics && d.atomics;
    c.imm_bits = 32;
    uint64_t max_msg = 1ull << 30;
    for (const auto& d : devs_) {
      // RC: the port's max_msg_sz. EFA: the port reports the SEND limit (about one MTU); RDMA writes are bounded by
      // efadv's max_rdma_size instead (older EFA devices allow far less than 1 GiB).
      if (!d.efa && d.port.max_msg_sz > 0) max_msg = std::min<uint64_t>(max_msg, d.port.max_msg_sz);
      if (d.efa && d.max_rdma > 0) max_msg = std::min<uint64_t>(max_msg, d.max_rdma);
    }
    c.max_write_bytes = max_msg;
    c.max_writes_per_post = cfg_.max_chain;
    c.name = efa_ ? "verbs-srd" : "verbs-rc";
    return c;
  }

  MemoryRegion register_memory(void* base, size_t bytes, MemoryKind kind) override {
    return register_impl(base, bytes, kind, -1, 0);
  }

  MemoryRegion register_dmabuf(void* base, size_t bytes, int fd, uint64_t offset) override {
    if (fd < 0) throw std::invalid_argument("verbs: register_dmabuf needs a dmabuf fd >= 0");
    return register_impl(base, bytes, MemoryKind::kDevice, fd, offset);
  }

  std::vector<uint8_t> local_info() override {
    info_taken_ = true;
    Writer w;
    w.put(kMagic);
    w.put(kWireVersion);
    w.put<int32_t>(cfg_.rank);
    w.put<int32_t>(cfg_.world_size);
    w.put<uint8_t>(efa_ ? 1 : 0);
    w.put<uint32_t>(static_cast<uint32_t>(devs_.size()));
    for (const auto& d : devs_) {
      w.put(d.gid);
      w.put<uint16_t>(d.port.lid);
      w.put<uint32_t>(static_cast<uint32_t>(d.port.active_mtu));
    }
    for (int r = 0; r < cfg_.world_size; ++r) {
      const Peer& p = peers_[r];
      w.put<uint32_t>(static_cast<uint32_t>(p.dev));
      w.put<uint32_t>(efa_ ? devs_[p.dev].srd_qp->qp_num : p.qp->qp_num);
    }
    w.put<uint32_t>(static_cast<uint32_t>(regions_.size()));
    for (const auto& reg : regions_) {
      w.put<uint64_t>(reinterpret_cast<uint64_t>(reg.pub.base));
      w.put<uint64_t>(reg.pub.bytes);
      for (auto* mr : reg.mrs) w.put<uint32_t>(mr->rkey);
    }
    return w.buf;
  }

  void connect(const std::vector<std::vector<uint8_t>>& infos) override {
    if (static_cast<int>(infos.size()) != cfg_.world_size)
      throw std::invalid_argument("verbs: connect() got " + std::to_string(infos.size()) + " infos for world size " +
                                  std::to_string(cfg_.world_size));
    std::vector<RemoteInfo> remote(cfg_.world_size);
    for (int r = 0; r < cfg_.world_size; ++r) remote[r] = parse_info(infos[r], r);
    for (int r = 0; r < cfg_.world_size; ++r) {
      Peer& p = peers_[r];
      const RemoteInfo& ri = remote[r];
      p.remote_dev = static_cast<int>(ri.peers[cfg_.rank].first);
      p.remote_qpn = ri.peers[cfg_.rank].second;
      p.regions = ri.regions;
      const RemoteInfo::Dev& rd = ri.devs.at(p.remote_dev);
      if (efa_)
        connect_srd(r, rd);
      else
        connect_rc(r, rd);
      p.connected = true;
    }
    if (efa_) build_srd_source_map();
  }

  size_t post_writes(const WriteRequest* reqs, size_t n) override {
    for (size_t i = 0; i < n; ++i) validate_write(reqs[i], i);
    return post_batch(n, [&](size_t i) { return reqs[i].dst_rank; },
                      [&](const std::vector<size_t>& idx, int peer) { post_write_chain(reqs, idx, peer); });
  }

  size_t post_atomics(const AtomicRequest* reqs, size_t n) override {
    if (n == 0) return 0;
    if (!caps().native_atomics)
      throw std::logic_error("verbs: post_atomics on " + caps().name +
                             " which has no native atomics; the proxy must emulate them (caps().native_atomics)");
    for (size_t i = 0; i < n; ++i) validate_atomic(reqs[i], i);
    return post_batch(n, [&](size_t i) { return reqs[i].dst_rank; },
                      [&](const std::vector<size_t>& idx, int peer) { post_atomic_chain(reqs, idx, peer); });
  }

  size_t poll(std::vector<Completion>& out, size_t max) override {
    if ((poll_calls_++ & (kAsyncCheckEvery - 1)) == 0) drain_async_events();
    size_t got = 0;
    while (got < max && !pending_.empty()) {
      out.push_back(std::move(pending_.front()));
      pending_.pop_front();
      ++got;
    }
    ibv_wc wcs[32];
    for (size_t d = 0; d < devs_.size() && got < max; ++d) {
      while (got < max) {
        int k = api_.poll_cq(devs_[d].cq, 32, wcs);
        if (k < 0) throw std::runtime_error("verbs: ibv_poll_cq failed on " + devs_[d].name);
        bool failed_wc = false;
        for (int i = 0; i < k; ++i) {
          failed_wc = failed_wc || wcs[i].status != IBV_WC_SUCCESS;
          handle_wc(static_cast<int>(d), wcs[i]);
        }
        // A failed completion often follows an asynchronous error (QP fatal, port down): look now, so the cause is
        // reported ahead of its flushes.
        if (failed_wc) drain_async_events();
        while (got < max && !pending_.empty()) {
          out.push_back(std::move(pending_.front()));
          pending_.pop_front();
          ++got;
        }
        if (k < 32) break;
      }
    }
    return got;
  }

  std::vector<std::string> describe() const override {
    std::vector<std::string> out;
    for (const auto& d : devs_) {
      std::ostringstream os;
      os << d.name << " port " << cfg_.port << ": " << (d.efa ? "EFA SRD" : "RC") << ", GID index " << d.gid_index
         << " (" << d.gid_reason << "), SL " << d.sl << ", TC " << d.tc
         << (d.atomics ? ", native atomics" : ", no native atomics") << d.sl_note;
      out.push_back(os.str());
    }
    return out;
  }

  // Work the NIC still owes us: a send queue that stays full while nothing completes points at the NIC or the peer,
  // not at the proxy.
  std::string debug_state() const override {
    std::ostringstream os;
    size_t wrs = 0;
    for (const auto& kv : chains_) wrs += size_t(kv.second.wrs);
    os << (efa_ ? "verbs-srd" : "verbs-rc") << " rank " << cfg_.rank << ": " << chains_.size() << " chains ("
       << wrs << " work requests) posted and not completed";
    for (size_t slot = 0; slot < sq_used_.size(); ++slot) {
      if (sq_used_[slot] == 0) continue;
      const bool per_peer = slot < size_t(cfg_.world_size);
      const int dev = per_peer ? peers_[slot].dev : int(slot) - cfg_.world_size;
      os << "; " << (per_peer ? "send queue to rank " + std::to_string(slot) : "SRD send queue") << " on "
         << devs_[dev].name << " " << sq_used_[slot] << "/" << sq_depth(devs_[dev]);
      if (per_peer && peers_[slot].failed) os << " (failed)";
    }
    if (!pending_.empty()) os << "; " << pending_.size() << " completions not yet returned";
    if (async_ignored_ > 0)
      os << "; " << async_ignored_ << " asynchronous events acknowledged and ignored (last: " << async_last_ignored_
         << ")";
    if (!async_fatal_.empty()) os << "; failed by " << async_fatal_;
    for (const auto& d : devs_)
      if (!d.async_watch) os << "; asynchronous events of " << d.name << " not watched (" << d.async_note << ")";
    return os.str();
  }

 private:
  // ------------------------------------------------------------ setup
  void open_devices() {
    int num = 0;
    ibv_device** list = api_.get_device_list(&num);
    if (list == nullptr || num == 0) {
      if (list) api_.free_device_list(list);
      throw std::runtime_error(
          "verbs: no RDMA device found (ibv_get_device_list returned none): load the NIC's RDMA driver (mlx5_ib, "
          "bnxt_re, ionic, efa), check /sys/class/infiniband, or set UCCL_EP_TRANSPORT=loopback; `uccl-ep-train "
          "doctor` shows what this host has");
    }
    for (size_t i = 0; i < cfg_.devices.size(); ++i) {
      std::string want = cfg_.devices[i];
      ibv_device* found = nullptr;
      std::string names;
      for (int k = 0; k < num; ++k) {
        std::string nm = api_.get_device_name(list[k]);
        names += (names.empty() ? "" : ", ") + nm;
        if (nm == want) found = list[k];
      }
      if (found == nullptr) {
        api_.free_device_list(list);
        throw std::runtime_error("verbs: RDMA device '" + want + "' not found (this host has: " + names +
                                 "); fix UCCL_IB_HCA");
      }
      Device d;
      d.name = want;
      d.ctx = api_.open_device(found);
      if (d.ctx == nullptr) {
        int err = errno;
        api_.free_device_list(list);
        throw std::runtime_error("verbs: ibv_open_device(" + want + ") failed: " + errno_text(err) +
                                 " (permissions on /dev/infiniband/uverbs*? inside a container, pass the devices)");
      }
      devs_.push_back(d);
      watch_async(devs_.back());
      setup_device(devs_.back(), i);
    }
    api_.free_device_list(list);
    efa_ = devs_.front().efa;
    for (const auto& d : devs_)
      if (d.efa != efa_)
        throw std::invalid_argument("verbs: cannot mix EFA and IB/RoCE devices in one transport (" +
                                    devs_.front().name + ", " + d.name + "); fix UCCL_IB_HCA");
  }

  // ibv_get_async_event blocks on a blocking fd; the proxy thread must never block, so the context's async fd (ours
  // alone: every transport opens its own context) becomes non-blocking and is polled.
  void watch_async(Device& d) {
    if (api_.get_async_event == nullptr || api_.ack_async_event == nullptr) {
      d.async_note = "this libibverbs table has no ibv_get_async_event";
      return;
    }
    const int fd = d.ctx->async_fd;
    const int fl = fd >= 0 ? ::fcntl(fd, F_GETFL) : -1;
    if (fl < 0 || ::fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0) {
      d.async_note = "cannot make async_fd " + std::to_string(fd) + " non-blocking: " + errno_text(errno);
      return;
    }
    d.async_watch = true;
  }

  void setup_device(Device& d, size_t i) {
    if (api_.query_device(d.ctx, &d.attr) != 0)
      throw std::runtime_error("verbs: ibv_query_device(" + d.name + ") failed: " + errno_text(errno));
    if (api_.query_port(d.ctx, static_cast<uint8_t>(cfg_.port), &d.port) != 0)
      throw std::runtime_error("verbs: ibv_query_port(" + d.name + ", " + std::to_string(cfg_.port) +
                               ") failed: " + errno_text(errno));
    if (d.port.state != IBV_PORT_ACTIVE)
      throw std::runtime_error("verbs: " + d.name + " port " + std::to_string(cfg_.port) + " is not ACTIVE (state " +
                               std::to_string(d.port.state) + "): check the cable/switch, `ibv_devinfo`, or drop it "
                               "from UCCL_IB_HCA");
    d.efa = d.attr.vendor_id == kAmazonVendorId || d.name.rfind("rdmap", 0) == 0 || d.name.rfind("efa", 0) == 0;
    d.atomics = !d.efa && d.attr.atomic_cap != IBV_ATOMIC_NONE;
    if (d.efa) {
#ifdef UCCL_EP_WITH_EFADV
      if (api_.efadv_create_qp_ex == nullptr)
        throw std::runtime_error("verbs: " + d.name + " is an EFA device but libefa.so.1 could not be loaded: install "
                                 "rdma-core's EFA provider (apt install ibverbs-providers, or the AWS EFA installer)");
      query_efa(d);
#else
      throw std::runtime_error("verbs: " + d.name + " is an EFA device but this build has no EFA support "
                               "(infiniband/efadv.h was missing): install libibverbs-dev (rdma-core >= 27) and rebuild");
#endif
    }
    const int override_index = i < cfg_.gid_index.size() ? cfg_.gid_index[i] : -1;
    GidTable table = api_.gid_table(d.name.c_str(), cfg_.port);
    GidChoice choice = choose_gid(table, override_index, d.efa);
    d.gid_index = choice.index;
    d.gid_reason = choice.reason;
    if (api_.query_gid(d.ctx, static_cast<uint8_t>(cfg_.port), d.gid_index, &d.gid) != 0)
      throw std::runtime_error("verbs: ibv_query_gid(" + d.name + ", index " + std::to_string(d.gid_index) +
                               ") failed: " + errno_text(errno));
    d.sl = cfg_.sl >= 0 ? cfg_.sl : (d.efa ? 8 : 3);
    d.tc = cfg_.tc >= 0 ? cfg_.tc : (d.efa ? 0 : 104);
    d.pd = api_.alloc_pd(d.ctx);
    if (d.pd == nullptr) throw std::runtime_error("verbs: ibv_alloc_pd(" + d.name + ") failed: " + errno_text(errno));
    size_queues(d, i);
    d.cq = api_.create_cq(d.ctx, d.cqe, nullptr, nullptr, 0);
    if (d.cq == nullptr)
      throw std::runtime_error("verbs: ibv_create_cq(" + d.name + ", " + std::to_string(d.cqe) +
                               ") failed: " + errno_text(errno));
    d.recv_mr = api_.reg_mr(d.pd, recv_scratch_, sizeof(recv_scratch_), IBV_ACCESS_LOCAL_WRITE);
    if (d.recv_mr == nullptr)
      throw std::runtime_error("verbs: registering the receive scratch buffer on " + d.name +
                               " failed: " + errno_text(errno));
    if (d.atomics) {
      d.scratch_mr = api_.reg_mr(d.pd, scratch_, sizeof(scratch_), IBV_ACCESS_LOCAL_WRITE);
      if (d.scratch_mr == nullptr)
        throw std::runtime_error("verbs: registering the atomics scratch word on " + d.name +
                                 " failed: " + errno_text(errno));
    }
  }

#ifdef UCCL_EP_WITH_EFADV
  // RDMA write on SRD is a device capability (EFA gen 3+, rdma-core >= 46), reported only by efadv_query_device;
  // without it efadv_create_qp_ex fails with a bare EOPNOTSUPP. max_rdma_size bounds each write.
  void query_efa(Device& d) {
    if (api_.efadv_query_device == nullptr)
      throw std::runtime_error("verbs: " + d.name + ": libefa.so.1 lacks efadv_query_device; update rdma-core (>= 46 "
                               "for RDMA write on EFA)");
    EfaDeviceAttr ea{};
    int rc = api_.efadv_query_device(d.ctx, reinterpret_cast<efadv_device_attr*>(&ea), sizeof(ea));
    if (rc != 0)
      throw std::runtime_error("verbs: efadv_query_device(" + d.name + ") failed: " + errno_text(rc) +
                               "; update rdma-core and the EFA kernel driver");
    d.efa_caps = ea.device_caps;
    if (!(ea.device_caps & kEfaCapRdmaWrite))
      throw std::runtime_error("verbs: " + d.name + " reports no RDMA write (efadv device_caps 0x" +
                               [&] { std::ostringstream o; o << std::hex << ea.device_caps; return o.str(); }() +
                               "): SRD writes need an EFA generation with RDMA write (p5/p5en/p6 and newer), EFA "
                               "driver >= 2.1 and rdma-core >= 46; `ibv_devinfo -v` and `uccl-ep-train doctor` show "
                               "what this host has");
    d.max_rdma = ea.max_rdma_size;
    if (ea.max_sq_wr > 0) d.attr.max_qp_wr = std::min<int>(d.attr.max_qp_wr > 0 ? d.attr.max_qp_wr : INT32_MAX,
                                                           static_cast<int>(std::min<uint32_t>(ea.max_sq_wr,
                                                                                               ea.max_rq_wr)));
  }
#endif

  // Per-QP queue depths (config, capped by max_qp_wr) and a CQ that holds every completion they can produce at
  // once: each QP's signalled sends (at most its send depth; on RC after an error even unsignalled WRs complete,
  // still at most the send depth) plus its posted receives. The CQ is shared by all QPs of the device, and an
  // overrun is fatal and asynchronous (IBV_EVENT_CQ_ERR; every QP on it goes to error), so it is sized for the worst
  // case, and when max_cqe cannot hold that the queue depths shrink instead.
  void size_queues(Device& d, size_t dev_index) {
    const int ndev = static_cast<int>(cfg_.devices.size());
    int nqp = 1;  // SRD: one QP per device
    if (!d.efa) {
      nqp = 0;
      for (int r = 0; r < cfg_.world_size; ++r) nqp += (r % ndev) == static_cast<int>(dev_index) ? 1 : 0;
      nqp = std::max(nqp, 1);
    }
    int sq = d.attr.max_qp_wr > 0 ? std::min(cfg_.sq_depth, d.attr.max_qp_wr) : cfg_.sq_depth;
    int rq = d.attr.max_qp_wr > 0 ? std::min(cfg_.rq_depth, d.attr.max_qp_wr) : cfg_.rq_depth;
    const int64_t max_cqe = d.attr.max_cqe > 0 ? d.attr.max_cqe : INT32_MAX;
    if (int64_t(nqp) * (sq + rq) > max_cqe) {
      const int per_qp = static_cast<int>(std::max<int64_t>(2, max_cqe / nqp));
      rq = std::max(1, std::min(rq, per_qp / 2));
      sq = std::max(1, std::min(sq, per_qp - rq));
    }
    d.qp_sq = sq;
    d.qp_rq = rq;
    d.cqe = static_cast<int>(std::min<int64_t>(max_cqe, std::max<int64_t>(cfg_.cq_depth, int64_t(nqp) * (sq + rq))));
  }
  int sq_depth(const Device& d) const { return d.qp_sq; }
  int rq_depth(const Device& d) const { return d.qp_rq; }
  // max_dest_rd_atomic is our responder depth (device max_qp_rd_atom); max_rd_atomic our initiator depth (device
  // max_qp_init_rd_atom). They differ on some NICs (Broadcom), and the provider rejects RTR/RTS above them.
  static int clamp_rd(int cap) { return std::max(1, std::min(16, cap)); }
  int dest_rd_atomic(const Device& d) const { return clamp_rd(d.attr.max_qp_rd_atom); }
  int init_rd_atomic(const Device& d) const { return clamp_rd(d.attr.max_qp_init_rd_atom); }

  void modify(ibv_qp* qp, ibv_qp_attr& a, int mask, const char* what, const Device& d, int peer) {
    if (api_.modify_qp(qp, &a, mask) != 0) {
      int err = errno;
      std::string msg = "verbs: moving " + d.name + " qp " + std::to_string(qp->qp_num) + (peer >= 0 ? " (to rank " +
                        std::to_string(peer) + ")" : "") + " to " + what + " failed: " + errno_text(err);
      if (std::string(what) == "RTR")
        msg += "; usually the GID index (" + std::to_string(d.gid_index) + ", " + d.gid_reason +
               ") or the remote address is wrong: check UCCL_IB_GID_INDEX with `uccl-ep-train doctor`";
      throw std::runtime_error(msg);
    }
  }

  void create_queue_pairs() {
    peers_.resize(cfg_.world_size);
    for (int r = 0; r < cfg_.world_size; ++r) peers_[r].dev = r % static_cast<int>(devs_.size());
    sq_used_.assign(cfg_.world_size + devs_.size(), 0);
    if (efa_) {
      for (size_t i = 0; i < devs_.size(); ++i) create_srd_qp(devs_[i], static_cast<int>(i));
      return;
    }
    for (int r = 0; r < cfg_.world_size; ++r) {
      Peer& p = peers_[r];
      Device& d = devs_[p.dev];
      ibv_qp_init_attr init{};
      init.send_cq = d.cq;
      init.recv_cq = d.cq;
      init.qp_type = IBV_QPT_RC;
      init.sq_sig_all = 0;
      init.cap.max_send_wr = sq_depth(d);
      init.cap.max_recv_wr = rq_depth(d);
      init.cap.max_send_sge = 1;
      init.cap.max_recv_sge = 1;
      p.qp = api_.create_qp(d.pd, &init);
      if (p.qp == nullptr)
        throw std::runtime_error("verbs: ibv_create_qp(RC, " + d.name + ", for rank " + std::to_string(r) +
                                 ") failed: " + errno_text(errno) + "; lower the queue depths or check ulimit -l");
      qp_owner_[key(p.dev, p.qp->qp_num)] = r;
      ibv_qp_attr a{};
      a.qp_state = IBV_QPS_INIT;
      a.pkey_index = 0;
      a.port_num = static_cast<uint8_t>(cfg_.port);
      a.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                          (d.atomics ? IBV_ACCESS_REMOTE_ATOMIC : 0);
      modify(p.qp, a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT", d, r);
      post_recvs(d, p.qp, kRecvTag | static_cast<uint64_t>(r), rq_depth(d));
    }
  }

  void create_srd_qp(Device& d, int dev_index) {
#ifdef UCCL_EP_WITH_EFADV
    ibv_qp_init_attr_ex ex{};
    ex.qp_type = IBV_QPT_DRIVER;
    ex.send_cq = d.cq;
    ex.recv_cq = d.cq;
    ex.pd = d.pd;
    ex.cap.max_send_wr = sq_depth(d);
    ex.cap.max_recv_wr = rq_depth(d);
    ex.cap.max_send_sge = 1;
    ex.cap.max_recv_sge = 1;
    ex.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
    ex.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
    // rdma-core >= 55 put `uint16_t flags; uint8_t sl;` in place of efadv_qp_init_attr's reserved bytes (and later
    // versions append fields: libefa takes `inlen` for that). Older libefa rejects non-zero reserved bytes, so try
    // with the SL and fall back to the device default.
    struct EfaQpAttr {
      uint64_t comp_mask;
      uint32_t driver_qp_type;
      uint16_t flags;
      uint8_t sl;
      uint8_t reserved;
    };
    static_assert(offsetof(EfaQpAttr, driver_qp_type) == offsetof(efadv_qp_init_attr, driver_qp_type) &&
                      sizeof(EfaQpAttr) <= sizeof(efadv_qp_init_attr),
                  "efadv_qp_init_attr layout changed");
    EfaQpAttr efa{};
    efa.driver_qp_type = EFADV_QP_DRIVER_TYPE_SRD;
    efa.sl = static_cast<uint8_t>(d.sl);
    d.srd_qp = api_.efadv_create_qp_ex(d.ctx, &ex, reinterpret_cast<efadv_qp_init_attr*>(&efa), sizeof(efa));
    if (d.srd_qp == nullptr && d.sl != 0) {
      efa.sl = 0;
      d.srd_qp = api_.efadv_create_qp_ex(d.ctx, &ex, reinterpret_cast<efadv_qp_init_attr*>(&efa), sizeof(efa));
      if (d.srd_qp) d.sl_note = " (SL " + std::to_string(d.sl) + " not applied: libefa predates per-QP SL)";
    }
    if (d.srd_qp == nullptr)
      throw std::runtime_error("verbs: efadv_create_qp_ex(SRD, " + d.name + ") failed: " + errno_text(errno) +
                               "; update the EFA driver and rdma-core (RDMA write on SRD needs EFA driver >= 2.1)");
    d.srd_qpx = api_.qp_to_qp_ex ? api_.qp_to_qp_ex(d.srd_qp) : nullptr;
    if (d.srd_qpx == nullptr)
      throw std::runtime_error("verbs: ibv_qp_to_qp_ex failed on " + d.name + ": libibverbs is too old for SRD writes");
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_INIT;
    a.pkey_index = 0;
    a.port_num = static_cast<uint8_t>(cfg_.port);
    a.qkey = kQkey;
    modify(d.srd_qp, a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY, "INIT", d, -1);
    a = ibv_qp_attr{};
    a.qp_state = IBV_QPS_RTR;
    modify(d.srd_qp, a, IBV_QP_STATE, "RTR", d, -1);
    a = ibv_qp_attr{};
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = 0;
    modify(d.srd_qp, a, IBV_QP_STATE | IBV_QP_SQ_PSN, "RTS", d, -1);
    post_recvs(d, d.srd_qp, kRecvTag | (1ull << 62) | static_cast<uint64_t>(dev_index), rq_depth(d));
#else
    (void)d;
    (void)dev_index;
#endif
  }

  void post_recvs(const Device& d, ibv_qp* qp, uint64_t tag, int count) {
    // A write-with-immediate needs a receive WR only to carry its completion; its payload goes to the rkey'd
    // address, never to the receive buffer. Still every receive carries one SGE: libefa's efa_post_recv writes RX
    // descriptors only per SGE, so a zero-SGE receive is taken (wqe_posted counts it) yet never reaches the device,
    // and the sender would see RNR. All receives share one scratch buffer.
    ibv_sge sge{};
    sge.addr = reinterpret_cast<uint64_t>(recv_scratch_);
    sge.length = kRecvScratchBytes;
    sge.lkey = d.recv_mr->lkey;
    std::vector<ibv_recv_wr> wrs(count);
    for (int i = 0; i < count; ++i) {
      wrs[i] = ibv_recv_wr{};
      wrs[i].wr_id = tag;
      wrs[i].sg_list = &sge;
      wrs[i].num_sge = 1;
      wrs[i].next = i + 1 < count ? &wrs[i + 1] : nullptr;
    }
    ibv_recv_wr* bad = nullptr;
    if (count > 0 && api_.post_recv(qp, wrs.data(), &bad) != 0)
      throw std::runtime_error("verbs: ibv_post_recv (qp " + std::to_string(qp->qp_num) + ") failed: " +
                               errno_text(errno));
  }

  void teardown() {
    for (auto& p : peers_) {
      if (p.qp) api_.destroy_qp(p.qp);
      if (p.ah) api_.destroy_ah(p.ah);
      p.qp = nullptr;
      p.ah = nullptr;
    }
    for (auto& d : devs_)
      if (d.srd_qp) {
        api_.destroy_qp(d.srd_qp);
        d.srd_qp = nullptr;
      }
    for (auto& r : regions_)
      for (auto* mr : r.mrs)
        if (mr) api_.dereg_mr(mr);
    regions_.clear();
    for (auto& d : devs_) {
      if (d.scratch_mr) api_.dereg_mr(d.scratch_mr);
      if (d.recv_mr) api_.dereg_mr(d.recv_mr);
      if (d.cq) api_.destroy_cq(d.cq);
      if (d.pd) api_.dealloc_pd(d.pd);
      if (d.ctx) api_.close_device(d.ctx);
      d = Device{};
    }
    devs_.clear();
  }

  // ------------------------------------------------------------ registration
  MemoryRegion register_impl(void* base, size_t bytes, MemoryKind kind, int fd, uint64_t offset) {
    if (info_taken_)
      throw std::logic_error("verbs: register_memory after local_info(): peers would not learn the region's keys; "
                             "register every buffer first");
    if (base == nullptr || bytes == 0) throw std::invalid_argument("verbs: register_memory needs a non-empty buffer");
    Region reg;
    reg.pub = MemoryRegion{static_cast<int>(regions_.size()), base, bytes, kind};
    try {
      for (auto& d : devs_) reg.mrs.push_back(register_on(d, base, bytes, kind, fd, offset));
    } catch (...) {
      for (auto* mr : reg.mrs) api_.dereg_mr(mr);
      throw;
    }
    regions_.push_back(reg);
    return reg.pub;
  }

  ibv_mr* register_on(Device& d, void* base, size_t bytes, MemoryKind kind, int fd, uint64_t offset) {
    // The EFA kernel driver refuses (EOPNOTSUPP) access bits the device lacks; remote read is never used here, so
    // on EFA it is asked for only when the device has RDMA read.
    const bool remote_read = !d.efa || (d.efa_caps & kEfaCapRdmaRead);
    const int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | (remote_read ? IBV_ACCESS_REMOTE_READ : 0) |
                       (d.atomics ? IBV_ACCESS_REMOTE_ATOMIC : 0);
    const uint64_t iova = reinterpret_cast<uint64_t>(base);
    std::string dmabuf_why;
    if (kind == MemoryKind::kDevice) {
      bool own_fd = false;
      if (fd < 0 && api_.get_dmabuf_fd) {
        int rc = api_.get_dmabuf_fd(base, bytes, &fd, &offset);
        if (rc != 0) {
          fd = -1;
          dmabuf_why = "no dmabuf export (" + (rc == ENOSYS ? std::string("no CUDA driver library") : errno_text(rc)) +
                       ")";
        } else {
          own_fd = true;
        }
      }
      if (fd >= 0) {
        if (api_.reg_dmabuf_mr == nullptr) {
          dmabuf_why = "libibverbs lacks ibv_reg_dmabuf_mr (rdma-core < 34)";
        } else {
          ibv_mr* mr = api_.reg_dmabuf_mr(d.pd, offset, bytes, iova, fd, access);
          int err = errno;
          if (own_fd) ::close(fd);  // the MR keeps its own reference to the dmabuf
          if (mr) return mr;
          dmabuf_why = "ibv_reg_dmabuf_mr failed: " + errno_text(err) +
                       " (needs Linux >= 5.12, a NIC driver with dmabuf support and, for NVIDIA, the open kernel "
                       "modules)";
        }
      }
    }
    ibv_mr* mr = api_.reg_mr(d.pd, base, bytes, access);
    if (mr) return mr;
    int err = errno;
    std::ostringstream os;
    os << "verbs: registering " << bytes << " bytes of " << (kind == MemoryKind::kDevice ? "GPU" : "host")
       << " memory at 0x" << std::hex << iova << std::dec << " on " << d.name << " failed: ibv_reg_mr: "
       << errno_text(err);
    if (kind == MemoryKind::kDevice) {
      os << "; " << (dmabuf_why.empty() ? "dmabuf not attempted" : dmabuf_why)
         << ". GPU memory needs either dmabuf or a peer-memory kernel module: `sudo modprobe nvidia_peermem` "
         << "(NVIDIA on IB/RoCE), `sudo modprobe efa_nv_peermem` (NVIDIA on EFA), or amdgpu's peer-memory support "
         << "(ROCm on Broadcom/Pollara); `uccl-ep-train doctor` checks which is present";
    } else if (err == ENOMEM || err == EPERM) {
      os << "; raise the locked-memory limit (ulimit -l unlimited)";
    }
    throw std::runtime_error(os.str());
  }

  // ------------------------------------------------------------ connection
  RemoteInfo parse_info(const std::vector<uint8_t>& buf, int r) {
    Reader rd(buf, r);
    RemoteInfo ri;
    if (rd.get<uint32_t>() != kMagic || rd.get<uint32_t>() != kWireVersion)
      throw std::runtime_error("verbs: connection info of rank " + std::to_string(r) +
                               " is not from this uccl-ep-train version (or not from the verbs transport)");
    int rank = rd.get<int32_t>(), world = rd.get<int32_t>();
    if (rank != r || world != cfg_.world_size)
      throw std::runtime_error("verbs: info at position " + std::to_string(r) + " claims rank " +
                               std::to_string(rank) + " of " + std::to_string(world) + "; bootstrap mixed up ranks");
    ri.efa = rd.get<uint8_t>() != 0;
    if (ri.efa != efa_)
      throw std::runtime_error("verbs: rank " + std::to_string(r) + " uses " + (ri.efa ? "EFA" : "IB/RoCE") +
                               " while this rank uses " + (efa_ ? "EFA" : "IB/RoCE") + "; fix UCCL_IB_HCA");
    uint32_t ndev = rd.get<uint32_t>();
    ri.devs.resize(ndev);
    for (auto& d : ri.devs) {
      d.gid = rd.get<ibv_gid>();
      d.lid = rd.get<uint16_t>();
      d.mtu = rd.get<uint32_t>();
    }
    ri.peers.resize(world);
    for (auto& p : ri.peers) {
      p.first = rd.get<uint32_t>();
      p.second = rd.get<uint32_t>();
      if (p.first >= ndev) throw std::runtime_error("verbs: corrupt connection info from rank " + std::to_string(r));
    }
    uint32_t nreg = rd.get<uint32_t>();
    ri.regions.resize(nreg);
    for (auto& reg : ri.regions) {
      reg.base = rd.get<uint64_t>();
      reg.bytes = rd.get<uint64_t>();
      reg.rkeys.resize(ndev);
      for (auto& k : reg.rkeys) k = rd.get<uint32_t>();
    }
    return ri;
  }

  void connect_rc(int r, const RemoteInfo::Dev& rd) {
    Peer& p = peers_[r];
    Device& d = devs_[p.dev];
    ibv_qp_attr a{};
    a.qp_state = IBV_QPS_RTR;
    const uint32_t local_mtu = static_cast<uint32_t>(d.port.active_mtu);
    a.path_mtu = static_cast<ibv_mtu>(std::min<uint32_t>(local_mtu, rd.mtu ? rd.mtu : local_mtu));
    a.dest_qp_num = p.remote_qpn;
    a.rq_psn = 0;
    a.max_dest_rd_atomic = static_cast<uint8_t>(dest_rd_atomic(d));
    a.min_rnr_timer = 12;
    a.ah_attr.port_num = static_cast<uint8_t>(cfg_.port);
    a.ah_attr.sl = static_cast<uint8_t>(d.sl);
    a.ah_attr.dlid = rd.lid;
    // RoCE always routes by GID; InfiniBand needs the GRH when the peer has no LID (another subnet) or the port says
    // so (IBV_QPF_GRH_REQUIRED, ibv_modify_qp(3)).
    a.ah_attr.is_global = (d.port.link_layer == IBV_LINK_LAYER_ETHERNET || rd.lid == 0 ||
                           (d.port.flags & IBV_QPF_GRH_REQUIRED))
                              ? 1
                              : 0;
    a.ah_attr.grh.dgid = rd.gid;
    a.ah_attr.grh.sgid_index = static_cast<uint8_t>(d.gid_index);
    a.ah_attr.grh.hop_limit = 255;
    a.ah_attr.grh.traffic_class = static_cast<uint8_t>(d.tc);
    modify(p.qp, a,
           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
               IBV_QP_MIN_RNR_TIMER,
           "RTR", d, r);
    a = ibv_qp_attr{};
    a.qp_state = IBV_QPS_RTS;
    a.sq_psn = 0;
    a.timeout = static_cast<uint8_t>(cfg_.timeout);
    a.retry_cnt = static_cast<uint8_t>(cfg_.retry_cnt);
    a.rnr_retry = 7;  // infinite: a slow receiver re-posting receives is not an error
    a.max_rd_atomic = static_cast<uint8_t>(init_rd_atomic(d));
    modify(p.qp, a,
           IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC,
           "RTS", d, r);
  }

  void connect_srd(int r, const RemoteInfo::Dev& rd) {
    Peer& p = peers_[r];
    Device& d = devs_[p.dev];
    ibv_ah_attr ah{};
    ah.is_global = 1;
    ah.grh.dgid = rd.gid;
    ah.grh.sgid_index = static_cast<uint8_t>(d.gid_index);
    ah.port_num = static_cast<uint8_t>(cfg_.port);
    p.ah = api_.create_ah(d.pd, &ah);
    if (p.ah == nullptr)
      throw std::runtime_error("verbs: ibv_create_ah(" + d.name + " -> rank " + std::to_string(r) +
                               ") failed: " + errno_text(errno));
  }

  // SRD receive completions name the sender by (address-handle number as seen here, source QPN).
  void build_srd_source_map() {
    srd_src_.clear();
    for (int r = 0; r < cfg_.world_size; ++r) {
      Peer& p = peers_[r];
      uint32_t ahn = 0xffff;
#ifdef UCCL_EP_WITH_EFADV
      if (api_.efadv_query_ah) {
        efadv_ah_attr attr{};
        if (api_.efadv_query_ah(p.ah, &attr, sizeof(attr)) == 0) ahn = attr.ahn;
      }
#endif
      srd_src_[srd_key(p.dev, ahn, p.remote_qpn)] = r;
      srd_src_by_qpn_.emplace(key(p.dev, p.remote_qpn), r);
    }
  }

  static uint64_t key(int dev, uint32_t qpn) { return (static_cast<uint64_t>(dev) << 32) | qpn; }
  static uint64_t srd_key(int dev, uint32_t ahn, uint32_t qpn) {
    return (static_cast<uint64_t>(dev) << 48) | (static_cast<uint64_t>(ahn & 0xffff) << 32) | qpn;
  }

  // ------------------------------------------------------------ posting
  void validate_region(int dst, int region, uint64_t off, uint64_t bytes, size_t i, const char* what) {
    const Peer& p = peers_[dst];
    if (!p.connected)
      throw std::logic_error("verbs: " + std::string(what) + " #" + std::to_string(i) + " before connect()");
    if (region < 0 || region >= static_cast<int>(p.regions.size()))
      throw std::invalid_argument("verbs: " + std::string(what) + " #" + std::to_string(i) + ": rank " +
                                  std::to_string(dst) + " has no region " + std::to_string(region));
    const RemoteRegion& rr = p.regions[region];
    if (off > rr.bytes || bytes > rr.bytes - off)
      throw std::invalid_argument("verbs: " + std::string(what) + " #" + std::to_string(i) + ": [" +
                                  std::to_string(off) + ", +" + std::to_string(bytes) + ") exceeds rank " +
                                  std::to_string(dst) + "'s region " + std::to_string(region) + " of " +
                                  std::to_string(rr.bytes) + " bytes");
  }

  void validate_write(const WriteRequest& w, size_t i) {
    if (w.dst_rank < 0 || w.dst_rank >= cfg_.world_size)
      throw std::invalid_argument("verbs: write #" + std::to_string(i) + ": dst_rank " + std::to_string(w.dst_rank) +
                                  " out of range [0, " + std::to_string(cfg_.world_size) + ")");
    if (w.local_region < 0 || w.local_region >= static_cast<int>(regions_.size()))
      throw std::invalid_argument("verbs: write #" + std::to_string(i) + ": no local region " +
                                  std::to_string(w.local_region));
    const MemoryRegion& lr = regions_[w.local_region].pub;
    if (w.local_offset > lr.bytes || w.bytes > lr.bytes - w.local_offset)
      throw std::invalid_argument("verbs: write #" + std::to_string(i) + ": local [" + std::to_string(w.local_offset) +
                                  ", +" + std::to_string(w.bytes) + ") exceeds region " +
                                  std::to_string(w.local_region) + " of " + std::to_string(lr.bytes) + " bytes");
    if (w.bytes == 0 && !w.has_imm)
      throw std::invalid_argument("verbs: write #" + std::to_string(i) + " has no bytes and no immediate");
    if (w.bytes > caps().max_write_bytes)
      throw std::invalid_argument("verbs: write #" + std::to_string(i) + " of " + std::to_string(w.bytes) +
                                  " bytes exceeds the NIC's message limit; split it");
    validate_region(w.dst_rank, w.remote_region, w.remote_offset, w.bytes, i, "write");
  }

  void validate_atomic(const AtomicRequest& a, size_t i) {
    if (a.dst_rank < 0 || a.dst_rank >= cfg_.world_size)
      throw std::invalid_argument("verbs: atomic #" + std::to_string(i) + ": dst_rank " + std::to_string(a.dst_rank) +
                                  " out of range");
    if (a.remote_offset % 8 != 0)
      throw std::invalid_argument("verbs: atomic #" + std::to_string(i) + ": remote_offset " +
                                  std::to_string(a.remote_offset) + " is not 8-byte aligned");
    validate_region(a.dst_rank, a.remote_region, a.remote_offset, 8, i, "atomic");
  }

  int slot_of(int peer) const { return efa_ ? cfg_.world_size + peers_[peer].dev : peer; }

  // Accept the longest prefix whose send queues have room, group it by destination (keeping order within one),
  // and post each group as chains of at most max_chain WRs.
  template <typename DstOf, typename PostChain>
  size_t post_batch(size_t n, DstOf dst_of, PostChain post_chain) {
    std::vector<int> demand(sq_used_.size(), 0);
    size_t accepted = 0;
    for (; accepted < n; ++accepted) {
      int peer = dst_of(accepted);
      int slot = slot_of(peer);
      if (sq_used_[slot] + demand[slot] >= sq_depth(devs_[peers_[peer].dev])) break;
      ++demand[slot];
    }
    std::vector<int> order;
    std::unordered_map<int, std::vector<size_t>> by_dst;
    for (size_t i = 0; i < accepted; ++i) {
      int dst = dst_of(i);
      auto& v = by_dst[dst];
      if (v.empty()) order.push_back(dst);
      v.push_back(i);
    }
    for (int dst : order) {
      const auto& all = by_dst[dst];
      for (size_t s = 0; s < all.size(); s += cfg_.max_chain) {
        std::vector<size_t> part(all.begin() + s, all.begin() + std::min(all.size(), s + cfg_.max_chain));
        post_chain(part, dst);
      }
    }
    return accepted;
  }

  uint64_t new_chain(int peer, Completion::Kind kind, std::vector<uint64_t> wr_ids) {
    uint64_t id = ++chain_seq_;
    Chain c;
    c.peer = peer;
    c.slot = slot_of(peer);
    c.wrs = static_cast<int>(wr_ids.size());
    c.kind = kind;
    c.wr_ids = std::move(wr_ids);
    sq_used_[c.slot] += c.wrs;
    chains_.emplace(id, std::move(c));
    return id;
  }

  void post_rc_chain(int peer, std::vector<ibv_send_wr>& wrs, std::vector<ibv_sge>& sges, Completion::Kind kind,
                     std::vector<uint64_t> wr_ids) {
    const size_t k = wrs.size();
    uint64_t id = new_chain(peer, kind, std::move(wr_ids));
    for (size_t j = 0; j < k; ++j) {
      wrs[j].wr_id = id;
      wrs[j].sg_list = wrs[j].num_sge ? &sges[j] : nullptr;
      wrs[j].next = j + 1 < k ? &wrs[j + 1] : nullptr;
      wrs[j].send_flags = j + 1 == k ? IBV_SEND_SIGNALED : 0;
    }
    ibv_send_wr* bad = nullptr;
    if (api_.post_send(peers_[peer].qp, wrs.data(), &bad) != 0) {
      int err = errno;
      sq_used_[chains_[id].slot] -= chains_[id].wrs;
      chains_.erase(id);
      throw std::runtime_error("verbs: ibv_post_send to rank " + std::to_string(peer) + " via " +
                               devs_[peers_[peer].dev].name + " failed: " + errno_text(err) +
                               (bad ? " at WR " + std::to_string(bad - wrs.data()) + " of " + std::to_string(k) : ""));
    }
  }

  void post_write_chain(const WriteRequest* reqs, const std::vector<size_t>& idx, int peer) {
    Peer& p = peers_[peer];
    Device& d = devs_[p.dev];
    if (efa_) {
      post_srd_writes(reqs, idx, peer);
      return;
    }
    std::vector<ibv_send_wr> wrs(idx.size());
    std::vector<ibv_sge> sges(idx.size());
    std::vector<uint64_t> ids;
    for (size_t j = 0; j < idx.size(); ++j) {
      const WriteRequest& w = reqs[idx[j]];
      const Region& lr = regions_[w.local_region];
      ibv_send_wr& wr = wrs[j];
      wr = ibv_send_wr{};
      wr.opcode = w.has_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
      if (w.has_imm) wr.imm_data = htonl(w.imm);
      wr.num_sge = w.bytes ? 1 : 0;
      sges[j].addr = reinterpret_cast<uint64_t>(lr.pub.base) + w.local_offset;
      sges[j].length = static_cast<uint32_t>(w.bytes);
      sges[j].lkey = lr.mrs[p.dev]->lkey;
      const RemoteRegion& rr = p.regions[w.remote_region];
      wr.wr.rdma.remote_addr = rr.base + w.remote_offset;
      wr.wr.rdma.rkey = rr.rkeys[p.remote_dev];
      ids.push_back(w.wr_id);
    }
    (void)d;
    post_rc_chain(peer, wrs, sges, Completion::Kind::kLocalWrite, std::move(ids));
  }

  void post_atomic_chain(const AtomicRequest* reqs, const std::vector<size_t>& idx, int peer) {
    Peer& p = peers_[peer];
    Device& d = devs_[p.dev];
    std::vector<ibv_send_wr> wrs(idx.size());
    std::vector<ibv_sge> sges(idx.size());
    std::vector<uint64_t> ids;
    for (size_t j = 0; j < idx.size(); ++j) {
      const AtomicRequest& a = reqs[idx[j]];
      ibv_send_wr& wr = wrs[j];
      wr = ibv_send_wr{};
      wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
      wr.num_sge = 1;
      sges[j].addr = reinterpret_cast<uint64_t>(scratch_);
      sges[j].length = 8;
      sges[j].lkey = d.scratch_mr->lkey;
      const RemoteRegion& rr = p.regions[a.remote_region];
      wr.wr.atomic.remote_addr = rr.base + a.remote_offset;
      wr.wr.atomic.rkey = rr.rkeys[p.remote_dev];
      wr.wr.atomic.compare_add = static_cast<uint64_t>(a.add);
      ids.push_back(a.wr_id);
    }
    post_rc_chain(peer, wrs, sges, Completion::Kind::kLocalAtomic, std::move(ids));
  }

  void post_srd_writes(const WriteRequest* reqs, const std::vector<size_t>& idx, int peer) {
    Peer& p = peers_[peer];
    Device& d = devs_[p.dev];
    ibv_qp_ex* qpx = d.srd_qpx;
    std::vector<uint64_t> chain_ids;
    ibv_wr_start(qpx);
    for (size_t j : idx) {
      const WriteRequest& w = reqs[j];
      const Region& lr = regions_[w.local_region];
      const RemoteRegion& rr = p.regions[w.remote_region];
      uint64_t id = new_chain(peer, Completion::Kind::kLocalWrite, {w.wr_id});
      chain_ids.push_back(id);
      qpx->wr_id = id;
      qpx->wr_flags = IBV_SEND_SIGNALED;
      if (w.has_imm)
        ibv_wr_rdma_write_imm(qpx, rr.rkeys[p.remote_dev], rr.base + w.remote_offset, htonl(w.imm));
      else
        ibv_wr_rdma_write(qpx, rr.rkeys[p.remote_dev], rr.base + w.remote_offset);
      ibv_wr_set_ud_addr(qpx, p.ah, p.remote_qpn, kQkey);
      if (w.bytes)
        ibv_wr_set_sge(qpx, lr.mrs[p.dev]->lkey, reinterpret_cast<uint64_t>(lr.pub.base) + w.local_offset,
                       static_cast<uint32_t>(w.bytes));
      else
        ibv_wr_set_sge_list(qpx, 0, nullptr);
    }
    int rc = ibv_wr_complete(qpx);
    if (rc != 0) {
      for (uint64_t id : chain_ids) {
        sq_used_[chains_[id].slot] -= chains_[id].wrs;
        chains_.erase(id);
      }
      throw std::runtime_error("verbs: ibv_wr_complete (SRD) to rank " + std::to_string(peer) + " via " + d.name +
                               " failed: " + errno_text(rc));
    }
  }

  // ------------------------------------------------------------ asynchronous events
  void drain_async_events() {
    if (async_pfds_.empty()) return;
    for (auto& p : async_pfds_) p.revents = 0;
    if (::poll(async_pfds_.data(), async_pfds_.size(), 0) <= 0) return;
    std::vector<Completion> fatal;
    for (size_t i = 0; i < async_pfds_.size(); ++i) {
      if (async_pfds_[i].revents == 0) continue;
      const int dev = async_pfd_dev_[i];
      for (int n = 0; n < 64; ++n) {  // bounded: a flood of events must not stall the proxy loop
        ibv_async_event ev{};
        if (api_.get_async_event(devs_[dev].ctx, &ev) != 0) break;  // EAGAIN: none left
        const ibv_async_event copy = ev;
        // Acknowledge at once: destroying a QP/CQ or closing the device waits for the acks of its events.
        api_.ack_async_event(&ev);
        handle_async(dev, copy, fatal);
      }
    }
    // Ahead of every completion not yet returned (the flushes they cause), in the order they were read.
    pending_.insert(pending_.begin(), std::make_move_iterator(fatal.begin()), std::make_move_iterator(fatal.end()));
  }

  std::string ranks_on(int dev) const {
    std::string s;
    for (int r = 0; r < static_cast<int>(peers_.size()); ++r)
      if (peers_[r].dev == dev) s += (s.empty() ? "" : ", ") + std::to_string(r);
    return s.empty() ? "none" : s;
  }

  void handle_async(int dev, const ibv_async_event& ev, std::vector<Completion>& fatal_out) {
    Device& d = devs_[dev];
    const ibv_event_type t = ev.event_type;
    const char* txt = api_.event_type_str ? api_.event_type_str(t) : nullptr;
    const std::string name = event_name(t);
    const std::string what = (txt && *txt && std::strcmp(txt, "unknown") != 0) ? std::string(txt) + " (" + name + ")"
                                                                               : name;
    bool fatal = false;
    switch (t) {
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
      case IBV_EVENT_CQ_ERR:
      case IBV_EVENT_DEVICE_FATAL:
      case IBV_EVENT_SRQ_ERR:
      case IBV_EVENT_WQ_FATAL:
        fatal = true;
        break;
      case IBV_EVENT_PORT_ERR:
        fatal = ev.element.port_num == cfg_.port;  // another port of the device carries none of our traffic
        break;
      default:
        break;
    }
    std::string subject;
    int peer = -1;
    bool all_on_dev = false;
    switch (async_subject(t)) {
      case AsyncSubject::kQp: {
        const ibv_qp* qp = ev.element.qp;
        const uint32_t qpn = qp ? qp->qp_num : 0;
        if (qp != nullptr && qp == d.srd_qp) {
          subject = " on SRD qp " + std::to_string(qpn) + ", shared by ranks " + ranks_on(dev);
          all_on_dev = true;
        } else if (auto it = qp_owner_.find(key(dev, qpn)); qp != nullptr && it != qp_owner_.end()) {
          peer = it->second;
          subject = " on qp " + std::to_string(qpn) + " to rank " + std::to_string(peer);
        } else {
          subject = " on qp " + std::to_string(qpn) + " (not one of this transport's queue pairs)";
        }
        break;
      }
      case AsyncSubject::kCq:
        subject = " on the completion queue of " + d.name + ", serving ranks " + ranks_on(dev);
        all_on_dev = true;
        break;
      case AsyncSubject::kPort:
        subject = " on port " + std::to_string(ev.element.port_num) +
                  (t == IBV_EVENT_PORT_ERR && fatal ? ", carrying ranks " + ranks_on(dev) : "");
        all_on_dev = true;
        break;
      case AsyncSubject::kDevice:
        subject = ", carrying ranks " + ranks_on(dev);
        all_on_dev = true;
        break;
      default:  // SRQ / WQ: this transport creates neither
        all_on_dev = true;
        break;
    }
    if (!fatal) {
      ++async_ignored_;
      async_last_ignored_ = name + " on " + d.name + subject;
      return;
    }
    std::string hint = async_hint(t);
    if (const size_t at = hint.find("=^name"); at != std::string::npos) hint.replace(at, 6, "=^" + d.name);
    std::string msg = "verbs: asynchronous event on " + d.name + " (rank " + std::to_string(cfg_.rank) +
                      "): " + what + subject + ". " + hint;
    if (peer >= 0 && peer < static_cast<int>(peers_.size())) peers_[peer].failed = true;
    if (all_on_dev)
      for (auto& p : peers_)
        if (p.dev == dev) p.failed = true;
    if (async_fatal_.empty()) async_fatal_ = name + " on " + d.name + subject;
    Completion out;
    out.kind = Completion::Kind::kRemoteImm;
    out.src_rank = peer;
    out.status = kAsyncEventStatus;
    out.error = std::move(msg);
    fatal_out.push_back(std::move(out));
  }

  // ------------------------------------------------------------ completions
  std::string wc_text(ibv_wc_status s) const {
    const char* t = api_.wc_status_str ? api_.wc_status_str(s) : nullptr;
    return std::string(t ? t : "unknown status") + " (status " + std::to_string(static_cast<int>(s)) + ")";
  }

  void handle_wc(int dev, const ibv_wc& wc) {
    if (wc.wr_id & kRecvTag) {
      handle_recv(dev, wc);
      return;
    }
    auto it = chains_.find(wc.wr_id);
    if (it == chains_.end()) return;  // an unsignalled WR of a chain already retired by its error
    Chain c = std::move(it->second);
    chains_.erase(it);
    sq_used_[c.slot] -= c.wrs;
    std::string error;
    if (wc.status != IBV_WC_SUCCESS) {
      std::ostringstream os;
      os << "verbs: " << (c.kind == Completion::Kind::kLocalAtomic ? "atomic" : "RDMA write") << " from rank "
         << cfg_.rank << " to rank " << c.peer << " via " << devs_[dev].name << " (qp " << wc.qp_num
         << ") failed: " << wc_text(wc.status) << ", vendor error 0x" << std::hex << wc.vendor_err << std::dec << ". "
         << status_hint(wc.status);
      error = os.str();
      peers_[c.peer].failed = true;
    }
    for (uint64_t id : c.wr_ids) {
      Completion out;
      out.kind = c.kind;
      out.wr_id = id;
      out.status = static_cast<int>(wc.status);
      out.error = error;
      pending_.push_back(std::move(out));
    }
  }

  void handle_recv(int dev, const ibv_wc& wc) {
    const bool srd = wc.wr_id & (1ull << 62);
    int src = -1;
    // ibv_poll_cq(3): on a failed completion only wr_id, status, qp_num and vendor_err are valid, so an SRD error
    // (slid/src_qp garbage) names no sender. An SRD QP stays usable after one failed receive: replace it.
    if (srd && wc.status != IBV_WC_SUCCESS) {
      if (wc.status != IBV_WC_WR_FLUSH_ERR) post_recvs(devs_[dev], devs_[dev].srd_qp, wc.wr_id, 1);
    } else if (srd) {
      auto it = srd_src_.find(srd_key(dev, wc.slid, wc.src_qp));
      if (it != srd_src_.end()) {
        src = it->second;
      } else if (srd_src_by_qpn_.count(key(dev, wc.src_qp)) == 1) {
        src = srd_src_by_qpn_.find(key(dev, wc.src_qp))->second;
      }
    } else {
      auto it = qp_owner_.find(key(dev, wc.qp_num));
      if (it != qp_owner_.end()) src = it->second;
    }
    if (wc.status != IBV_WC_SUCCESS) {
      if (wc.status == IBV_WC_WR_FLUSH_ERR && (src < 0 || peers_[src].failed)) return;  // teardown noise
      Completion out;
      out.kind = Completion::Kind::kRemoteImm;
      out.src_rank = src;
      out.status = static_cast<int>(wc.status);
      out.error = "verbs: receive on rank " + std::to_string(cfg_.rank) + " from " +
                  (src >= 0 ? "rank " + std::to_string(src) : std::string("an unnamed sender (SRD error completion)")) +
                  " via " + devs_[dev].name + " failed: " + wc_text(wc.status) + ". " + status_hint(wc.status);
      if (src >= 0) peers_[src].failed = true;
      pending_.push_back(std::move(out));
      return;
    }
    if (src < 0) {
      // Still replace the receive (the SRD QP is per device), or stray traffic would drain the receive queue.
      if (srd) post_recvs(devs_[dev], devs_[dev].srd_qp, wc.wr_id, 1);
      Completion out;
      out.kind = Completion::Kind::kRemoteImm;
      out.status = -1;
      out.error = "verbs: write-with-immediate on " + devs_[dev].name + " from an unknown sender (qp " +
                  std::to_string(wc.qp_num) + ", source qp " + std::to_string(wc.src_qp) + ", ah " +
                  std::to_string(wc.slid) + "): a process from another job or a stale connection";
      pending_.push_back(std::move(out));
      return;
    }
    Completion out;
    out.kind = Completion::Kind::kRemoteImm;
    out.src_rank = src;
    out.imm = (wc.wc_flags & IBV_WC_WITH_IMM) ? ntohl(wc.imm_data) : 0;
    pending_.push_back(std::move(out));
    // Replace the consumed receive so the sender never meets an empty receive queue.
    ibv_qp* qp = srd ? devs_[dev].srd_qp : peers_[src].qp;
    post_recvs(devs_[dev], qp, wc.wr_id, 1);
  }

  VerbsConfig cfg_;
  const IbvApi& api_;
  bool efa_ = false;
  bool info_taken_ = false;
  std::vector<Device> devs_;
  std::vector<Peer> peers_;
  std::vector<Region> regions_;
  std::vector<int> sq_used_;  // per send queue: RC peer QPs, then SRD device QPs
  std::unordered_map<uint64_t, Chain> chains_;
  uint64_t chain_seq_ = 0;
  std::unordered_map<uint64_t, int> qp_owner_;   // (device, local qpn) -> peer (RC)
  std::unordered_map<uint64_t, int> srd_src_;    // (device, ahn, source qpn) -> peer (SRD)
  std::unordered_multimap<uint64_t, int> srd_src_by_qpn_;
  std::deque<Completion> pending_;
  uint32_t poll_calls_ = 0;
  std::vector<pollfd> async_pfds_;     // the watched devices' async fds
  std::vector<int> async_pfd_dev_;     // their device indices
  uint64_t async_ignored_ = 0;         // benign events acknowledged
  std::string async_last_ignored_;
  std::string async_fatal_;            // the first fatal event, for debug_state()
  alignas(8) uint64_t scratch_[1] = {0};
  alignas(64) uint8_t recv_scratch_[kRecvScratchBytes] = {};
};

}  // namespace

bool verbs_transport_built() { return true; }

std::unique_ptr<VerbsTransport> make_verbs_transport(const VerbsConfig& cfg) {
  return std::make_unique<VerbsTransportImpl>(cfg);
}

}  // namespace uccl_ep

#else  // !UCCL_EP_WITH_VERBS

namespace uccl_ep {

bool verbs_transport_built() { return false; }

std::unique_ptr<VerbsTransport> make_verbs_transport(const VerbsConfig&) {
  throw std::runtime_error(
      "verbs: this uccl-ep-train build has no verbs transport (infiniband/verbs.h was not found at build time): "
      "install rdma-core's headers (libibverbs-dev / rdma-core-devel) and rebuild, or set UCCL_EP_TRANSPORT=loopback");
}

}  // namespace uccl_ep
#endif  // UCCL_EP_WITH_VERBS
