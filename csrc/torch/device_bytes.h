// The memory timeline's "saved activations on the device" line: bytes of saved activations
// ckpt_offload holds on their device right now (kept tensors, sources still being copied,
// reloaded or prefetched storages).
#pragma once

#include <cstdint>

namespace ckpt_offload {

// Note [Device bytes held]: every holder of device bytes counts them through one of these, so
// the count goes up and down with the holder's lifetime and cannot drift: a forgotten
// subtraction would show only as a wrong plot (tests/core/test_device_bytes.py checks it returns to
// zero after every graph). Movable (the count moves with the holder), not copyable.
class DeviceBytesHeld {
 public:
  DeviceBytesHeld() = default;
  explicit DeviceBytesHeld(int64_t n) { set(n); }
  ~DeviceBytesHeld() { set(0); }
  DeviceBytesHeld(DeviceBytesHeld&& o) noexcept : n_(o.n_) { o.n_ = 0; }
  DeviceBytesHeld& operator=(DeviceBytesHeld&& o) noexcept {
    if (this != &o) {
      set(0);
      n_ = o.n_;
      o.n_ = 0;
    }
    return *this;
  }
  DeviceBytesHeld(const DeviceBytesHeld&) = delete;
  DeviceBytesHeld& operator=(const DeviceBytesHeld&) = delete;

  // Counts `n` bytes for this holder from now on (0: none).
  void set(int64_t n) noexcept;
  void reset() noexcept { set(0); }
  int64_t bytes() const { return n_; }

  // The sum over every live holder.
  static int64_t total() noexcept;

 private:
  int64_t n_ = 0;
};

}  // namespace ckpt_offload
