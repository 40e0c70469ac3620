#include "transport/gid.hpp"

#include <arpa/inet.h>
#include <dirent.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace uccl_ep {

bool gid_is_zero(const std::array<uint8_t, 16>& gid) {
  return std::all_of(gid.begin(), gid.end(), [](uint8_t b) { return b == 0; });
}

bool gid_is_link_local(const std::array<uint8_t, 16>& gid) { return gid[0] == 0xfe && (gid[1] & 0xc0) == 0x80; }

bool gid_is_ipv4_mapped(const std::array<uint8_t, 16>& gid) {
  for (int i = 0; i < 10; ++i)
    if (gid[i] != 0) return false;
  return gid[10] == 0xff && gid[11] == 0xff;
}

std::string gid_to_string(const std::array<uint8_t, 16>& gid) {
  char buf[48];
  int n = 0;
  for (int i = 0; i < 16; i += 2)
    n += std::snprintf(buf + n, sizeof(buf) - n, "%s%02x%02x", i ? ":" : "", gid[i], gid[i + 1]);
  return std::string(buf, n);
}

std::array<uint8_t, 16> gid_from_string(const std::string& text) {
  std::string s = text;
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  std::array<uint8_t, 16> out{};
  if (inet_pton(AF_INET6, s.c_str(), out.data()) != 1)
    throw std::invalid_argument("not a GID (expected 8 groups of hex digits as in sysfs): '" + s + "'");
  return out;
}

const char* gid_type_name(GidType type) {
  switch (type) {
    case GidType::kIB: return "IB";
    case GidType::kRoCEv1: return "RoCE v1";
    case GidType::kRoCEv2: return "RoCE v2";
    default: return "unknown";
  }
}

GidType gid_type_from_sysfs(const std::string& types_text, const std::string& link_layer) {
  if (types_text.find("RoCE v2") != std::string::npos) return GidType::kRoCEv2;
  if (types_text.find("RoCE v1") != std::string::npos || types_text.find("IB") != std::string::npos)
    return link_layer == "Ethernet" ? GidType::kRoCEv1 : GidType::kIB;
  return GidType::kUnknown;
}

namespace {

std::string describe_table(const GidTable& t) {
  std::ostringstream os;
  bool any = false;
  for (const auto& e : t.entries) {
    if (gid_is_zero(e.raw)) continue;
    os << "\n  [" << e.index << "] " << gid_to_string(e.raw) << " " << gid_type_name(e.type);
    if (!e.netdev.empty()) os << " " << e.netdev;
    any = true;
  }
  if (!any) os << " (no non-zero GID)";
  return os.str();
}

// Lower is better; -1 means never chosen automatically.
int roce_rank(const GidEntry& e) {
  if (gid_is_zero(e.raw) || gid_is_link_local(e.raw)) return -1;
  const bool v4 = gid_is_ipv4_mapped(e.raw);
  switch (e.type) {
    case GidType::kRoCEv2: return v4 ? 0 : 1;
    case GidType::kRoCEv1: return v4 ? 2 : 3;
    case GidType::kUnknown: return v4 ? 4 : 5;  // no gid_attrs (old kernels): still better than nothing
    default: return -1;
  }
}

}  // namespace

GidChoice choose_gid(const GidTable& table, int override_index, bool is_efa) {
  const std::string where = table.device + " port " + std::to_string(table.port);
  auto find = [&](int idx) -> const GidEntry* {
    for (const auto& e : table.entries)
      if (e.index == idx) return &e;
    return nullptr;
  };
  if (override_index >= 0) {
    const GidEntry* e = find(override_index);
    if (e == nullptr || gid_is_zero(e->raw))
      throw std::invalid_argument("UCCL_IB_GID_INDEX=" + std::to_string(override_index) + " names no GID of " + where +
                                  "; its GIDs are:" + describe_table(table) +
                                  "\nset UCCL_IB_GID_INDEX to one of them, or unset it to choose automatically");
    GidChoice c{override_index, "UCCL_IB_GID_INDEX=" + std::to_string(override_index) + " (" +
                                    gid_to_string(e->raw) + ", " + gid_type_name(e->type) + ")"};
    return c;
  }
  if (is_efa || table.link_layer == "InfiniBand") {
    const GidEntry* e = find(0);
    if (e == nullptr || gid_is_zero(e->raw))
      throw std::invalid_argument(where + " has no GID at index 0 (is the port up? `ibv_devinfo -v`)");
    return {0, std::string(is_efa ? "EFA" : "InfiniBand") + " port: index 0 (" + gid_to_string(e->raw) + ")"};
  }
  const GidEntry* best = nullptr;
  int best_rank = 1 << 30;
  for (const auto& e : table.entries) {
    int r = roce_rank(e);
    if (r < 0) continue;
    if (r < best_rank || (r == best_rank && e.index < best->index)) {
      best = &e;
      best_rank = r;
    }
  }
  if (best == nullptr)
    throw std::invalid_argument("no routable GID on " + where + " (only zero or link-local fe80:: entries):" +
                                describe_table(table) +
                                "\nassign an IPv4/IPv6 address to the NIC's netdev, or force one with UCCL_IB_GID_INDEX");
  static const char* const kWhy[] = {"RoCE v2, IPv4-mapped", "RoCE v2, global IPv6 (no IPv4-mapped RoCE v2 GID)",
                                     "RoCE v1, IPv4-mapped (no RoCE v2 GID)", "RoCE v1, global IPv6 (no RoCE v2 GID)",
                                     "IPv4-mapped, type unknown", "global IPv6, type unknown"};
  std::string reason = std::string(kWhy[best_rank]) + ": index " + std::to_string(best->index) + " (" +
                       gid_to_string(best->raw) + (best->netdev.empty() ? "" : " on " + best->netdev) + ")";
  return {best->index, reason};
}

namespace {

bool read_text(const std::string& path, std::string* out) {
  std::ifstream f(path);
  if (!f) return false;
  std::stringstream ss;
  ss << f.rdbuf();
  if (f.bad()) return false;
  *out = ss.str();
  while (!out->empty() && (out->back() == '\n' || out->back() == ' ')) out->pop_back();
  return true;
}

}  // namespace

GidTable read_gid_table(const std::string& sysfs_root, const std::string& device, int port) {
  GidTable t;
  t.device = device;
  t.port = port;
  const std::string base = sysfs_root + "/class/infiniband/" + device + "/ports/" + std::to_string(port);
  if (!read_text(base + "/link_layer", &t.link_layer))
    throw std::runtime_error("cannot read " + base + "/link_layer: no such RDMA device/port");
  DIR* dir = opendir((base + "/gids").c_str());
  if (dir == nullptr) return t;
  std::vector<int> indices;
  while (dirent* d = readdir(dir)) {
    char* end = nullptr;
    long idx = std::strtol(d->d_name, &end, 10);
    if (end != d->d_name && *end == '\0') indices.push_back(static_cast<int>(idx));
  }
  closedir(dir);
  std::sort(indices.begin(), indices.end());
  for (int idx : indices) {
    std::string text, types, ndev;
    if (!read_text(base + "/gids/" + std::to_string(idx), &text)) continue;
    GidEntry e;
    e.index = idx;
    try {
      e.raw = gid_from_string(text);
    } catch (const std::invalid_argument&) {
      continue;
    }
    read_text(base + "/gid_attrs/types/" + std::to_string(idx), &types);
    read_text(base + "/gid_attrs/ndevs/" + std::to_string(idx), &ndev);
    e.type = types.empty() ? (t.link_layer == "Ethernet" ? GidType::kUnknown : GidType::kIB)
                           : gid_type_from_sysfs(types, t.link_layer);
    e.netdev = ndev;
    t.entries.push_back(std::move(e));
  }
  return t;
}

}  // namespace uccl_ep
