"""fastdp.replicate and the replicas fastdp.DataParallel runs, against torch.nn.DataParallel's
(docs/data_parallel.md): parameters shared with the master on device 0 and present inside each replica, buffers
and BatchNorm's statistics from chunk 0, shared submodules and tied weights, ParameterList and ParameterDict, RNNs'
flatten_parameters, lazy modules refused, and scripted modules.

Every case runs on ``["cpu"] * N`` devices, and those written with tests/_places.py on simulated CUDA devices too
(tests/test_sim_contract.py). Results are compared with the bare module on the full batch,
never with numbers typed by hand.
"""

import copy
import io
import re

import pytest
import torch
import torch.nn as nn

import fastdp

from _dp_cases import ids
from _places import device, devices, host, module, on


# Every test runs with "cpu" replicas in the calling thread and on worker threads (conftest.cpu_apply).
pytestmark = pytest.mark.usefixtures("cpu_apply")


# ---------------------------------------------------------------- replication


def test_replicate_storage_sharing_and_parameters_inside_replicas():
    m = nn.Linear(4, 3)
    ref = copy.deepcopy(m)
    m = module(m)
    replicas = fastdp.replicate(m, devices(3))
    assert len(replicas) == 3
    x = torch.randn(5, 4)
    for k, r in enumerate(replicas):
        assert r._is_replica
        params = list(r.parameters())  # deliberate: upstream yields nothing here
        assert len(params) == 2
        for p, master in zip(params, ref.parameters()):
            assert p.requires_grad and p.grad_fn is not None and not isinstance(p, nn.Parameter)
            torch.testing.assert_close(host(p), master)
        for p, master in zip(params, m.parameters()):
            assert (p.data_ptr() == master.data_ptr()) == (k == 0)
        torch.testing.assert_close(host(r(on(x, k))), ref(x))
    detached = fastdp.replicate(m, devices(2), detach=True)
    assert detached[0].weight is m.weight
    assert not detached[1].weight.requires_grad
    assert detached[1].weight.data_ptr() != m.weight.data_ptr()


def test_replicate_accepts_any_iterable_and_tuple():
    m = module(nn.Linear(2, 2))
    assert len(fastdp.replicate(m, tuple(devices(2)))) == 2
    assert len(fastdp.replicate(m, iter(devices(3)))) == 3


def test_replicate_buffers_and_batchnorm_chunk0_semantics():
    bn = nn.BatchNorm1d(3)
    ref = copy.deepcopy(bn)
    bn = module(bn)
    x = torch.randn(8, 3) * 3 + 1
    for r, d in zip(fastdp.replicate(bn, devices(2)), devices(2)):
        assert r.running_mean.device == device(d) and r.num_batches_tracked.dtype == torch.long
    dp = fastdp.DataParallel(bn, device_ids=devices(2))
    out = dp(x)
    # Each chunk is normalised with its own statistics; running stats come from chunk 0 only.
    ref1 = copy.deepcopy(ref)
    expected = torch.cat([ref(x[:4]), ref1(x[4:])])
    torch.testing.assert_close(host(out), expected)
    torch.testing.assert_close(host(bn.running_mean), ref.running_mean)
    torch.testing.assert_close(host(bn.running_var), ref.running_var)
    assert bn.num_batches_tracked.item() == 1


def test_shared_submodules_and_tied_weights_stay_shared():
    emb = nn.Embedding(10, 4)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = emb
            self.b = emb
            self.out = nn.Linear(4, 10, bias=False)
            self.out.weight = emb.weight

        def forward(self, idx):
            return self.out(self.a(idx) + self.b(idx))

    m = Tied()
    ref = copy.deepcopy(m)
    m = module(m)
    for r in fastdp.replicate(m, devices(2)):
        assert r.a is r.b
        assert r.out.weight is r.a.weight
    idx = torch.randint(0, 10, (6,))
    fastdp.DataParallel(m, device_ids=devices(3))(idx).sum().backward()
    ref(idx).sum().backward()
    torch.testing.assert_close(host(m.a.weight.grad), ref.a.weight.grad)


def test_save_replica_module():
    m = nn.Linear(3, 2)
    for detach in (False, True):
        for r in fastdp.replicate(m, ["cpu"] * 2, detach=detach):
            torch.save(r, io.BytesIO())


def test_parameter_list_and_dict_inside_replica():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.plist = nn.ParameterList([nn.Parameter(torch.randn(2, 2)) for _ in range(2)])
            self.pdict = nn.ParameterDict({"a": nn.Parameter(torch.randn(2, 2))})

        def forward(self, x):
            checks.append(all(p.requires_grad and p.grad_fn is not None for p in [*self.plist, self.pdict["a"]]))
            return x @ self.plist[0] @ self.plist[1] @ self.pdict["a"]

    checks = []
    m = Net()
    ref = copy.deepcopy(m)
    x = torch.randn(4, 2)
    out = fastdp.DataParallel(module(m), device_ids=devices(2))(x)
    assert checks == [True, True]
    torch.testing.assert_close(host(out), ref(x))


def test_zero_grad_inside_replica_warns_upstream_text():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(2, 2)

        def forward(self, x):
            self.zero_grad()
            return self.l(x)

    replica = nn.Linear(1, 1)
    replica._is_replica = True
    with pytest.warns(UserWarning) as upstream:  # torch's own text, from a module marked as a replica
        replica.zero_grad()
    with pytest.warns(UserWarning, match="^" + re.escape(str(upstream[0].message)) + "$"):
        fastdp.DataParallel(module(Net()), device_ids=devices(2))(torch.randn(4, 2))


def test_rnn_flatten_parameters_no_grad_and_one_step():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(4, 5, num_layers=2, batch_first=True, bidirectional=True)

        def forward(self, x):
            self.rnn.flatten_parameters()
            return self.rnn(x)[0]

    torch.manual_seed(0)
    m = Net().double()
    ref = copy.deepcopy(m)
    m = module(m)
    x = torch.randn(6, 3, 4, dtype=torch.double)
    dp = fastdp.DataParallel(m, device_ids=devices(2))
    with torch.no_grad():
        torch.testing.assert_close(host(dp(x)), ref(x))
    opt, ref_opt = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    dp(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    opt.step()
    ref_opt.step()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(host(p), q, rtol=0, atol=1e-12)


def test_lazy_linear_raises():
    dp = fastdp.DataParallel(nn.LazyLinear(10), device_ids=ids("cpu", 2))
    with pytest.raises(ValueError) as info:
        dp(torch.randn(4, 3))
    with pytest.raises(ValueError) as upstream:  # torch's own text, naming fastdp's function
        nn.UninitializedParameter.__torch_function__("fastdp.replicate", (), ())
    assert str(info.value) == str(upstream.value)


def test_script_module_replicates():
    scripted = torch.jit.script(nn.Linear(3, 2))
    x = torch.randn(4, 3)
    replicas = fastdp.replicate(scripted, ["cpu", "cpu"])
    for r in replicas:
        torch.testing.assert_close(r(x), scripted(x))
    torch.testing.assert_close(fastdp.DataParallel(scripted, device_ids=ids("cpu", 2))(x), scripted(x))


def test_python_module_wrapping_script_module():
    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.jit.script(nn.Linear(3, 2))

        def forward(self, x):
            return self.inner(x)

    m = Wrap()
    ref = copy.deepcopy(m)
    x = torch.randn(4, 3)
    torch.testing.assert_close(host(fastdp.DataParallel(module(m), device_ids=devices(2))(x)), ref(x))
