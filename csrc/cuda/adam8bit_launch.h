// adam8bit_launch.h — the C interface between the CUDA kernels (fused_step.cuh, instantiated by adam8bit.cu,
// lion8bit.cu and momentum8bit.cu, built by nvcc with no torch headers) and their torch bindings (adam8bit_cuda.cpp,
// lion8bit_cuda.cpp, momentum8bit_cuda.cpp, through fused_cuda.h). Raw device pointers only.
#pragma once

#include <cstdint>

#include "dsbnb/adam8bit.h"
#include "dsbnb/master_weights.h"

namespace dsbnb {

// Device copies of one map's quantizer tables, uploaded once per map by the binding (fused_cuda.h).
struct DeviceTables {
    const float* midpoints;  // [256]: between consecutive sorted map values, fp32; [255] a NaN sentinel
    const uint8_t* order;    // [256]: code of each sorted value
    const uint8_t* lo;       // [entries]: compact_quantizer.h's table (when fast)
    int e_lo, span, entries; // its shape
    bool fast;               // the compact table applies (else a binary search / bnb's literal search)
    bool sorted;             // the map is sorted already (order is the identity): bnb's fast path needs it
    PositiveFloor floor;     // the codes floor_positive uses (Adam's second moment, ieee arithmetic)
};

enum class GradType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// DeepSpeed's unscale/clip factor: none, a number the host knows (`value`), or a 0-dim tensor on the device
// (`pointer`, read by the kernel: the host never waits for it).
struct Scale {
    bool present;
    bool on_device;
    float value;
    const float* pointer;
};

// Everything one launch needs. Segments and hyper rows: dsbnb/adam8bit.h; block_starts [S + 1]: each segment's
// first 256-element block among all (prefix sums); block_segment [total_blocks]: the segment of every block.
struct StepArgs {
    const Segment* segments;
    const int64_t* block_starts;
    const int32_t* block_segment;
    int64_t total_blocks;
    const float* hyper;  // [H, hyper_fields]
    int hyper_fields;
    Master params;       // fp32, bf16 or compensated master weights
    const void* grads;
    GradType grad_type;
    uint8_t* codes[2];   // per state (moment 1, moment 2): codes of 8-bit segments, absmax per block, packed fp32
    float* absmax[2];    // state of 32-bit segments, the map and its tables (unused entries null for one state)
    float* state[2];
    const float* qmap[2];
    DeviceTables tables[2];
    Scale scale;
    bool aligned;        // every array 16-byte aligned (8 for codes and error terms): full blocks use wide loads
};

// Each launches its rule's kernel in the arithmetic named by `bnb` (false: "ieee", true: "bnb_cuda") on `stream` (a
// cudaStream_t); returns a cudaError_t as int (0: success).
int launch_adam8bit_step(const StepArgs& args, bool bnb, void* stream);
int launch_lion8bit_step(const StepArgs& args, bool bnb, void* stream);
int launch_momentum8bit_step(const StepArgs& args, bool bnb, void* stream);

}  // namespace dsbnb
