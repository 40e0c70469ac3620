// Ordering emulation: signal increments as 32-bit immediates, applied in order even on unordered transports.
//
// Immediate layout (slot in the top 14 bits, so a receiver can always tell control traffic from signals):
//   signal:  slot[31:18] | seq[17:17-S] | neg[1] | magnitude[V]      S = seq_bits (0 on in-order transports),
//                                                                     V = 17 - S
//   control: 0x3FFF[31:18] | kind[17:16] | fifo[15:10] | epoch[9:0]
// seq_bits is the smallest S with 2^S >= 2 * window, so an arrival at most `window` ahead of the expected number is
// never confused with an old one. Each (receiver, source rank, slot) lane has its own sequence: the receiver applies
// lane increments strictly in sequence, holding early ones (at most `window` of them).
// Rule: a slot's counter only proves that the writes which carried its increments landed if every increment for that
// slot arrives through the same lane, i.e. from one sender rank's proxy thread. Feed each slot from one sender thread.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "uccl_ep/command.hpp"

namespace uccl_ep {

class ImmCodec {
 public:
  ImmCodec(bool ordered, int window);
  int seq_bits() const { return seq_bits_; }
  uint32_t max_magnitude() const { return (1u << value_bits_) - 1; }
  uint32_t seq_mask() const { return seq_bits_ ? (1u << seq_bits_) - 1 : 0; }

  uint32_t signal(uint32_t slot, uint32_t seq, bool negative, uint32_t magnitude) const {
    return (slot << 18) | encode_low(seq, negative, magnitude);
  }
  struct Signal {
    uint32_t slot, seq;
    bool negative;
    uint32_t magnitude;
  };
  static bool is_control(uint32_t imm) { return (imm >> 18) == cmd::kControlSlot; }
  Signal decode_signal(uint32_t imm) const;

  static uint32_t barrier(uint32_t fifo, uint32_t epoch) {
    return (cmd::kControlSlot << 18) | (1u << 16) | ((fifo & 63u) << 10) | (epoch & 1023u);
  }
  static uint32_t control_fifo(uint32_t imm) { return (imm >> 10) & 63u; }
  static uint32_t control_epoch(uint32_t imm) { return imm & 1023u; }
  static constexpr uint32_t kEpochMask = 1023u;

 private:
  uint32_t encode_low(uint32_t seq, bool negative, uint32_t magnitude) const {
    return ((seq & seq_mask()) << (value_bits_ + 1)) | (uint32_t(negative) << value_bits_) | magnitude;
  }
  int window_;
  int seq_bits_;
  int value_bits_;
};

// Sender side: splits an increment into immediates that each fit, numbering them per (destination, slot).
class SignalSequencer {
 public:
  SignalSequencer(const ImmCodec& codec, int world, uint32_t num_slots)
      : codec_(codec), num_slots_(num_slots), next_(size_t(world) * num_slots, 0) {}
  // Appends the immediates carrying `add` to `out` (at least one, even for add == 0, so the write it rides on is
  // still announced).
  void encode(int dst, uint32_t slot, int64_t add, std::vector<uint32_t>* out);
  // encode() for the common increment that fits one immediate, without a vector (the proxy calls this once per
  // command). False, and nothing numbered, when `add` must be split: then call encode().
  bool encode_one(int dst, uint32_t slot, int64_t add, uint32_t* imm) {
    const bool negative = add < 0;
    const uint64_t magnitude = negative ? 0 - uint64_t(add) : uint64_t(add);
    if (magnitude > codec_.max_magnitude()) return false;
    uint32_t& seq = next_[size_t(dst) * num_slots_ + slot];
    *imm = codec_.signal(slot, seq, negative, uint32_t(magnitude));
    seq = (seq + 1) & codec_.seq_mask();
    return true;
  }

 private:
  const ImmCodec& codec_;
  uint32_t num_slots_;
  std::vector<uint32_t> next_;
};

// Receiver side: applies increments in sequence order per (source rank, slot).
class ReorderBuffer {
 public:
  ReorderBuffer(const ImmCodec& codec, int world, uint32_t num_slots, int window)
      : codec_(codec), num_slots_(num_slots), window_(window), expected_(size_t(world) * num_slots, 0) {}

  // Deliver one signal immediate; calls apply(slot, delta) for it and every held successor it releases. Returns
  // an empty string, or an error (sequence number outside the window or a duplicate).
  template <class Apply>
  std::string receive(int src, uint32_t imm, Apply&& apply);

  size_t held() const { return held_.size(); }
  // For the watchdog: a lane that holds early increments and what it waits for.
  bool oldest_gap(int* src, uint32_t* slot, uint32_t* expected) const;

 private:
  static uint64_t key(int src, uint32_t slot, uint32_t seq) { return (uint64_t(src) << 40) | (uint64_t(slot) << 20) | seq; }
  const ImmCodec& codec_;
  uint32_t num_slots_;
  int window_;
  std::vector<uint32_t> expected_;
  std::unordered_map<uint64_t, int64_t> held_;
};

template <class Apply>
std::string ReorderBuffer::receive(int src, uint32_t imm, Apply&& apply) {
  const ImmCodec::Signal s = codec_.decode_signal(imm);
  if (s.slot >= num_slots_)
    return "signal slot " + std::to_string(s.slot) + " from rank " + std::to_string(src) + " is outside the " +
           std::to_string(num_slots_) + " slots of this rank";
  const int64_t delta = s.negative ? -int64_t(s.magnitude) : int64_t(s.magnitude);
  if (codec_.seq_bits() == 0) {
    apply(s.slot, delta);
    return {};
  }
  const uint32_t mask = codec_.seq_mask();
  uint32_t& exp = expected_[size_t(src) * num_slots_ + s.slot];
  const uint32_t ahead = (s.seq - exp) & mask;
  if (ahead == 0) {
    apply(s.slot, delta);
    exp = (exp + 1) & mask;
    while (!held_.empty()) {
      auto it = held_.find(key(src, s.slot, exp));
      if (it == held_.end()) break;
      apply(s.slot, it->second);
      held_.erase(it);
      exp = (exp + 1) & mask;
    }
    return {};
  }
  if (ahead >= uint32_t(window_))
    return "signal from rank " + std::to_string(src) + " slot " + std::to_string(s.slot) + " has sequence " +
           std::to_string(s.seq) + " but " + std::to_string(exp) + " is expected: outside the reorder window of " +
           std::to_string(window_) + " (raise UCCL_EP_REORDER_WINDOW or lower the in-flight caps)";
  if (!held_.emplace(key(src, s.slot, s.seq), delta).second)
    return "duplicate signal from rank " + std::to_string(src) + " slot " + std::to_string(s.slot) + " sequence " +
           std::to_string(s.seq);
  return {};
}

}  // namespace uccl_ep
