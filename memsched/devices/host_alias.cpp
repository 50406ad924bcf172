// Device-typed aliases of host memory for memsched's stand-in device (PrivateUse1, "sim"):
// see [Note: parameters read where they compute] in memsched/devices/host_alias.py. Built into the
// stand-in's extension with sim_backend.cpp (memsched/devices/sim_backend.py).
//
// host_alias(t) is a stand-in tensor over the same bytes as the CPU tensor `t` (same sizes, strides and
// offset; no copy). Its storage holds a reference to `t`'s storage, so the host memory lives as long as any
// alias or view of it does, and it is not counted against the stand-in's capacity (it is host memory, as a
// CUDA tensor over mapped pinned memory is).

#include <ATen/ATen.h>
#include <c10/core/Storage.h>
#include <torch/library.h>

namespace {

struct Held {
  c10::Storage host;
};

void free_held(void* ctx) { delete static_cast<Held*>(ctx); }

at::Tensor host_alias(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.layout() == c10::kStrided,
              "host_alias: expected a dense CPU tensor, got one on ", t.device());
  const c10::Storage& st = t.storage();
  auto* held = new Held{st};
  c10::Storage alias(c10::Storage::use_byte_size_t(), st.nbytes(),
                     c10::DataPtr(st.mutable_data(), held, &free_held,
                                  c10::Device(c10::DeviceType::PrivateUse1, 0)),
                     /*allocator=*/nullptr, /*resizable=*/false);
  auto out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(alias), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), t.dtype());
  out.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides());
  out.unsafeGetTensorImpl()->set_storage_offset(t.storage_offset());
  // A write through the alias is a write to `t`, as through a view: one version counter.
  out.unsafeGetTensorImpl()->set_version_counter(t.unsafeGetTensorImpl()->version_counter());
  return out;
}

}  // namespace

TORCH_LIBRARY(memsched_alias, m) { m.def("host_alias(Tensor(a) host) -> Tensor(a)", &host_alias); }
