// A recording stand-in for libibverbs/libefa (tests only): simulated devices, every call logged with its arguments,
// signalled sends completed (or failed on request), receives injected. Queue-pair state transitions are checked the
// way a real provider checks them, so a transport that skips a state fails here too. Single-threaded by design.
#ifdef UCCL_EP_WITH_VERBS
#include <arpa/inet.h>
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <thread>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "transport/ibv_api.hpp"

namespace uccl_ep::fake_verbs {
namespace {

// Proxy threads post and poll while the test thread injects receives and reads the record: every entry point of the
// fake (table functions and the test API) holds this lock. Recursive because some call others.
std::recursive_mutex& fake_mu() {
  static std::recursive_mutex m;
  return m;
}
using FakeLock = std::lock_guard<std::recursive_mutex>;

struct FakeQp {
  ibv_qp_ex qpx{};
  bool srd = false;
  std::deque<uint64_t> recvs;
  Record chain;
  bool in_chain = false;
  int chain_err = 0;
};

struct State {
  IbvApi api;
  std::vector<FakeDevice> devs;
  std::vector<std::unique_ptr<ibv_device>> ibdevs;
  std::vector<ibv_device*> list;
  bool dmabuf = false;
  std::vector<Record> calls;
  std::map<std::string, int> fail;
  bool auto_complete = true;
  bool fail_completion = false;
  int fail_status = 0;
  uint32_t fail_vendor = 0;
  uint32_t next_qpn = 0x100, next_key = 0x1000;
  uint16_t next_ahn = 1;
  std::map<ibv_context*, int> ctx_dev;
  std::map<ibv_cq*, std::deque<ibv_wc>> cq_queue;
  std::map<ibv_qp*, std::unique_ptr<FakeQp>> qps;
  std::map<uint32_t, ibv_qp*> by_qpn;
  std::map<ibv_ah*, uint16_t> ahn;
  std::vector<std::unique_ptr<ibv_context>> ctxs;
  std::vector<std::unique_ptr<ibv_pd>> pds;
  std::vector<std::unique_ptr<ibv_cq>> cqs;
  std::vector<std::unique_ptr<ibv_mr>> mrs;
  std::vector<std::unique_ptr<ibv_ah>> ahs;
  // asynchronous events: per context a queue and the write end of the pipe whose read end is ctx->async_fd
  std::map<ibv_context*, std::deque<ibv_async_event>> async_q;
  std::map<ibv_context*, int> async_wfd;
  AsyncCounts async;
};

State* g = nullptr;
// Uninstalled states are kept: a transport that outlives uninstall() (a failing test's traceback holds it) still
// tears down through its captured table without touching freed memory.
std::vector<State*> g_retired;

State& st() {
  if (g != nullptr) return *g;
  if (!g_retired.empty()) return *g_retired.back();
  throw std::logic_error("fake verbs used before install()");
}

Record& rec(const char* fn) {
  st().calls.push_back(Record{fn, {}, {}, {}});
  return st().calls.back();
}

bool failing(const char* fn) {
  auto it = st().fail.find(fn);
  if (it == st().fail.end()) return false;
  errno = it->second;
  rec(fn).args.push_back({"errno", static_cast<uint64_t>(it->second)});
  st().fail.erase(it);
  return true;
}

const FakeDevice& dev_of(ibv_context* ctx) { return st().devs.at(st().ctx_dev.at(ctx)); }

FakeQp& fq(ibv_qp* qp) { return *st().qps.at(qp); }
FakeQp& fq(ibv_qp_ex* qpx) { return fq(&qpx->qp_base); }

// A CQ holds cq->cqe entries; one more is an overrun: on a NIC an asynchronous IBV_EVENT_CQ_ERR after which every
// QP on the CQ is in error. Recorded (fn "cq_overrun") so tests can prove the transport sizes CQs for the worst case.
void push_cqe(ibv_cq* cq, const ibv_wc& wc) {
  auto& q = st().cq_queue[cq];
  q.push_back(wc);
  if (q.size() > static_cast<size_t>(cq->cqe)) {
    Record& r = rec("cq_overrun");
    r.args.push_back({"cqe", static_cast<uint64_t>(cq->cqe)});
    r.args.push_back({"queued", q.size()});
  }
}

void complete(ibv_qp* qp, uint64_t wr_id, ibv_wc_opcode op) {
  State& s = st();
  if (!s.auto_complete) return;
  ibv_wc wc{};
  wc.wr_id = wr_id;
  wc.opcode = op;
  wc.qp_num = qp->qp_num;
  wc.status = IBV_WC_SUCCESS;
  if (s.fail_completion) {
    wc.status = static_cast<ibv_wc_status>(s.fail_status);
    wc.vendor_err = s.fail_vendor;
    s.fail_completion = false;
  }
  push_cqe(qp->send_cq, wc);
}

// ---------------------------------------------------------------- device / context
ibv_device** f_get_device_list(int* num) {
  FakeLock lk(fake_mu());
  rec("ibv_get_device_list").args.push_back({"num", st().devs.size()});
  if (num) *num = static_cast<int>(st().devs.size());
  return st().list.data();
}
void f_free_device_list(ibv_device**) {}
const char* f_get_device_name(ibv_device* d) { return d->name; }
ibv_context* f_open_device(ibv_device* d) {
  FakeLock lk(fake_mu());
  Record& r = rec("ibv_open_device");
  r.text.push_back({"device", d->name});
  if (failing("ibv_open_device")) return nullptr;
  auto ctx = std::make_unique<ibv_context>();
  ctx->device = d;
  ctx->cmd_fd = -1;
  // The async fd is a pipe the fake controls: one byte per queued event, left blocking as libibverbs leaves it.
  int fds[2] = {-1, -1};
  if (::pipe2(fds, O_CLOEXEC) != 0) return nullptr;
  ctx->async_fd = fds[0];
  st().async_wfd[ctx.get()] = fds[1];
  for (size_t i = 0; i < st().ibdevs.size(); ++i)
    if (st().ibdevs[i].get() == d) st().ctx_dev[ctx.get()] = static_cast<int>(i);
  st().ctxs.push_back(std::move(ctx));
  return st().ctxs.back().get();
}
int f_close_device(ibv_context* ctx) {
  FakeLock lk(fake_mu());
  rec("ibv_close_device").text.push_back({"device", ctx->device->name});
  auto w = st().async_wfd.find(ctx);
  if (w != st().async_wfd.end()) {
    ::close(w->second);
    ::close(ctx->async_fd);
    ctx->async_fd = -1;
    st().async_wfd.erase(w);
  }
  st().async_q.erase(ctx);
  return 0;
}
int f_query_device(ibv_context* ctx, ibv_device_attr* a) {
  FakeLock lk(fake_mu());
  std::memset(a, 0, sizeof(*a));
  const FakeDevice& d = dev_of(ctx);
  a->vendor_id = d.vendor_id;
  a->atomic_cap = d.atomics ? IBV_ATOMIC_HCA : IBV_ATOMIC_NONE;
  a->max_qp_wr = d.max_qp_wr;
  a->max_cqe = d.max_cqe;
  a->max_qp_rd_atom = d.max_qp_rd_atom;
  a->max_qp_init_rd_atom = d.max_qp_init_rd_atom;
  a->max_sge = 16;
  return 0;
}
int f_query_port(ibv_context* ctx, uint8_t port, ibv_port_attr* a) {
  FakeLock lk(fake_mu());
  std::memset(a, 0, sizeof(*a));
  if (port != 1) {
    errno = EINVAL;
    return -1;
  }
  const FakeDevice& d = dev_of(ctx);
  a->state = d.port_active ? IBV_PORT_ACTIVE : IBV_PORT_DOWN;
  a->active_mtu = static_cast<ibv_mtu>(d.active_mtu);
  a->max_mtu = IBV_MTU_4096;
  a->lid = d.lid;
  a->max_msg_sz = 1u << 31;
  a->link_layer = d.link_layer == "InfiniBand" ? IBV_LINK_LAYER_INFINIBAND
                  : d.link_layer == "Ethernet" ? IBV_LINK_LAYER_ETHERNET
                                               : IBV_LINK_LAYER_UNSPECIFIED;
  return 0;
}
int f_query_gid(ibv_context* ctx, uint8_t port, int index, ibv_gid* gid) {
  FakeLock lk(fake_mu());
  Record& r = rec("ibv_query_gid");
  r.args.push_back({"port", port});
  r.args.push_back({"index", static_cast<uint64_t>(index)});
  for (const auto& e : dev_of(ctx).gids)
    if (e.index == index) {
      auto raw = gid_from_string(e.gid);
      std::memcpy(gid->raw, raw.data(), 16);
      return 0;
    }
  errno = EINVAL;
  return -1;
}
ibv_pd* f_alloc_pd(ibv_context* ctx) {
  FakeLock lk(fake_mu());
  rec("ibv_alloc_pd").text.push_back({"device", ctx->device->name});
  if (failing("ibv_alloc_pd")) return nullptr;
  auto pd = std::make_unique<ibv_pd>();
  pd->context = ctx;
  st().pds.push_back(std::move(pd));
  return st().pds.back().get();
}
int f_dealloc_pd(ibv_pd*) {
  FakeLock lk(fake_mu());
  rec("ibv_dealloc_pd");
  return 0;
}
ibv_cq* f_create_cq(ibv_context* ctx, int cqe, void*, ibv_comp_channel*, int) {
  FakeLock lk(fake_mu());
  Record& r = rec("ibv_create_cq");
  r.args.push_back({"cqe", static_cast<uint64_t>(cqe)});
  r.text.push_back({"device", ctx->device->name});
  if (failing("ibv_create_cq")) return nullptr;
  if (cqe > dev_of(ctx).max_cqe) {  // providers refuse more than ibv_query_device's max_cqe
    errno = EINVAL;
    return nullptr;
  }
  auto cq = std::make_unique<ibv_cq>();
  cq->context = ctx;
  cq->cqe = cqe;
  st().cqs.push_back(std::move(cq));
  return st().cqs.back().get();
}
int f_destroy_cq(ibv_cq*) {
  FakeLock lk(fake_mu());
  rec("ibv_destroy_cq");
  return 0;
}

// ---------------------------------------------------------------- queue pairs
ibv_qp* new_qp(ibv_pd* pd, ibv_cq* scq, ibv_cq* rcq, ibv_qp_type type, bool srd) {
  auto q = std::make_unique<FakeQp>();
  q->srd = srd;
  ibv_qp* qp = &q->qpx.qp_base;
  qp->context = pd->context;
  qp->pd = pd;
  qp->send_cq = scq;
  qp->recv_cq = rcq;
  qp->qp_type = type;
  qp->qp_num = st().next_qpn++;
  qp->state = IBV_QPS_RESET;
  st().by_qpn[qp->qp_num] = qp;
  st().qps[qp] = std::move(q);
  return qp;
}

ibv_qp* f_create_qp(ibv_pd* pd, ibv_qp_init_attr* a) {
  FakeLock lk(fake_mu());
  Record& r = rec("ibv_create_qp");
  r.text.push_back({"device", pd->context->device->name});
  r.args.push_back({"qp_type", a->qp_type});
  r.args.push_back({"max_send_wr", a->cap.max_send_wr});
  r.args.push_back({"max_recv_wr", a->cap.max_recv_wr});
  r.args.push_back({"sq_sig_all", static_cast<uint64_t>(a->sq_sig_all)});
  if (failing("ibv_create_qp")) return nullptr;
  ibv_qp* qp = new_qp(pd, a->send_cq, a->recv_cq, a->qp_type, false);
  st().calls.back().args.push_back({"qp_num", qp->qp_num});
  return qp;
}

int f_modify_qp(ibv_qp* qp, ibv_qp_attr* a, int mask) {
  FakeLock lk(fake_mu());
  Record& r = rec("ibv_modify_qp");
  auto put = [&](const char* k, uint64_t v) { r.args.push_back({k, v}); };
  put("qp_num", qp->qp_num);
  put("mask", static_cast<uint64_t>(mask));
  put("qp_state", a->qp_state);
  if (mask & IBV_QP_PKEY_INDEX) put("pkey_index", a->pkey_index);
  if (mask & IBV_QP_PORT) put("port_num", a->port_num);
  if (mask & IBV_QP_ACCESS_FLAGS) put("qp_access_flags", a->qp_access_flags);
  if (mask & IBV_QP_QKEY) put("qkey", a->qkey);
  if (mask & IBV_QP_PATH_MTU) put("path_mtu", a->path_mtu);
  if (mask & IBV_QP_DEST_QPN) put("dest_qp_num", a->dest_qp_num);
  if (mask & IBV_QP_RQ_PSN) put("rq_psn", a->rq_psn);
  if (mask & IBV_QP_SQ_PSN) put("sq_psn", a->sq_psn);
  if (mask & IBV_QP_MAX_DEST_RD_ATOMIC) put("max_dest_rd_atomic", a->max_dest_rd_atomic);
  if (mask & IBV_QP_MAX_QP_RD_ATOMIC) put("max_rd_atomic", a->max_rd_atomic);
  if (mask & IBV_QP_MIN_RNR_TIMER) put("min_rnr_timer", a->min_rnr_timer);
  if (mask & IBV_QP_TIMEOUT) put("timeout", a->timeout);
  if (mask & IBV_QP_RETRY_CNT) put("retry_cnt", a->retry_cnt);
  if (mask & IBV_QP_RNR_RETRY) put("rnr_retry", a->rnr_retry);
  if (mask & IBV_QP_AV) {
    put("ah_is_global", a->ah_attr.is_global);
    put("ah_dlid", a->ah_attr.dlid);
    put("ah_sl", a->ah_attr.sl);
    put("ah_port_num", a->ah_attr.port_num);
    put("ah_sgid_index", a->ah_attr.grh.sgid_index);
    put("ah_hop_limit", a->ah_attr.grh.hop_limit);
    put("ah_traffic_class", a->ah_attr.grh.traffic_class);
    std::array<uint8_t, 16> raw;
    std::memcpy(raw.data(), a->ah_attr.grh.dgid.raw, 16);
    r.text.push_back({"ah_dgid", gid_to_string(raw)});
  }
  if (failing("ibv_modify_qp")) return -1;
  if (!(mask & IBV_QP_STATE)) return 0;
  // The legal forward path; anything else is what a real provider rejects with EINVAL.
  const ibv_qp_state from = qp->state, to = a->qp_state;
  const bool ok = (from == IBV_QPS_RESET && to == IBV_QPS_INIT) || (from == IBV_QPS_INIT && to == IBV_QPS_RTR) ||
                  (from == IBV_QPS_RTR && to == IBV_QPS_RTS) || to == IBV_QPS_ERR || to == IBV_QPS_RESET;
  const bool srd = fq(qp).srd;
  const bool rc_rtr_complete =
      to != IBV_QPS_RTR || srd ||
      (mask & (IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN)) ==
          (IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN);
  if (!ok || !rc_rtr_complete) {
    errno = EINVAL;
    return -1;
  }
  qp->state = to;
  return 0;
}

int f_destroy_qp(ibv_qp* qp) {
  FakeLock lk(fake_mu());
  rec("ibv_destroy_qp").args.push_back({"qp_num", qp->qp_num});
  return 0;
}
ibv_qp_ex* f_qp_to_qp_ex(ibv_qp* qp) {
  FakeLock lk(fake_mu());
  return &fq(qp).qpx;
}

// ---------------------------------------------------------------- memory
ibv_mr* new_mr(ibv_pd* pd, void* addr, size_t len) {
  auto mr = std::make_unique<ibv_mr>();
  mr->context = pd->context;
  mr->pd = pd;
  mr->addr = addr;
  mr->length = len;
  mr->lkey = st().next_key++;
  mr->rkey = st().next_key++;
  st().mrs.push_back(std::move(mr));
  return st().mrs.back().get();
}
ibv_mr* f_reg_mr(ibv_pd* pd, void* addr, size_t len, int access) {
  FakeLock lk(fake_mu());
  Record& r = rec("ibv_reg_mr");
  r.text.push_back({"device", pd->context->device->name});
  r.args.push_back({"addr", reinterpret_cast<uint64_t>(addr)});
  r.args.push_back({"length", len});
  r.args.push_back({"access", static_cast<uint64_t>(access)});
  if (failing("ibv_reg_mr")) return nullptr;
  ibv_mr* mr = new_mr(pd, addr, len);
  st().calls.back().args.push_back({"rkey", mr->rkey});
  return mr;
}
ibv_mr* f_reg_dmabuf_mr(ibv_pd* pd, uint64_t offset, size_t len, uint64_t iova, int fd, int access) {
  FakeLock lk(fake_mu());
  Record& r = rec("ibv_reg_dmabuf_mr");
  r.text.push_back({"device", pd->context->device->name});
  r.args.push_back({"offset", offset});
  r.args.push_back({"length", len});
  r.args.push_back({"iova", iova});
  r.args.push_back({"fd_valid", fd >= 0 ? 1u : 0u});
  r.args.push_back({"access", static_cast<uint64_t>(access)});
  if (failing("ibv_reg_dmabuf_mr")) return nullptr;
  ibv_mr* mr = new_mr(pd, reinterpret_cast<void*>(iova), len);
  st().calls.back().args.push_back({"rkey", mr->rkey});
  return mr;
}
int f_dereg_mr(ibv_mr* mr) {
  FakeLock lk(fake_mu());
  rec("ibv_dereg_mr").args.push_back({"lkey", mr->lkey});
  return 0;
}
int f_get_dmabuf_fd(void* base, size_t bytes, int* fd, uint64_t* offset) {
  FakeLock lk(fake_mu());
  Record& r = rec("get_dmabuf_fd");
  r.args.push_back({"base", reinterpret_cast<uint64_t>(base)});
  r.args.push_back({"bytes", bytes});
  if (failing("get_dmabuf_fd")) return errno;
  if (!st().dmabuf) return EOPNOTSUPP;
  *fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);  // a real descriptor: the transport closes it
  *offset = reinterpret_cast<uint64_t>(base) & 4095;
  return 0;
}

// ---------------------------------------------------------------- address handles
ibv_ah* f_create_ah(ibv_pd* pd, ibv_ah_attr* a) {
  FakeLock lk(fake_mu());
  Record& r = rec("ibv_create_ah");
  r.text.push_back({"device", pd->context->device->name});
  r.args.push_back({"is_global", a->is_global});
  r.args.push_back({"port_num", a->port_num});
  std::array<uint8_t, 16> raw;
  std::memcpy(raw.data(), a->grh.dgid.raw, 16);
  r.text.push_back({"dgid", gid_to_string(raw)});
  if (failing("ibv_create_ah")) return nullptr;
  auto ah = std::make_unique<ibv_ah>();
  ah->context = pd->context;
  ah->pd = pd;
  uint16_t n = st().next_ahn++;
  st().ahn[ah.get()] = n;
  st().calls.back().args.push_back({"ahn", n});
  st().ahs.push_back(std::move(ah));
  return st().ahs.back().get();
}
int f_destroy_ah(ibv_ah*) {
  FakeLock lk(fake_mu());
  rec("ibv_destroy_ah");
  return 0;
}
int f_efadv_query_ah(ibv_ah* ah, efadv_ah_attr* attr, uint32_t) {
  FakeLock lk(fake_mu());
#ifdef UCCL_EP_WITH_EFADV
  std::memset(attr, 0, sizeof(*attr));
  attr->ahn = st().ahn.at(ah);
  return 0;
#else
  (void)ah;
  (void)attr;
  return EOPNOTSUPP;
#endif
}

// ---------------------------------------------------------------- data path (RC)
// block_next_post_send: the next ibv_post_send sleeps this long first, outside the fake's lock, as a driver call
// that does not return would (the proxy monitor's test).
std::atomic<double>& post_send_stall() {
  static std::atomic<double> secs{0.0};
  return secs;
}

int f_post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) {
  if (const double stall = post_send_stall().exchange(0.0); stall > 0)
    std::this_thread::sleep_for(std::chrono::duration<double>(stall));
  FakeLock lk(fake_mu());
  Record& r = rec("ibv_post_send");
  r.args.push_back({"qp_num", qp->qp_num});
  for (ibv_send_wr* w = wr; w; w = w->next) {
    std::vector<std::pair<std::string, uint64_t>> e;
    e.push_back({"wr_id", w->wr_id});
    e.push_back({"opcode", w->opcode});
    e.push_back({"signaled", (w->send_flags & IBV_SEND_SIGNALED) ? 1u : 0u});
    e.push_back({"send_flags", w->send_flags});
    e.push_back({"num_sge", static_cast<uint64_t>(w->num_sge)});
    if (w->num_sge > 0) {
      e.push_back({"sge_addr", w->sg_list[0].addr});
      e.push_back({"sge_length", w->sg_list[0].length});
      e.push_back({"sge_lkey", w->sg_list[0].lkey});
    }
    if (w->opcode == IBV_WR_ATOMIC_FETCH_AND_ADD || w->opcode == IBV_WR_ATOMIC_CMP_AND_SWP) {
      e.push_back({"remote_addr", w->wr.atomic.remote_addr});
      e.push_back({"rkey", w->wr.atomic.rkey});
      e.push_back({"compare_add", w->wr.atomic.compare_add});
    } else {
      e.push_back({"remote_addr", w->wr.rdma.remote_addr});
      e.push_back({"rkey", w->wr.rdma.rkey});
    }
    if (w->opcode == IBV_WR_RDMA_WRITE_WITH_IMM) e.push_back({"imm_data_raw", w->imm_data});
    e.push_back({"has_next", w->next ? 1u : 0u});
    r.wrs.push_back(std::move(e));
  }
  if (failing("ibv_post_send") || qp->state != IBV_QPS_RTS) {
    if (qp->state != IBV_QPS_RTS) errno = EINVAL;
    if (bad) *bad = wr;
    return errno;
  }
  for (ibv_send_wr* w = wr; w; w = w->next)
    if (w->send_flags & IBV_SEND_SIGNALED)
      complete(qp, w->wr_id,
               w->opcode == IBV_WR_ATOMIC_FETCH_AND_ADD ? IBV_WC_FETCH_ADD : IBV_WC_RDMA_WRITE);
  return 0;
}

int f_post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) {
  FakeLock lk(fake_mu());
  Record& r = rec("ibv_post_recv");
  r.args.push_back({"qp_num", qp->qp_num});
  uint64_t n = 0, sges = 0;
  for (ibv_recv_wr* w = wr; w; w = w->next) {
    ++n;
    sges += static_cast<uint64_t>(w->num_sge);
  }
  r.args.push_back({"count", n});
  r.args.push_back({"total_sge", sges});
  if (wr && wr->num_sge > 0) {
    r.args.push_back({"sge_lkey", wr->sg_list[0].lkey});
    r.args.push_back({"sge_length", wr->sg_list[0].length});
  }
  if (failing("ibv_post_recv") || qp->state == IBV_QPS_RESET) {
    if (qp->state == IBV_QPS_RESET) errno = EINVAL;
    if (bad) *bad = wr;
    return errno;
  }
  for (ibv_recv_wr* w = wr; w; w = w->next) {
    // libefa (efa_post_recv) writes RX descriptors per SGE: a zero-SGE receive is accepted but the device never
    // sees it, so on SRD it never takes a write-with-immediate.
    if (fq(qp).srd && w->num_sge == 0) continue;
    fq(qp).recvs.push_back(w->wr_id);
  }
  return 0;
}

int f_poll_cq(ibv_cq* cq, int n, ibv_wc* wc) {
  FakeLock lk(fake_mu());
  auto& q = st().cq_queue[cq];
  int k = 0;
  while (k < n && !q.empty()) {
    wc[k++] = q.front();
    q.pop_front();
  }
  return k;
}

const char* f_wc_status_str(ibv_wc_status s) {
  FakeLock lk(fake_mu());
  try {
    return system_ibv_api().wc_status_str(s);
  } catch (const std::exception&) {
  }
  switch (s) {
    case IBV_WC_SUCCESS: return "success";
    case IBV_WC_RETRY_EXC_ERR: return "transport retry counter exceeded";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error";
    case IBV_WC_WR_FLUSH_ERR: return "Work Request Flushed Error";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    default: return "unknown";
  }
}

// ---------------------------------------------------------------- asynchronous events
int f_get_async_event(ibv_context* ctx, ibv_async_event* ev) {
  FakeLock lk(fake_mu());
  State& s = st();
  auto& q = s.async_q[ctx];
  if (q.empty()) {
    // A real ibv_get_async_event blocks here unless the fd is O_NONBLOCK; the fake refuses to hang the test and
    // counts it instead.
    const int fl = ::fcntl(ctx->async_fd, F_GETFL);
    if (fl < 0 || !(fl & O_NONBLOCK)) ++s.async.blocking_reads;
    errno = EAGAIN;
    return -1;
  }
  char byte;
  (void)!::read(ctx->async_fd, &byte, 1);
  *ev = q.front();
  q.pop_front();
  ++s.async.delivered;
  Record& r = rec("ibv_get_async_event");
  r.text.push_back({"device", ctx->device->name});
  r.args.push_back({"event_type", static_cast<uint64_t>(ev->event_type)});
  return 0;
}
void f_ack_async_event(ibv_async_event* ev) {
  FakeLock lk(fake_mu());
  State& s = st();
  if (s.async.acked >= s.async.delivered)
    ++s.async.bad_acks;
  else
    ++s.async.acked;
  rec("ibv_ack_async_event").args.push_back({"event_type", static_cast<uint64_t>(ev->event_type)});
}
const char* f_event_type_str(ibv_event_type t) {
  FakeLock lk(fake_mu());
  try {
    if (auto fn = system_ibv_api().event_type_str) return fn(t);
  } catch (const std::exception&) {
  }
  switch (t) {  // libibverbs' own texts
    case IBV_EVENT_QP_FATAL: return "local work queue catastrophic error";
    case IBV_EVENT_QP_REQ_ERR: return "invalid request local work queue error";
    case IBV_EVENT_QP_ACCESS_ERR: return "local access violation work queue error";
    case IBV_EVENT_CQ_ERR: return "CQ error";
    case IBV_EVENT_DEVICE_FATAL: return "local catastrophic error";
    case IBV_EVENT_PORT_ACTIVE: return "port active";
    case IBV_EVENT_PORT_ERR: return "port error";
    case IBV_EVENT_LID_CHANGE: return "LID change";
    case IBV_EVENT_GID_CHANGE: return "GID table change";
    default: return "unknown";
  }
}

// ---------------------------------------------------------------- data path (EFA SRD, extended QP)
std::vector<std::pair<std::string, uint64_t>>& last_wr(ibv_qp_ex* qpx) {
  FakeQp& q = fq(qpx);
  if (q.chain.wrs.empty()) q.chain_err = EINVAL;  // setter before an opcode: a provider bug we want to catch
  if (q.chain.wrs.empty()) q.chain.wrs.emplace_back();
  return q.chain.wrs.back();
}
void x_start(ibv_qp_ex* qpx) {
  FakeLock lk(fake_mu());
  FakeQp& q = fq(qpx);
  rec("ibv_wr_start").args.push_back({"qp_num", qpx->qp_base.qp_num});
  q.chain = Record{"ibv_wr_complete", {{"qp_num", qpx->qp_base.qp_num}}, {}, {}};
  q.in_chain = true;
  q.chain_err = 0;
}
void x_write_common(ibv_qp_ex* qpx, uint32_t op, uint32_t rkey, uint64_t raddr) {
  FakeLock lk(fake_mu());
  FakeQp& q = fq(qpx);
  if (!q.in_chain) q.chain_err = EINVAL;
  q.chain.wrs.push_back({{"wr_id", qpx->wr_id},
                         {"opcode", op},
                         {"signaled", (qpx->wr_flags & IBV_SEND_SIGNALED) ? 1u : 0u},
                         {"rkey", rkey},
                         {"remote_addr", raddr}});
}
void x_rdma_write(ibv_qp_ex* qpx, uint32_t rkey, uint64_t raddr) { x_write_common(qpx, IBV_WR_RDMA_WRITE, rkey, raddr); }
void x_rdma_write_imm(ibv_qp_ex* qpx, uint32_t rkey, uint64_t raddr, __be32 imm) {
  FakeLock lk(fake_mu());
  x_write_common(qpx, IBV_WR_RDMA_WRITE_WITH_IMM, rkey, raddr);
  fq(qpx).chain.wrs.back().push_back({"imm_data_raw", imm});
}
void x_set_ud_addr(ibv_qp_ex* qpx, ibv_ah* ah, uint32_t rqpn, uint32_t qkey) {
  FakeLock lk(fake_mu());
  auto& w = last_wr(qpx);
  w.push_back({"ahn", st().ahn.at(ah)});
  w.push_back({"remote_qpn", rqpn});
  w.push_back({"remote_qkey", qkey});
}
void x_set_sge(ibv_qp_ex* qpx, uint32_t lkey, uint64_t addr, uint32_t len) {
  FakeLock lk(fake_mu());
  auto& w = last_wr(qpx);
  w.push_back({"num_sge", 1});
  w.push_back({"sge_lkey", lkey});
  w.push_back({"sge_addr", addr});
  w.push_back({"sge_length", len});
}
void x_set_sge_list(ibv_qp_ex* qpx, size_t n, const ibv_sge* sg) {
  FakeLock lk(fake_mu());
  auto& w = last_wr(qpx);
  w.push_back({"num_sge", n});
  if (n > 0) {
    w.push_back({"sge_lkey", sg[0].lkey});
    w.push_back({"sge_addr", sg[0].addr});
    w.push_back({"sge_length", sg[0].length});
  }
}
int x_complete(ibv_qp_ex* qpx) {
  FakeLock lk(fake_mu());
  FakeQp& q = fq(qpx);
  q.in_chain = false;
  st().calls.push_back(q.chain);
  if (failing("ibv_wr_complete")) return errno;
  if (q.chain_err) return q.chain_err;
  if (qpx->qp_base.state != IBV_QPS_RTS) return EINVAL;
  for (const auto& w : q.chain.wrs) {
    uint64_t id = 0, sig = 0;
    for (const auto& kv : w) {
      if (kv.first == "wr_id") id = kv.second;
      if (kv.first == "signaled") sig = kv.second;
    }
    if (sig) complete(&qpx->qp_base, id, IBV_WC_RDMA_WRITE);
  }
  return 0;
}
void x_abort(ibv_qp_ex* qpx) {
  FakeLock lk(fake_mu());
  fq(qpx).in_chain = false;
  rec("ibv_wr_abort");
}

int f_efadv_query_device(ibv_context* ctx, efadv_device_attr* attr, uint32_t inlen) {
  FakeLock lk(fake_mu());
  Record& r = rec("efadv_query_device");
  r.text.push_back({"device", ctx->device->name});
  r.args.push_back({"inlen", inlen});
  if (failing("efadv_query_device")) return errno;
  const FakeDevice& d = dev_of(ctx);
  if (d.vendor_id != 0x1d0f) return EOPNOTSUPP;  // "Not an EFA device"
  if (inlen < 32) return EINVAL;                  // rdma-core >= 46 wants up to max_rdma_size
  auto* raw = reinterpret_cast<uint8_t*>(attr);
  std::memset(raw, 0, inlen);
  const uint32_t wr = static_cast<uint32_t>(d.max_qp_wr);
  std::memcpy(raw + 8, &wr, 4);    // max_sq_wr
  std::memcpy(raw + 12, &wr, 4);   // max_rq_wr
  std::memcpy(raw + 24, &d.efa_device_caps, 4);
  std::memcpy(raw + 28, &d.efa_max_rdma_size, 4);
  return 0;
}

ibv_qp* f_efadv_create_qp_ex(ibv_context* ctx, ibv_qp_init_attr_ex* a, efadv_qp_init_attr* efa, uint32_t inlen) {
  FakeLock lk(fake_mu());
  Record& r = rec("efadv_create_qp_ex");
  r.text.push_back({"device", ctx->device->name});
  r.args.push_back({"qp_type", a->qp_type});
  r.args.push_back({"comp_mask", a->comp_mask});
  r.args.push_back({"send_ops_flags", a->send_ops_flags});
  r.args.push_back({"max_send_wr", a->cap.max_send_wr});
  r.args.push_back({"max_recv_wr", a->cap.max_recv_wr});
  r.args.push_back({"inlen", inlen});
  const auto* raw = reinterpret_cast<const uint8_t*>(efa);
  uint32_t driver_type;
  std::memcpy(&driver_type, raw + 8, 4);
  r.args.push_back({"driver_qp_type", driver_type});
  r.args.push_back({"sl", raw[14]});
  if (failing("efadv_create_qp_ex")) return nullptr;
  // libefa only offers RDMA write send ops on devices with the RDMA write capability.
  const uint64_t write_ops = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM;
  if ((a->send_ops_flags & write_ops) && !(dev_of(ctx).efa_device_caps & 8)) {
    errno = EOPNOTSUPP;
    return nullptr;
  }
  ibv_pd* pd = a->pd;
  ibv_qp* qp = new_qp(pd, a->send_cq, a->recv_cq, a->qp_type, true);
  st().calls.back().args.push_back({"qp_num", qp->qp_num});
  ibv_qp_ex& x = fq(qp).qpx;
  x.wr_start = x_start;
  x.wr_rdma_write = x_rdma_write;
  x.wr_rdma_write_imm = x_rdma_write_imm;
  x.wr_set_ud_addr = x_set_ud_addr;
  x.wr_set_sge = x_set_sge;
  x.wr_set_sge_list = x_set_sge_list;
  x.wr_complete = x_complete;
  x.wr_abort = x_abort;
  return qp;
}

GidTable f_gid_table(const char* device, int port) {
  FakeLock lk(fake_mu());
  for (const auto& d : st().devs)
    if (d.name == device) {
      GidTable t;
      t.device = d.name;
      t.port = port;
      t.link_layer = d.link_layer;
      for (const auto& e : d.gids) {
        GidEntry g;
        g.index = e.index;
        g.raw = gid_from_string(e.gid);
        g.type = gid_type_from_sysfs(e.type, d.link_layer);
        g.netdev = e.netdev;
        t.entries.push_back(g);
      }
      return t;
    }
  throw std::runtime_error(std::string("fake verbs: no device ") + device);
}

}  // namespace

void install(const std::vector<FakeDevice>& devices, bool dmabuf) {
  FakeLock lk(fake_mu());
  uninstall();
  g = new State();
  State& s = *g;
  s.devs = devices;
  s.dmabuf = dmabuf;
  for (const auto& d : devices) {
    auto dev = std::make_unique<ibv_device>();
    std::snprintf(dev->name, sizeof(dev->name), "%s", d.name.c_str());
    s.list.push_back(dev.get());
    s.ibdevs.push_back(std::move(dev));
  }
  s.list.push_back(nullptr);
  IbvApi& a = s.api;
  a.name = "fake";
  a.get_device_list = f_get_device_list;
  a.free_device_list = f_free_device_list;
  a.get_device_name = f_get_device_name;
  a.open_device = f_open_device;
  a.close_device = f_close_device;
  a.query_device = f_query_device;
  a.query_port = f_query_port;
  a.query_gid = f_query_gid;
  a.alloc_pd = f_alloc_pd;
  a.dealloc_pd = f_dealloc_pd;
  a.create_cq = f_create_cq;
  a.destroy_cq = f_destroy_cq;
  a.create_qp = f_create_qp;
  a.modify_qp = f_modify_qp;
  a.destroy_qp = f_destroy_qp;
  a.qp_to_qp_ex = f_qp_to_qp_ex;
  a.reg_mr = f_reg_mr;
  a.reg_dmabuf_mr = f_reg_dmabuf_mr;
  a.dereg_mr = f_dereg_mr;
  a.create_ah = f_create_ah;
  a.destroy_ah = f_destroy_ah;
  a.post_send = f_post_send;
  a.post_recv = f_post_recv;
  a.poll_cq = f_poll_cq;
  a.wc_status_str = f_wc_status_str;
  a.get_async_event = f_get_async_event;
  a.ack_async_event = f_ack_async_event;
  a.event_type_str = f_event_type_str;
  a.efadv_create_qp_ex = f_efadv_create_qp_ex;
  a.efadv_query_ah = f_efadv_query_ah;
  a.efadv_query_device = f_efadv_query_device;
  a.gid_table = f_gid_table;
  a.get_dmabuf_fd = f_get_dmabuf_fd;
  set_ibv_api_override(&s.api);
}

void uninstall() {
  FakeLock lk(fake_mu());
  set_ibv_api_override(nullptr);
  if (g != nullptr) g_retired.push_back(g);
  g = nullptr;
}

std::vector<Record> calls() {
  FakeLock lk(fake_mu());
  return st().calls;
}
void clear_calls() {
  FakeLock lk(fake_mu());
  st().calls.clear();
}
void fail_next(const std::string& fn, int err) {
  FakeLock lk(fake_mu());
  st().fail[fn] = err;
}
void fail_next_completion(int status, uint32_t vendor_err) {
  FakeLock lk(fake_mu());
  st().fail_completion = true;
  st().fail_status = status;
  st().fail_vendor = vendor_err;
}
void block_next_post_send(double seconds) { post_send_stall().store(seconds); }
void set_auto_complete(bool on) {
  FakeLock lk(fake_mu());
  st().auto_complete = on;
}

void inject_recv(uint32_t qp_num, uint32_t src_qp, uint16_t slid, uint32_t imm, int status) {
  FakeLock lk(fake_mu());
  State& s = st();
  auto it = s.by_qpn.find(qp_num);
  if (it == s.by_qpn.end()) throw std::invalid_argument("fake verbs: no QP " + std::to_string(qp_num));
  FakeQp& q = fq(it->second);
  if (q.recvs.empty())
    throw std::runtime_error("fake verbs: QP " + std::to_string(qp_num) +
                             " has no receive posted (a real NIC would answer RNR)");
  ibv_wc wc{};
  wc.wr_id = q.recvs.front();
  q.recvs.pop_front();
  wc.status = static_cast<ibv_wc_status>(status);
  wc.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
  wc.wc_flags = IBV_WC_WITH_IMM;
  wc.imm_data = htonl(imm);
  wc.qp_num = qp_num;
  wc.src_qp = src_qp;
  wc.slid = slid;
  push_cqe(it->second->recv_cq, wc);
}

size_t posted_recvs(uint32_t qp_num) {
  FakeLock lk(fake_mu());
  auto it = st().by_qpn.find(qp_num);
  if (it == st().by_qpn.end()) throw std::invalid_argument("fake verbs: no QP " + std::to_string(qp_num));
  return fq(it->second).recvs.size();
}

int inject_async_event(int type, uint32_t qp_num, const std::string& device, int port) {
  FakeLock lk(fake_mu());
  State& s = st();
  const auto t = static_cast<ibv_event_type>(type);
  auto qp_of = [&]() -> ibv_qp* {
    auto it = s.by_qpn.find(qp_num);
    if (it == s.by_qpn.end())
      throw std::invalid_argument("fake verbs: event " + std::to_string(type) + " names no QP " +
                                  std::to_string(qp_num));
    return it->second;
  };
  auto queue = [&](ibv_context* ctx, const ibv_async_event& ev) {
    auto w = s.async_wfd.find(ctx);
    if (w == s.async_wfd.end()) throw std::invalid_argument("fake verbs: event on a closed context");
    s.async_q[ctx].push_back(ev);
    const char byte = 1;
    if (::write(w->second, &byte, 1) != 1) throw std::runtime_error("fake verbs: async pipe write failed");
    ++s.async.injected;
  };
  ibv_async_event ev{};
  ev.event_type = t;
  switch (async_subject(t)) {
    case AsyncSubject::kQp: {
      ibv_qp* qp = qp_of();
      ev.element.qp = qp;
      queue(qp->context, ev);
      return 1;
    }
    case AsyncSubject::kCq: {
      ibv_qp* qp = qp_of();
      ev.element.cq = qp->send_cq;
      queue(qp->context, ev);
      return 1;
    }
    case AsyncSubject::kSrq:
    case AsyncSubject::kWq:
      throw std::invalid_argument("fake verbs: SRQ/WQ events are not simulated (the transport creates neither)");
    default: {
      ev.element.port_num = port;
      int n = 0;
      for (auto& kv : s.async_wfd)
        if (device == kv.first->device->name) {
          queue(kv.first, ev);
          ++n;
        }
      if (n == 0) throw std::invalid_argument("fake verbs: no open context of device '" + device + "'");
      return n;
    }
  }
}

AsyncCounts async_counts() {
  FakeLock lk(fake_mu());
  return st().async;
}

std::vector<int> async_fds(const std::string& device) {
  FakeLock lk(fake_mu());
  std::vector<int> out;
  for (auto& kv : st().async_wfd)
    if (device == kv.first->device->name) out.push_back(kv.first->async_fd);
  return out;
}

}  // namespace uccl_ep::fake_verbs
#endif  // UCCL_EP_WITH_VERBS
