// Backend cuda_sim, one op: the CUDA launcher csrc/cuda/<op>.cu and its kernels, unchanged, compiled as
// plain C++ against the CPU SIMT execution model (simt.h) and run on CPU tensors. fastformer/cuda_sim
// builds this file once per op, as its own extension, with -DFF_SIM_OP=<op> (so one op's build never
// depends on another's).
// torch first: its headers never see the model's CUDA built-in macros.
#include <torch/python.h>  // pybind11, tensor casters (torch/extension.h adds the C++ frontend: 16 s to compile)

#ifndef FF_SIM_OP
#error "build with -DFF_SIM_OP=<op>, an op of FASTFORMER_OPS (csrc/ops.h)"
#endif
#define FF_STRING_(x) #x
#define FF_STRING(x) FF_STRING_(x)
#define FF_JOIN_(a, b) a##b
#define FF_JOIN(a, b) FF_JOIN_(a, b)

#include FF_STRING(cuda/FF_SIM_OP.cu)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastformer " FF_STRING(FF_SIM_OP) " CUDA kernels on the CPU SIMT execution model (test equipment)";
  m.def(FF_STRING(FF_JOIN(FF_SIM_OP, _fwd)), &fastformer::cuda::FF_JOIN(FF_SIM_OP, _fwd), "forward (cuda_sim)");
  m.def(FF_STRING(FF_JOIN(FF_SIM_OP, _bwd)), &fastformer::cuda::FF_JOIN(FF_SIM_OP, _bwd), "backward (cuda_sim)");
  m.def("set_schedule_seed", &fastformer::sim::set_schedule_seed,
        "seed of the warp/lane order between barriers (0 = index order)");
  m.def("delete_barrier", &fastformer::sim::delete_barrier,
        "mutation testing: the __syncthreads at (file suffix, line) becomes a no-op; '' clears");
  m.def("set_compute_capability", &fastformer::sim::set_compute_capability,
        "the compute capability the model plays, 10 major + minor (default 80: the tensor-core kernels "
        "serve float16/bfloat16; 60 runs the P100 SIMT kernels for every dtype)");
  m.def("compute_capability", &fastformer::sim::compute_capability, "the compute capability the model plays");
  m.def("deleted_barrier_hits", &fastformer::sim::deleted_barrier_hits,
        "how many times threads passed the deleted barrier");
}
