// How the kernel files turn a CUDA (or HIP) error into the exception Python sees: one wording, "<layer>: <call>
// failed: <the runtime's reason>", with the launch error cleared first, so that a caller who handles the exception
// can launch again.
#pragma once

#include <stdexcept>
#include <string>

#include "uccl_ep/portability.cuh"

namespace uccl_ep {

inline void throw_on_cuda_error(cudaError_t e, const char* layer, const std::string& what) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();
  throw std::runtime_error(std::string(layer) + ": " + what + " failed: " + cudaGetErrorString(e));
}

// After a <<<...>>> launch: a configuration the device refused (grid, shared memory, a missing image) raises here.
inline void check_launch(const char* layer, const std::string& kernel) {
  throw_on_cuda_error(cudaGetLastError(), layer, kernel + " launch");
}

}  // namespace uccl_ep
