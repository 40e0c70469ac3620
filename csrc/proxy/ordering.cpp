#include "proxy/ordering.hpp"

#include "proxy/errors.hpp"

namespace uccl_ep {

ImmCodec::ImmCodec(bool ordered, int window) : window_(window) {
  if (window < 2 || window > (1 << 15))
    throw ProxyError("reorder window " + std::to_string(window) + " must be in 2..32768 (UCCL_EP_REORDER_WINDOW)");
  seq_bits_ = 0;
  if (!ordered) {
    while ((1 << seq_bits_) < 2 * window) ++seq_bits_;
  }
  value_bits_ = 17 - seq_bits_;
}

ImmCodec::Signal ImmCodec::decode_signal(uint32_t imm) const {
  Signal s;
  s.slot = imm >> 18;
  s.magnitude = imm & max_magnitude();
  s.negative = (imm >> value_bits_) & 1u;
  s.seq = seq_bits_ ? (imm >> (value_bits_ + 1)) & seq_mask() : 0;
  return s;
}

void SignalSequencer::encode(int dst, uint32_t slot, int64_t add, std::vector<uint32_t>* out) {
  const bool negative = add < 0;
  uint64_t left = negative ? uint64_t(-add) : uint64_t(add);
  uint32_t& seq = next_[size_t(dst) * num_slots_ + slot];
  const uint32_t cap = codec_.max_magnitude();
  do {
    const uint32_t part = left > cap ? cap : uint32_t(left);
    out->push_back(codec_.signal(slot, seq, negative, part));
    seq = (seq + 1) & codec_.seq_mask();
    left -= part;
  } while (left);
}

bool ReorderBuffer::oldest_gap(int* src, uint32_t* slot, uint32_t* expected) const {
  if (held_.empty()) return false;
  const uint64_t k = held_.begin()->first;
  *src = int(k >> 40);
  *slot = uint32_t((k >> 20) & 0xFFFFF);
  *expected = expected_[size_t(*src) * num_slots_ + *slot];
  return true;
}

}  // namespace uccl_ep
