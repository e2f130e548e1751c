"""A forward's own edits to its replica never reach the next step: every step starts from the master, as upstream's
replicas do (torch.nn.DataParallel builds them afresh every forward).

A forward may change the replica it runs on in many ways: rebind a parameter's or a buffer's ``.data`` (a running
statistic kept as a frozen parameter), assign a tensor, a Parameter, a buffer, a module or a plain value to an
attribute, register a new buffer, parameter or submodule, swap a submodule, delete an attribute, resize a tensor in
place or change its shape in place. The kept replicas must undo all of it before the next forward. Each case runs the
same script through the wrapper and through upstream's rule by hand (``upstream_replicas``: replica 0 runs on the
master's storage, its buffers the master's own objects and its parameters aliases of the master's; every other replica
on copies of its own, all made before any replica runs) and compares outputs, gradients and the master's state after
every step. The emulated "cpu" replicas stand in for devices upstream's DataParallel cannot run on.
"""

import copy

import pytest
import torch
import torch.nn as nn

import fastdp

pytestmark = pytest.mark.usefixtures("cpu_apply")

R = 3
TOL = dict(rtol=1e-12, atol=1e-12)


# ---- upstream's rule, by hand ----------------------------------------------------------------------------------------


def upstream_replicas(master, count):
    """The replicas torch.nn.DataParallel makes for one forward: shallow copies of every module (their own parameter,
    buffer and child dicts, as ``Module._replicate_for_data_parallel`` gives them), replica 0 over the master's storage,
    the others over copies. Replica 0's buffers are the master's buffer objects; its parameters are aliases of the
    master's with autograd (differentiable ones for trainable parameters) and the master's own objects without
    (upstream's detached replicate)."""
    grad = torch.is_grad_enabled()
    modules = list(master.modules())
    index = {id(m): i for i, m in enumerate(modules)}
    rows = []
    for r in range(count):
        row = [m._replicate_for_data_parallel() for m in modules]
        copies = {}

        def replica_of(t, r=r, copies=copies):
            if id(t) not in copies:
                if r:
                    copies[id(t)] = t.clone()
                elif grad:
                    copies[id(t)] = t.view_as(t) if t.requires_grad else t.detach()
                else:
                    copies[id(t)] = t
            return copies[id(t)]

        for m, replica in zip(modules, row):
            replica._parameters = {k: None if p is None else replica_of(p) for k, p in m._parameters.items()}
            replica._buffers = {k: b if b is None or r == 0 else replica_of(b) for k, b in m._buffers.items()}
            replica._modules = {k: None if c is None else row[index[id(c)]] for k, c in m._modules.items()}
        rows.append(row[0])
    return rows


def upstream_forward(master, x, sizes):
    """One forward of torch.nn.DataParallel's rule over chunks of ``x`` of ``sizes`` rows."""
    chunks = x.split(sizes)
    replicas = upstream_replicas(master, len(chunks))  # every replica made before any runs
    return torch.cat([replica(chunk) for replica, chunk in zip(replicas, chunks)])


def state(module):
    """Every parameter and buffer by name, and the plain attributes a script may set, for comparison."""
    got = {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items()}
    got.update({f"attr:{k}": v for k, v in vars(module).items() if isinstance(v, (int, float, str))})
    return got


def assert_same(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        if isinstance(a[k], torch.Tensor):
            torch.testing.assert_close(a[k], b[k], **TOL, msg=f"{what}: {k}")
        else:
            assert a[k] == b[k], (what, k)


def run_both(make, steps=4, rows=12, sizes=None, grad=True, train=True):
    """The script through the wrapper and through upstream's rule: per step a forward (a backward and an SGD step
    with autograd), then outputs, gradients and the master's state compared. The rows of every chunk but replica
    0's carry a mark (column 3 at 100) that a model may act on."""
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    sizes = sizes or [rows // R] * R
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R, chunk_sizes=sizes if len(set(sizes)) > 1 else None)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1) for m in (model, ref)]
    torch.manual_seed(7)
    for step in range(steps):
        x = torch.randn(rows, 4, dtype=torch.float64)
        x[sizes[0]:, 3] = 100
        for m in (model, ref):
            m.train(train)
        with torch.set_grad_enabled(grad):
            got, want = dp(x), upstream_forward(ref, x, sizes)
        torch.testing.assert_close(got, want, **TOL, msg=f"step {step}: outputs")
        if grad:
            for out, opt in ((got, opts[0]), (want, opts[1])):
                opt.zero_grad()
                out.pow(2).sum().backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                if p.requires_grad:
                    torch.testing.assert_close(p.grad, q.grad, **TOL, msg=f"step {step}: grad {name}")
            for opt in opts:
                opt.step()
        assert_same(state(model), state(ref), f"step {step}: master state")


# ---- the models: one way of editing the replica each -------------------------------------------------------------


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.mu = nn.Parameter(torch.zeros(4, dtype=torch.float64), requires_grad=False)
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.scale = 1.0


class FrozenDataRebound(Base):
    """A running statistic kept as a frozen parameter, updated by rebinding its ``.data``."""

    def forward(self, x):
        y = self.lin(x) + self.mu
        self.mu.data = 0.9 * self.mu.data + 0.1 * x.mean(0)
        return y


class TrainableDataRebound(Base):
    """Weights clipped inside forward by rebinding ``.data`` (a replica's clipping never reaches the master)."""

    def forward(self, x):
        self.lin.weight.data = self.lin.weight.data.clamp(-0.2, 0.2) * 1.5
        return self.lin(x)


class DataReboundOffTheMaster(Base):
    """A trainable parameter's ``.data`` rebound by the replicas that do not run on the master's storage only (their
    rows carry the mark), so that the master never changes, even without autograd."""

    def forward(self, x):
        if x[0, 3] > 50:
            self.lin.weight.data = self.lin.weight.data * 2
        return self.lin(x)


class BufferDataRebound(Base):
    """A buffer's ``.data`` rebound: replica 0's is the master's buffer, the others' their own."""

    def forward(self, x):
        y = self.lin(x) * (1 + self.count)
        self.count.data = self.count.data + x[0, 0]
        return y


class BufferAssigned(Base):
    """A buffer assigned a new tensor (``self.count = ...``: Module.__setattr__ puts it in the replica's buffers)."""

    def forward(self, x):
        y = self.lin(x) * (1 + self.count)
        self.count = self.count + x[0, 0]
        return y


class ParameterAssigned(Base):
    """A Parameter assigned inside forward replaces the replica's parameter."""

    def forward(self, x):
        y = self.lin(x) + self.mu
        self.mu = nn.Parameter(self.mu.detach() + x.mean(0), requires_grad=False)
        return y


class TrainableParameterAssigned(Base):
    """A trainable parameter replaced inside forward by a Parameter of the replica's own."""

    def forward(self, x):
        y = self.lin(x)
        self.lin.bias = nn.Parameter(self.lin.bias.detach() * 2)
        return y


class PlainAttribute(Base):
    """A plain value set and a new attribute made inside forward."""

    def forward(self, x):
        self.scale = self.scale * 2
        self.calls = getattr(self, "calls", 0) + 1
        return self.lin(x) * self.scale * self.calls


class BufferRegistered(Base):
    """A cache registered lazily inside forward (made from the replica's own chunk on every fresh replica)."""

    def forward(self, x):
        if not hasattr(self, "cache"):
            self.register_buffer("cache", x.mean(0).detach())
        return self.lin(x) + self.cache


class ParameterRegistered(Base):
    """A parameter registered lazily inside forward."""

    def forward(self, x):
        if "extra" not in self._parameters:
            self.register_parameter("extra", nn.Parameter(x.mean(0).detach(), requires_grad=False))
        return self.lin(x) + self.extra


class ModuleRegistered(Base):
    """A submodule made lazily inside forward, from the replica's chunk."""

    def forward(self, x):
        if not hasattr(self, "head"):
            self.head = nn.Linear(4, 4).double()
            with torch.no_grad():
                self.head.weight.fill_(0.25)
                self.head.bias.copy_(x.mean(0))
        return self.head(self.lin(x))


class ModuleSwapped(Base):
    """A submodule swapped for another inside forward."""

    def forward(self, x):
        y = self.lin(x)
        self.lin = nn.Identity()
        return y


class AttributeDeleted(Base):
    """A buffer, a parameter and a plain attribute deleted inside forward."""

    def forward(self, x):
        y = self.lin(x) * (1 + self.count) * self.scale + self.mu
        del self.count, self.mu, self.scale
        return y


class TrainableParameterDeleted(Base):
    """A trainable parameter deleted inside forward, after its use."""

    def forward(self, x):
        y = self.lin(x)
        del self.lin.bias
        return y


class ParametersReordered(Base):
    """The replica's parameters reordered inside forward (one taken out of its dict and put back last): a forward
    reading them in registration order sees the master's order on every fresh replica."""

    def forward(self, x):
        first = next(self.lin.parameters())
        y = self.lin(x) + first.reshape(-1)[:4]
        self.lin._parameters["weight"] = self.lin._parameters.pop("weight")
        return y


class FrozenMadeTrainable(Base):
    """A frozen parameter made to require grad inside forward (on replica 0's alias with autograd, on the master's own
    without), read by the next forward."""

    def forward(self, x):
        y = self.lin(x) * (2 if self.mu.requires_grad else 1)
        self.mu.requires_grad_(True)
        return y


class BiasMadeTrainableByOneReplica(Base):
    """Without autograd, the replica given 5 rows (one only) makes its bias require grad, which the next forward
    reads: one replica's edit of one tensor, which the kept aliases must see as well as an edit of them all."""

    def forward(self, x):
        y = self.lin(x) * (2 if self.lin.bias.requires_grad and not torch.is_grad_enabled() else 1)
        if x.shape[0] == 5:
            self.lin.bias.requires_grad_(True)
        return y


class ShapeChangedInPlace(Base):
    """A frozen parameter reshaped in place (under no_grad: its metadata only) after its use."""

    def forward(self, x):
        y = self.lin(x) + self.mu
        with torch.no_grad():
            self.mu.unsqueeze_(0)
        return y


class BufferGrownInPlace(nn.Module):
    """A buffer sized to the replica's chunk in place: a replica with more rows than replica 0 grows its own buffer's
    memory (which replication must not write into afterwards); the value read before the resize shows whether the
    replica started from the master."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.register_buffer("seen", torch.zeros(0, dtype=torch.float64))

    def forward(self, x):
        y = self.lin(x) + self.seen.sum()
        self.seen.resize_(x.shape[0] * 64).fill_(x[0, 0].item())
        return y


EDITS = [FrozenDataRebound, TrainableDataRebound, DataReboundOffTheMaster, BufferDataRebound, BufferAssigned,
         ParameterAssigned, TrainableParameterAssigned, PlainAttribute, BufferRegistered, ParameterRegistered,
         ModuleRegistered, ModuleSwapped, AttributeDeleted, TrainableParameterDeleted, ParametersReordered,
         FrozenMadeTrainable, ShapeChangedInPlace]


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("make", EDITS, ids=lambda c: c.__name__)
def test_a_forwards_edits_never_reach_the_next_step(make, grad):
    run_both(make, grad=grad)


@pytest.mark.parametrize("make", EDITS, ids=lambda c: c.__name__)
def test_without_dict_version_tags(make, monkeypatch):
    """Without dict version tags (CPython 3.12 with every dict watcher taken), the replica's dicts are compared with
    the master's keys and the children built, and every grad slot is installed again each step. Run here by never
    recording a tag."""
    monkeypatch.setattr(fastdp._C, "DICT_TAGS", 0)
    monkeypatch.setattr(fastdp._C, "owned_record", lambda *args: None)
    run_both(make)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_a_buffer_grown_in_place_on_one_replica(grad):
    """Replica 0 (the master) holds 2 rows' worth, the others grow theirs to 5 rows' worth every step."""
    run_both(BufferGrownInPlace, steps=5, rows=12, sizes=[2, 5, 5], grad=grad)


def test_one_replicas_edit_of_one_tensor_never_reaches_the_next_step():
    run_both(BiasMadeTrainableByOneReplica, steps=3, rows=12, sizes=[3, 5, 4], grad=False)


def test_a_running_statistic_kept_as_a_frozen_parameter_trains_as_upstream():
    """The reported case: ``self.mu.data = 0.9 * self.mu.data + 0.1 * x.mean(0)``; many steps, eval steps between."""
    model, ref = FrozenDataRebound(), FrozenDataRebound()
    ref.load_state_dict(model.state_dict())
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    torch.manual_seed(3)
    for step in range(8):
        x = torch.randn(9, 4, dtype=torch.float64) + step
        with torch.set_grad_enabled(step % 3 != 2):
            torch.testing.assert_close(dp(x), upstream_forward(ref, x, [3, 3, 3]), **TOL, msg=f"step {step}")
    assert_same(state(model), state(ref), "master")
