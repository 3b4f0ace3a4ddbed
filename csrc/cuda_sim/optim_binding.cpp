// Backend cuda_sim, the fused Adam step: the CUDA launcher csrc/cuda/adam.cu and its kernels (adam.cuh), unchanged,
// compiled as plain C++ against the CPU SIMT execution model (simt.h) and run on CPU tensors. Not an op of
// FASTFORMER_OPS (binding.cpp builds those): fastformer/cuda_sim builds this file as the extension
// fastformer_cuda_sim_adam (fastformer.cuda_sim.adam_step).
// torch first: its headers never see the model's CUDA built-in macros.
#include <torch/python.h>  // pybind11, tensor casters

#include "cuda/adam.cu"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastformer's fused Adam CUDA kernels on the CPU SIMT execution model (test equipment)";
  m.def("adam_step", &fastformer::cuda::adam_step, "one Adam step of every parameter (cuda_sim)");
  m.def("set_schedule_seed", &fastformer::sim::set_schedule_seed,
        "seed of the warp/lane order between barriers (0 = index order)");
  m.def("set_compute_capability", &fastformer::sim::set_compute_capability,
        "the compute capability the model plays, 10 major + minor");
}
