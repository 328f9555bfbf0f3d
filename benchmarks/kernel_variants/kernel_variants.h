// kernel_variants.h — the C interface between kernel_variants.cu (the fused kernels in several launch shapes, built
// by nvcc without torch headers) and its torch binding (kernel_variants_binding.cpp). Rules: 0 AdamW, 1 Lion,
// 2 SGD-momentum; variant 0 is the product's own shape of the rule.
#pragma once

#include <array>
#include <cstdio>
#include <tuple>
#include <type_traits>
#include <utility>

#include "adam8bit_launch.h"

namespace dsbnb {
namespace variants {

using Launch = int (*)(const StepArgs&, bool, void*);  // as fused_cuda.h's run() takes it
using Info = int (*)(int* registers, int* blocks_per_sm);  // a CUDA error code (0: none)

int count();
const char* name(int rule, int variant);  // null out of range
const char* shape(int rule, int variant);  // Tuning's arguments, "3,true,false,1,true,false,true"; null out of range
Launch launcher(int rule, int variant);  // null out of range
Info info(int rule, int variant);        // null out of range

}  // namespace variants
}  // namespace dsbnb
