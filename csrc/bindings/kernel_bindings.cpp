// Bindings of the GPU kernels: uccl_ep_train._C.kernels. Torch-free: device pointers and streams are integers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)
#include "../kernels/intranode.hpp"
#endif

namespace py = pybind11;

namespace uccl_ep::bindings {

void bind_kernels(py::module_& m) {
#if defined(UCCL_EP_WITH_CUDA) || defined(UCCL_EP_WITH_HIP)
  namespace in = uccl_ep::intranode;
  auto k = m.def_submodule("kernels", "GPU kernels: dispatch layout and the intranode (NVLink/xGMI) backend");
  k.attr("max_ranks") = in::kMaxRanks;
  k.attr("max_topk") = in::kMaxTopk;
  k.attr("control_bytes") = static_cast<int64_t>(in::kControlBytes);
  k.attr("own_in_area") = static_cast<int>(in::kOwnInArea);      // dispatch's own_rows (intranode.hpp, OwnRows)
  k.attr("own_in_output") = static_cast<int>(in::kOwnInOutput);
  k.def("dispatch_layout", &in::dispatch_layout, py::arg("topk_idx"), py::arg("num_tokens"), py::arg("topk"),
        py::arg("num_experts"), py::arg("num_ranks"), py::arg("ranks_per_node"), py::arg("num_tokens_per_rank"),
        py::arg("num_tokens_per_node"), py::arg("num_tokens_per_expert"), py::arg("is_token_in_rank"),
        py::arg("stream"));
  k.def("dispatch_rows_capacity", &in::dispatch_rows_capacity, py::arg("data_bytes"), py::arg("hidden_bytes"),
        py::arg("num_scales"), py::arg("topk"));
  k.def("combine_tokens_capacity", &in::combine_tokens_capacity, py::arg("data_bytes"), py::arg("num_ranks"),
        py::arg("hidden"), py::arg("topk"));
  k.def("max_experts_in_control", &in::max_experts_in_control);
  k.def("dispatch_area_offsets", &in::dispatch_area_offsets, py::arg("rows_capacity"), py::arg("hidden_bytes"),
        py::arg("num_scales"), py::arg("topk"));

  py::class_<in::Context>(k, "IntranodeContext")
      .def(py::init<int, int, int64_t, int, double>(), py::arg("rank"), py::arg("num_ranks"), py::arg("num_bytes"),
           py::arg("device"), py::arg("timeout_secs"))
      .def("ipc_handle", [](const in::Context& c) { return py::bytes(c.ipc_handle()); })
      .def("open_peers", &in::Context::open_peers, py::arg("handles"))
      .def("destroy", &in::Context::destroy)
      .def_property_readonly("rank", &in::Context::rank)
      .def_property_readonly("num_ranks", &in::Context::num_ranks)
      .def_property_readonly("data_bytes", &in::Context::data_bytes)
      .def_property_readonly("buffer_ptr", &in::Context::buffer_ptr)
      .def("error_message", &in::Context::error_message)
      .def("clear_error", &in::Context::clear_error)
      .def("reset_host_counts", &in::Context::reset_host_counts)
      .def("wait_host_counts", &in::Context::wait_host_counts, py::arg("num_local_experts"),
           py::call_guard<py::gil_scoped_release>())
      .def("barrier", &in::Context::barrier, py::arg("stream"))
      .def("notify", &in::Context::notify, py::arg("num_tokens_per_rank"), py::arg("num_tokens_per_expert"),
           py::arg("is_token_in_rank"), py::arg("num_tokens"), py::arg("num_experts"), py::arg("rows_capacity"),
           py::arg("rank_prefix_matrix"), py::arg("recv_info"), py::arg("send_pos"), py::arg("stream"))
      .def("dispatch_send", &in::Context::dispatch_send, py::arg("x"), py::arg("x_scales"), py::arg("topk_idx"),
           py::arg("topk_weights"), py::arg("send_pos"), py::arg("rank_prefix_matrix"), py::arg("recv_info"),
           py::arg("num_tokens"), py::arg("hidden_bytes"), py::arg("num_scales"), py::arg("topk"),
           py::arg("num_experts"), py::arg("rows_capacity"), py::arg("own_rows"), py::arg("self_x"), py::arg("self_scales"),
           py::arg("self_rows"), py::arg("num_sms"), py::arg("stream"))
      .def("dispatch_recv", &in::Context::dispatch_recv, py::arg("recv_x"), py::arg("recv_scales"),
           py::arg("recv_topk_idx"), py::arg("recv_topk_weights"), py::arg("recv_src_idx"), py::arg("recv_info"),
           py::arg("rank_prefix_matrix"), py::arg("own_rows"), py::arg("rows_from"), py::arg("out_rows"), py::arg("hidden_bytes"), py::arg("num_scales"), py::arg("topk"),
           py::arg("rows_capacity"), py::arg("local_sms"), py::arg("stream"))
      .def("expert_major", &in::Context::expert_major, py::arg("src_x"), py::arg("src_scales"),
           py::arg("recv_topk_idx"), py::arg("recv_topk_weights"), py::arg("recv_info"), py::arg("out_rows"),
           py::arg("expert_rows"), py::arg("num_local_experts"), py::arg("alignment"), py::arg("hidden_bytes"),
           py::arg("num_scales"), py::arg("topk"), py::arg("out_x"), py::arg("out_scales"), py::arg("em_token"),
           py::arg("em_slot"), py::arg("em_expert"), py::arg("em_weights"), py::arg("slot_of"), py::arg("local_sms"),
           py::arg("stream"))
      .def("expert_major_partials", &in::Context::expert_major_partials, py::arg("x"), py::arg("topk_weights"),
           py::arg("slot_of"), py::arg("recv_info"), py::arg("num_rows"), py::arg("hidden"), py::arg("elem_size"),
           py::arg("topk"), py::arg("partials"), py::arg("out_topk_weights"), py::arg("local_sms"), py::arg("stream"))
      .def("combine_send", &in::Context::combine_send, py::arg("x"), py::arg("topk_weights"), py::arg("recv_src_idx"),
           py::arg("rank_prefix_matrix"), py::arg("recv_info"), py::arg("num_rows"), py::arg("hidden"),
           py::arg("elem_size"), py::arg("topk"), py::arg("max_src_tokens"), py::arg("num_sms"), py::arg("stream"))
      .def("combine_reduce", &in::Context::combine_reduce, py::arg("is_token_in_rank"), py::arg("num_tokens"),
           py::arg("hidden"), py::arg("elem_size"), py::arg("topk"), py::arg("out_x"), py::arg("out_topk_weights"),
           py::arg("max_src_tokens"), py::arg("local_sms"), py::arg("stream"))
      .def("combine_copy_engine", &in::Context::combine_copy_engine, py::arg("x"), py::arg("topk_weights"),
           py::arg("rows_from"), py::arg("is_token_in_rank"), py::arg("send_pos"), py::arg("num_tokens"),
           py::arg("hidden"), py::arg("elem_size"), py::arg("topk"), py::arg("out_x"), py::arg("out_topk_weights"),
           py::arg("max_src_tokens"), py::arg("chunk_bytes"), py::arg("num_streams"), py::arg("local_sms"),
           py::arg("stream"));
#else
  (void)m;  // built without a GPU toolchain: no `kernels` submodule, native.has_kernels() is False
#endif
}

}  // namespace uccl_ep::bindings
