#include "device_bytes.h"

#include <atomic>

namespace ckpt_offload {

namespace {
std::atomic<int64_t> g_device_bytes_saved{0};
}  // namespace

void DeviceBytesHeld::set(int64_t n) noexcept {
  if (n == n_) return;
  g_device_bytes_saved.fetch_add(n - n_);
  n_ = n;
}

int64_t DeviceBytesHeld::total() noexcept { return g_device_bytes_saved.load(); }

}  // namespace ckpt_offload
