// Backend cuda_sim, op layer_norm_residual: the CUDA launcher csrc/cuda/layer_norm_residual.cu and its kernels, unchanged, compiled as
// plain C++ against the CPU SIMT execution model (simt.h) and run on CPU tensors. Built on first use by
// fastformer/cuda_sim (one extension per op).
// torch first: its headers never see the model's CUDA built-in macros.
#include <torch/extension.h>

#include "../cuda/layer_norm_residual.cu"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastformer layer_norm_residual CUDA kernels on the CPU SIMT execution model (test equipment)";
  m.def("layer_norm_residual_fwd", &fastformer::cuda::layer_norm_residual_fwd, "layer_norm_residual forward (cuda_sim)");
  m.def("layer_norm_residual_bwd", &fastformer::cuda::layer_norm_residual_bwd, "layer_norm_residual backward (cuda_sim)");
  m.def("set_schedule_seed", &fastformer::sim::set_schedule_seed,
        "seed of the warp/lane order between barriers (0 = index order)");
  m.def("delete_barrier", &fastformer::sim::delete_barrier,
        "mutation testing: the __syncthreads at (file suffix, line) becomes a no-op; '' clears");
  m.def("deleted_barrier_hits", &fastformer::sim::deleted_barrier_hits,
        "how many times threads passed the deleted barrier");
}
