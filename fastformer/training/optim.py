"""Adam as one fused pass per element that also writes each weight's compute-dtype copy (issue 52).

``Adam`` is ``torch.optim.Adam`` (same hyperparameters, same ``state_dict()`` format: a checkpoint written with
either loads into the other) whose step is fastformer's kernel, ``fastformer._C.adam_step`` (csrc/optim/optim.h):
per element it reads the float32 param, grad, exp_avg and exp_avg_sq and writes param, exp_avg, exp_avg_sq and,
where the parameter has one, its compute-dtype copy (bfloat16 or float16, exactly ``param.to(copy.dtype)``): the
weight a bf16/fp16 forward reads without casting it. CPU parameters: the kernel of the loaded CPU level
(at::vec, at::parallel_for over fixed chunks: the same bits for any thread count). CUDA parameters: the CUDA
kernel (csrc/cuda/adam.cuh: 32 parameters per launch, the step counts, the learning rate, grad_scale and
found_inf read on the device, so the step is graph-capturable); where fastformer._C was built without CUDA
kernels, torch's fused Adam and a copy per weight instead.

    opt = Adam(model.parameters(), lr=0.0, betas=(0.9, 0.98), eps=1e-9, capturable=...,
               compute_copies={weight: weight_bf16, ...})   # or later: opt.set_compute_copies(mapping)
    opt.load_state_dict(saved)   # copies are not in a checkpoint: written again from the params here

With a ``torch.amp.GradScaler`` the step takes the scaler's grad_scale and found_inf as torch's fused Adam does
(``_step_supports_amp_scaling``): a nonzero found_inf skips the update and the step counts. Not supported (a
ValueError): amsgrad, maximize, differentiable, AdamW's decoupled weight decay, sparse gradients, parameters other
than contiguous float32 tensors.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.optim.adam import adam as torch_adam

from fastformer import _ext

COPY_DTYPES = (torch.bfloat16, torch.float16)


def own_kernel(device: torch.device) -> bool:
    """Whether fastformer's kernel updates parameters on ``device`` (else torch's fused Adam plus copies)."""
    return device.type == "cpu" or bool(getattr(_ext.C, "WITH_CUDA", False))


class Adam(torch.optim.Adam):
    """torch.optim.Adam whose step is one fused pass that also writes the parameters' compute-dtype copies.

    compute_copies: {parameter: its bfloat16 or float16 copy (same shape and device, contiguous)}, or None."""

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, capturable: bool = False,
                 compute_copies: Mapping[torch.nn.Parameter, torch.Tensor] | None = None, amsgrad: bool = False,
                 maximize: bool = False):
        if amsgrad:
            raise ValueError("fastformer Adam: amsgrad is not supported; use torch.optim.Adam")
        if maximize:
            raise ValueError("fastformer Adam: maximize is not supported; use torch.optim.Adam")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, capturable=capturable)
        self._step_supports_amp_scaling = True  # GradScaler hands over grad_scale and found_inf (below)
        self._copies: dict[torch.Tensor, torch.Tensor] = {}
        self.set_compute_copies(compute_copies)

    @property
    def compute_copies(self) -> dict[torch.Tensor, torch.Tensor]:
        """{parameter: its compute-dtype copy} (a new dict; set with set_compute_copies)."""
        return dict(self._copies)

    def set_compute_copies(self, mapping: Mapping[torch.nn.Parameter, torch.Tensor] | None) -> None:
        """Replaces the copies (None: none) and writes each from its parameter. Each key must be a parameter of
        this optimizer (float32), each value a contiguous bfloat16 or float16 tensor of its shape on its device."""
        mapping = dict(mapping or {})
        mine = {id(p) for group in self.param_groups for p in group["params"]}
        for k, (param, copy) in enumerate(mapping.items()):
            where = f"compute_copies entry {k} (parameter of shape {tuple(param.shape)})"
            if id(param) not in mine:
                raise ValueError(f"fastformer Adam: {where} is not a parameter of this optimizer")
            if not isinstance(copy, torch.Tensor):
                raise ValueError(f"fastformer Adam: {where}: the copy must be a tensor, got {type(copy).__name__}")
            if param.dtype != torch.float32:
                raise ValueError(f"fastformer Adam: {where}: the parameter must be float32, got {param.dtype}")
            if copy.dtype not in COPY_DTYPES:
                raise ValueError(f"fastformer Adam: {where}: the copy must be bfloat16 or float16, got {copy.dtype}")
            if copy.shape != param.shape:
                raise ValueError(f"fastformer Adam: {where}: the copy has shape {tuple(copy.shape)}")
            if copy.device != param.device:
                raise ValueError(f"fastformer Adam: {where}: the copy is on {copy.device}, the parameter on "
                                 f"{param.device}")
            if not copy.is_contiguous():
                raise ValueError(f"fastformer Adam: {where}: the copy must be contiguous")
        self._copies = mapping
        self.sync_compute_copies()

    @torch.no_grad()
    def sync_compute_copies(self) -> None:
        """Writes every copy from its parameter (copy = param.to(copy.dtype)): after construction, after
        load_state_dict, after anything that changed a parameter outside step()."""
        for param, copy in self._copies.items():
            copy.copy_(param)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch.optim.Adam's, then each CUDA parameter's step count on its device (the kernel reads it there; a
        checkpoint of an unfused Adam keeps it on the CPU) and the copies written from the loaded parameters."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and state["exp_avg"].device != step.device:
                state["step"] = step.to(device=state["exp_avg"].device, dtype=torch.float32)
        self.sync_compute_copies()

    def _group_lists(self, group: dict) -> dict[torch.device, tuple[list, ...]]:
        """Per device: the parameters with a gradient and their grads, exp_avgs, exp_avg_sqs, copies (None where
        none) and step counts; the state made on first use (step counts on the parameter's device)."""
        lists: dict[torch.device, tuple[list, ...]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise ValueError("fastformer Adam: sparse gradients are not supported; use torch.optim.SparseAdam")
            state = self.state[p]
            if len(state) == 0:
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            entry = lists.setdefault(p.device, ([], [], [], [], [], []))
            for items, value in zip(entry, (p, p.grad, state["exp_avg"], state["exp_avg_sq"], self._copies.get(p),
                                            state["step"])):
                items.append(value)
        return lists

    @torch.no_grad()
    def step(self, closure=None):
        """One Adam step of every parameter with a gradient (those without are skipped, their step counts too)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)  # set by GradScaler.step (_step_supports_amp_scaling)
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            for flag in ("amsgrad", "maximize", "differentiable", "decoupled_weight_decay"):
                if group.get(flag):
                    raise ValueError(f"fastformer Adam: {flag}=True is not supported (a loaded state_dict's group "
                                     "may carry it); use torch.optim.Adam")
            beta1, beta2 = (float(b) for b in group["betas"])
            lr = group["lr"]
            for device, (params, grads, exp_avgs, exp_avg_sqs, copies, steps) in self._group_lists(group).items():
                scale = grad_scale.to(device, non_blocking=True) if grad_scale is not None else None
                inf = found_inf.to(device, non_blocking=True) if found_inf is not None else None
                on_device = isinstance(lr, torch.Tensor) and lr.device == device
                if not own_kernel(device):
                    self._torch_fused_step(group, params, grads, exp_avgs, exp_avg_sqs, copies, steps, scale, inf)
                    continue
                _ext.C.adam_step(params, grads, exp_avgs, exp_avg_sqs, copies, steps,
                                 0.0 if on_device else float(lr), lr if on_device else None, beta1, beta2,
                                 float(group["weight_decay"]), float(group["eps"]), scale, inf)
        return loss

    @staticmethod
    def _torch_fused_step(group, params, grads, exp_avgs, exp_avg_sqs, copies, steps, grad_scale, found_inf):
        """CUDA parameters with a fastformer._C built without CUDA kernels: torch's fused Adam (also capturable,
        also taking grad_scale and found_inf), then each copy written from its parameter (a second pass)."""
        torch_adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, fused=True, amsgrad=False, has_complex=False,
                   beta1=float(group["betas"][0]), beta2=float(group["betas"][1]), lr=group["lr"],
                   weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                   capturable=group["capturable"], differentiable=False, grad_scale=grad_scale, found_inf=found_inf)
        pairs = [(c, p) for c, p in zip(copies, params) if c is not None]
        if pairs:
            torch._foreach_copy_([c for c, _ in pairs], [p for _, p in pairs])
        for t in (*params, *exp_avgs, *exp_avg_sqs, *steps):  # torch's fused kernel leaves the versions as they were
            torch.autograd.graph.increment_version(t)

