"""Random training scripts: sequences of what a script does between and inside steps (forwards with and without
grad, eval, checkpointed blocks, no_sync micro-batches of any size, every way of clearing .grad, parameter edits,
optimizer steps, saves and reloads), run on the bare model and on the wrapper (4 emulated replicas), compared after
every action: gradients, parameters, buffers and the saved state's bytes. One model has a BatchNorm inside its
checkpointed block, synced across the replicas on the wrapper's side.

Seeded (derandomized): the same sequences on every run. A failure prints the shortest sequence that still fails
(Hypothesis shrinks it). FASTDP_SEQUENCES sets how many sequences run (default 250).
"""

import copy
import os
import pickle

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fastdp

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (scripts/setup.sh installs it)")
st = hypothesis.strategies

from test_step_state import CLEARS, Checkpointed, Gated, _between, _clear  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")

R = 4
TOL = 1e-10  # float64; sums over replicas and micro-batches in another order than the bare model's
SEQUENCES = int(os.environ.get("FASTDP_SEQUENCES", "250"))

sizes = st.integers(min_value=1, max_value=9)
kinds = st.sampled_from(["no_grad", "eval_no_grad", "inference_mode", "eval_with_grad", "training_forward"])
# An accumulation window: micro-batches under no_sync (one of them maybe abandoned by clearing .grad after it),
# the synchronising micro-batch, maybe an optimizer step; a script is steps, each some other actions, then a window.
windows = st.tuples(st.just("window"), st.lists(sizes, min_size=1, max_size=3),
                    st.one_of(st.none(), st.tuples(st.integers(0, 2), st.sampled_from(CLEARS))), sizes, st.booleans())
actions = st.one_of(
    st.tuples(st.just("train"), sizes),
    st.tuples(st.just("no_sync"), sizes),
    st.tuples(st.just("between"), kinds, sizes, sizes),  # a training forward, a forward of `kind`, the backward
    st.tuples(st.just("forward"), kinds, sizes),
    st.tuples(st.just("clear"), st.sampled_from(CLEARS)),
    st.tuples(st.just("clear_one"), st.sampled_from(["none", "zeros"])),
    st.tuples(st.just("optimizer_step")),
    st.tuples(st.just("edit"), st.sampled_from(["in_place", "data_in_place", "data_replaced", "retype"])),
    st.tuples(st.just("replace_parameter")),
    st.tuples(st.just("mode"), st.booleans()),
    st.tuples(st.just("reload"), st.sampled_from(["pickle", "deepcopy"])),
)
steps = st.tuples(st.lists(actions, max_size=3), windows).map(lambda step: [*step[0], step[1]])
scripts = st.lists(steps, min_size=1, max_size=4).map(lambda s: [action for step in s for action in step])


def _input(n, counter):
    counter[0] += 1
    g = torch.Generator().manual_seed(counter[0])
    return torch.randn(n, 6, dtype=torch.float64, generator=g).requires_grad_()


def _apply(action, model, run, opt, dp, counter):
    """One action on `model` (the bare model, or the wrapped one) through `run` (itself, or the wrapper)."""
    name = action[0]
    if name == "train":
        run(_input(action[1], counter)).pow(2).sum().backward()
    elif name == "no_sync":
        with dp.no_sync():
            run(_input(action[1], counter)).pow(2).sum().backward()
    elif name == "window":
        _, micro, abandon, last, stepped = action
        for i, n in enumerate(micro):
            with dp.no_sync():
                run(_input(n, counter)).pow(2).sum().backward()
            if abandon is not None and abandon[0] == i:
                _clear(model, opt, abandon[1])
        run(_input(last, counter)).pow(2).sum().backward()
        if stepped:
            opt.step()
    elif name == "between":
        loss = run(_input(action[2], counter)).pow(2).sum()
        _between(run, action[1], _input(action[3], counter).detach())
        loss.backward()
    elif name == "forward":
        _between(run, action[1], _input(action[2], counter).detach())
    elif name == "clear":
        _clear(model, opt, action[1])
    elif name == "clear_one":
        p = model.head.weight
        if action[1] == "none":
            p.grad = None
        elif p.grad is not None:
            p.grad.zero_()
    elif name == "optimizer_step":
        opt.step()
    elif name == "edit":
        p = model.stem.weight
        with torch.no_grad():
            if action[1] == "in_place":
                p.mul_(0.9)
            elif action[1] == "data_in_place":
                p.data.add_(0.01)  # invisible to version counters
            elif action[1] == "data_replaced":
                p.data = p.data * 0.9
            else:
                model.float().double()
    elif name == "replace_parameter":
        model.head.bias = nn.Parameter(model.head.bias.detach().clone())
        opt.add_param_group({"params": [model.head.bias]})
    elif name == "mode":
        run.train(action[1])
    elif name == "reload":
        state = run.state_dict()
        state = pickle.loads(pickle.dumps(state)) if action[1] == "pickle" else copy.deepcopy(state)
        run.load_state_dict(state)
    else:
        raise AssertionError(name)


def _assert_same(bare, model, action, grads=True):
    for (name, p), q in zip(model.named_parameters(), bare.parameters()):
        if grads:
            assert (p.grad is None) == (q.grad is None), (action, name)
        if grads and p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=TOL, atol=TOL, msg=lambda m: f"{action} {name}: {m}")
        torch.testing.assert_close(p.detach(), q.detach(), rtol=TOL, atol=TOL)
    for b, c in zip(model.buffers(), bare.buffers()):
        torch.testing.assert_close(b, c, rtol=TOL, atol=TOL)
    assert len(pickle.dumps(model.state_dict())) <= 1.1 * len(pickle.dumps(bare.state_dict())), action


class SyncedCheckpointed(nn.Module):
    """A BatchNorm (momentum=None: every counted batch weighs in its running statistics) inside a block recomputed
    in backward; the wrapper's copy has it converted to SyncBatchNorm. Its input is (N, 2, 4), so any batch size
    has values enough per channel."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.stem = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(2, momentum=None)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)
        self.double()

    def block(self, h):
        return self.mix(torch.tanh(self.bn(h.view(-1, 2, 4)).flatten(1)))

    def forward(self, x):
        return self.head(checkpoint(self.block, torch.tanh(self.stem(x)), use_reentrant=False))


MODELS = {"checkpointed": Checkpointed, "checkpointed_reentrant": lambda: Checkpointed(True), "gated": Gated,
          "synced_checkpointed": SyncedCheckpointed}


@hypothesis.settings(max_examples=SEQUENCES, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(make=st.sampled_from(sorted(MODELS)), script=scripts)
def test_random_training_scripts_match_the_bare_model(make, script):
    bare = MODELS[make]()
    model = copy.deepcopy(bare)
    if make.startswith("synced"):
        model = fastdp.convert_sync_batchnorm(model)
    dp = fastdp.DataParallel(model, device_ids=["cpu"] * R)
    runs = []
    for m, run in ((bare, bare), (model, dp)):
        runs.append((m, run, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.5), [0]))
    accumulating = False  # no_sync sums pending: .grad shows replica 0's share until the synchronising backward
    for action in script:
        if action[0] in ("optimizer_step", "window") and accumulating and (action[0] != "window" or action[4]):
            continue  # a step inside an accumulation window uses a rank's partial .grad under DDP: not compared
        for m, run, opt, counter in runs:
            _apply(action, _gated_stem_of(m), run, opt, dp, counter)
        if action[0] in ("train", "between", "window"):
            accumulating = False
        elif action[0] == "no_sync" or (action[0] == "clear_one" and accumulating):
            accumulating = True
        elif action[0] == "clear":
            accumulating = False  # every .grad cleared: nothing pending on either side
        _assert_same(bare, model, action, grads=not accumulating)


def _gated_stem_of(model):
    """The model with `stem` and `head` names whatever its class (Gated calls them `a` and `c`)."""
    if isinstance(model, Gated):
        return _Named(model)
    return model


class _Named:
    """Gated under the names the actions use, forwarding everything else."""

    def __init__(self, model):
        self.__dict__["model"] = model

    def __getattr__(self, name):
        return getattr(self.model, {"stem": "a", "head": "c"}.get(name, name))

    def __setattr__(self, name, value):
        setattr(self.model, {"stem": "a", "head": "c"}.get(name, name), value)
