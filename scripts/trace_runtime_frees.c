// LD_PRELOAD shim that logs the CUDA runtime calls which, made while one of our kernels spins, hold the loopback
// proxy's copies until the kernel ends (docs/internode.md, "Which host calls hold the loopback's copies"). It sees
// the calls of libraries that link the runtime dynamically (torch does); a statically linked runtime bypasses it.
// Build and use on a GPU machine:
//   gcc -shared -fPIC -o /tmp/trace_frees.so scripts/trace_runtime_frees.c -ldl
//   LD_PRELOAD=/tmp/trace_frees.so python3 -m pytest ... 2>&1 | grep TRACE_FREES
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

typedef int (*one_pointer_call)(void*);

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define TRACE(name)                                                                                    \
  int name(void* p) {                                                                                  \
    static one_pointer_call real;                                                                      \
    if (!real) real = (one_pointer_call)dlsym(RTLD_NEXT, #name);                                       \
    const double t = now_s();                                                                          \
    const int r = real(p);                                                                             \
    fprintf(stderr, "TRACE_FREES pid %d %s(%p) at %.3f took %.1f ms\n", getpid(), #name, p, t,          \
            (now_s() - t) * 1e3);                                                                      \
    return r;                                                                                          \
  }

TRACE(cudaFree)
TRACE(cudaFreeHost)
TRACE(cudaHostUnregister)
TRACE(cudaIpcCloseMemHandle)
TRACE(cudaStreamDestroy)
