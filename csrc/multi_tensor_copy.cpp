// PyTorch binding of the multi-tensor copy: multi_tensor_copy(dst_list, src_list, stream) copies src[i] into dst[i]
// on `stream` (a cudaStream_t as int, e.g. torch.cuda.current_stream().cuda_stream) of the current device, one launch
// per max_tensors_per_launch tensors; multi_tensor_copy_engine(dst_list, src_list, stream) does the same copy by the
// copy engines (one cudaMemcpyBatchAsync asking to overlap with compute), for same-dtype lists. Host C++ only: it
// checks the tensors and hands raw pointers to hk_sync (multi_tensor_copy.h, defined in
// multi_tensor_copy_kernel.cu), so it compiles with the host compiler against a CPU build of torch's headers. All
// sources share one dtype and all targets share one dtype (fp32, bf16 or fp16; the copy engines take any one dtype
// on both sides); tensors are contiguous, on one device, with equal numel.
#include <torch/extension.h>

#include <vector>

#include "multi_tensor_copy.h"

namespace {

hk_sync::DType kind(at::ScalarType t, const char* what) {
  TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, "multi_tensor_copy: unsupported ", what,
              " dtype ", t);
  return t == at::kFloat ? hk_sync::kF32 : t == at::kBFloat16 ? hk_sync::kBF16 : hk_sync::kF16;
}

void check(const char* error) { TORCH_CHECK(error == nullptr, "multi_tensor_copy: ", error); }

// The lists' raw pointers and element counts, after checking what both copies need.
struct Lists {
  std::vector<void*> dst;
  std::vector<const void*> src;
  std::vector<int64_t> numel;
};

Lists checked(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) {
  TORCH_CHECK(dst.size() == src.size(), "multi_tensor_copy: ", dst.size(), " targets but ", src.size(), " sources");
  Lists out;
  if (dst.empty()) return out;
  const auto st = src[0].scalar_type(), dt = dst[0].scalar_type();
  const auto dev = dst[0].device();
  TORCH_CHECK(dev.is_cuda(), "multi_tensor_copy: tensors must be on a CUDA device");
  const auto n = dst.size();
  out.dst.resize(n);
  out.src.resize(n);
  out.numel.resize(n);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(src[i].scalar_type() == st && dst[i].scalar_type() == dt,
                "multi_tensor_copy: all sources (targets) must share one dtype; tensor ", i, " differs");
    TORCH_CHECK(src[i].device() == dev && dst[i].device() == dev, "multi_tensor_copy: tensor ", i,
                " is on another device");
    TORCH_CHECK(src[i].numel() == dst[i].numel(), "multi_tensor_copy: tensor ", i, " has ", dst[i].numel(),
                " target and ", src[i].numel(), " source elements");
    TORCH_CHECK(src[i].is_contiguous() && dst[i].is_contiguous(), "multi_tensor_copy: tensor ", i,
                " is not contiguous");
    out.dst[i] = dst[i].data_ptr();
    out.src[i] = src[i].data_ptr();
    out.numel[i] = dst[i].numel();
  }
  int cur = -1;
  check(hk_sync::current_device(&cur));
  TORCH_CHECK(cur == dev.index(), "multi_tensor_copy: tensors are on cuda:", dev.index(), " but the current device is ",
              cur);
  return out;
}

void multi_tensor_copy(std::vector<at::Tensor> dst, std::vector<at::Tensor> src, int64_t stream_handle) {
  const Lists l = checked(dst, src);
  if (l.dst.empty()) return;
  const auto src_kind = kind(src[0].scalar_type(), "source");
  const auto dst_kind = kind(dst[0].scalar_type(), "target");
  check(hk_sync::copy(src_kind, dst_kind, l.dst.data(), l.src.data(), l.numel.data(),
                      static_cast<int64_t>(l.dst.size()), reinterpret_cast<void*>(stream_handle)));
}

void multi_tensor_copy_engine(std::vector<at::Tensor> dst, std::vector<at::Tensor> src, int64_t stream_handle) {
  Lists l = checked(dst, src);
  if (l.dst.empty()) return;
  TORCH_CHECK(src[0].scalar_type() == dst[0].scalar_type(), "multi_tensor_copy_engine: copies without a cast only; ",
              src[0].scalar_type(), " to ", dst[0].scalar_type());
  const int64_t item = static_cast<int64_t>(src[0].element_size());
  for (auto& k : l.numel) k *= item;  // bytes
  check(hk_sync::copy_engine(l.dst.data(), l.src.data(), l.numel.data(), static_cast<int64_t>(l.dst.size()),
                             reinterpret_cast<void*>(stream_handle)));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("multi_tensor_copy", &multi_tensor_copy, "dst[i].copy_(src[i]) for all i in one multi-tensor launch",
        pybind11::arg("dst"), pybind11::arg("src"), pybind11::arg("stream"));
  m.def("multi_tensor_copy_engine", &multi_tensor_copy_engine,
        "dst[i].copy_(src[i]) for all i (one dtype) by the copy engines: one batched async copy",
        pybind11::arg("dst"), pybind11::arg("src"), pybind11::arg("stream"));
  m.attr("max_tensors_per_launch") = hk_sync::max_tensors_per_launch();
}
