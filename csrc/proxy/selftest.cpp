#include "proxy/selftest.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include "proxy/errors.hpp"
#include "proxy/host_memory.hpp"
#include "proxy/proxy.hpp"
#include "transport/loopback.hpp"
#include "uccl_ep/command.hpp"

namespace uccl_ep {
namespace {

constexpr int kWorld = 2;
constexpr uint32_t kSlots = 64;
constexpr uint64_t kSourceBytes = 1ull << 20;  // first half of each data buffer: what a rank sends from
constexpr uint64_t kMaxWrite = 512;

uint64_t splitmix(uint64_t* s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct Plan {
  std::vector<Command> cmds;
  std::vector<uint64_t> src, dst, len;  // per command, in bytes
  std::vector<int64_t> expect;           // per slot of the receiver
  uint64_t bytes = 0;
};

}  // namespace

SelftestResult loopback_selftest(const SelftestOptions& o) {
  if (o.commands < 1 || o.commands > (1u << 20)) throw ProxyError("loopback_selftest: commands must be 1..1048576");
  if (o.reorder < 0 || o.reorder > 128) throw ProxyError("loopback_selftest: reorder must be 0..128");
  const uint64_t recv_bytes = ((o.commands * kMaxWrite + 4095) / 4096) * 4096;
  const uint64_t data_bytes = kSourceBytes + recv_bytes;

  ProxyConfig cfg;
  cfg.world = kWorld;
  cfg.num_threads = 1;
  cfg.fifos_per_thread = 2;
  cfg.fifo_depth = 256;
  cfg.timeout_secs = o.timeout_secs;
  cfg.max_inflight_writes = 32;
  cfg.max_inflight_bytes = 1ull << 20;
  cfg.reorder_window = 256;
  cfg.num_signal_slots = kSlots;

  std::vector<std::unique_ptr<SharedHostMemory>> data;
  std::vector<std::unique_ptr<Proxy>> proxies;
  // Destroyed before both: a proxy whose stuck thread was detached (Proxy::stop) is leaked with every data buffer,
  // since that thread may still return into them.
  struct LeakIfDetached {
    std::vector<std::unique_ptr<SharedHostMemory>>& data;
    std::vector<std::unique_ptr<Proxy>>& proxies;
    ~LeakIfDetached() {
      bool leak = false;
      for (auto& p : proxies) {
        if (!p) continue;
        p->stop();
        if (p->detached_threads()) leak = true;
      }
      if (!leak) return;
      for (auto& p : proxies) (void)p.release();
      for (auto& d : data) (void)d.release();
    }
  } leak_if_detached{data, proxies};
  for (int r = 0; r < kWorld; ++r) {
    data.push_back(std::make_unique<SharedHostMemory>(data_bytes));
    uint64_t s = o.seed * 1000003 + uint64_t(r);
    auto* p = static_cast<uint8_t*>(data[r]->data());
    for (uint64_t i = 0; i < kSourceBytes; i += 8) {
      const uint64_t v = splitmix(&s);
      std::memcpy(p + i, &v, 8);
    }
    ProxyConfig c = cfg;
    c.rank = r;
    Proxy::TransportFactory factory = [&, r](int t) {
      LoopbackOptions lo;
      lo.rank = r;
      lo.world = kWorld;
      lo.thread_index = t;
      lo.reorder = o.reorder;
      lo.seed = o.seed + uint64_t(r);
      return make_loopback_transport(lo);
    };
    proxies.push_back(std::make_unique<Proxy>(c, factory, data[r]->data(), data_bytes, MemoryKind::kHost));
  }
  std::vector<std::vector<std::vector<uint8_t>>> infos(1);
  for (int r = 0; r < kWorld; ++r) infos[0].push_back(proxies[r]->local_info(0));
  for (auto& p : proxies) p->connect(infos);

  // Rank r sends to rank 1 - r: random lengths (16..512 B) from random source offsets into consecutive receive
  // offsets, increments 1..600 (above 255, the reordered immediate's maximum, so the split path runs too).
  std::vector<Plan> plans(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    Plan& pl = plans[r];
    pl.expect.assign(kSlots, 0);
    uint64_t s = o.seed * 7919 + uint64_t(r) + 17, off = kSourceBytes;
    for (uint64_t i = 0; i < o.commands; ++i) {
      const uint64_t len = 16 * (1 + splitmix(&s) % (kMaxWrite / 16));
      const uint64_t src = 16 * (splitmix(&s) % ((kSourceBytes - len) / 16 + 1));
      const uint32_t slot = uint32_t(splitmix(&s) % kSlots);
      const uint32_t value = uint32_t(1 + splitmix(&s) % 600);
      Command c;
      if (int e = encode_write_signal(&c, uint32_t(1 - r), len, src, off, slot, value))
        throw ProxyError(std::string("loopback_selftest: cannot encode: ") + command_error_name(e));
      pl.cmds.push_back(c);
      pl.src.push_back(src);
      pl.dst.push_back(off);
      pl.len.push_back(len);
      pl.expect[slot] += value;
      pl.bytes += len;
      off += len;
    }
  }

  for (auto& p : proxies) p->start();
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> producers;
  std::vector<std::exception_ptr> errs(kWorld * 2);
  for (int r = 0; r < kWorld; ++r)
    for (int f = 0; f < 2; ++f)  // two FIFOs per rank, each carrying every other command
      producers.emplace_back([&, r, f] {
        try {
          const Plan& pl = plans[r];
          for (size_t i = size_t(f); i < pl.cmds.size(); i += 2) proxies[r]->push(f, pl.cmds[i]);
        } catch (...) {
          errs[r * 2 + f] = std::current_exception();
        }
      });
  for (auto& t : producers) t.join();
  for (auto& e : errs)
    if (e) {
      for (auto& p : proxies) p->stop();
      std::rethrow_exception(e);
    }
  auto finish = [&] { for (auto& p : proxies) p->stop(); };
  try {
    for (int r = 0; r < kWorld; ++r)
      for (uint32_t slot = 0; slot < kSlots; ++slot)
        proxies[r]->wait_signal(slot, plans[1 - r].expect[slot], o.timeout_secs);
  } catch (...) {
    finish();
    throw;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  try {
    for (auto& p : proxies) p->wait_idle(o.timeout_secs);
  } catch (...) {
    finish();
    throw;
  }
  finish();
  if (o.inject_fault == "byte") {
    static_cast<uint8_t*>(data[1]->data())[plans[0].dst[o.commands / 2] + 5] ^= 0x40;
  } else if (o.inject_fault == "signal") {
    proxies[1]->signals()[3] += 1;
  } else if (!o.inject_fault.empty()) {
    throw ProxyError("loopback_selftest: inject_fault must be '', 'byte' or 'signal'");
  }

  SelftestResult res;
  for (int r = 0; r < kWorld; ++r) {
    const Plan& sent = plans[1 - r];  // what rank r received
    const auto* src = static_cast<const uint8_t*>(data[1 - r]->data());
    const auto* dst = static_cast<const uint8_t*>(data[r]->data());
    for (size_t i = 0; i < sent.cmds.size(); ++i)
      if (std::memcmp(src + sent.src[i], dst + sent.dst[i], sent.len[i]) != 0) {
        uint64_t k = 0;
        while (src[sent.src[i] + k] == dst[sent.dst[i] + k]) ++k;
        throw ProxyError("loopback_selftest: rank " + std::to_string(r) + " received wrong bytes from rank " +
                         std::to_string(1 - r) + ": command #" + std::to_string(i) + " (" +
                         std::to_string(sent.len[i]) + " bytes to offset " + std::to_string(sent.dst[i]) +
                         ") differs at byte " + std::to_string(k));
      }
    // the receive area past the last write must be untouched
    for (uint64_t b = sent.dst.back() + sent.len.back(); b < data_bytes; ++b)
      if (dst[b] != 0)
        throw ProxyError("loopback_selftest: rank " + std::to_string(r) + " has a stray byte at offset " +
                         std::to_string(b) + " beyond every write");
    const int64_t* sig = proxies[r]->signals();
    for (uint32_t slot = 0; slot < kSlots; ++slot)
      if (sig[slot] != sent.expect[slot])
        throw ProxyError("loopback_selftest: rank " + std::to_string(r) + " signal slot " + std::to_string(slot) +
                         " is " + std::to_string(sig[slot]) + ", expected exactly " +
                         std::to_string(sent.expect[slot]));
    const ProxyThreadStats st = proxies[r]->stats(0);
    if (st.commands != o.commands)
      throw ProxyError("loopback_selftest: rank " + std::to_string(r) + " proxy took " + std::to_string(st.commands) +
                       " commands, expected " + std::to_string(o.commands));
    res.commands += st.commands;
    res.signals += st.signals_applied;
    res.max_reorder_held = std::max(res.max_reorder_held, st.max_reorder_held);
    res.bytes += sent.bytes;
  }
  res.seconds = secs;
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "2 endpoints, %llu write+signal commands (reorder %d, %llu immediates, up to %llu held for order): "
                "%llu bytes and %u counters verified, %.3g commands/s",
                (unsigned long long)res.commands, o.reorder, (unsigned long long)res.signals,
                (unsigned long long)res.max_reorder_held, (unsigned long long)res.bytes, kWorld * kSlots,
                secs > 0 ? double(res.commands) / secs : 0.0);
  res.summary = buf;
  return res;
}

}  // namespace uccl_ep
