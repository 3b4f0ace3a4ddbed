// Launch plans: the triton backend's calls replayed from C++ (csrc/triton/plans.cpp says how).
#pragma once
#include <pybind11/pybind11.h>

namespace fastformer {

// Binds fastformer._C.triton_plans_* (stats, clear, on/off, the CPU registration for interpreter tests).
void bind_triton_plans(pybind11::module_& m);

}  // namespace fastformer
