// Placeholder so the host-core library has a source; removed once the proxy sources exist.
namespace uccl_ep { int host_core_placeholder() { return 0; } }
