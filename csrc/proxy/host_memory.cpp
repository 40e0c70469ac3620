#include "proxy/host_memory.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>

#include "proxy/errors.hpp"

namespace uccl_ep {
namespace {

struct Registry {
  std::mutex mu;
  std::map<uintptr_t, SharedHostMemory*> by_base;
  std::map<std::string, bool> names;  // name -> still linked
};

Registry& registry() {
  static Registry* r = new Registry();  // leaked on purpose: used from destructors at exit
  return *r;
}

size_t page_round(size_t n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (n + page - 1) / page * page;
}

}  // namespace

SharedHostMemory::SharedHostMemory(size_t bytes) : bytes_(bytes) {
  static std::atomic<uint64_t> counter{0};
  if (bytes == 0) throw ProxyError("SharedHostMemory: cannot allocate 0 bytes");
  mapped_ = page_round(bytes);
  name_ = "/uccl_ep." + std::to_string(getpid()) + "." + std::to_string(counter.fetch_add(1));
  int fd = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) throw ProxyError("shm_open(" + name_ + ") failed: " + std::strerror(errno) + " (is /dev/shm mounted?)");
  if (ftruncate(fd, static_cast<off_t>(mapped_)) != 0) {
    int e = errno;
    close(fd);
    shm_unlink(name_.c_str());
    throw ProxyError("ftruncate(" + name_ + ", " + std::to_string(mapped_) + ") failed: " + std::strerror(e) +
                     " (is /dev/shm large enough? docker: --shm-size)");
  }
  void* p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name_.c_str());
    throw ProxyError("mmap of " + name_ + " failed: " + std::strerror(errno));
  }
  base_ = p;
  auto& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  r.by_base[reinterpret_cast<uintptr_t>(base_)] = this;
  r.names[name_] = true;
}

SharedHostMemory::~SharedHostMemory() {
  auto& r = registry();
  {
    std::lock_guard<std::mutex> g(r.mu);
    r.by_base.erase(reinterpret_cast<uintptr_t>(base_));
    auto it = r.names.find(name_);
    if (it != r.names.end()) {
      if (it->second) shm_unlink(name_.c_str());
      r.names.erase(it);
    }
  }
  munmap(base_, mapped_);
}

bool find_shared_host_memory(const void* ptr, size_t bytes, std::string* name, size_t* offset,
                             size_t* object_bytes) {
  auto& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  const uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  auto it = r.by_base.upper_bound(p);
  if (it == r.by_base.begin()) return false;
  --it;
  SharedHostMemory* m = it->second;
  if (p + bytes > it->first + m->bytes()) return false;
  *name = m->name();
  *offset = p - it->first;
  *object_bytes = m->bytes();
  return true;
}

void unlink_shared_host_memory_names() {
  auto& r = registry();
  std::lock_guard<std::mutex> g(r.mu);
  for (auto& [name, linked] : r.names) {
    if (linked) shm_unlink(name.c_str());
    linked = false;
  }
}

void* map_shared_host_memory(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0)
    throw ProxyError("cannot open peer shared memory " + name + ": " + std::strerror(errno) +
                     " (peers must be on this host and connect before unlink_shared_host_memory_names())");
  void* p = mmap(nullptr, page_round(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) throw ProxyError("mmap of peer shared memory " + name + " failed: " + std::strerror(errno));
  return p;
}

void unmap_shared_host_memory(void* base, size_t bytes) {
  if (base) munmap(base, page_round(bytes));
}

}  // namespace uccl_ep
