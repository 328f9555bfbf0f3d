// adam8bit_launch.h — the C interface between the CUDA kernels (adam8bit.cu, lion8bit.cu, momentum8bit.cu, built by
// nvcc with no torch headers) and their torch bindings (adam8bit_cuda.cpp, lion8bit_cuda.cpp, momentum8bit_cuda.cpp).
// Raw device pointers only.
#pragma once

#include <cstdint>

#include "dsbnb/adam8bit.h"
#include "dsbnb/master_weights.h"

namespace dsbnb {

// Device copies of one map's QuantTables (midpoints, order, lut), uploaded once per map by the binding.
struct DeviceTables {
    const float* midpoints;  // [256], +inf last
    const int32_t* order;    // [256]
    const int32_t* lut;      // [1 << kLutBits]
    int max_walk;            // compares nearest_sorted needs after the look-up
    PositiveFloor floor;     // the codes floor_positive uses (Adam's second moment)
};

enum class GradType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Launches the fused step on `stream` (a cudaStream_t). block_starts: [segments + 1] prefix sums of each segment's
// 256-element blocks (device), total_blocks its last entry; params the master weights (fp32, bf16 or compensated).
// Returns a cudaError_t as int (0: success).
int launch_adam8bit_step(const Segment* segments, const int64_t* block_starts, int64_t num_segments,
                         int64_t total_blocks, const Hyper* hyper, Master params, const void* grads, GradType grad_type,
                         uint8_t* codes1, uint8_t* codes2, float* absmax1, float* absmax2, float* state1,
                         float* state2, const float* qmap1, const float* qmap2, DeviceTables tables1,
                         DeviceTables tables2, const float* inv_scale, void* stream);

// Launches the fused Lion step on `stream`; as above with one state (codes1/absmax1 or state1) and LionHyper rows.
int launch_lion8bit_step(const Segment* segments, const int64_t* block_starts, int64_t num_segments,
                         int64_t total_blocks, const LionHyper* hyper, Master params, const void* grads,
                         GradType grad_type, uint8_t* codes1, float* absmax1, float* state1, const float* qmap1,
                         DeviceTables tables1, const float* inv_scale, void* stream);

// Launches the fused SGD-momentum step on `stream`; as the Lion launch with MomentumHyper rows.
int launch_momentum8bit_step(const Segment* segments, const int64_t* block_starts, int64_t num_segments,
                             int64_t total_blocks, const MomentumHyper* hyper, Master params, const void* grads,
                             GradType grad_type, uint8_t* codes1, float* absmax1, float* state1, const float* qmap1,
                             DeviceTables tables1, const float* inv_scale, void* stream);

}  // namespace dsbnb
