"""Tiny Hugging Face transformers models built from configs (no downloads) on 2 emulated replicas: logits, losses,
gradients (tied weights), hidden states step after step, GPT-2's cache, and 5 training steps equal the bare model's.

transformers is installed at a pinned version by scripts/setup.sh; without it these tests skip.
"""

import copy

import pytest
import torch

import fastdp

transformers = pytest.importorskip("transformers", reason="transformers is not installed (scripts/setup.sh pins it)")

TOL = 1e-5  # float32 models
# Each replica's loss is a scalar: gathered into a vector, with upstream's warning.
pytestmark = pytest.mark.filterwarnings("ignore:Was asked to gather along dimension 0")


def _bert():
    cfg = transformers.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=37, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=37, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg)


MODELS = {"bert": _bert, "gpt2": _gpt2, "llama": _llama}


def _pair(name):
    torch.manual_seed(0)
    bare = MODELS[name]()
    model = copy.deepcopy(bare)
    return bare, model, fastdp.DataParallel(model, device_ids=["cpu"] * 2)


def _ids(seed, batch=4, length=7):
    return torch.randint(0, 99, (batch, length), generator=torch.Generator().manual_seed(seed))


def _close(got, expected, what):
    torch.testing.assert_close(got, expected, rtol=TOL, atol=TOL, msg=lambda m: f"{what}: {m}")


def _hooks_on(model):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_loss_and_grads(name):
    bare, model, dp = _pair(name)
    ids = _ids(1)
    ob = bare(input_ids=ids, labels=ids)
    od = dp(input_ids=ids, labels=ids)
    _close(od.logits, ob.logits, "logits")
    # Each replica returns its chunk's mean loss (gathered into a vector, as upstream); equal chunks of equal
    # length make their mean the full batch's.
    assert od.loss.shape == (2,)
    _close(od.loss.mean(), ob.loss, "loss")
    ob.loss.backward()
    od.loss.mean().backward()
    for (pname, pb), pd in zip(bare.named_parameters(), model.parameters()):
        _close(pd.grad, pb.grad, f"grad of {pname}")
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied, "the test models tie their input and output embeddings"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hidden_states_step_after_step(name, cpu_apply):
    bare, model, dp = _pair(name)
    for step in range(3):
        ids = _ids(step)
        ob = bare(input_ids=ids, output_hidden_states=True)
        od = dp(input_ids=ids, output_hidden_states=True)
        assert len(od.hidden_states) == len(ob.hidden_states) == 3, f"step {step}"
        for i, (hd, hb) in enumerate(zip(od.hidden_states, ob.hidden_states)):
            _close(hd, hb, f"step {step} hidden state {i}")
        assert _hooks_on(model) == 0, f"step {step}: the replicas' capture hooks reached the master"
    # The master still works on its own (it installs its own hooks, as the bare model did).
    ids = _ids(9)
    _close(model(input_ids=ids, output_hidden_states=True).hidden_states[-1],
           bare(input_ids=ids, output_hidden_states=True).hidden_states[-1], "master after the wrapper")


def test_gpt2_default_forward_gathers_the_cache():
    bare, model, dp = _pair("gpt2")
    ids = _ids(2)
    ob = bare(input_ids=ids, labels=ids)  # use_cache defaults to True
    od = dp(input_ids=ids, labels=ids)
    cb, cd = ob.cache, od.cache
    assert type(cd) is type(cb) and len(cd.layers) == len(cb.layers) == 2
    for i, (lb, ld) in enumerate(zip(cb.layers, cd.layers)):
        _close(ld.keys, lb.keys, f"layer {i} keys")
        _close(ld.values, lb.values, f"layer {i} values")
    # The gathered cache continues generation like the full-batch one.
    nxt = _ids(3, length=1)
    _close(model(input_ids=nxt, cache=cd).logits, bare(input_ids=nxt, cache=cb).logits,
           "next-token logits from the gathered cache")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_five_training_steps(name):
    bare, model, dp = _pair(name)
    opt_b = torch.optim.SGD(bare.parameters(), lr=0.1)
    opt_d = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(5):
        ids = _ids(10 + step)
        lb = bare(input_ids=ids, labels=ids).loss
        ld = dp(input_ids=ids, labels=ids).loss.mean()
        _close(ld, lb, f"step {step} loss")
        lb.backward()
        ld.backward()
        opt_b.step()
        opt_d.step()
        opt_b.zero_grad()
        opt_d.zero_grad()
    for (pname, pb), pd in zip(bare.named_parameters(), model.parameters()):
        _close(pd, pb, f"{pname} after 5 steps")
