// list_shapes.cpp — prints every launch shape kernel_variants.cu compiles, one line per rule and variant:
// "RULE VARIANT SHAPE NAME" (SHAPE: Tuning's arguments as DEEPSPEED_BNB_CUDA_SHAPE takes them; NAME: the part's
// description), so that a machine without a GPU can hold the two to each other and to the product's shapes
// (tests/kernels/test_cuda_build.py). It calls no CUDA function.
// Build: nvcc -std=c++17 -Icsrc/include -Icsrc/cuda kernel_variants.o benchmarks/kernel_variants/list_shapes.cpp
#include <cstdio>

#include "kernel_variants.h"

int main() {
    for (int rule = 0; rule < 3; ++rule) {
        for (int variant = 0; variant < dsbnb::variants::count(); ++variant) {
            std::printf("%d %d %s %s\n", rule, variant, dsbnb::variants::shape(rule, variant),
                        dsbnb::variants::name(rule, variant));
        }
    }
    return 0;
}
