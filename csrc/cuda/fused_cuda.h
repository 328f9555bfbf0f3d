// fused_cuda.h — host code the torch bindings of the CUDA kernels share (adam8bit_cuda.cpp, lion8bit_cuda.cpp,
// momentum8bit_cuda.cpp): the quantizer tables of a map uploaded once per map, the segment table's block offsets
// uploaded once per table (both cached per tensor, so a steady-state step never synchronizes with the device), the
// per-call segment checks on the cached host rows, and the gradient argument of the launch.
// Build: only with a CUDA build of torch, with the bindings. Test: tests/test_cuda_build.py (syntax, without a GPU);
// tests/test_fused_rules.py (every rule of the registry) on a machine with a GPU.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "adam8bit_launch.h"

namespace dsbnb {
namespace binding {

// Identifies one constant input tensor across calls without reading it: its address, shape and version counter
// (bumped by every in-place write, views included). The cache holds a reference to the tensor, so its memory cannot
// be freed and handed to another tensor while the entry lives: an equal key means the same, unmodified content.
struct TensorKey {
    const void* data;
    int64_t numel;
    int64_t version;
    int device;
    static TensorKey of(const at::Tensor& t) {
        return {t.data_ptr(), t.numel(), static_cast<int64_t>(t._version()), t.get_device()};
    }
    bool operator==(const TensorKey& o) const {
        return data == o.data && numel == o.numel && version == o.version && device == o.device;
    }
};

// A small cache of values derived on the host from constant tensors (most runs hold two maps and one segment table
// per param group); the oldest entry goes first.
template <typename Value>
class ConstantCache {
   public:
    template <typename Make>
    const Value& get(const at::Tensor& t, Make make) {
        const TensorKey key = TensorKey::of(t);
        std::lock_guard<std::mutex> guard(lock_);
        for (const auto& entry : entries_) {
            if (entry->key == key) return entry->value;
        }
        if (entries_.size() >= kCapacity) entries_.erase(entries_.begin());
        entries_.push_back(std::make_unique<Entry>(Entry{key, t, make(t.to(at::kCPU).contiguous())}));
        return entries_.back()->value;
    }

   private:
    struct Entry {
        TensorKey key;
        at::Tensor keep_alive;  // pins the address in the key
        Value value;
    };
    static constexpr size_t kCapacity = 64;
    std::mutex lock_;
    std::vector<std::unique_ptr<Entry>> entries_;
};

// The quantizer tables of one map, uploaded to its device.
struct UploadedTables {
    at::Tensor midpoints, order, lut;
    int max_walk;
    PositiveFloor floor;
    DeviceTables view() const {
        return {midpoints.data_ptr<float>(), order.data_ptr<int32_t>(), lut.data_ptr<int32_t>(), max_walk, floor};
    }
};

inline DeviceTables tables_for(const at::Tensor& qmap) {
    static ConstantCache<UploadedTables> cache;
    return cache
        .get(qmap,
             [&](const at::Tensor& host) {
                 auto tables = std::make_unique<QuantTables>(host.data_ptr<float>());
                 auto upload = [&](const void* data, int64_t n, at::ScalarType type) {
                     return at::from_blob(const_cast<void*>(data), {n}, at::TensorOptions().dtype(type))
                         .to(qmap.device());
                 };
                 return UploadedTables{upload(tables->midpoints, 256, at::kFloat),
                                       upload(tables->order, 256, at::kInt),
                                       upload(tables->lut, 1 << kLutBits, at::kInt), tables->max_walk,
                                       tables->floor};
             })
        .view();
}

// What a launch needs from a segment table: its rows on the host (checked on every call, against that call's
// sizes), the first block of each segment on the device, and the block count.
struct SegmentBlocks {
    std::vector<Segment> rows;
    at::Tensor starts;  // int64 [S + 1] on the device
    int64_t total;      // blocks over all segments (the grid size)
};

inline const SegmentBlocks& blocks_for(const at::Tensor& segments) {
    static ConstantCache<SegmentBlocks> cache;
    return cache.get(segments, [&](const at::Tensor& host) {
        const auto* first = reinterpret_cast<const Segment*>(host.data_ptr<int64_t>());
        std::vector<Segment> rows(first, first + segments.size(0));
        std::vector<int64_t> starts(rows.size() + 1, 0);
        for (size_t i = 0; i < rows.size(); ++i) {
            starts[i + 1] = starts[i] + (std::max<int64_t>(rows[i].numel, 0) + kBlock - 1) / kBlock;
        }
        return SegmentBlocks{rows, at::tensor(starts, at::TensorOptions().dtype(at::kLong)).to(segments.device()),
                             starts.back()};
    });
}

// Argument checks whose messages name the operator.
class Checker {
   public:
    explicit Checker(const char* op) : op_(op) {}
    void operator()(bool ok, const std::string& message) const {
        TORCH_CHECK(ok, "deepspeed_bnb::", op_, " (CUDA): ", message);
    }

   private:
    const char* op_;
};

// Checks what every launch needs (`tensors` contiguous on params' device, `floats` float32, `codes` uint8, segments
// int64, the tables' shapes) and the segment rows against the partition and the states' arrays; returns the segment
// table's cached blocks.
inline const SegmentBlocks& check_and_plan(const Checker& check, const at::Tensor& params,
                                           std::initializer_list<const at::Tensor*> tensors,
                                           std::initializer_list<const at::Tensor*> floats,
                                           std::initializer_list<const at::Tensor*> codes, const at::Tensor& segments,
                                           const at::Tensor& hyper, int64_t hyper_fields, const StateSizes* states,
                                           int num_states) {
    for (const at::Tensor* t : tensors) {
        check(t->is_cuda() && t->get_device() == params.get_device() && t->is_contiguous(),
              "every tensor must be contiguous and on params' CUDA device");
    }
    bool ok = segments.scalar_type() == at::kLong;
    for (const at::Tensor* t : floats) ok &= t->scalar_type() == at::kFloat;
    for (const at::Tensor* t : codes) ok &= t->scalar_type() == at::kByte;
    check(ok, "dtypes: hyper, absmax, fp32 state and maps float32; segments int64; codes uint8");
    check(segments.dim() == 2 && segments.size(1) == kSegmentFields, "segments must be int64 [S, 5]");
    check(hyper.dim() == 2 && hyper.size(1) == hyper_fields,
          "hyper must be float32 [H, " + std::to_string(hyper_fields) + "]");
    const SegmentBlocks& blocks = blocks_for(segments);
    for (size_t i = 0; i < blocks.rows.size(); ++i) {
        const char* problem = segment_problem(blocks.rows[i], params.numel(), hyper.size(0), states, num_states);
        check(problem == nullptr, "segment " + std::to_string(i) + ": " + (problem ? problem : ""));
    }
    return blocks;
}

// The master weights of an operator's `params` and `error` (fp32; bf16; bf16 with int8 error terms), checked.
inline Master master_of(const Checker& check, const at::Tensor& params, const std::optional<at::Tensor>& error) {
    if (params.scalar_type() == at::kFloat) {
        check(!error.has_value(), "error (the int8 error terms of compensated master weights) goes with bfloat16 "
                                  "params, got float32 params");
        return {MasterKind::kFloat32, params.data_ptr<float>(), nullptr};
    }
    check(params.scalar_type() == at::kBFloat16, "params must be float32 or bfloat16");
    if (!error.has_value()) return {MasterKind::kBFloat16, params.data_ptr(), nullptr};
    check(error->scalar_type() == at::kChar && error->numel() == params.numel() && error->is_contiguous() &&
              error->is_cuda() && error->get_device() == params.get_device(),
          "error must be a contiguous int8 tensor of params' size on params' device");
    return {MasterKind::kCompensated, params.data_ptr(), error->data_ptr<int8_t>()};
}

// The device address of DeepSpeed's unscale/clip factor (nullptr: none), read by the kernel so that the host never
// waits for it; and the arithmetic check (only "ieee" here).
inline const float* scale_of(const Checker& check, const at::Tensor& params, const std::optional<at::Tensor>& inv_scale,
                             c10::string_view arithmetic) {
    check(arithmetic == "ieee", "unknown arithmetic '" + std::string(arithmetic.data(), arithmetic.size()) + "'");
    if (!inv_scale.has_value()) return nullptr;
    check(inv_scale->scalar_type() == at::kFloat && inv_scale->numel() == 1 && inv_scale->is_cuda() &&
              inv_scale->get_device() == params.get_device(),
          "inv_scale must be a one-element float32 tensor on params' CUDA device");
    return inv_scale->data_ptr<float>();
}

inline GradType grad_type(const Checker& check, const at::Tensor& grads) {
    const GradType type = grads.scalar_type() == at::kBFloat16 ? GradType::kBFloat16
                          : grads.scalar_type() == at::kHalf   ? GradType::kFloat16
                                                               : GradType::kFloat32;
    check(grads.scalar_type() == at::kFloat || type != GradType::kFloat32, "grads must be float32, bfloat16 or float16");
    return type;
}

}  // namespace binding
}  // namespace dsbnb
