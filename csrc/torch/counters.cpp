#include "counters.h"


namespace ckpt_offload {

const char* keep_reason_name(KeepReason r) {
  switch (r) {
    case KeepReason::Parameter: return "parameter";
    case KeepReason::Buffer: return "buffer";
    case KeepReason::TooSmall: return "too_small";
    case KeepReason::Device: return "device";
    case KeepReason::Layout: return "layout";
    case KeepReason::Subclass: return "subclass";
    case KeepReason::PoolFull: return "pool_full";
    case KeepReason::GraphCapture: return "cuda_graph_capture";
    case KeepReason::DiskFull: return "disk_full";
    case KeepReason::AutocastCast: return "autocast_cast";
    case KeepReason::NoData: return "no_data";
    default: return "unknown";
  }
}

}  // namespace ckpt_offload
