// Every libibverbs / libefa entry point the verbs transport uses, as one table of function pointers.
//
// Why a table: (1) the module must import on hosts without rdma-core, so the libraries are dlopen'ed at run time
// (only headers are needed to build); (2) tests swap in a recording fake (verbs_fake.cpp) and check the exact
// calls: work-request chains, QP attributes, registration arguments, without an RDMA NIC.
//
// Calls that verbs.h implements inline through provider ops (ibv_post_send, ibv_post_recv, ibv_poll_cq) are table
// entries too. The extended-QP calls used for EFA SRD (ibv_wr_start, ibv_wr_rdma_write_imm, ...) are not: they go
// through function pointers inside struct ibv_qp_ex, which the fake fills with its own recorders.
//
// Only the table lives here (with the recording fake that replaces it in tests); the transport built on it, its
// configuration and factory are in verbs.hpp.
#pragma once

#ifdef UCCL_EP_WITH_VERBS

#include <infiniband/verbs.h>
#ifdef UCCL_EP_WITH_EFADV
#include <infiniband/efadv.h>
#endif

#include <cstdint>
#include <string>
#include <vector>

#include "transport/gid.hpp"

#ifndef UCCL_EP_WITH_EFADV
struct efadv_qp_init_attr;
struct efadv_ah_attr;
struct efadv_device_attr;
#endif

namespace uccl_ep {

struct IbvApi {
  const char* name = "";  // "libibverbs" or "fake"
  ibv_device** (*get_device_list)(int* num) = nullptr;
  void (*free_device_list)(ibv_device** list) = nullptr;
  const char* (*get_device_name)(ibv_device* dev) = nullptr;
  ibv_context* (*open_device)(ibv_device* dev) = nullptr;
  int (*close_device)(ibv_context* ctx) = nullptr;
  int (*query_device)(ibv_context* ctx, ibv_device_attr* attr) = nullptr;
  int (*query_port)(ibv_context* ctx, uint8_t port, ibv_port_attr* attr) = nullptr;
  int (*query_gid)(ibv_context* ctx, uint8_t port, int index, ibv_gid* gid) = nullptr;
  ibv_pd* (*alloc_pd)(ibv_context* ctx) = nullptr;
  int (*dealloc_pd)(ibv_pd* pd) = nullptr;
  ibv_cq* (*create_cq)(ibv_context* ctx, int cqe, void* cq_context, ibv_comp_channel* ch, int vector) = nullptr;
  int (*destroy_cq)(ibv_cq* cq) = nullptr;
  ibv_qp* (*create_qp)(ibv_pd* pd, ibv_qp_init_attr* attr) = nullptr;
  int (*modify_qp)(ibv_qp* qp, ibv_qp_attr* attr, int mask) = nullptr;
  int (*destroy_qp)(ibv_qp* qp) = nullptr;
  ibv_qp_ex* (*qp_to_qp_ex)(ibv_qp* qp) = nullptr;
  ibv_mr* (*reg_mr)(ibv_pd* pd, void* addr, size_t len, int access) = nullptr;
  // nullptr when libibverbs predates dmabuf (rdma-core < 34)
  ibv_mr* (*reg_dmabuf_mr)(ibv_pd* pd, uint64_t offset, size_t len, uint64_t iova, int fd, int access) = nullptr;
  int (*dereg_mr)(ibv_mr* mr) = nullptr;
  ibv_ah* (*create_ah)(ibv_pd* pd, ibv_ah_attr* attr) = nullptr;
  int (*destroy_ah)(ibv_ah* ah) = nullptr;
  int (*post_send)(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) = nullptr;
  int (*post_recv)(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) = nullptr;
  int (*poll_cq)(ibv_cq* cq, int n, ibv_wc* wc) = nullptr;
  const char* (*wc_status_str)(ibv_wc_status status) = nullptr;
  // Asynchronous events of a context (port down, QP/CQ/device errors). The transport sets ctx->async_fd
  // O_NONBLOCK, so get_async_event returns -1 (errno EAGAIN) when none is pending; every event it returns must be
  // acknowledged (ibv_destroy_qp / ibv_destroy_cq / ibv_close_device wait for the acks of their events).
  int (*get_async_event)(ibv_context* ctx, ibv_async_event* event) = nullptr;
  void (*ack_async_event)(ibv_async_event* event) = nullptr;
  const char* (*event_type_str)(ibv_event_type type) = nullptr;  // optional: nullptr -> the transport's own names
  // libefa; nullptr when libefa.so.1 is absent or the build had no efadv.h
  ibv_qp* (*efadv_create_qp_ex)(ibv_context* ctx, ibv_qp_init_attr_ex* attr, efadv_qp_init_attr* efa,
                                uint32_t inlen) = nullptr;
  int (*efadv_query_ah)(ibv_ah* ah, efadv_ah_attr* attr, uint32_t inlen) = nullptr;
  // RDMA write support and its size limit are only reported here (ibv_query_device knows neither).
  int (*efadv_query_device)(ibv_context* ctx, efadv_device_attr* attr, uint32_t inlen) = nullptr;
  // Not verbs: the GID table of a port (sysfs on real hosts, recorded tables in the fake) and the dmabuf export
  // of a device allocation (cuMemGetHandleForAddressRange through libcuda when present). Returns 0 or an errno and
  // fills *fd / *offset (the allocation's offset inside the exported range).
  GidTable (*gid_table)(const char* device, int port) = nullptr;
  int (*get_dmabuf_fd)(void* base, size_t bytes, int* fd, uint64_t* offset) = nullptr;
};

// Which member of ibv_async_event::element an event names (ibv_get_async_event(3)): the transport and its fake read
// and fill that union the same way.
enum class AsyncSubject { kQp, kCq, kSrq, kWq, kPort, kDevice };
inline AsyncSubject async_subject(ibv_event_type t) {
  switch (t) {
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_COMM_EST:
    case IBV_EVENT_SQ_DRAINED:
    case IBV_EVENT_PATH_MIG:
    case IBV_EVENT_PATH_MIG_ERR:
    case IBV_EVENT_QP_LAST_WQE_REACHED:
      return AsyncSubject::kQp;
    case IBV_EVENT_CQ_ERR:
      return AsyncSubject::kCq;
    case IBV_EVENT_SRQ_ERR:
    case IBV_EVENT_SRQ_LIMIT_REACHED:
      return AsyncSubject::kSrq;
    case IBV_EVENT_WQ_FATAL:
      return AsyncSubject::kWq;
    case IBV_EVENT_PORT_ACTIVE:
    case IBV_EVENT_PORT_ERR:
    case IBV_EVENT_LID_CHANGE:
    case IBV_EVENT_PKEY_CHANGE:
    case IBV_EVENT_SM_CHANGE:
    case IBV_EVENT_CLIENT_REREGISTER:
    case IBV_EVENT_GID_CHANGE:
      return AsyncSubject::kPort;
    default:
      return AsyncSubject::kDevice;  // IBV_EVENT_DEVICE_FATAL
  }
}

// The table calls go through: the system one (loaded on first use; throws std::runtime_error naming the package to
// install when libibverbs.so.1 is missing) unless a test installed an override.
const IbvApi& ibv_api();
const IbvApi& system_ibv_api();
void set_ibv_api_override(const IbvApi* api);  // nullptr restores the system table
bool libefa_available();                      // libefa.so.1 loaded (only meaningful after system_ibv_api())

// ------------------------------------------------------------------ the recording fake (tests only; verbs_fake.cpp)
// install() makes ibv_api() return a table that simulates the given devices, records every call with its
// arguments, completes signalled work requests (or fails them on request) and lets tests inject receive
// completions. Transports capture the table when constructed.
namespace fake_verbs {
struct FakeGid {
  int index = 0;
  std::string gid;      // sysfs form
  std::string type;     // "RoCE v2", "IB/RoCE v1"
  std::string netdev;
};
struct FakeDevice {
  std::string name;
  std::string link_layer = "Ethernet";  // "InfiniBand", "Ethernet", "Unknown" (EFA)
  uint32_t vendor_id = 0x02c9;          // Mellanox; 0x1d0f = Amazon (EFA), 0x14e4 = Broadcom
  bool atomics = true;
  uint16_t lid = 0;
  int active_mtu = 5;                   // IBV_MTU_4096
  bool port_active = true;
  int max_qp_wr = 32768;
  // Responder (max_dest_rd_atomic) and initiator (max_rd_atomic) depths. They differ on real NICs (Broadcom); the
  // fake keeps them apart so a transport that mixes them up is caught.
  int max_qp_rd_atom = 16;
  int max_qp_init_rd_atom = 8;
  int max_cqe = 1 << 22;
  // EFA only (efadv_query_device): device_caps bits as in efadv.h (RDMA_READ 1, RNR_RETRY 2, RDMA_WRITE 8) and the
  // largest RDMA transfer.
  uint32_t efa_device_caps = 1 | 2 | 8;
  uint32_t efa_max_rdma_size = 1u << 20;
  std::vector<FakeGid> gids;
};
struct Record {
  std::string fn;
  std::vector<std::pair<std::string, uint64_t>> args;
  std::vector<std::pair<std::string, std::string>> text;
  std::vector<std::vector<std::pair<std::string, uint64_t>>> wrs;  // post_send / wr_complete chains, in link order
};
void install(const std::vector<FakeDevice>& devices, bool dmabuf);
void uninstall();
std::vector<Record> calls();
void clear_calls();
void fail_next(const std::string& fn, int err);              // the next call of `fn` fails with errno `err`
void fail_next_completion(int status, uint32_t vendor_err);  // the next signalled send completes with `status`
void set_auto_complete(bool on);                             // off: signalled sends never complete
void block_next_post_send(double seconds);                   // the next ibv_post_send returns only after this long
// A peer's write-with-immediate landing on local QP `qp_num` (consumes one posted receive). Throws if none posted.
void inject_recv(uint32_t qp_num, uint32_t src_qp, uint16_t slid, uint32_t imm, int status);
size_t posted_recvs(uint32_t qp_num);
// Asynchronous events. Every fake context's async_fd is the read end of a pipe the fake owns (one byte per pending
// event), so poll()/fcntl work on it as on a real uverbs fd. inject_async_event queues `type` (an ibv_event_type):
// QP events (QP_FATAL, QP_REQ_ERR, QP_ACCESS_ERR, COMM_EST, SQ_DRAINED, PATH_MIG*, QP_LAST_WQE_REACHED) on the
// context owning QP `qp_num`; CQ_ERR on the CQ of QP `qp_num`; every other (port/device) event on every open context
// of `device`, with element.port_num = `port`. Returns how many contexts got it.
int inject_async_event(int type, uint32_t qp_num, const std::string& device, int port);
struct AsyncCounts {
  uint64_t injected = 0, delivered = 0, acked = 0;
  uint64_t bad_acks = 0;          // acks of events never delivered (or acked twice)
  uint64_t blocking_reads = 0;    // get_async_event on an empty fd that was left blocking (a real one would hang)
};
AsyncCounts async_counts();
std::vector<int> async_fds(const std::string& device);  // the async_fd of every open context of `device`
}  // namespace fake_verbs

}  // namespace uccl_ep

#endif  // UCCL_EP_WITH_VERBS
