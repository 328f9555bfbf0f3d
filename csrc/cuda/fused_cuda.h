// fused_cuda.h — host code the torch bindings of the CUDA kernels share (adam8bit_cuda.cpp, lion8bit_cuda.cpp,
// momentum8bit_cuda.cpp): argument checks, the quantizer tables of a map (sorted order, midpoints and the compact
// table of csrc/include/dsbnb/compact_quantizer.h) uploaded once per map, the segment table's block map (each block's
// segment and each segment's first block) uploaded once per table — both cached per tensor, so a steady-state step
// never synchronizes with the device —, DeepSpeed's unscale factor (a device tensor's address, never its value), the
// model's bf16 copy the kernel may write (with_model_copy), and the launch arguments of every rule (`run`).
// Build: only with a CUDA build of torch, with the bindings. Test: tests/kernels/test_cuda_build.py (syntax, without a
// GPU); tests/kernels/test_fused_rules.py (every rule of the registry) on a machine with a GPU.
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
#include "dsbnb/compact_quantizer.h"

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

// The quantizer tables of one map, on its device.
struct UploadedTables {
    at::Tensor midpoints, order, lo;
    DeviceTables tables;
};

inline DeviceTables tables_for(const at::Tensor& qmap) {
    static ConstantCache<UploadedTables> cache;
    return cache
        .get(qmap,
             [&](const at::Tensor& host) {
                 const float* map = host.data_ptr<float>();
                 int index[256];
                 for (int i = 0; i < 256; ++i) index[i] = i;
                 std::stable_sort(index, index + 256, [map](int a, int b) { return map[a] < map[b]; });
                 float sorted[256], midpoints[256];
                 uint8_t order[256];
                 bool identity = true;
                 for (int i = 0; i < 256; ++i) {
                     sorted[i] = map[index[i]];
                     order[i] = static_cast<uint8_t>(index[i]);
                     identity = identity && index[i] == i;
                 }
                 for (int i = 0; i < 255; ++i) midpoints[i] = (sorted[i] + sorted[i + 1]) / 2.0f;  // the reference's
                 midpoints[255] = NAN;  // a sentinel: no value is below it or equal to it
                 auto compact = std::make_unique<compact::Table>(sorted);
                 PositiveFloor floor;  // the codes of 0 and of the smallest positive value (Adam's v, ieee)
                 for (int i = 0; i + 1 < 256; ++i) {
                     if (sorted[i] == 0.0f && sorted[i + 1] > 0.0f) floor = PositiveFloor{index[i], index[i + 1]};
                 }
                 const auto options = at::TensorOptions().device(qmap.device());
                 auto upload = [&](const void* data, int64_t n, at::ScalarType type) {
                     return at::from_blob(const_cast<void*>(data), {n}, at::TensorOptions().dtype(type))
                         .to(options.dtype(type));
                 };
                 UploadedTables up;
                 up.midpoints = upload(midpoints, 256, at::kFloat);
                 up.order = upload(order, 256, at::kByte);
                 up.lo = upload(compact->lo, std::max(compact->entries(), 1), at::kByte);
                 up.tables = DeviceTables{up.midpoints.data_ptr<float>(), up.order.data_ptr<uint8_t>(),
                                          up.lo.data_ptr<uint8_t>(), compact->e_lo, compact->span,
                                          compact->usable ? compact->entries() : 0, compact->usable, identity,
                                          floor};
                 return up;
             })
        .tables;
}

// What a launch needs from a segment table: its rows on the host (checked on every call, against that call's
// sizes), each segment's first block and each block's segment on the device, and the block count.
struct SegmentBlocks {
    std::vector<Segment> rows;
    at::Tensor starts;  // int64 [S + 1] on the device
    at::Tensor owner;   // int32 [total] on the device: the segment of each block
    int64_t total;      // blocks over all segments
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
        std::vector<int32_t> owner(static_cast<size_t>(starts.back()));
        for (size_t i = 0; i < rows.size(); ++i) {
            std::fill(owner.begin() + starts[i], owner.begin() + starts[i + 1], static_cast<int32_t>(i));
        }
        const auto device = at::TensorOptions().device(segments.device());
        return SegmentBlocks{rows, at::tensor(starts, at::TensorOptions().dtype(at::kLong)).to(device),
                             at::tensor(owner, at::TensorOptions().dtype(at::kInt)).to(device), starts.back()};
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

// The model's copy of the updated weights (lp_params), checked, into `master`: bf16 beside fp32 master weights, on
// their device, the partition's size, sharing no byte with them. Its kind then has the kernel write it
// (kFloat32WithBf16Copy), where DeepSpeed's step otherwise converts the partition in a pass of its own after the
// optimizer (6 bytes per element beside the 8-bit step's 16; runtime/zero/lp_copy.py). The CPU kernels also write fp32
// copies; on a GPU an fp32 model's copy stays DeepSpeed's.
inline void with_model_copy(const Checker& check, const at::Tensor& params, Master& master,
                            const std::optional<at::Tensor>& lp_params) {
    if (!lp_params.has_value()) return;
    const at::Tensor& lp = *lp_params;
    check(master.kind == MasterKind::kFloat32, "lp_params (the model's copy of the updated weights) goes with float32 "
                                               "master weights; bf16 master weights are that copy themselves");
    check(lp.scalar_type() == at::kBFloat16,
          std::string("lp_params must be bfloat16 on a GPU (the CUDA kernels write a bf16 copy), got ") +
              c10::toString(lp.scalar_type()));
    check(lp.is_cuda() && lp.get_device() == params.get_device() && lp.is_contiguous(),
          "lp_params must be a contiguous tensor on params' CUDA device");
    check(lp.numel() == params.numel(), "lp_params and params differ in size (" + std::to_string(lp.numel()) + " vs " +
                                            std::to_string(params.numel()) + " elements)");
    const auto start = reinterpret_cast<uintptr_t>(lp.data_ptr()), end = start + 2 * lp.numel();
    const auto first = reinterpret_cast<uintptr_t>(params.data_ptr()), last = first + 4 * params.numel();
    check(end <= first || last <= start, "lp_params overlaps params (the copy must be a tensor of its own)");
    master.kind = MasterKind::kFloat32WithBf16Copy;
    master.copy = static_cast<uint16_t*>(lp.data_ptr());
}

inline GradType grad_type(const Checker& check, const at::Tensor& grads) {
    const GradType type = grads.scalar_type() == at::kBFloat16 ? GradType::kBFloat16
                          : grads.scalar_type() == at::kHalf   ? GradType::kFloat16
                                                               : GradType::kFloat32;
    check(grads.scalar_type() == at::kFloat || type != GradType::kFloat32,
          "grads must be float32, bfloat16 or float16");
    return type;
}

// DeepSpeed's unscale/clip factor: none; a one-element float32 tensor on params' device (its address: the kernel
// reads it, the host never waits); or one on the CPU (a number the host knows, read here).
inline Scale scale_of(const Checker& check, const at::Tensor& params, const std::optional<at::Tensor>& inv_scale) {
    if (!inv_scale.has_value()) return Scale{false, false, 1.0f, nullptr};
    check(inv_scale->scalar_type() == at::kFloat && inv_scale->numel() == 1,
          "inv_scale must be a one-element float32 tensor");
    if (inv_scale->device().is_cpu()) return Scale{true, false, inv_scale->item<float>(), nullptr};
    check(inv_scale->is_cuda() && inv_scale->get_device() == params.get_device(),
          "inv_scale must be on params' CUDA device or on the CPU");
    return Scale{true, true, 1.0f, inv_scale->data_ptr<float>()};
}

// true for "bnb_cuda" (bitsandbytes' own CUDA arithmetic), false for "ieee"; anything else refused.
inline bool bnb_arithmetic(const Checker& check, c10::string_view arithmetic) {
    const std::string name(arithmetic.data(), arithmetic.size());
    check(name == "ieee" || name == "bnb_cuda", "arithmetic must be 'ieee' or 'bnb_cuda', got '" + name + "'");
    return name == "bnb_cuda";
}

inline bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// One state's tensors (moment k): codes and absmax of 8-bit segments, the packed fp32 state of 32-bit ones, the map.
struct StateTensors {
    at::Tensor* codes;
    at::Tensor* absmax;
    at::Tensor* state;
    const at::Tensor* qmap;
};

using Launch = int (*)(const StepArgs&, bool, void*);

// Checks an operator's arguments and launches `launch` on the current stream: `ieee_fields` is the width of its
// ieee hyper rows (the bnb_cuda ones are kBnbHyperFields wide for every rule).
inline void run(const char* op, Launch launch, at::Tensor& params, const at::Tensor& grads,
                std::initializer_list<StateTensors> state_list, const at::Tensor& segments, const at::Tensor& hyper,
                int64_t ieee_fields, const std::optional<at::Tensor>& inv_scale,
                const std::optional<at::Tensor>& error, c10::string_view arithmetic,
                const std::optional<at::Tensor>& lp_params = std::nullopt) {
    const Checker check(op);
    const std::vector<StateTensors> states(state_list);
    const bool bnb = bnb_arithmetic(check, arithmetic);
    const c10::cuda::CUDAGuard guard(params.device());
    std::vector<const at::Tensor*> tensors = {&params, &grads, &segments, &hyper};
    for (const StateTensors& s : states) tensors.insert(tensors.end(), {s.codes, s.absmax, s.state, s.qmap});
    for (const at::Tensor* t : tensors) {
        check(t->is_cuda() && t->get_device() == params.get_device() && t->is_contiguous(),
              "every tensor must be contiguous and on params' CUDA device");
    }
    bool ok = segments.scalar_type() == at::kLong && hyper.scalar_type() == at::kFloat;
    for (const StateTensors& s : states) {
        ok &= s.codes->scalar_type() == at::kByte && s.absmax->scalar_type() == at::kFloat &&
              s.state->scalar_type() == at::kFloat && s.qmap->scalar_type() == at::kFloat;
        check(s.qmap->numel() == 256, "every qmap must hold 256 entries");
    }
    check(ok, "dtypes: hyper, absmax, fp32 state and maps float32; segments int64; codes uint8");
    const int64_t fields = bnb ? kBnbHyperFields : ieee_fields;
    check(segments.dim() == 2 && segments.size(1) == kSegmentFields, "segments must be int64 [S, 5]");
    check(hyper.dim() == 2 && hyper.size(1) == fields,
          "hyper must be float32 [H, " + std::to_string(fields) + "] in the '" +
              std::string(arithmetic.data(), arithmetic.size()) + "' arithmetic");
    check(grads.numel() == params.numel(), "grads and params differ in size");
    StateSizes sizes[2];
    for (size_t k = 0; k < states.size(); ++k) {
        sizes[k] = {states[k].codes->numel(), states[k].absmax->numel(), states[k].state->numel()};
    }
    const SegmentBlocks& blocks = blocks_for(segments);
    for (size_t i = 0; i < blocks.rows.size(); ++i) {
        const char* problem = segment_problem(blocks.rows[i], params.numel(), hyper.size(0), sizes,
                                              static_cast<int>(states.size()));
        check(problem == nullptr, "segment " + std::to_string(i) + ": " + (problem ? problem : ""));
    }
    StepArgs a{};
    a.segments = reinterpret_cast<const Segment*>(segments.data_ptr<int64_t>());
    a.block_starts = blocks.starts.data_ptr<int64_t>();
    a.block_segment = blocks.owner.data_ptr<int32_t>();
    a.total_blocks = blocks.total;
    a.hyper = hyper.data_ptr<float>();
    a.hyper_fields = static_cast<int>(fields);
    a.params = master_of(check, params, error);
    with_model_copy(check, params, a.params, lp_params);
    a.grads = grads.data_ptr();
    a.grad_type = grad_type(check, grads);
    a.scale = scale_of(check, params, inv_scale);
    a.aligned = aligned(a.params.values, 16) && aligned(a.grads, 16) &&
                (!a.params.error || aligned(a.params.error, 8)) && (!a.params.copy || aligned(a.params.copy, 16));
    for (size_t k = 0; k < states.size(); ++k) {
        a.codes[k] = states[k].codes->data_ptr<uint8_t>();
        a.absmax[k] = states[k].absmax->data_ptr<float>();
        a.state[k] = states[k].state->data_ptr<float>();
        a.qmap[k] = states[k].qmap->data_ptr<float>();
        a.tables[k] = tables_for(*states[k].qmap);
        a.aligned = a.aligned && aligned(a.codes[k], 8);
    }
    const int status = launch(a, bnb, c10::cuda::getCurrentCUDAStream().stream());
    check(status == 0, "kernel launch failed with CUDA error " + std::to_string(status));
}

}  // namespace binding
}  // namespace dsbnb
