// Device sessions of the sliding window mask.
#include "device_sessions.cuh"

namespace ringattn_torch::device {
RINGATTN_TORCH_DEVICE_SESSIONS(ringattn::sliding_window)
} // namespace ringattn_torch::device
