// The activations of bias_activation (fastformer/nn/config.py ACTIVATIONS) by code: the registered op takes
// the name (csrc/ops.h activation_code turns it into the code), the entry points and kernels of every
// backend take the code. Included by ops.h (host) and by csrc/cuda/bias_activation.cuh (no standard headers).
#pragma once

namespace fastformer {

enum ActivationCode : int {
  kActRelu = 0,  // max(h, 0) (NaN stays NaN)
  kActGelu = 1,  // h Phi(h) = h (1 + erf(h / sqrt 2)) / 2, exact (erf)
  kActSilu = 2,  // h sigmoid(h) (swish)
};

}  // namespace fastformer
