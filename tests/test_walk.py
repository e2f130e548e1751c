"""The structure signature built in C (``fastdp._C.walk``, csrc/python/structure.c) against the same walk written in
Python over the modules' own dicts, on module trees with every kind of slot; that a change of any kind the kept
replicas depend on changes the signature (``matches`` 0); and that a tensor whose memory moved while the structure
stayed is told apart (``matches`` 2: what aliases it is remade, nothing rebuilt)."""

import gc
import sys
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

from fastdp import _C
from fastdp._native import core as _core


@pytest.fixture(params=["aoti", "python"])
def path(request):
    """matches() reads plain tensors through libtorch's C shim in one batch ("aoti"), or every tensor through its
    Python attributes ("python"): both must give the same answers."""
    if request.param == "aoti" and not _core.tensor_shim_usable():
        pytest.skip("this torch has no usable C shim")
    previous = _C.set_tensor_path(request.param)
    yield request.param
    _C.set_tensor_path(previous)


def _memory(t, what):
    try:
        return getattr(t, what)()
    except Exception:  # sparse tensors have neither
        return None


def reference_walk(root):
    """Breadth first over every distinct module, root first: a header per module, then an entry per parameter,
    buffer and child slot."""
    todo, seen, sig = [root], {id(root)}, []
    for m in todo:
        params, buffers, children = m._parameters, m._buffers, m._modules
        sig.append((id(m), type(m), len(params), len(buffers), id(m.__dict__)))
        for d in (params, buffers):
            for k, t in d.items():
                sig.append((k, None) if t is None else
                           (k, id(t), t.dtype, t.shape, t.device, t.requires_grad, t.layout, _memory(t, "data_ptr"),
                            _memory(t, "stride")))
        for k, c in children.items():
            sig.append((k, id(c)))
            if c is not None and id(c) not in seen:
                seen.add(id(c))
                todo.append(c)
    return todo, sig


class Odd(nn.Module):
    """Empty slots, a shared child, a frozen parameter, buffers of other dtypes, an OrderedDict of parameters."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = self.a  # the same child twice
        self.c = None
        self.register_parameter("none_p", None)
        self.register_buffer("none_b", None)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.frozen = nn.Parameter(torch.ones(2, 2, dtype=torch.float64), requires_grad=False)
        self.seq = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.ReLU())
        self.plist = nn.ParameterList([nn.Parameter(torch.randn(3)) for _ in range(2)])
        self.pdict = nn.ParameterDict({"x": nn.Parameter(torch.randn(1, 1))})
        self.sparse = nn.Embedding(5, 2, sparse=True)
        self.meta = nn.Linear(2, 2, device="meta")


def models():
    ordered = nn.Linear(2, 2)
    ordered._parameters = OrderedDict(reversed(list(ordered._parameters.items())))  # not a plain dict
    nested = nn.Sequential(Odd(), nn.Sequential(nn.Linear(4, 4)))
    nested[1].append(nested[0].a)  # a module shared across branches
    return [nn.Linear(2, 3), Odd(), ordered, nested, nn.TransformerEncoderLayer(8, 2, 16), nn.LSTM(3, 4, 2)]


@pytest.mark.parametrize("model", models(), ids=lambda m: type(m).__name__)
def test_c_walk_equals_the_python_walk(model, path):
    modules, sig = _C.walk(model)
    ref_modules, ref_sig = reference_walk(model)
    assert [id(m) for m in modules] == [id(m) for m in ref_modules]
    assert sig == ref_sig
    assert len(sig) == len(ref_sig) and all(type(a) is type(b) for a, b in zip(sig, ref_sig))
    assert _C.matches(modules, sig) == 1
    assert _C.matches(ref_modules, ref_sig) == 1  # a device object per entry, as the Python walk makes them
    assert _C.matches(modules, sig[:-1]) == 0 and _C.matches(modules, sig + [sig[-1]]) == 0
    assert _C.matches(modules[:-1], sig) == 0


CHANGES = {
    "requires_grad": lambda m: m[0].weight.requires_grad_(False),
    "dtype": lambda m: setattr(m[0].weight, "data", m[0].weight.data.double()),
    "shape": lambda m: setattr(m[0].weight, "data", m[0].weight.data.reshape(-1)),
    "replaced parameter": lambda m: setattr(m[0], "weight", nn.Parameter(m[0].weight.detach().clone())),
    "parameter removed": lambda m: setattr(m[0], "bias", None),
    "buffer added": lambda m: m[2].register_buffer("extra", torch.zeros(1)),
    "child added": lambda m: m.append(nn.ReLU()),
    "child replaced": lambda m: m.__setitem__(1, nn.Tanh()),
    "buffer dtype": lambda m: setattr(m[2].running_mean, "data", m[2].running_mean.data.double()),
    "buffer shape, same storage": lambda m: setattr(m[2].running_var, "data", m[2].running_var.data[:2]),
    "buffer replaced": lambda m: setattr(m[2], "running_mean", m[2].running_mean.clone()),
    "frozen buffer now requires grad": lambda m: m[2].running_mean.requires_grad_(True),
    # The same slot dicts in a new __dict__ (a __setstate__ assigning the state it got): the plain attributes kept
    # replicas mirror from the old one are elsewhere now.
    "instance dict replaced": lambda m: setattr(m[1], "__dict__", dict(m[1].__dict__)),
}


@pytest.mark.parametrize("change", CHANGES)
def test_every_change_moves_the_signature(change, path):
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.BatchNorm1d(3))
    modules, before = _C.walk(model)
    assert _C.walk(model)[1] == before and _C.matches(modules, before) == 1
    CHANGES[change](model)
    after = _C.walk(model)[1]
    assert after != before
    assert after == reference_walk(model)[1]
    assert _C.matches(modules, before) == 0


MOVES = {
    "data replaced": lambda m: setattr(m[0].weight, "data", m[0].weight.data.clone()),
    "data transposed (square)": lambda m: setattr(m[0].weight, "data", m[0].weight.data.t()),
    "moved to shared memory": lambda m: m[2].running_var.share_memory_(),
    "set_ to other memory": lambda m: m[2].running_mean.set_(torch.zeros(3)),
    "swap_tensors": lambda m: torch.utils.swap_tensors(m[0].bias, nn.Parameter(torch.zeros(3))),
}


@pytest.mark.parametrize("move", MOVES)
def test_memory_moved_under_the_same_structure(move, path):
    """A tensor whose data pointer or strides changed while everything else stayed: matches says 2, and a walk made
    now matches again."""
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.BatchNorm1d(3))
    modules, before = _C.walk(model)
    MOVES[move](model)
    assert _C.matches(modules, before) == 2
    modules, after = _C.walk(model)
    assert after == reference_walk(model)[1] and _C.matches(modules, after) == 1


def _recorded(model, recordable=True):
    """A model's walk, and records of a check that found it equal (NOTE [structure records]), made and then read.
    Recordable: dict tags, plain dicts, and every tensor read through the shim (the records keep only those)."""
    modules, sig = _C.walk(model)
    seen = _C.structure_records()
    assert _C.matches(modules, sig, seen) == 1
    if _C.DICT_TAGS and _C.tensor_path()[0] == "aoti":
        assert isinstance(seen[0], bytearray) == recordable  # the checks below take the records' path first
    assert _C.matches(modules, sig, seen) == 1
    return modules, sig, seen


@pytest.mark.parametrize("edit, found", [(CHANGES[k], 0) for k in CHANGES] + [(MOVES[k], 2) for k in MOVES],
                         ids=list(CHANGES) + list(MOVES))
def test_a_recorded_check_sees_every_change_and_move(edit, found, path):
    """Every structure change (0) and memory move (2) is seen by a check that recorded the model first."""
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.BatchNorm1d(3))
    modules, sig, seen = _recorded(model)
    edit(model)
    assert _C.matches(modules, sig, seen) == found


RECORDED_CHANGES = {
    "class assigned": lambda m: setattr(m[1], "__class__", nn.Tanh),
    "instance dict replaced": lambda m: setattr(m[0], "__dict__", {
        **m[0].__dict__, "_parameters": {"weight": nn.Parameter(torch.zeros(3, 3)), "bias": m[0].bias}}),
    "parameter dict replaced": lambda m: setattr(m[0], "_parameters", dict(reversed(m[0]._parameters.items()))),
    "child's buffers emptied": lambda m: m[2]._buffers.clear(),
}


@pytest.mark.parametrize("change", RECORDED_CHANGES)
def test_a_recorded_check_sees_what_no_recorded_dict_shows(change, path):
    """Changes a record could miss: a class assigned and a new instance dict change none of the recorded dicts (the
    old ones are kept alive here, so a record read through them would find them unchanged), a slot dict replaced
    changes the instance dict only, a dict emptied in place changes only itself."""
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.BatchNorm1d(3))
    modules, sig, seen = _recorded(model)
    kept = [m.__dict__ for m in model.modules()] + [m._parameters for m in model.modules()]
    RECORDED_CHANGES[change](model)
    assert _C.matches(modules, sig, seen) == 0
    assert kept


def test_a_change_made_while_a_check_compares_is_seen_by_the_next(path):
    """A garbage collection can run at any allocation inside the comparison, and its callback (or a finalizer) can
    change the model there: what the records vouch for is read before the comparison, so the next check sees the
    change, as a check without records does. Each collection point inside the first check is tried in turn."""
    reached = 0
    for k in range(1, 40):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        modules, sig = _C.walk(model)
        seen = _C.structure_records()
        state = {"n": 0, "done": False}

        def swap(phase, info):
            if phase == "start" and not state["done"]:
                state["n"] += 1
                if state["n"] == k:
                    state["done"] = True
                    model[1] = nn.Linear(8, 8)

        gc.collect()
        threshold = gc.get_threshold()
        gc.callbacks.append(swap)
        gc.set_threshold(1)
        try:
            _C.matches(modules, sig, seen)
        finally:
            gc.set_threshold(*threshold)
            gc.callbacks.remove(swap)
        if not state["done"]:
            break
        reached += 1
        assert _C.matches(modules, sig, seen) == _C.matches(modules, sig) == 0
    if not reached:
        # From 3.12 a collection waits for the interpreter's next check between bytecodes: none runs inside C.
        assert sys.version_info >= (3, 12), "no collection ran inside the check"
        pytest.skip("no collection runs inside a C call on this Python")


def test_an_ordered_parameter_dict_is_compared_every_time(path):
    """An OrderedDict can change its order with no change to the dict underneath: such a module is never taken
    from a record."""
    model = nn.Linear(2, 2)
    model._parameters = OrderedDict(model._parameters.items())
    modules, sig, seen = _recorded(model, recordable=False)
    model._parameters.move_to_end("weight")
    assert _C.matches(modules, sig, seen) == 0


def test_a_subclass_tensors_facts_are_read_every_time(path):
    """A tensor of a subclass is compared through its Python attributes during the walk, which records would skip:
    such a model is never taken from a record, and its tensor's change is seen."""

    class Tagged(nn.Parameter):
        pass

    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model[0].weight = Tagged(torch.randn(3, 3))
    modules, sig, seen = _recorded(model, recordable=False)
    model[0].weight.requires_grad_(False)
    assert _C.matches(modules, sig, seen) == 0


def test_a_change_outside_the_structure_is_recorded_again(path):
    """An attribute set on a module (a training flag, a user's field) changes its instance dict and nothing of the
    structure: the check compares everything, finds it equal and records it again; a later change is still seen."""
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.BatchNorm1d(3))
    modules, sig, seen = _recorded(model)
    model.eval()
    model[0].note = "x"
    assert _C.matches(modules, sig, seen) == 1 and _C.matches(modules, sig, seen) == 1
    model[2].register_buffer("extra", torch.zeros(1))
    assert _C.matches(modules, sig, seen) == 0


def test_records_of_another_walk_are_not_used(path):
    """Records belong to the walk they were made with: another walk of the same model compares everything."""
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    modules, sig, seen = _recorded(model)
    model[1].register_buffer("extra", torch.zeros(1))
    modules2, sig2 = _C.walk(model)
    assert _C.matches(modules2, sig2, seen) == 1
    model[0].weight.requires_grad_(False)
    assert _C.matches(modules2, sig2, seen) == 0 and _C.matches(modules, sig, seen) == 0


def _wide():
    """More tensors than the shim path reads per conversion (it converts them a few dozen at a time)."""
    return nn.Sequential(*[nn.Linear(3, 3) for _ in range(70)], nn.BatchNorm1d(3))


def _tensor_at(model, sig, k):
    """The k-th tensor of the signature's entries, in the order matches() compares them."""
    by_id = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return by_id[[e for e in sig if len(e) == 9][k][1]]


@pytest.mark.parametrize("k", [0, 59, 60, 61, 119, -1])
def test_a_change_anywhere_among_many_tensors_is_seen(k, path):
    """Whichever tensor changes, first or last or either side of where one conversion ends and the next begins,
    matches() sees its shape changed (0) or its memory moved (2), and nothing else."""
    model = _wide()
    modules, sig = _C.walk(model)
    assert len([e for e in sig if len(e) == 9]) > 120
    t = _tensor_at(model, sig, k)
    kept = t.data
    t.data = kept.clone()
    assert _C.matches(modules, sig) == 2
    t.data = kept.reshape(1, -1) if kept.dim() == 1 else kept.reshape(-1)
    assert _C.matches(modules, sig) == 0
    t.data = kept
    assert _C.matches(modules, sig) == 1


@pytest.mark.parametrize("field, value, found", [
    (2, torch.float64, 0), (3, torch.Size([3, 4]), 0), (3, (3, "3"), 0), (4, torch.device("cpu", 0), 0),
    (4, "cpu", 0), (5, True, 0), (6, torch.sparse_coo, 0), (7, 8, 2), (7, None, 2), (8, (2,), 2), (8, (1, 1), 2)],
    ids=["dtype", "shape", "shape_not_ints", "device_index", "device_string", "requires_grad", "layout", "data_ptr",
         "data_ptr_none", "strides", "strides_other_rank"])
def test_matches_compares_every_field(field, value, found, path):
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    modules, sig = _C.walk(model)
    model[1].running_mean.requires_grad_(False)
    at = next(i for i, e in enumerate(sig) if len(e) == 9 and e[0] == "running_mean")
    changed = list(sig[at])
    changed[field] = value
    assert _C.matches(modules, sig) == 1
    assert _C.matches(modules, sig[:at] + [tuple(changed)] + sig[at + 1:]) == found


def test_walk_shares_equal_device_objects():
    """Entries of tensors on one device hold one device object, so that matches() reads what it is once."""
    modules, sig = _C.walk(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 2, device="meta")))
    devices = [e[4] for e in sig if len(e) == 9]
    assert len(devices) == 9 and len({id(d) for d in devices}) == 2
    assert [str(d) for d in devices] == ["cpu"] * 7 + ["meta"] * 2


def test_errors_are_python_exceptions(path):
    broken = nn.Sequential(nn.Linear(2, 2))
    del broken[0].__dict__["_modules"]  # Module.__getattr__ then raises
    with pytest.raises(AttributeError, match="_modules"):
        _C.walk(broken)
    with pytest.raises(AttributeError):
        _C.walk(object())
    modules, sig = _C.walk(nn.Sequential(nn.Linear(2, 2)))
    seen = _C.structure_records()
    assert _C.matches(modules, sig, seen) == 1
    for records in ([], [None, None], (None, None, None), "records"):
        with pytest.raises(TypeError, match="records must be None or what structure_records"):
            _C.matches(modules, sig, records)
    del modules[1].__dict__["_parameters"]
    with pytest.raises(AttributeError, match="_parameters"):
        _C.matches(modules, sig)
    with pytest.raises(AttributeError, match="_parameters"):
        _C.matches(modules, sig, seen)  # the recorded check sees the change and walks, which raises
    with pytest.raises(TypeError):
        _C.matches(tuple(modules), sig)


class _FactsInPython(torch.Tensor):
    """A tensor subclass whose data_ptr runs Python code, where an interrupt can land."""

    interrupting = False

    def data_ptr(self):
        if type(self).interrupting:
            raise KeyboardInterrupt("while the binding read a tensor's memory")
        return super().data_ptr()


def test_an_interrupt_inside_a_fact_the_binding_can_do_without_still_reaches_the_caller():
    """The structure walk and check do without a tensor's memory facts where they cannot read them, and drop that
    error; an interrupt raised by the Python code they ran there is not dropped with it (NOTE [no lost interrupt] in
    binding.h): the interpreter raises it again at its next check."""
    module = nn.Linear(2, 2)
    module.register_buffer("odd", torch.zeros(2).as_subclass(_FactsInPython))
    modules, signature = _C.walk(module)
    _FactsInPython.interrupting = True
    try:
        for check in (lambda: _C.walk(module), lambda: _C.matches(modules, signature)):
            with pytest.raises(KeyboardInterrupt):
                check()
                for _ in range(3):
                    pass
    finally:
        _FactsInPython.interrupting = False
