"""fastformer.training.optim.Adam: the fused Adam step (csrc/optim/, csrc/cuda/adam.cuh) against torch.optim.Adam
run in float64 on float64 copies; its compute-dtype copies; GradScaler's grad_scale and found_inf; thread and
offset invariance; bad input; the state_dict round trip with torch.optim.Adam; the CUDA kernel on the CPU SIMT
model (cuda_sim) against the CPU kernel."""
import copy

import pytest
import torch

from fastformer._ext import C
from fastformer.training import optim
from fastformer.training.optim import Adam
from tolerances import assert_close

SHAPES = [(1,), (7,), (97, 113), (3, 5, 7), (40000,)]  # (40000,): several of the CPU kernel's 16,384-element chunks
HYPER = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-9)


def make_params(shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def draw_grads(params, step, skip=()):
    """Fresh random gradients (the same for the same step) on every parameter but those at ``skip``."""
    g = torch.Generator().manual_seed(1000 + step)
    for k, p in enumerate(params):
        grad = torch.randn(p.shape, generator=g) * (k + 1)
        p.grad = None if k in skip else grad.to(p.dtype)


def copies_for(params, dtype):
    return {} if dtype is None else {p: torch.empty(p.shape, dtype=dtype) for p in params}


def reference_step(ref, ref_params, params):
    """torch.optim.Adam (single-tensor, float64) on the float64 copies, with the float32 grads in float64."""
    for r, p in zip(ref_params, params):
        r.grad = None if p.grad is None else p.grad.double()
    ref.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16, torch.float16], ids=["no-copy", "bf16", "fp16"])
def test_matches_torch_adam_in_float64(weight_decay, copy_dtype):
    params = make_params()
    start = [p.detach().clone() for p in params]
    ref_params = [torch.nn.Parameter(p.detach().double()) for p in params]
    copies = copies_for(params[:-1], copy_dtype)  # the last parameter has none
    opt = Adam(params, weight_decay=weight_decay, compute_copies=copies, **HYPER)
    ref = torch.optim.Adam(ref_params, weight_decay=weight_decay, foreach=False, **HYPER)
    skipped = 1  # the (7,) parameter gets no gradient: skipped, no state, unchanged
    for step in range(6):
        draw_grads(params, step, skip=(skipped,))
        opt.step()
        reference_step(ref, ref_params, params)
        for p, c in copies.items():
            assert torch.equal(c, p.detach().to(copy_dtype)), f"step {step}: a copy is not param.to({copy_dtype})"
    for k, (p, r, p0) in enumerate(zip(params, ref_params, start)):
        if k == skipped:
            assert torch.equal(p.detach(), p0) and len(opt.state[p]) == 0
            continue
        # the update itself (param - start), whose float32 rounding the float64 reference does not have
        assert_close(p.detach() - p0, r.detach() - p0.double(), torch.float32, f"param {k} update")
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(opt.state[p][key], ref.state[r][key], torch.float32, f"param {k} {key}")
        assert opt.state[p]["step"].item() == ref.state[r]["step"].item() == 6.0


def test_torch_fused_fallback_matches_the_kernel(monkeypatch):
    """The path of CUDA parameters when fastformer._C has no CUDA kernels (torch's fused Adam and a copy), taken
    here on the CPU: the same results within the float32 tolerance, the copies exact."""
    params, twins = make_params(), make_params()
    copies = copies_for(twins, torch.bfloat16)
    opt, fallback = Adam(params, **HYPER), Adam(twins, compute_copies=copies, **HYPER)
    for step in range(3):
        draw_grads(params, step)
        opt.step()
    monkeypatch.setattr(optim, "own_kernel", lambda device: False)
    for step in range(3):
        draw_grads(twins, step)
        fallback.step()
    for p, t in zip(params, twins):
        assert_close(t.detach(), p.detach().double(), torch.float32, "fallback param")
        assert torch.equal(copies[t], t.detach().to(torch.bfloat16))
        assert fallback.state[t]["step"].item() == 3.0


def test_step_gives_what_it_writes_a_new_version():
    """As an in-place op: a cache keyed by a weight's version (fastformer/nn/linear.py's packed weights) sees the
    update. Parameters without a gradient keep theirs."""
    params = make_params()
    copies = copies_for(params, torch.bfloat16)
    opt = Adam(params, compute_copies=copies, **HYPER)
    draw_grads(params, 0, skip=(1,))
    opt.step()
    before = {p: (p._version, copies[p]._version, opt.state[p].get("exp_avg", p)._version) for p in params}
    opt.step()
    for k, p in enumerate(params):
        changed = [now > then for now, then in zip((p._version, copies[p]._version,
                                                     opt.state[p].get("exp_avg", p)._version), before[p])]
        assert changed == ([False] * 3 if k == 1 else [True] * 3), k


def scaled_backward(params, scaler, step, poison=False):
    """Gradients of a loss whose gradient w.r.t. each param is draw_grads' (times the scaler's scale)."""
    draw_grads(params, step)
    targets = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    loss = sum((p * t).sum() for p, t in zip(params, targets))
    scaler.scale(loss).backward()
    if poison:
        params[2].grad[3, 4] = float("inf")


@pytest.mark.parametrize("unscale_first", [False, True], ids=["grad_scale", "unscaled"])
def test_grad_scaler(unscale_first):
    """GradScaler hands the step grad_scale (or, after unscale_, None) and found_inf: the update equals Adam on the
    unscaled gradients; an overflow skips everything, step counts included, and halves the scale."""
    params = make_params()
    ref_params = [torch.nn.Parameter(p.detach().double()) for p in params]
    copies = copies_for(params, torch.float16)
    opt = Adam(params, compute_copies=copies, **HYPER)
    ref = torch.optim.Adam(ref_params, foreach=False, **HYPER)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    for step in range(3):
        scaled_backward(params, scaler, step)
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        draw_grads(ref_params, step)
        ref.step()
    before = {p: (p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
              for p in params}
    scaled_backward(params, scaler, 3, poison=True)
    if unscale_first:
        scaler.unscale_(opt)
    scale = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == scale / 2
    for k, (p, r) in enumerate(zip(params, ref_params)):
        assert_close(p.detach(), r.detach(), torch.float32, f"param {k}")
        p0, m0, v0 = before[p]
        assert torch.equal(p.detach(), p0) and torch.equal(opt.state[p]["exp_avg"], m0)
        assert torch.equal(opt.state[p]["exp_avg_sq"], v0) and opt.state[p]["step"].item() == 3.0
        assert torch.equal(copies[p], p.detach().to(torch.float16))


def kernel_args(params, grads, copies, seed=3):
    """fastformer._C.adam_step's lists for float32 tensors: states drawn at random (as after some steps)."""
    g = torch.Generator().manual_seed(seed)
    m = [torch.randn(p.shape, generator=g) * 0.1 for p in params]
    v = [torch.rand(p.shape, generator=g) * 0.01 for p in params]
    steps = [torch.tensor(float(k + 2)) for k in range(len(params))]
    return [params, grads, m, v, copies, steps]


def clone_args(args):
    return [[None if t is None else t.clone() for t in items] for items in args]


def call(args, lr=1e-3, lr_tensor=None, weight_decay=0.01, grad_scale=None, found_inf=None, impl=None):
    (impl or C.adam_step)(*args, lr, lr_tensor, 0.9, 0.98, weight_decay, 1e-9, grad_scale, found_inf)


def fresh_args(shapes=SHAPES, copy_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) for s in shapes]
    copies = [torch.full(s, 7.0, dtype=copy_dtype) if k % 2 == 0 else None for k, s in enumerate(shapes)]
    return kernel_args(params, grads, copies)


def test_found_inf_skips_the_update_and_the_step_count():
    args = fresh_args()
    before = clone_args(args)
    call(args, found_inf=torch.tensor([1.0]))
    for items, saved in zip(args, before):
        for t, s in zip(items, saved):
            assert t is None and s is None or torch.equal(t, s)
    call(args, found_inf=torch.tensor([0.0]))
    assert [s.item() for s in args[5]] == [s.item() + 1 for s in before[5]]
    assert not torch.equal(args[0][2], before[0][2])


def test_grad_scale_divides_the_gradient():
    args = fresh_args()
    scaled = clone_args(args)
    scaled[1] = [g * 1024.0 for g in scaled[1]]  # exact: a power of two
    call(args)
    call(scaled, grad_scale=torch.tensor(1024.0))
    for i in (0, 2, 3, 4):  # params, exp_avgs, exp_avg_sqs, copies (the gradient is read, not written)
        for x, y in zip(args[i], scaled[i]):
            if x is not None:
                assert torch.equal(x, y)


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_threads_and_offsets_give_the_same_bits(copy_dtype):
    """The same update with 1, 2 and 3 threads, and with every tensor a view at an odd offset of a larger buffer."""
    shapes = SHAPES + [(2, 16384 + 5)]
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            args = fresh_args(shapes, copy_dtype)
            call(args)
            results.append(args)
    finally:
        torch.set_num_threads(threads)
    offset = fresh_args(shapes, copy_dtype)
    for i, items in enumerate(offset[:5]):  # params, grads, exp_avgs, exp_avg_sqs, copies: views at offset 3
        for k, t in enumerate(items):
            if t is not None:
                buffer = torch.empty(t.numel() + 5, dtype=t.dtype)
                items[k] = buffer[3:3 + t.numel()].view(t.shape)
                items[k].copy_(t)
    call(offset)
    results.append(offset)
    for other in results[1:]:
        for items, ref in zip(other, results[0]):
            for t, r in zip(items, ref):
                assert t is None and r is None or torch.equal(t, r)


def test_copies_round_to_nearest_even_at_the_edges():
    """Values where bfloat16 and float16 round (ties, overflow to inf in float16, subnormals) copy exactly as
    Tensor.to does: the update is 0 (lr 0), so the param keeps these values."""
    edges = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -(1.0 + 2 ** -8), 65504.0, 65520.0, 1e6, 3e-8, -6e-5,
                          1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 0.0, -0.0, 1e-40] * 5)
    for dtype in (torch.bfloat16, torch.float16):
        params = [edges.clone()]
        args = kernel_args(params, [torch.randn(edges.shape)], [torch.empty(edges.shape, dtype=dtype)])
        call(args, lr=0.0, weight_decay=0.0)
        assert torch.equal(params[0], edges)
        assert torch.equal(args[4][0], edges.to(dtype)), dtype


def test_bad_input_raises_value_error_naming_the_argument():
    p = torch.nn.Parameter(torch.randn(4, 3))
    q = torch.nn.Parameter(torch.randn(5))
    cases = [({p: torch.empty(3, 4, dtype=torch.bfloat16)}, "shape"),
             ({p: torch.empty(4, 3)}, "bfloat16 or float16"),
             ({p: torch.empty(4, 3, dtype=torch.bfloat16, device="meta")}, "meta"),
             ({p: torch.empty(3, 4, dtype=torch.bfloat16).t()}, "contiguous"),
             ({torch.nn.Parameter(torch.randn(4, 3)): torch.empty(4, 3, dtype=torch.bfloat16)}, "not a parameter")]
    for mapping, words in cases:
        with pytest.raises(ValueError, match=words):
            Adam([p, q], compute_copies=mapping)
    with pytest.raises(ValueError, match="amsgrad"):
        Adam([p], amsgrad=True)
    opt = Adam([p])
    p.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()

    def args_with(index, k, value):
        args = fresh_args([(4, 3), (5,)])
        args[index][k] = value
        return args

    kernel_cases = [
        (args_with(1, 1, torch.randn(6)), "grads\\[1\\] has shape"),
        (args_with(2, 0, torch.randn(4, 3, dtype=torch.float64)), "exp_avgs\\[0\\] must be float32"),
        (args_with(0, 0, torch.randn(3, 4).t()), "params\\[0\\] must be contiguous"),
        (args_with(0, 1, torch.randn(5, dtype=torch.float64)), "params\\[1\\] must be a dense float32"),
        (args_with(4, 1, torch.empty(5, dtype=torch.int32)), "copies\\[1\\] must be bfloat16 or float16"),
        (args_with(4, 0, torch.empty(4, 3, dtype=torch.bfloat16, device="meta")), "copies\\[0\\] is on meta"),
        (args_with(5, 1, torch.tensor(1, dtype=torch.int64)), "steps\\[1\\] must be a one-element float32"),
        (args_with(3, 0, torch.rand(4, 3, device="meta")), "exp_avg_sqs\\[0\\] is on meta"),
    ]
    for args, words in kernel_cases:
        with pytest.raises(ValueError, match=words):
            call(args)
    short = fresh_args([(4, 3), (5,)])
    short[3] = short[3][:1]
    with pytest.raises(ValueError, match="exp_avg_sqs holds 1 tensors"):
        call(short)
    with pytest.raises(ValueError, match="found_inf must be a one-element float32"):
        call(fresh_args([(5,)]), found_inf=torch.zeros(2))
    with pytest.raises(ValueError, match="beta"):
        C.adam_step(*fresh_args([(5,)]), 1e-3, None, 1.0, 0.98, 0.0, 1e-9, None, None)


def test_state_dict_round_trips_with_torch_adam():
    """Ours -> torch.optim.Adam -> ours: the same state_dict format; steps continue; a loaded optimizer writes its
    copies from the loaded parameters."""
    params = make_params()
    opt = Adam(params, **HYPER)
    for step in range(2):
        draw_grads(params, step)
        opt.step()
    saved = opt.state_dict()
    torch_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    torch_opt = torch.optim.Adam(torch_params, foreach=False, **HYPER)
    torch_opt.load_state_dict(copy.deepcopy(saved))  # as through a checkpoint: loading keeps the tensors
    fresh = torch.optim.Adam(make_params(), foreach=False, **HYPER).state_dict()
    assert sorted(saved["param_groups"][0]) == sorted(fresh["param_groups"][0])
    assert all(s["step"].dtype == torch.float32 for s in saved["state"].values())
    draw_grads(params, 2)
    draw_grads(torch_params, 2)
    opt.step()
    torch_opt.step()
    for p, t in zip(params, torch_params):
        assert_close(p.detach(), t.detach().double(), torch.float32, "after the torch round trip")
    back_params = [torch.nn.Parameter(t.detach().clone()) for t in torch_params]
    copies = copies_for(back_params, torch.bfloat16)
    back = Adam(back_params, compute_copies=copies, **HYPER)
    for c in copies.values():
        c.fill_(3.0)
    back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    for p, c in copies.items():
        assert torch.equal(c, p.detach().to(torch.bfloat16))
        assert back.state[p]["step"].item() == 3.0
    draw_grads(back_params, 3)
    draw_grads(params, 3)
    back.step()
    opt.step()
    for p, b in zip(params, back_params):
        assert_close(b.detach(), p.detach().double(), torch.float32, "after loading torch's state")


def test_cuda_kernel_on_the_simt_model_matches_the_cpu_kernel():
    """csrc/cuda/adam.cuh on the CPU SIMT model (cuda_sim) against the CPU kernel, both against the float64
    reference: 40 parameters (two launches of 32), one over several blocks, bf16 and fp16 copies, the learning
    rate, grad_scale and found_inf read from tensors as on the device."""
    from fastformer import cuda_sim
    shapes = [(97, 113), (1,), (7,)] + [(k + 1, 3) for k in range(37)]
    copy_dtypes = [torch.bfloat16, torch.float16, None]
    g = torch.Generator().manual_seed(5)
    params = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g) * 64.0 for s in shapes]
    copies = [None if copy_dtypes[k % 3] is None else torch.empty(s, dtype=copy_dtypes[k % 3])
              for k, s in enumerate(shapes)]
    args = kernel_args(params, grads, copies)
    sim = clone_args(args)
    start = clone_args(args)
    lr = torch.tensor(2e-3)
    call(args, lr=float(lr), grad_scale=torch.tensor(64.0), found_inf=torch.tensor([0.0]))
    call(sim, lr=0.5, lr_tensor=lr, grad_scale=torch.tensor(64.0), found_inf=torch.tensor([0.0]),
         impl=cuda_sim.adam_step)
    ref_params = [torch.nn.Parameter(p.double()) for p in start[0]]
    ref = torch.optim.Adam(ref_params, lr=float(lr), betas=(0.9, 0.98), eps=1e-9, weight_decay=0.01, foreach=False)
    for k, r in enumerate(ref_params):
        r.grad = start[1][k].double() / 64.0
        ref.state[r] = {"step": start[5][k].clone(), "exp_avg": start[2][k].double(),
                        "exp_avg_sq": start[3][k].double()}
    ref.step()
    for k, r in enumerate(ref_params):
        for name, result in (("cpu", args), ("cuda_sim", sim)):
            assert_close(result[0][k] - start[0][k], r.detach() - start[0][k].double(), torch.float32,
                         f"{name} param {k} update")
            assert_close(result[2][k], ref.state[r]["exp_avg"], torch.float32, f"{name} exp_avg {k}")
            assert_close(result[3][k], ref.state[r]["exp_avg_sq"], torch.float32, f"{name} exp_avg_sq {k}")
            assert result[5][k].item() == start[5][k].item() + 1
            if result[4][k] is not None:
                assert torch.equal(result[4][k], result[0][k].to(result[4][k].dtype)), f"{name} copy {k}"
        # the two kernels: the same float32 operations, up to the contraction of a multiply-add into an FMA
        torch.testing.assert_close(sim[0][k], args[0][k], rtol=1e-6, atol=1e-7)
    skipped = clone_args(sim)
    call(skipped, lr_tensor=lr, found_inf=torch.tensor([1.0]), impl=cuda_sim.adam_step)
    for items, saved in zip(skipped, sim):
        for t, s in zip(items, saved):
            assert t is None and s is None or torch.equal(t, s)
