// Entry points of the CUDA kernels: the launchers in csrc/cuda/<op>.cu. Same signatures and semantics as
// the CPU entry points (csrc/cpu/cpu_ops.h). Registered for the CUDA dispatch key of fastformer::<op>_<fwd|bwd>
// by each launcher file (nvcc build, through csrc/ops.h's adapters) and bound as <op>_<fwd|bwd> in the cuda_sim extension (the same sources compiled against the CPU SIMT model).
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <tuple>

namespace fastformer::cuda {

using at::Tensor;

#include "op_entry_points.h"

}  // namespace fastformer::cuda
