// y = dropout(act(x + bias)) over the last dim on the GPU, forward and backward (kernels; launchers in
// bias_activation.cu); act = relu, gelu (exact, erf) or silu (csrc/activation.h), a launch argument (one
// branch, the same for every thread). x, y, dy, saved, dx are R contiguous rows of N of type T (float,
// __half, __nv_bfloat16); bias and dbias (N,) of type TB (float, or T); fp32 math (P100-compatible: no
// bf16 arithmetic, half2/bfloat162 only to load and store).
//
// Layout: thread t of block (bx, by) owns the quad of columns 4 (kBaThreads bx + t) .. + 3 and walks the
// rows of chunk by (chunk_rows consecutive rows): its bias values stay in registers, and a warp's loads of a
// row cover 128 consecutive elements (coalesced). A quad moves as two half2/bfloat162/float2 pairs when N is a
// multiple of 4 and every row pointer is 4-element aligned (vec4), else element by element (columns >= N
// skipped).
// Dropout: element index e = row N + col (the flat row-major index in x), factor r = csrc/philox.h
// dropout_factor; a quad starting at a multiple of 4 takes its 4 factors from one Philox call (N % 4 == 0),
// others one call per element.
// Forward: y = act(x + b) r, rounded to T. DRAM: 2 N sizeof(T) per row (bias read once per thread).
// Backward: dz = dy act'(h) r; relu from the saved y (dz = dy / (1 - p) where y > 0: no Philox), gelu and
// silu from the saved x (h = x + b, r regenerated). dx = dz rounded to T. dbias without atomics, in two
// stages whose split depends on R only: (1) each block writes the sums of dz over its chunk's rows for its
// columns as row by of partial (P, N) float32; (2) bias_activation_dbias_kernel sums the P partials of each
// column in chunk order and writes dbias in TB. DRAM: 3 N sizeof(T) per row, plus P N 8 bytes of partials.
#pragma once
#include "../activation.h"
#include "common.cuh"

namespace fastformer {
namespace cuda {

constexpr int kBaThreads = 256;         // threads (quads of columns) per block
constexpr int kBaFwdRows = 8;           // forward: rows per block, at least (more when R / 8 exceeds the grid's y)
constexpr int kBaBwdMinRows = 16;       // backward: rows per chunk, at least ...
constexpr int kBaBwdMaxChunks = 256;    // ... and at most this many chunks (partial rows)
constexpr int kBaMaxGridY = 65535;      // gridDim.y limit

template <typename T, typename TB>
struct BiasActFwdParams {
  const T* x;           // (R, N) input
  const TB* bias;       // (N,)
  T* y;                 // (R, N) output
  int64_t rows;         // R
  int cols;             // N
  int64_t chunk_rows;   // rows per block (gridDim.y chunks)
  int activation;       // kActRelu, kActGelu, kActSilu
  float dropout_p;      // p in [0, 1); 0 = no dropout
  float inv_keep;       // 1 / (1 - p)
  const int64_t* seed;  // () dropout seed in device memory (load_seed); nullptr without dropout
  bool vec4;            // N % 4 == 0 and every row pointer 4-element aligned: quads as two pairs
};

template <typename T, typename TB>
struct BiasActBwdParams {
  const T* dy;          // (R, N) gradient of y
  const T* saved;       // (R, N) the forward's y (relu) or x (gelu, silu)
  const TB* bias;       // (N,)
  T* dx;                // (R, N) output
  float* partial;       // (P, N) stage-1 output: row by = sum over chunk by of dz
  int64_t rows;         // R
  int cols;             // N
  int64_t chunk_rows;   // rows per chunk (the last may be shorter); P = gridDim.y chunks
  int activation;
  float dropout_p;
  float inv_keep;       // 1 / (1 - p) (1 without dropout)
  const int64_t* seed;  // () as in BiasActFwdParams
  bool vec4;
};

template <typename TB>
struct BiasActDbiasParams {
  const float* partial;  // (P, N)
  TB* dbias;             // (N,) output
  int partials;          // P
  int cols;              // N
};

FF_DEVICE float ba_act(int act, float h) {
  if (act == kActRelu) return h > 0.0f || h != h ? h : 0.0f;  // NaN stays NaN, as torch.relu
  if (act == kActGelu) return 0.5f * h * (1.0f + erff(h * 0.70710678118654752f));
  return h / (1.0f + expf(-h));
}

// act'(h) of gelu (Phi(h) + h phi(h)) and silu (s (1 + h (1 - s)), s = sigmoid(h)).
FF_DEVICE float ba_act_grad(int act, float h) {
  if (act == kActGelu) {
    return 0.5f * (1.0f + erff(h * 0.70710678118654752f)) + h * 0.39894228040143268f * expf(-0.5f * h * h);
  }
  const float s = 1.0f / (1.0f + expf(-h));
  return s * (1.0f + h * (1.0f - s));
}

// The quad of columns col .. col + 3 of a row as float (columns >= n read as 0).
template <typename T>
FF_DEVICE void ba_load4(const T* row, int col, int n, bool vec4, float (&v)[4]) {
  if (vec4) {
    const float2 a = load2(row + col), b = load2(row + col + 2);
    v[0] = a.x;
    v[1] = a.y;
    v[2] = b.x;
    v[3] = b.y;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = col + k < n ? to_float(row[col + k]) : 0.0f;
  }
}

template <typename T>
FF_DEVICE void ba_store4(T* row, int col, int n, bool vec4, const float (&v)[4]) {
  if (vec4) {
    store2(row + col, float2{v[0], v[1]});
    store2(row + col + 2, float2{v[2], v[3]});
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (col + k < n) row[col + k] = from_float<T>(v[k]);
    }
  }
}

// Keep-factors of elements e .. e + 3: one Philox call when e is a multiple of 4, else one per element.
FF_DEVICE void ba_dropout4(const int64_t* seed, int64_t e, float p, float inv_keep, float (&r)[4]) {
  if ((e & 3) == 0) {
    const Philox4 w = philox4x32_10(load_seed(seed), static_cast<uint64_t>(e) >> 2);
#pragma unroll
    for (int k = 0; k < 4; ++k) r[k] = philox_uniform(w.w[k]) >= p ? inv_keep : 0.0f;
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) r[k] = dropout_factor(load_seed(seed), static_cast<uint64_t>(e + k), p, inv_keep);
  }
}

template <typename T, typename TB>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kBaThreads) bias_activation_fwd_kernel(const BiasActFwdParams<T, TB> p) {
  const int col = 4 * (static_cast<int>(blockIdx.x) * kBaThreads + static_cast<int>(threadIdx.x));
  if (col >= p.cols) return;  // no barrier in this kernel
  float b[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) b[k] = col + k < p.cols ? to_float(p.bias[col + k]) : 0.0f;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * p.chunk_rows;
  const int64_t last = first + p.chunk_rows < p.rows ? first + p.chunk_rows : p.rows;
  for (int64_t row = first; row < last; ++row) {
    const int64_t base = row * p.cols;
    float v[4];
    ba_load4(p.x + base, col, p.cols, p.vec4, v);
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = ba_act(p.activation, v[k] + b[k]);
    if (p.dropout_p > 0.0f) {
      float r[4];
      ba_dropout4(p.seed, base + col, p.dropout_p, p.inv_keep, r);
#pragma unroll
      for (int k = 0; k < 4; ++k) v[k] *= r[k];
    }
    ba_store4(p.y + base, col, p.cols, p.vec4, v);
  }
}

template <typename T, typename TB>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kBaThreads) bias_activation_bwd_kernel(const BiasActBwdParams<T, TB> p) {
  const int col = 4 * (static_cast<int>(blockIdx.x) * kBaThreads + static_cast<int>(threadIdx.x));
  if (col >= p.cols) return;
  const bool relu = p.activation == kActRelu;
  float b[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) b[k] = !relu && col + k < p.cols ? to_float(p.bias[col + k]) : 0.0f;
  float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const int64_t first = static_cast<int64_t>(blockIdx.y) * p.chunk_rows;
  const int64_t last = first + p.chunk_rows < p.rows ? first + p.chunk_rows : p.rows;
  for (int64_t row = first; row < last; ++row) {
    const int64_t base = row * p.cols;
    float g[4], s[4];
    ba_load4(p.dy + base, col, p.cols, p.vec4, g);
    ba_load4(p.saved + base, col, p.cols, p.vec4, s);
    if (relu) {
#pragma unroll
      for (int k = 0; k < 4; ++k) g[k] = s[k] > 0.0f ? g[k] * p.inv_keep : 0.0f;
    } else {
#pragma unroll
      for (int k = 0; k < 4; ++k) g[k] *= ba_act_grad(p.activation, s[k] + b[k]);
      if (p.dropout_p > 0.0f) {
        float r[4];
        ba_dropout4(p.seed, base + col, p.dropout_p, p.inv_keep, r);
#pragma unroll
        for (int k = 0; k < 4; ++k) g[k] *= r[k];
      }
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) sum[k] += g[k];
    ba_store4(p.dx + base, col, p.cols, p.vec4, g);
  }
  float* out = p.partial + static_cast<int64_t>(blockIdx.y) * p.cols;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (col + k < p.cols) out[col + k] = sum[k];
  }
}

// Stage 2: thread j sums column j of the P partial rows in chunk order (coalesced across the warp).
template <typename TB>
FF_GLOBAL void FF_LAUNCH_BOUNDS(kBaThreads) bias_activation_dbias_kernel(const BiasActDbiasParams<TB> p) {
  const int col = static_cast<int>(blockIdx.x) * kBaThreads + static_cast<int>(threadIdx.x);
  if (col >= p.cols) return;
  float sum = 0.0f;
  for (int c = 0; c < p.partials; ++c) sum += p.partial[static_cast<int64_t>(c) * p.cols + col];
  p.dbias[col] = from_float<TB>(sum);
}

}  // namespace cuda
}  // namespace fastformer

// instantiations: bias_activation_fwd_kernel<float, float> bias_activation_fwd_kernel<__half, float> bias_activation_fwd_kernel<__nv_bfloat16, float>
// instantiations: bias_activation_fwd_kernel<__half, __half> bias_activation_fwd_kernel<__nv_bfloat16, __nv_bfloat16>
// instantiations: bias_activation_bwd_kernel<float, float> bias_activation_bwd_kernel<__half, float> bias_activation_bwd_kernel<__nv_bfloat16, float>
// instantiations: bias_activation_bwd_kernel<__half, __half> bias_activation_bwd_kernel<__nv_bfloat16, __nv_bfloat16>
// instantiations: bias_activation_dbias_kernel<float> bias_activation_dbias_kernel<__half> bias_activation_dbias_kernel<__nv_bfloat16>
