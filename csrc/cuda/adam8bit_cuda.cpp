// adam8bit_cuda.cpp — the torch binding of the CUDA kernel (adam8bit.cu): checks the arguments, uploads the
// quantizer tables once per map and the segment block offsets once per segment table, and launches on the current
// stream. Steady state has no host-device synchronization: the maps and segment tables are constants of a run, so
// what the host derives from them is cached per tensor (see TensorKey). Registered as the CUDA implementation of deepspeed_bnb::adam8bit_step_ (schema: csrc/ops.cpp).
// Build: only with a CUDA build of torch, by deepspeed_bnb/ops/loader.py (JIT) or setup.py (prebuilt).
// Test: pytest tests/test_fused_step.py on a machine with a GPU.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "adam8bit_launch.h"

namespace {

using dsbnb::DeviceTables;

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
    DeviceTables view() const {
        return {midpoints.data_ptr<float>(), order.data_ptr<int32_t>(), lut.data_ptr<int32_t>(), max_walk};
    }
};

DeviceTables tables_for(const at::Tensor& qmap) {
    static ConstantCache<UploadedTables> cache;
    return cache
        .get(qmap,
             [&](const at::Tensor& host) {
                 auto tables = std::make_unique<dsbnb::QuantTables>(host.data_ptr<float>());
                 auto upload = [&](const void* data, int64_t n, at::ScalarType type) {
                     return at::from_blob(const_cast<void*>(data), {n}, at::TensorOptions().dtype(type))
                         .to(qmap.device());
                 };
                 return UploadedTables{upload(tables->midpoints, 256, at::kFloat),
                                       upload(tables->order, 256, at::kInt),
                                       upload(tables->lut, 1 << dsbnb::kLutBits, at::kInt), tables->max_walk};
             })
        .view();
}

// What the launch needs from a segment table: its rows on the host (checked on every call, against that call's
// sizes), the first block of each segment on the device, and the block count.
struct SegmentBlocks {
    std::vector<dsbnb::Segment> rows;
    at::Tensor starts;  // int64 [S + 1] on the device
    int64_t total;      // blocks over all segments (the grid size)
};

const SegmentBlocks& blocks_for(const at::Tensor& segments) {
    static ConstantCache<SegmentBlocks> cache;
    return cache.get(segments, [&](const at::Tensor& host) {
        const auto* first = reinterpret_cast<const dsbnb::Segment*>(host.data_ptr<int64_t>());
        std::vector<dsbnb::Segment> rows(first, first + segments.size(0));
        std::vector<int64_t> starts(rows.size() + 1, 0);
        for (size_t i = 0; i < rows.size(); ++i) {
            starts[i + 1] = starts[i] + (std::max<int64_t>(rows[i].numel, 0) + dsbnb::kBlock - 1) / dsbnb::kBlock;
        }
        return SegmentBlocks{rows, at::tensor(starts, at::TensorOptions().dtype(at::kLong)).to(segments.device()),
                             starts.back()};
    });
}

void check(bool ok, const std::string& message) { TORCH_CHECK(ok, "deepspeed_bnb::adam8bit_step_ (CUDA): ", message); }

void adam8bit_step_cuda(at::Tensor params, const at::Tensor& grads, at::Tensor codes1, at::Tensor codes2,
                        at::Tensor absmax1, at::Tensor absmax2, at::Tensor state1, at::Tensor state2,
                        const at::Tensor& qmap1, const at::Tensor& qmap2, const at::Tensor& segments,
                        const at::Tensor& hyper, double inv_scale, const std::optional<at::Tensor>& lp_params) {
    const at::Tensor* all[] = {&params, &grads, &codes1, &codes2, &absmax1, &absmax2, &state1, &state2,
                               &qmap1, &qmap2, &segments, &hyper};
    for (const at::Tensor* t : all) {
        check(t->is_cuda() && t->get_device() == params.get_device() && t->is_contiguous(),
              "every tensor must be contiguous and on params' CUDA device");
    }
    check(params.scalar_type() == at::kFloat && hyper.scalar_type() == at::kFloat &&
              segments.scalar_type() == at::kLong && codes1.scalar_type() == at::kByte &&
              codes2.scalar_type() == at::kByte,
          "dtypes: params/hyper float32, segments int64, codes uint8");
    check(segments.dim() == 2 && segments.size(1) == dsbnb::kSegmentFields, "segments must be int64 [S, 5]");
    check(hyper.dim() == 2 && hyper.size(1) == dsbnb::kHyperFields, "hyper must be float32 [H, 7]");
    const c10::cuda::CUDAGuard guard(params.device());

    const SegmentBlocks& blocks = blocks_for(segments);
    for (size_t i = 0; i < blocks.rows.size(); ++i) {
        const dsbnb::Segment& s = blocks.rows[i];
        const std::string where = "segment " + std::to_string(i) + ": ";
        check(s.offset >= 0 && s.numel > 0 && s.offset + s.numel <= params.numel() && s.offset % dsbnb::kBlock == 0,
              where + "outside the partition or not block-aligned");
        check(s.hyper_row >= 0 && s.hyper_row < hyper.size(0), where + "hyper_row outside the hyper table");
        check(s.eight_bit || (s.fp32_offset >= 0 && s.fp32_offset + s.numel <= state1.numel() &&
                              s.fp32_offset + s.numel <= state2.numel()),
              where + "fp32 state too short");
        check(!s.eight_bit || (codes1.numel() == params.numel() && codes2.numel() == params.numel() &&
                               absmax1.numel() * dsbnb::kBlock >= s.offset + s.numel &&
                               absmax2.numel() * dsbnb::kBlock >= s.offset + s.numel),
              where + "codes/absmax too short for an 8-bit segment");
    }

    dsbnb::GradType grad_type = grads.scalar_type() == at::kBFloat16 ? dsbnb::GradType::kBFloat16
                                : grads.scalar_type() == at::kHalf   ? dsbnb::GradType::kFloat16
                                                                     : dsbnb::GradType::kFloat32;
    check(grads.scalar_type() == at::kFloat || grad_type != dsbnb::GradType::kFloat32,
          "grads must be float32, bfloat16 or float16");
    void* low = nullptr;
    dsbnb::LowType low_type = dsbnb::LowType::kNone;
    if (lp_params.has_value()) {
        const at::Tensor& lp = *lp_params;
        check(lp.is_cuda() && lp.is_contiguous() && lp.numel() == params.numel(), "lp_params: partition-sized");
        low = lp.data_ptr();
        low_type = lp.scalar_type() == at::kBFloat16 ? dsbnb::LowType::kBFloat16 : dsbnb::LowType::kFloat16;
        check(lp.scalar_type() == at::kBFloat16 || lp.scalar_type() == at::kHalf, "lp_params must be bf16 or fp16");
    }
    const int status = dsbnb::launch_adam8bit_step(
        reinterpret_cast<const dsbnb::Segment*>(segments.data_ptr<int64_t>()), blocks.starts.data_ptr<int64_t>(),
        segments.size(0), blocks.total, reinterpret_cast<const dsbnb::Hyper*>(hyper.data_ptr<float>()),
        params.data_ptr<float>(), grads.data_ptr(), grad_type, codes1.data_ptr<uint8_t>(), codes2.data_ptr<uint8_t>(),
        absmax1.data_ptr<float>(), absmax2.data_ptr<float>(), state1.data_ptr<float>(), state2.data_ptr<float>(),
        qmap1.data_ptr<float>(), qmap2.data_ptr<float>(), tables_for(qmap1), tables_for(qmap2), inv_scale != 1.0,
        static_cast<float>(inv_scale), low, low_type, c10::cuda::getCurrentCUDAStream().stream());
    check(status == 0, "kernel launch failed with CUDA error " + std::to_string(status));
}

}  // namespace

TORCH_LIBRARY_IMPL(deepspeed_bnb, CUDA, m) { m.impl("adam8bit_step_", &adam8bit_step_cuda); }
