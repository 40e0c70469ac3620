// GID choice for RoCE / InfiniBand / EFA ports, compatible with what NCCL picks, as a pure function over a GID table
// so it is tested against recorded tables (tests/fixtures/sysfs) instead of real NICs.
//
// Rules (docs/transports.md "GID choice"):
//   1. UCCL_IB_GID_INDEX >= 0 wins; it must name a non-zero entry of the table, else an error lists the valid ones.
//   2. InfiniBand and EFA ports use index 0 (the port GID; EFA exposes exactly one, link-local looking, GID).
//   3. RoCE: RoCE v2 with an IPv4-mapped address (::ffff:a.b.c.d), then RoCE v2 with a global IPv6 address
//      (Broadcom bnxt_re exposes IPv6-only GIDs), then the same two orders for RoCE v1. Zero GIDs and link-local
//      fe80::/10 GIDs are never chosen automatically (they do not route). Ties go to the lowest index.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace uccl_ep {

enum class GidType : uint8_t { kUnknown = 0, kIB = 1, kRoCEv1 = 2, kRoCEv2 = 3 };

struct GidEntry {
  int index = 0;
  std::array<uint8_t, 16> raw{};
  GidType type = GidType::kUnknown;
  std::string netdev;  // gid_attrs/ndevs/<i>; empty on IB/EFA
};

struct GidTable {
  std::string device;      // mlx5_0, bnxt_re3, rdmap79s0
  int port = 1;
  std::string link_layer;  // "InfiniBand", "Ethernet", "Unspecified" (EFA)
  std::vector<GidEntry> entries;
};

struct GidChoice {
  int index = -1;
  std::string reason;  // why this one: printed by doctor and in connection errors
};

bool gid_is_zero(const std::array<uint8_t, 16>& gid);
bool gid_is_link_local(const std::array<uint8_t, 16>& gid);  // fe80::/10
bool gid_is_ipv4_mapped(const std::array<uint8_t, 16>& gid);  // ::ffff:a.b.c.d
std::string gid_to_string(const std::array<uint8_t, 16>& gid);  // sysfs form: 8 groups of 4 hex digits
// Parses the sysfs form (also accepts compressed "::" IPv6 notation). Throws std::invalid_argument.
std::array<uint8_t, 16> gid_from_string(const std::string& text);
const char* gid_type_name(GidType type);
GidType gid_type_from_sysfs(const std::string& types_text, const std::string& link_layer);

// `override_index` is UCCL_IB_GID_INDEX (-1: choose). `is_efa` forces rule 2. Throws std::invalid_argument with a
// message naming the device, the table and UCCL_IB_GID_INDEX when nothing usable exists.
GidChoice choose_gid(const GidTable& table, int override_index, bool is_efa = false);

// Reads <sysfs_root>/class/infiniband/<device>/ports/<port>/{link_layer,gids/*,gid_attrs/types/*,gid_attrs/ndevs/*}.
// Unreadable entries (the kernel returns EINVAL for unused slots) are skipped. Throws std::runtime_error when the
// port directory does not exist.
GidTable read_gid_table(const std::string& sysfs_root, const std::string& device, int port);

}  // namespace uccl_ep
