// A native backtrace for crashes in C++/CUDA code that Python's faulthandler only shows as the Python line that
// called into it. Preload it into every process of a run:
//   gcc -shared -fPIC -O1 -o /tmp/native_backtrace.so scripts/native_backtrace.c
//   LD_PRELOAD=/tmp/native_backtrace.so python3 -m pytest ...
// On SIGSEGV, SIGBUS, SIGILL, SIGFPE or SIGABRT it writes the thread id and the frames (module(+offset)) to stderr,
// then lets the signal kill the process as before. faulthandler, enabled later, runs first and chains to this handler.
// Resolve a frame with: addr2line -f -C -e <module> <offset>.
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

static void put(const char* s) { (void)!write(2, s, strlen(s)); }

static void put_number(unsigned long v) {
  char buf[24];
  int i = sizeof(buf);
  buf[--i] = 0;
  do buf[--i] = (char)('0' + v % 10); while ((v /= 10) && i > 0);
  put(buf + i);
}

static void put_hex(unsigned long v) {
  char buf[19];
  int i = sizeof(buf);
  buf[--i] = 0;
  do buf[--i] = "0123456789abcdef"[v & 15]; while ((v >>= 4) && i > 2);
  buf[--i] = 'x';
  buf[--i] = '0';
  put(buf + i);
}

static void on_fatal(int sig, siginfo_t* info, void* uctx) {
  (void)uctx;
  void* frames[64];
  put("\n== native backtrace: signal ");
  put_number((unsigned long)sig);
  put(" in thread ");
  put_number((unsigned long)syscall(SYS_gettid));
  put(" of pid ");
  put_number((unsigned long)getpid());
  // Sent by the kernel: the faulting address. faulthandler re-raises the signal itself, which carries none; the
  // frames below still lead through its handler to the faulting call.
  if (info->si_code > 0) {
    put(", fault address ");
    put_hex((unsigned long)info->si_addr);
  }
  put(" ==\n");
  int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  put("== end of native backtrace ==\n");
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  static char stack[1 << 16];  // a handler for a stack overflow needs a stack of its own
  stack_t ss = {.ss_sp = stack, .ss_size = sizeof(stack), .ss_flags = 0};
  sigaltstack(&ss, NULL);
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc_s now: dlopen inside a signal handler is not safe
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_fatal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  const int sigs[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
  for (unsigned i = 0; i < sizeof(sigs) / sizeof(sigs[0]); ++i) sigaction(sigs[i], &sa, NULL);
}
