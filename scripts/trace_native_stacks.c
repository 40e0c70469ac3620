// Diagnostic (docs/internode.md, "Drains"): every STK_NATIVE_PERIOD seconds (default 4), append the native stack
// of every thread of this process to $STK_NATIVE_DIR/native-<pid>.txt, with the thread's name and the system call
// it sits in. For a stall where gdb is not installed: which thread is inside which CUDA call, and whether it spins
// or sleeps. Load it into every process of a run, forked ones included:
//   gcc -O1 -g -shared -fPIC -o /tmp/trace_native_stacks.so scripts/trace_native_stacks.c -lpthread
//   STK_NATIVE_DIR=/tmp/stk LD_PRELOAD=/tmp/trace_native_stacks.so python3 -m pytest ...
// Frames inside stripped libraries (libcuda) print as library+offset; the exported entry point a thread came in
// through (cuEventCreate, cudaStreamSynchronize, ...) prints by name.
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <execinfo.h>
#include <fcntl.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#define SAMPLE_SIGNAL (SIGRTMIN + 5)

static int g_out = -1;   // the file the signalled thread writes its stack to
static sem_t g_written;  // posted by the handler once the stack is written

static void write_str(int fd, const char* s) { (void)!write(fd, s, strlen(s)); }

static void on_sample(int sig, siginfo_t* info, void* ctx) {
  (void)sig; (void)info;
  const int saved = errno;
  void* frames[32];
  // the interrupted instruction first: the unwinder may stop early inside code without unwind tables
  ucontext_t* uc = (ucontext_t*)ctx;
  frames[0] = (void*)uc->uc_mcontext.gregs[REG_RIP];
  write_str(g_out, "  pc: ");
  backtrace_symbols_fd(frames, 1, g_out);
  const int n = backtrace(frames, 32);
  backtrace_symbols_fd(frames, n, g_out);
  sem_post(&g_written);
  errno = saved;
}

static void read_line(const char* path, char* buf, size_t size) {
  buf[0] = 0;
  const int fd = open(path, O_RDONLY);
  if (fd < 0) return;
  const ssize_t r = read(fd, buf, size - 1);
  close(fd);
  buf[r > 0 ? r : 0] = 0;
  char* nl = strchr(buf, '\n');
  if (nl) *nl = 0;
}

static int signal_blocked(pid_t tid) {
  char path[96], buf[2048];
  snprintf(path, sizeof path, "/proc/self/task/%d/status", tid);
  const int fd = open(path, O_RDONLY);
  if (fd < 0) return 1;
  const ssize_t r = read(fd, buf, sizeof buf - 1);
  close(fd);
  buf[r > 0 ? r : 0] = 0;
  const char* b = strstr(buf, "SigBlk:");
  return b && (strtoull(b + 7, NULL, 16) >> (SAMPLE_SIGNAL - 1) & 1ull);
}

static void sample_all(int out, int round) {
  const pid_t pid = getpid(), self = (pid_t)syscall(SYS_gettid);
  char line[512];
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  snprintf(line, sizeof line, "=== pid %d round %d monotonic %ld.%03ld\n", pid, round, (long)ts.tv_sec,
           ts.tv_nsec / 1000000);
  write_str(out, line);
  DIR* d = opendir("/proc/self/task");
  if (!d) return;
  struct dirent* e;
  while ((e = readdir(d))) {
    const pid_t tid = (pid_t)atoi(e->d_name);
    if (tid <= 0 || tid == self) continue;
    char path[96], comm[64], sc[256], stat[512];
    snprintf(path, sizeof path, "/proc/self/task/%d/comm", tid);
    read_line(path, comm, sizeof comm);
    snprintf(path, sizeof path, "/proc/self/task/%d/syscall", tid);
    read_line(path, sc, sizeof sc);
    snprintf(path, sizeof path, "/proc/self/task/%d/stat", tid);
    read_line(path, stat, sizeof stat);
    const char* st = strrchr(stat, ')');
    snprintf(line, sizeof line, "-- tid %d (%s) state %.1s syscall %s\n", tid, comm, st ? st + 2 : "?", sc);
    write_str(out, line);
    if (signal_blocked(tid)) {  // a thread in sigwait(), say: it would answer only later, out of turn
      write_str(out, "  (blocks the sampling signal)\n");
      continue;
    }
    g_out = out;
    if (syscall(SYS_tgkill, pid, tid, SAMPLE_SIGNAL) != 0) continue;
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_nsec += 500000000;
    if (dl.tv_nsec >= 1000000000) { dl.tv_sec += 1; dl.tv_nsec -= 1000000000; }
    while (sem_timedwait(&g_written, &dl) != 0 && errno == EINTR) {}
  }
  closedir(d);
}

static void* sampler(void* arg) {
  (void)arg;
  const char* dir = getenv("STK_NATIVE_DIR");
  const double period = getenv("STK_NATIVE_PERIOD") ? atof(getenv("STK_NATIVE_PERIOD")) : 4.0;
  const int rounds = getenv("STK_NATIVE_ROUNDS") ? atoi(getenv("STK_NATIVE_ROUNDS")) : 60;
  char path[512];
  snprintf(path, sizeof path, "%s/native-%d.txt", dir, getpid());
  for (int round = 1; round <= rounds; ++round) {
    struct timespec p = {(time_t)period, (long)((period - (time_t)period) * 1e9)};
    while (nanosleep(&p, &p) != 0 && errno == EINTR) {}
    const int out = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (out < 0) return NULL;
    sample_all(out, round);
    close(out);
  }
  return NULL;
}

static void start_sampler(void) {
  pthread_t t;
  if (pthread_create(&t, NULL, sampler, NULL) == 0) pthread_detach(t);
}

__attribute__((constructor)) static void init(void) {
  if (!getenv("STK_NATIVE_DIR")) return;
  void* warm[2];
  backtrace(warm, 2);  // loads the unwinder now: the first backtrace() dlopens it, which a signal handler must not
  sem_init(&g_written, 0, 0);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_sample;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SAMPLE_SIGNAL, &sa, NULL);
  pthread_atfork(NULL, NULL, start_sampler);  // forked ranks (a forkserver) sample too
  start_sampler();
}
