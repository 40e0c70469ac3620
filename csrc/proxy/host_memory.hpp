// Registrable host memory: page-aligned, backed by a POSIX shared-memory object so that another process on the same
// host can map it (the loopback transport's "remote write" is a memcpy into that mapping). Any transport can
// register it (verbs pins it like any other host page).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace uccl_ep {

class SharedHostMemory {
 public:
  explicit SharedHostMemory(size_t bytes);  // zero-filled
  ~SharedHostMemory();
  SharedHostMemory(const SharedHostMemory&) = delete;
  SharedHostMemory& operator=(const SharedHostMemory&) = delete;

  void* data() const { return base_; }
  size_t bytes() const { return bytes_; }
  const std::string& name() const { return name_; }

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  size_t mapped_ = 0;
  std::string name_;
};

// Where a registered pointer lives: the shm object name and the offset inside it (false if it is not shared memory
// allocated by SharedHostMemory in this process).
bool find_shared_host_memory(const void* ptr, size_t bytes, std::string* name, size_t* offset, size_t* object_bytes);

// Remove every shm name this process created from /dev/shm. Mappings stay valid; call once every peer has mapped
// them (after the connect barrier) so that a crash later leaks nothing.
void unlink_shared_host_memory_names();

// Map a peer's shm object read-write. Throws ProxyError saying which name could not be opened.
void* map_shared_host_memory(const std::string& name, size_t bytes);
void unmap_shared_host_memory(void* base, size_t bytes);

}  // namespace uccl_ep
