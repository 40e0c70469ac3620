// The system IbvApi: libibverbs.so.1 and libefa.so.1 opened at run time, so the module imports (and the loopback
// transport works) on hosts without rdma-core.
#ifdef UCCL_EP_WITH_VERBS
#include <dirent.h>
#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "transport/ibv_api.hpp"

namespace uccl_ep {
namespace {

IbvApi g_system;
bool g_loaded = false;
bool g_efa = false;
std::string g_load_error;
std::atomic<const IbvApi*> g_override{nullptr};

int (*g_compat_query_port)(ibv_context*, uint8_t, _compat_ibv_port_attr*) = nullptr;

int sys_query_port(ibv_context* ctx, uint8_t port, ibv_port_attr* attr) {
  // verbs.h's inline ibv_query_port: the provider's extended op when present, else the exported compat symbol.
  if (verbs_context* vctx = verbs_get_ctx_op(ctx, query_port)) return vctx->query_port(ctx, port, attr, sizeof(*attr));
  std::memset(attr, 0, sizeof(*attr));
  return g_compat_query_port(ctx, port, reinterpret_cast<_compat_ibv_port_attr*>(attr));
}
int sys_post_send(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) { return ibv_post_send(qp, wr, bad); }
int sys_post_recv(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) { return ibv_post_recv(qp, wr, bad); }
int sys_poll_cq(ibv_cq* cq, int n, ibv_wc* wc) { return ibv_poll_cq(cq, n, wc); }

GidTable sys_gid_table(const char* device, int port) { return read_gid_table("/sys", device, port); }

// CUDA: cuMemGetHandleForAddressRange(..., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1, 0) through libcuda, looked up
// at run time so hosts without a GPU driver still load the module. HIP/ROCm exports dmabufs through
// hsa_amd_portable_export_dmabuf; not wired yet (peer-memory registration is used there).
int sys_get_dmabuf_fd(void* base, size_t bytes, int* fd, uint64_t* offset) {
  using GetHandle = int (*)(void*, unsigned long long, size_t, int, unsigned long long);
  static GetHandle fn = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    return lib ? reinterpret_cast<GetHandle>(dlsym(lib, "cuMemGetHandleForAddressRange")) : nullptr;
  }();
  if (fn == nullptr) return ENOSYS;
  // The range must be aligned to the *host* page size (CUDA driver API docs): 64 KiB on many aarch64 kernels
  // (GH200/GB200), where a 4 KiB-aligned range fails with CUDA_ERROR_INVALID_VALUE.
  static const uint64_t page = [] {
    long p = sysconf(_SC_PAGESIZE);
    return p > 0 ? static_cast<uint64_t>(p) : uint64_t(4096);
  }();
  const uint64_t addr = reinterpret_cast<uint64_t>(base);
  const uint64_t start = addr & ~(page - 1);
  const uint64_t end = (addr + bytes + page - 1) & ~(page - 1);
  int handle = -1;
  int rc = fn(&handle, start, end - start, 1, 0);
  if (rc != 0) return rc == 801 /* CUDA_ERROR_NOT_SUPPORTED */ ? EOPNOTSUPP : EINVAL;
  *fd = handle;
  *offset = addr - start;
  return 0;
}

template <typename F>
void sym(void* lib, const char* name, F* out, bool required) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  if (*out == nullptr && required) throw std::runtime_error(std::string("libibverbs.so.1 lacks ") + name);
}

void load() {
  void* lib = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (lib == nullptr)
    throw std::runtime_error(std::string("cannot load libibverbs.so.1 (") + dlerror() +
                             "): install rdma-core's user-space verbs library (Debian/Ubuntu: apt install libibverbs1 "
                             "ibverbs-providers; RHEL: dnf install rdma-core libibverbs; AWS: the EFA installer), or "
                             "set UCCL_EP_TRANSPORT=loopback");
  IbvApi a;
  a.name = "libibverbs";
  sym(lib, "ibv_get_device_list", &a.get_device_list, true);
  sym(lib, "ibv_free_device_list", &a.free_device_list, true);
  sym(lib, "ibv_get_device_name", &a.get_device_name, true);
  sym(lib, "ibv_open_device", &a.open_device, true);
  sym(lib, "ibv_close_device", &a.close_device, true);
  sym(lib, "ibv_query_device", &a.query_device, true);
  sym(lib, "ibv_query_port", &g_compat_query_port, true);
  a.query_port = sys_query_port;
  sym(lib, "ibv_query_gid", &a.query_gid, true);
  sym(lib, "ibv_alloc_pd", &a.alloc_pd, true);
  sym(lib, "ibv_dealloc_pd", &a.dealloc_pd, true);
  sym(lib, "ibv_create_cq", &a.create_cq, true);
  sym(lib, "ibv_destroy_cq", &a.destroy_cq, true);
  sym(lib, "ibv_create_qp", &a.create_qp, true);
  sym(lib, "ibv_modify_qp", &a.modify_qp, true);
  sym(lib, "ibv_destroy_qp", &a.destroy_qp, true);
  sym(lib, "ibv_qp_to_qp_ex", &a.qp_to_qp_ex, false);
  sym(lib, "ibv_reg_mr", &a.reg_mr, true);
  sym(lib, "ibv_reg_dmabuf_mr", &a.reg_dmabuf_mr, false);
  sym(lib, "ibv_dereg_mr", &a.dereg_mr, true);
  sym(lib, "ibv_create_ah", &a.create_ah, true);
  sym(lib, "ibv_destroy_ah", &a.destroy_ah, true);
  sym(lib, "ibv_wc_status_str", &a.wc_status_str, true);
  sym(lib, "ibv_get_async_event", &a.get_async_event, true);
  sym(lib, "ibv_ack_async_event", &a.ack_async_event, true);
  sym(lib, "ibv_event_type_str", &a.event_type_str, false);
  a.post_send = sys_post_send;
  a.post_recv = sys_post_recv;
  a.poll_cq = sys_poll_cq;
  a.gid_table = sys_gid_table;
  a.get_dmabuf_fd = sys_get_dmabuf_fd;
#ifdef UCCL_EP_WITH_EFADV
  if (void* efa = dlopen("libefa.so.1", RTLD_NOW | RTLD_LOCAL)) {
    sym(efa, "efadv_create_qp_ex", &a.efadv_create_qp_ex, false);
    sym(efa, "efadv_query_ah", &a.efadv_query_ah, false);
    sym(efa, "efadv_query_device", &a.efadv_query_device, false);
    g_efa = a.efadv_create_qp_ex != nullptr;
  }
#endif
  g_system = a;
}

}  // namespace

const IbvApi& system_ibv_api() {
  static std::once_flag once;
  std::call_once(once, [] {
    try {
      load();
      g_loaded = true;
    } catch (const std::exception& e) {
      g_load_error = e.what();
    }
  });
  if (!g_loaded) throw std::runtime_error(g_load_error);
  return g_system;
}

const IbvApi& ibv_api() {
  const IbvApi* o = g_override.load(std::memory_order_acquire);
  return o ? *o : system_ibv_api();
}

void set_ibv_api_override(const IbvApi* api) { g_override.store(api, std::memory_order_release); }

bool libefa_available() { return g_efa; }

}  // namespace uccl_ep
#endif  // UCCL_EP_WITH_VERBS
