// uccl_ep_train._C: one module, one registration function per layer. Each layer's bindings live in their own file
// so the host core, the verbs transport and the kernels can change independently.
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace uccl_ep::bindings {
void bind_host_core(py::module_& m);   // proxy_bindings.cpp: settings structs, FIFOs, proxies, loopback
void bind_verbs(py::module_& m);       // verbs_bindings.cpp: verbs transport, GID choice, recorded-call tests
void bind_kernels(py::module_& m);     // kernel_bindings.cpp: layout and intranode launchers
void bind_internode(py::module_& m);   // internode_bindings.cpp: hierarchical path (regions, proxy, kernels)
}  // namespace uccl_ep::bindings

PYBIND11_MODULE(_C, m) {
  m.doc() = "uccl-ep-train native core (torch-free: pointers, sizes and streams cross as integers)";
  m.attr("gpu_backend") = UCCL_EP_GPU_BACKEND;  // "CUDA", "HIP" or "NONE"
#ifdef UCCL_EP_CUDA_ARCHS
  m.attr("cuda_archs") = UCCL_EP_CUDA_ARCHS;
#else
  m.attr("cuda_archs") = "";
#endif
#ifdef UCCL_EP_WITH_VERBS
  m.attr("with_verbs") = true;
#else
  m.attr("with_verbs") = false;
#endif
#ifdef UCCL_EP_WITH_EFADV
  m.attr("with_efadv") = true;
#else
  m.attr("with_efadv") = false;
#endif
  uccl_ep::bindings::bind_host_core(m);
  uccl_ep::bindings::bind_verbs(m);
  uccl_ep::bindings::bind_kernels(m);
  uccl_ep::bindings::bind_internode(m);
}
