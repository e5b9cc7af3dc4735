// PyTorch binding of the multi-tensor copy/cast kernel: multi_tensor_copy(dst_list, src_list, stream) copies
// src[i] into dst[i] on `stream` (a cudaStream_t as int, e.g. torch.cuda.current_stream().cuda_stream) of the
// current device, one launch per kMaxTensors tensors. Only <torch/extension.h> and the CUDA runtime are used
// (no c10/cuda headers), so the file also compiles against a CPU build of torch's headers. All sources share one dtype
// and all targets share one dtype (fp32, bf16 or fp16); tensors are contiguous, on one device, with equal numel.
#include <torch/extension.h>

#include <vector>

#include "multi_tensor_copy_kernel.cuh"

namespace {

void check(cudaError_t e) { TORCH_CHECK(e == cudaSuccess, "multi_tensor_copy: ", cudaGetErrorString(e)); }

template <typename S, typename D>
void run(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src, cudaStream_t stream) {
  hk_sync::Launcher<S, D> launcher(stream);
  for (size_t i = 0; i < dst.size(); ++i) check(launcher.add(dst[i].data_ptr(), src[i].data_ptr(), dst[i].numel()));
  check(launcher.flush());
}

template <typename S>
void run_dst(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src, at::ScalarType dt,
             cudaStream_t stream) {
  switch (dt) {
    case at::kFloat: return run<S, hk_sync::F32>(dst, src, stream);
    case at::kBFloat16: return run<S, hk_sync::BF16>(dst, src, stream);
    case at::kHalf: return run<S, hk_sync::F16>(dst, src, stream);
    default: TORCH_CHECK(false, "multi_tensor_copy: unsupported target dtype ", dt);
  }
}

void multi_tensor_copy(std::vector<at::Tensor> dst, std::vector<at::Tensor> src, int64_t stream_handle) {
  TORCH_CHECK(dst.size() == src.size(), "multi_tensor_copy: ", dst.size(), " targets but ", src.size(), " sources");
  if (dst.empty()) return;
  const auto st = src[0].scalar_type(), dt = dst[0].scalar_type();
  const auto dev = dst[0].device();
  TORCH_CHECK(dev.is_cuda(), "multi_tensor_copy: tensors must be on a CUDA device");
  for (size_t i = 0; i < dst.size(); ++i) {
    TORCH_CHECK(src[i].scalar_type() == st && dst[i].scalar_type() == dt,
                "multi_tensor_copy: all sources (targets) must share one dtype; tensor ", i, " differs");
    TORCH_CHECK(src[i].device() == dev && dst[i].device() == dev, "multi_tensor_copy: tensor ", i,
                " is on another device");
    TORCH_CHECK(src[i].numel() == dst[i].numel(), "multi_tensor_copy: tensor ", i, " has ", dst[i].numel(),
                " target and ", src[i].numel(), " source elements");
    TORCH_CHECK(src[i].is_contiguous() && dst[i].is_contiguous(), "multi_tensor_copy: tensor ", i,
                " is not contiguous");
  }
  int cur = -1;
  check(cudaGetDevice(&cur));
  TORCH_CHECK(cur == dev.index(), "multi_tensor_copy: tensors are on cuda:", dev.index(), " but the current device is ",
              cur);
  const auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  switch (st) {
    case at::kFloat: return run_dst<hk_sync::F32>(dst, src, dt, stream);
    case at::kBFloat16: return run_dst<hk_sync::BF16>(dst, src, dt, stream);
    case at::kHalf: return run_dst<hk_sync::F16>(dst, src, dt, stream);
    default: TORCH_CHECK(false, "multi_tensor_copy: unsupported source dtype ", st);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("multi_tensor_copy", &multi_tensor_copy, "dst[i].copy_(src[i]) for all i in one multi-tensor launch",
        pybind11::arg("dst"), pybind11::arg("src"), pybind11::arg("stream"));
  m.attr("max_tensors_per_launch") = hk_sync::kMaxTensors;
}
