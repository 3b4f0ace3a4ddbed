"""The checks of argument values (cross_entropy's targets, attention_varlen's cu_seqlens tables) and their
deferred mode (csrc/value_checks.h, fastformer/ops/deferred.py).

The deferred checks are device ops that OR what is broken into a per-device flag, read by check_deferred().
CI has no GPU, so their computation runs here on CPU tensors through fastformer._C's entry points (the very
functions the GPU path calls): each rule of each check sets its word and check_deferred() names it once; a
dispatch mode sees that they read nothing on the host and make no op whose output shape depends on the data
(a sync on a GPU). CPU calls of the ops keep their immediate checks inside the mode. Meta tensors (which have
no values to copy: a read raises) show when a GPU-style table check reads the table and when it finds it
checked already. tests/gpu/test_cuda_tensors.py runs the mode on a GPU under set_sync_debug_mode("error").
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastformer import ops
from fastformer._ext import C

from helpers import ALL_BACKENDS

aten = torch.ops.aten
INT32_MAX = 2**31 - 1


@pytest.fixture(autouse=True)
def clear_flags():
    """Each test starts and ends with every flag clear and the mode off."""
    C.check_deferred()
    yield
    C.set_deferred_checks(False)
    try:
        C.check_deferred()
    except ValueError:
        pass


def table(*values):
    return torch.tensor(values, dtype=torch.int32)


def cross_entropy_message():
    return (r"^fastformer cross_entropy: a target outside \[0, V\) and not ignore_index was passed since the last "
            r"check_deferred\(\) \(checked on cpu, deferred\)$")


@pytest.mark.parametrize("target,ignore_index", [((0, 9, -100), -100), ((0, 9, 3), 3), ((-100, -100), -100),
                                                 ((5, -1), -1)])
def test_good_targets_leave_the_flag_clear(target, ignore_index):
    C.defer_cross_entropy_check(torch.tensor(target), 10, ignore_index)
    assert ops.check_deferred() is None


@pytest.mark.parametrize("target,ignore_index", [((0, 10), -100), ((-1, 3), -100), ((-100, 2), 2), ((1 << 40,), 0)])
def test_a_bad_target_raises_once_from_check_deferred(target, ignore_index):
    C.defer_cross_entropy_check(torch.tensor(target), 10, ignore_index)  # no error here
    with pytest.raises(ValueError, match=cross_entropy_message()):
        ops.check_deferred()
    assert ops.check_deferred() is None  # read and cleared


# (table, total, max_seqlen, the rule broken or None)
TABLES = {
    "good": (table(0, 3, 3, 7), 7, 4, None),
    "no sequence": (table(0), 0, 0, None),
    "empty sequences": (table(0, 0, 0), 0, 0, None),
    "first not 0": (table(1, 3, 7), 7, 6, "whose first entry is not 0"),
    "decreasing": (table(0, 4, 3, 7), 7, 4, r"that decreases \(it must be non-decreasing\)"),
    "too long": (table(0, 5, 7), 7, 4, "with a sequence longer than max_seqlen_{side}"),
    "last not the total": (table(0, 5, 6), 7, 6, r"whose last entry is not {side}'s row count \(the packed total\)"),
    "no sequence, rows left": (table(0), 3, 0, r"whose last entry is not {side}'s row count \(the packed total\)"),
    # int32 differences wrap around to 6 and look fine; in int64 the third entry is far below the second
    "decreasing past int32": (table(0, INT32_MAX, -INT32_MAX + 4, 0, 10), 10, 2**32,
                              r"that decreases \(it must be non-decreasing\)"),
}


@pytest.mark.parametrize("side", ["q", "k"])
@pytest.mark.parametrize("name", TABLES)
def test_each_table_rule_sets_its_own_word(name, side):
    cu, total, max_seqlen, rule = TABLES[name]
    C.defer_cu_seqlens_check(cu, f"cu_seqlens_{side}", total, max_seqlen)
    if rule is None:
        assert ops.check_deferred() is None
        return
    rule = rule.format(side=side)
    with pytest.raises(ValueError, match=rf"^fastformer attention_varlen: a cu_seqlens_{side} {rule} was passed "
                                         r"since the last check_deferred\(\) \(checked on cpu, deferred\)$"):
        ops.check_deferred()
    assert ops.check_deferred() is None


@pytest.mark.parametrize("name", [n for n, t in TABLES.items() if t[3] is not None])
def test_the_host_check_refuses_what_the_device_check_flags(name):
    # The two ways of checking a table are the same rules: the CPU call (host check) refuses each bad table.
    cu, total, max_seqlen, _ = TABLES[name]
    q = torch.randn(total, 2, 8)
    with pytest.raises(ValueError, match="fastformer attention_varlen: .*cu_seqlens_q"):
        C.check_attention_varlen(q, q, q, cu, table(0, total), max_seqlen, total, 0.0, None)


def test_several_broken_rules_are_named_together():
    C.defer_cu_seqlens_check(table(2, 1, 9), "cu_seqlens_k", 7, 8)
    C.defer_cross_entropy_check(torch.tensor([7]), 5, -100)
    with pytest.raises(ValueError) as raised:
        ops.check_deferred()
    message = str(raised.value)
    for part in ("cross_entropy: a target outside", "cu_seqlens_k whose first entry is not 0",
                 "cu_seqlens_k that decreases", "cu_seqlens_k whose last entry"):
        assert part in message, message
    assert "longer than" not in message and "cu_seqlens_q" not in message


class HostReads(TorchDispatchMode):
    """Every ATen call, and those that make a GPU's host wait: a scalar read back, an output whose shape
    depends on the data (the host must learn it), a copy to the CPU."""

    def __init__(self):
        super().__init__()
        self.calls, self.waits = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append(func)
        tags = set(func.tags)
        if torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags or \
                func in (aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default):
            self.waits.append(str(func))
        if func is aten._to_copy.default and kwargs.get("device") is not None:
            self.waits.append(f"{func} to {kwargs['device']}")
        if func is aten.index.Tensor or func is aten.masked_select.default:
            self.waits.append(str(func))
        return func(*args, **kwargs)


@pytest.mark.parametrize("check", ["cross_entropy", "cu_seqlens"])
@pytest.mark.parametrize("bad", [False, True])
def test_deferred_checks_read_nothing_on_the_host(check, bad):
    with HostReads() as seen:
        if check == "cross_entropy":
            C.defer_cross_entropy_check(torch.tensor([0, 4, 12 if bad else 3, -100]), 10, -100)
        else:
            C.defer_cu_seqlens_check(table(0, 2, 9 if bad else 5, 8), "cu_seqlens_k", 8, 4)
    assert seen.waits == [], seen.waits
    assert aten.logical_or_.default in seen.calls, seen.calls  # the flag's update, in place on the device
    if bad:
        with pytest.raises(ValueError):
            ops.check_deferred()
    assert ops.check_deferred() is None


def test_the_detector_sees_the_immediate_checks_host_read():
    # What the deferred checks avoid: the check at the call reads the values back (here on meta tensors, whose
    # values cannot be read: the read raises).
    cu = table(0, 3, 7).to("meta")
    q = torch.empty(7, 2, 8, device="meta")
    with pytest.raises(NotImplementedError):
        C.check_attention_varlen(q, q, q, cu, cu, 4, 4, 0.0, None)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_cpu_calls_keep_their_immediate_checks_in_the_mode(backend):
    with ops.deferred_checks():
        with pytest.raises(ValueError, match="outside the classes"):
            ops.cross_entropy(torch.randn(2, 10), torch.tensor([3, 10]), backend=backend)
        q = torch.randn(7, 2, 8)
        with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
            ops.attention_varlen(q, q, q, table(0, 5, 3, 7), table(0, 5, 6, 7), 5, 5, backend=backend)
    assert ops.check_deferred() is None


def test_the_mode_is_a_context_and_restores_the_previous_one():
    assert not C.deferred_checks_enabled()
    with ops.deferred_checks():
        assert C.deferred_checks_enabled()
        with ops.deferred_checks(enabled=False):
            assert not C.deferred_checks_enabled()
        assert C.deferred_checks_enabled()
        with pytest.raises(RuntimeError, match="inside"):
            with ops.deferred_checks():
                raise RuntimeError("inside")
        assert C.deferred_checks_enabled()
    assert not C.deferred_checks_enabled()


def test_a_table_checked_on_the_host_is_not_read_again():
    # checked_cu_seqlens checks a host table and puts it on a device, remembered as checked: the ops' checks
    # of that tensor read nothing while it is unchanged (meta tensors: a read would raise). Another tensor with
    # the same values, another max_seqlen or total, or the same tensor changed in place is read again.
    with pytest.raises(ValueError, match="must be non-decreasing"):
        C.checked_cu_seqlens(table(0, 4, 3, 7), torch.device("meta"), 7, 4)
    cu = C.checked_cu_seqlens(table(0, 3, 7), torch.device("meta"), 7, 4)
    assert cu.device.type == "meta" and cu.dtype == torch.int32 and cu.shape == (3,)
    q = torch.empty(7, 2, 8, device="meta")
    for _ in range(2):  # queries and keys, every layer, forward and backward
        C.check_attention_varlen(q, q, q, cu, cu, 4, 4, 0.0, None)
    with pytest.raises(NotImplementedError):
        C.check_attention_varlen(q, q, q, cu, cu, 5, 5, 0.0, None)  # another max_seqlen: read
    other = table(0, 3, 7).to("meta")
    with pytest.raises(NotImplementedError):
        C.check_attention_varlen(q, q, q, other, other, 4, 4, 0.0, None)
    cu.add_(0)  # a new version
    with pytest.raises(NotImplementedError):
        C.check_attention_varlen(q, q, q, cu, cu, 4, 4, 0.0, None)


def test_checked_cu_seqlens_on_the_cpu_is_the_checked_table():
    cu = C.checked_cu_seqlens(table(0, 3, 7), torch.device("cpu"), 7, 4)
    assert torch.equal(cu, table(0, 3, 7))
    with pytest.raises(ValueError, match="the last entry of cu_seqlens_q is 7 but the packed tensor has 8 rows"):
        C.checked_cu_seqlens(table(0, 3, 7), torch.device("cpu"), 8, 4)
    with pytest.raises(ValueError, match="1-D int32 CPU tensor"):
        C.checked_cu_seqlens(table(0, 3, 7).long(), torch.device("cpu"), 7, 4)
