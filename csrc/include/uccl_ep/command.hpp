// The 16-byte command a GPU kernel (or a CPU producer) pushes into a FIFO for a proxy thread to execute.
//
// One header for host and device code: the encoder and decoder must agree bit for bit, and both sides compile it.
// Layout (bit positions within the 128-bit command; word `lo` holds bits 0..63, `hi` bits 64..127):
//
//   type          [  0,   4)  0 = empty slot; a non-zero type marks a valid command (the proxy polls this nibble)
//   dst_rank      [  4,  16)  destination rank, 0..4095
//   slot          [ 16,  30)  signal slot on the destination, 0..16382 (16383 is reserved for proxy control traffic)
//   value         [ 30,  48)  unsigned signal increment, 0..2^18-1 (write+signal)
//   bytes         [ 48,  72)  length in 16-byte units (up to 256 MiB - 16)
//   local_offset  [ 72, 100)  offset in the sender's registered data region, 16-byte units (up to 4 GiB - 16)
//   remote_offset [100, 128)  offset in the receiver's registered data region, 16-byte units
//
// An atomic has no payload: its signed 42-bit addend takes the value and bytes fields ([30, 72)).
// Every encoder returns an error code instead of truncating a field that does not fit.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define UCCL_EP_HD __host__ __device__ __forceinline__
#else
#define UCCL_EP_HD inline
#endif

namespace uccl_ep {

struct alignas(16) Command {
  uint64_t lo;
  uint64_t hi;
};
static_assert(sizeof(Command) == 16, "a command is one 16-byte store");

enum CommandType : uint32_t {
  kCmdEmpty = 0,
  kCmdWrite = 1,        // copy bytes, no signal
  kCmdWriteSignal = 2,  // copy bytes, then add `value` to the destination's signal slot
  kCmdAtomic = 3,       // add a signed 42-bit value to the destination's signal slot
  kCmdQuiet = 4,        // completes when every earlier command of this FIFO has completed locally
  kCmdBarrier = 5,      // quiet, then wait until every rank's same FIFO reached its barrier
  kCmdTypeCount = 6,
};

enum CommandError : int {
  kCmdOk = 0,
  kCmdBadType = 1,
  kCmdRankRange = 2,
  kCmdSlotRange = 3,
  kCmdValueRange = 4,
  kCmdBytesRange = 5,
  kCmdBytesUnaligned = 6,
  kCmdLocalOffsetRange = 7,
  kCmdLocalOffsetUnaligned = 8,
  kCmdRemoteOffsetRange = 9,
  kCmdRemoteOffsetUnaligned = 10,
  kCmdAtomicRange = 11,
};

namespace cmd {
constexpr int kTypePos = 0, kTypeBits = 4;
constexpr int kRankPos = 4, kRankBits = 12;
constexpr int kSlotPos = 16, kSlotBits = 14;
constexpr int kValuePos = 30, kValueBits = 18;
constexpr int kBytesPos = 48, kBytesBits = 24;
constexpr int kLocalPos = 72, kOffsetBits = 28;
constexpr int kRemotePos = 100;
constexpr int kAtomicPos = 30, kAtomicBits = 42;
constexpr uint64_t kUnit = 16;  // bytes and offsets travel in 16-byte units

constexpr uint32_t kMaxRanks = 1u << kRankBits;           // ranks 0..4095
constexpr uint32_t kControlSlot = (1u << kSlotBits) - 1;  // reserved for barriers
constexpr uint32_t kMaxSlots = kControlSlot;              // usable slots 0..16382
constexpr uint32_t kMaxValue = (1u << kValueBits) - 1;
constexpr uint64_t kMaxBytes = ((1ull << kBytesBits) - 1) * kUnit;
constexpr uint64_t kMaxOffset = ((1ull << kOffsetBits) - 1) * kUnit;  // largest encodable offset
constexpr int64_t kMaxAtomic = (1ll << (kAtomicBits - 1)) - 1;
constexpr int64_t kMinAtomic = -(1ll << (kAtomicBits - 1));

UCCL_EP_HD uint64_t mask(int bits) { return bits >= 64 ? ~0ull : ((1ull << bits) - 1); }

// Reads/writes a field that may straddle the two 64-bit words.
UCCL_EP_HD uint64_t get(const Command& c, int pos, int bits) {
  if (pos >= 64) return (c.hi >> (pos - 64)) & mask(bits);
  uint64_t v = c.lo >> pos;
  const int low_bits = 64 - pos;
  if (bits > low_bits) v |= c.hi << low_bits;
  return v & mask(bits);
}

UCCL_EP_HD void put(Command& c, int pos, int bits, uint64_t v) {
  v &= mask(bits);
  if (pos >= 64) {
    c.hi |= v << (pos - 64);
    return;
  }
  c.lo |= v << pos;
  const int low_bits = 64 - pos;
  if (bits > low_bits) c.hi |= v >> low_bits;
}

UCCL_EP_HD int check_span(uint64_t bytes, uint64_t local_offset, uint64_t remote_offset) {
  if (bytes % kUnit) return kCmdBytesUnaligned;
  if (bytes > kMaxBytes) return kCmdBytesRange;
  if (local_offset % kUnit) return kCmdLocalOffsetUnaligned;
  if (local_offset > kMaxOffset) return kCmdLocalOffsetRange;
  if (remote_offset % kUnit) return kCmdRemoteOffsetUnaligned;
  if (remote_offset > kMaxOffset) return kCmdRemoteOffsetRange;
  return kCmdOk;
}
}  // namespace cmd

// Write (with_signal=false: plain; true: add `value` to `slot` on dst_rank after the bytes landed).
UCCL_EP_HD int encode_write(Command* out, uint32_t dst_rank, uint64_t bytes, uint64_t local_offset,
                            uint64_t remote_offset, bool with_signal = false, uint32_t slot = 0,
                            uint32_t value = 0) {
  if (dst_rank >= cmd::kMaxRanks) return kCmdRankRange;
  int err = cmd::check_span(bytes, local_offset, remote_offset);
  if (err != kCmdOk) return err;
  if (!with_signal && bytes == 0) return kCmdBytesRange;  // a plain write of nothing is a producer bug
  if (with_signal && slot >= cmd::kMaxSlots) return kCmdSlotRange;
  if (with_signal && value > cmd::kMaxValue) return kCmdValueRange;
  Command c{0, 0};
  cmd::put(c, cmd::kTypePos, cmd::kTypeBits, with_signal ? kCmdWriteSignal : kCmdWrite);
  cmd::put(c, cmd::kRankPos, cmd::kRankBits, dst_rank);
  if (with_signal) {
    cmd::put(c, cmd::kSlotPos, cmd::kSlotBits, slot);
    cmd::put(c, cmd::kValuePos, cmd::kValueBits, value);
  }
  cmd::put(c, cmd::kBytesPos, cmd::kBytesBits, bytes / cmd::kUnit);
  cmd::put(c, cmd::kLocalPos, cmd::kOffsetBits, local_offset / cmd::kUnit);
  cmd::put(c, cmd::kRemotePos, cmd::kOffsetBits, remote_offset / cmd::kUnit);
  *out = c;
  return kCmdOk;
}

UCCL_EP_HD int encode_write_signal(Command* out, uint32_t dst_rank, uint64_t bytes, uint64_t local_offset,
                                   uint64_t remote_offset, uint32_t slot, uint32_t value) {
  return encode_write(out, dst_rank, bytes, local_offset, remote_offset, true, slot, value);
}

UCCL_EP_HD int encode_atomic(Command* out, uint32_t dst_rank, uint32_t slot, int64_t add) {
  if (dst_rank >= cmd::kMaxRanks) return kCmdRankRange;
  if (slot >= cmd::kMaxSlots) return kCmdSlotRange;
  if (add > cmd::kMaxAtomic || add < cmd::kMinAtomic) return kCmdAtomicRange;
  Command c{0, 0};
  cmd::put(c, cmd::kTypePos, cmd::kTypeBits, kCmdAtomic);
  cmd::put(c, cmd::kRankPos, cmd::kRankBits, dst_rank);
  cmd::put(c, cmd::kSlotPos, cmd::kSlotBits, slot);
  cmd::put(c, cmd::kAtomicPos, cmd::kAtomicBits, static_cast<uint64_t>(add));
  *out = c;
  return kCmdOk;
}

// Quiet and barrier carry no fields: they act on the FIFO they are pushed into.
UCCL_EP_HD int encode_control(Command* out, uint32_t type) {
  if (type != kCmdQuiet && type != kCmdBarrier) return kCmdBadType;
  Command c{0, 0};
  cmd::put(c, cmd::kTypePos, cmd::kTypeBits, type);
  *out = c;
  return kCmdOk;
}

struct CommandFields {
  uint32_t type;
  uint32_t dst_rank;
  uint32_t slot;
  uint32_t value;
  int64_t atomic_add;
  uint64_t bytes;
  uint64_t local_offset;
  uint64_t remote_offset;
};

UCCL_EP_HD uint32_t command_type(const Command& c) {
  return static_cast<uint32_t>(c.lo & cmd::mask(cmd::kTypeBits));
}

UCCL_EP_HD CommandFields decode(const Command& c) {
  CommandFields f;
  f.type = command_type(c);
  f.dst_rank = static_cast<uint32_t>(cmd::get(c, cmd::kRankPos, cmd::kRankBits));
  f.slot = static_cast<uint32_t>(cmd::get(c, cmd::kSlotPos, cmd::kSlotBits));
  f.value = 0;
  f.atomic_add = 0;
  f.bytes = f.local_offset = f.remote_offset = 0;
  if (f.type == kCmdAtomic) {
    uint64_t raw = cmd::get(c, cmd::kAtomicPos, cmd::kAtomicBits);
    // sign-extend the 42-bit two's complement addend
    f.atomic_add = static_cast<int64_t>(raw << (64 - cmd::kAtomicBits)) >> (64 - cmd::kAtomicBits);
    return f;
  }
  f.value = static_cast<uint32_t>(cmd::get(c, cmd::kValuePos, cmd::kValueBits));
  f.bytes = cmd::get(c, cmd::kBytesPos, cmd::kBytesBits) * cmd::kUnit;
  f.local_offset = cmd::get(c, cmd::kLocalPos, cmd::kOffsetBits) * cmd::kUnit;
  f.remote_offset = cmd::get(c, cmd::kRemotePos, cmd::kOffsetBits) * cmd::kUnit;
  return f;
}

inline const char* command_error_name(int err) {
  switch (err) {
    case kCmdOk: return "ok";
    case kCmdBadType: return "unknown command type";
    case kCmdRankRange: return "dst_rank out of range (0..4095)";
    case kCmdSlotRange: return "signal slot out of range (0..16382)";
    case kCmdValueRange: return "signal value out of range (0..262143)";
    case kCmdBytesRange: return "byte count out of range (16..268435440; 0 only with a signal)";
    case kCmdBytesUnaligned: return "byte count not a multiple of 16";
    case kCmdLocalOffsetRange: return "local offset out of range (< 4 GiB)";
    case kCmdLocalOffsetUnaligned: return "local offset not a multiple of 16";
    case kCmdRemoteOffsetRange: return "remote offset out of range (< 4 GiB)";
    case kCmdRemoteOffsetUnaligned: return "remote offset not a multiple of 16";
    case kCmdAtomicRange: return "atomic addend out of range (signed 42 bits)";
    default: return "unknown error";
  }
}

}  // namespace uccl_ep
