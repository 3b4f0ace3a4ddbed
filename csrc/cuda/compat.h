// The tiny compatibility header: the only include of the kernel headers csrc/cuda/*.cuh (no torch).
//
// The same kernel source compiles three ways:
//   nvcc            into fastformer._C (backend "cuda"), via the launchers csrc/cuda/*.cu;
//   NVRTC           device code only, for the sm_60 / sm_80 resource report (tools/kernel_report.py);
//   a C++ compiler  against the CPU SIMT execution model csrc/cuda_sim/simt.h (backend "cuda_sim"),
//                   where every CUDA thread is a fiber and __syncthreads / __syncwarp / warp shuffles
//                   are barriers, so the kernels are executed (not only compiled) on machines with no GPU.
//
// Kernels use only what is declared here or in simt.h: threadIdx/blockIdx/blockDim/gridDim, __shared__
// (static sizes only), __syncthreads, __syncwarp, __shfl_sync/__shfl_xor_sync/__shfl_down_sync (full
// mask), __half/__nv_bfloat16 and their 2-vectors with the conversion intrinsics, float2/float4,
// expf/logf/sqrtf/rsqrtf/fmaxf/fminf/fabsf/__int_as_float/__float_as_int; and the sm_80 instructions
// that csrc/cuda/mma.cuh wraps (mma.sync m16n8k16, ldmatrix, cp.async), used only by the tensor-core
// kernels. No atomics, no dynamic shared memory.
#pragma once

#if defined(__CUDACC__)  // nvcc or NVRTC
#if defined(__CUDACC_RTC__)
typedef unsigned char uint8_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
#else
#include <cstdint>
#endif
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define FF_DEVICE __device__ __forceinline__
#define FF_GLOBAL __global__
#define FF_LAUNCH_BOUNDS(threads) __launch_bounds__(threads)
// ... and at least min_blocks blocks per SM. The attention kernels take 1: with the plain bound ptxas traded a
// few spilled bytes (8-28 per thread) for another block's registers, moving between instantiations with every
// change of the code (docs/kernels.md shows the registers and occupancy each gets now)
#define FF_LAUNCH_BOUNDS_BLOCKS(threads, min_blocks) __launch_bounds__(threads, min_blocks)
#else  // the CPU SIMT execution model
#include "../cuda_sim/simt.h"
#define FF_DEVICE inline
#define FF_GLOBAL
#define FF_LAUNCH_BOUNDS(threads)
#define FF_LAUNCH_BOUNDS_BLOCKS(threads, min_blocks)
#endif
