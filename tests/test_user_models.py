"""Patterns from users' own training scripts on emulated replicas, each against the bare model on the full batch (or
against upstream's behaviour where it is right): SyncBatchNorm subclasses, per-replica losses that are not a plain
mean, parameters made under inference mode, inputs and outputs that cannot be split or gathered along the batch,
and unwrapping the wrapper with ``isinstance(model, torch.nn.DataParallel)``.
"""

import copy
import importlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp

DEVICES = ["cpu"] * 3


# ---- SyncBatchNorm subclasses keep their own forward ---------------------------------------------------------------


class ShiftedSyncBatchNorm(nn.SyncBatchNorm):
    """A SyncBatchNorm whose forward does more than normalise (timm's SyncBatchNormAct adds an activation)."""

    def forward(self, x):
        return super().forward(x) + 1


class NormAct(nn.SyncBatchNorm):
    def forward(self, x):
        x = super().forward(x)
        if hasattr(self, "act"):
            x = self.act(x)
        return x


def _conv_net(norm):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), norm(4), nn.Conv2d(4, 2, 1), norm(2), nn.Flatten()).double()


def _act_norm(channels):
    layer = NormAct(channels)
    layer.act = nn.ReLU()
    return layer


@pytest.mark.parametrize("norm", [ShiftedSyncBatchNorm, _act_norm], ids=["shifted", "with-act"])
def test_sync_batchnorm_subclass_runs_its_own_forward(norm):
    bare = _conv_net(norm)
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=DEVICES)
    x = torch.randn(7, 3, 6, 6, dtype=torch.float64)
    for step in range(2):
        expected, got = bare(x), dp(x)
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
        expected.square().sum().backward()
        got.square().sum().backward()
        for (name, p), q in zip(bare.named_parameters(), dp.module.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-10, msg=name)
    for b, q in zip(bare.buffers(), dp.module.buffers()):
        torch.testing.assert_close(q, b, rtol=1e-10, atol=1e-10)


# ---- isinstance(model, torch.nn.DataParallel) ------------------------------------------------------------------------


def test_wrapper_is_an_nn_dataparallel_for_unwrapping():
    net = nn.Linear(4, 2)
    dp = fastdp.DataParallel(net, device_ids=DEVICES)
    assert isinstance(dp, torch.nn.DataParallel) and isinstance(dp, torch.nn.parallel.DataParallel)
    unwrapped = dp.module if isinstance(dp, torch.nn.DataParallel) else dp
    assert unwrapped is net
    # The wrapper still behaves as fastdp's: its state dict is the bare model's, and torch's constructor never ran.
    assert list(dp.state_dict()) == list(net.state_dict())
    x = torch.randn(5, 4)
    torch.testing.assert_close(dp(x), net(x))


def test_upstream_members_resolve_to_fastdp_or_module():
    """Whatever torch's DataParallel defines, a fastdp wrapper uses fastdp's or Module's own: a method torch adds to
    its class later never runs on the fastdp wrapper by inheritance."""
    upstream = importlib.import_module("torch.nn.parallel.data_parallel").DataParallel
    for name, value in vars(upstream).items():
        if not callable(value):
            continue
        assert getattr(fastdp.DataParallel, name) is not value, name


def test_transformers_unwrap_helpers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_utils import unwrap_model

    net = nn.Linear(4, 2)
    assert unwrap_model(fastdp.DataParallel(net, device_ids=DEVICES)) is net


def test_accelerate_unwrap_helper():
    accelerate = pytest.importorskip("accelerate")
    net = nn.Linear(4, 2)
    assert accelerate.utils.extract_model_from_parallel(fastdp.DataParallel(net, device_ids=DEVICES)) is net


# ---- criterion=: per-replica losses only where exact ----------------------------------------------------------------


class ShiftedCrossEntropy(nn.CrossEntropyLoss):
    """Causal-LM loss: position t predicts label t + 1."""

    def forward(self, logits, labels):
        return super().forward(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


class TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def _labels(batch, length, ignored):
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 11, (batch, length), generator=g)
    if ignored:
        labels[torch.rand(batch, length, generator=g) < 0.4] = -100
        labels[0] = -100  # the first replica's chunk counts fewer tokens than the others
    return labels


def _shifted_fn(logits, labels):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def _flat_ce(**kwargs):
    ce = nn.CrossEntropyLoss(**kwargs)
    return lambda logits, labels: ce(logits.flatten(0, 1), labels.flatten())


CRITERIA = {
    "shifted-subclass": lambda: ShiftedCrossEntropy(),
    "shifted-function": lambda: _shifted_fn,
    "subclass-smoothing": lambda: ShiftedCrossEntropy(label_smoothing=0.1),
}


def _check_loss(criterion, model_fn, x, target, **dp_kwargs):
    torch.manual_seed(0)
    bare = model_fn().double()
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=DEVICES, criterion=criterion, **dp_kwargs)
    expected = criterion(bare(x), target)
    got = dp(x, target=target)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    expected.backward()
    got.backward()
    for (name, p), q in zip(bare.named_parameters(), dp.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-12, msg=name)
    return dp


@pytest.mark.parametrize("name", sorted(CRITERIA))
@pytest.mark.parametrize("ignored", [False, True], ids=["all", "ignore_index"])
def test_criterion_that_is_not_a_plain_mean_matches_the_bare_loss(name, ignored):
    ids = torch.randint(0, 11, (7, 6), generator=torch.Generator().manual_seed(1))
    _check_loss(CRITERIA[name](), TokenModel, ids, _labels(7, 6, ignored))


class ClassModel(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.fc = nn.Linear(6, classes)

    def forward(self, x):
        return self.fc(x)


def _class_target(batch=7, classes=5, ignored=True):
    g = torch.Generator().manual_seed(4)
    t = torch.randint(0, classes, (batch,), generator=g)
    if ignored:
        t[:3] = 2  # ignore_index below: the first chunk has no counted sample
    return t


TORCH_LOSSES = {
    "ce": lambda: nn.CrossEntropyLoss(),
    "ce-ignore": lambda: nn.CrossEntropyLoss(ignore_index=2),
    "ce-weight-ignore-smooth": lambda: nn.CrossEntropyLoss(
        weight=torch.tensor([0.5, 1.0, 2.0, 3.0, 0.1], dtype=torch.float64), ignore_index=2, label_smoothing=0.2),
    "ce-sum": lambda: nn.CrossEntropyLoss(reduction="sum", ignore_index=2),
    "nll-weight": lambda: nn.NLLLoss(weight=torch.tensor([0.5, 1.0, 2.0, 3.0, 0.1], dtype=torch.float64)),
    "multimargin-weight": lambda: nn.MultiMarginLoss(weight=torch.tensor([0.5, 1.0, 2.0, 3.0, 0.1],
                                                                         dtype=torch.float64)),
}


@pytest.mark.parametrize("name", sorted(TORCH_LOSSES))
def test_torch_losses_per_replica_equal_the_bare_loss(name):
    x = torch.randn(7, 6, dtype=torch.float64)
    dp = _check_loss(TORCH_LOSSES[name](), ClassModel, x, _class_target())
    assert dp._last_step.avoided_gather_bytes, "torch's own losses are computed per replica"


def test_function_criterion_goes_through_the_gathered_output():
    x = torch.randn(7, 6, dtype=torch.float64)
    target = torch.randn(7, 5, dtype=torch.float64)
    dp = _check_loss(lambda out, t: (out - t).square().mean(), ClassModel, x, target)
    assert not dp._last_step.avoided_gather_bytes


def test_declared_decomposable_criterion_runs_per_replica():
    x = torch.randn(7, 6, dtype=torch.float64)
    target = torch.randn(7, 5, dtype=torch.float64)
    dp = _check_loss(lambda out, t: (out - t).square().mean(), ClassModel, x, target, criterion_reduction="mean")
    assert dp._last_step.avoided_gather_bytes
    _check_loss(lambda out, t: (out - t).square().sum(), ClassModel, x, target, criterion_reduction="sum")


def test_criterion_reduction_is_checked():
    with pytest.raises(ValueError, match="criterion_reduction"):
        fastdp.DataParallel(nn.Linear(2, 2), device_ids=DEVICES, criterion=nn.MSELoss(), criterion_reduction="avg")
    with pytest.raises(ValueError, match="criterion_reduction.*criterion"):
        fastdp.DataParallel(nn.Linear(2, 2), device_ids=DEVICES, criterion_reduction="mean")


# ---- parameters made under inference mode ---------------------------------------------------------------------------


def _inference_made(layers):
    torch.manual_seed(0)
    with torch.inference_mode():
        return nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_inference_made_parameters_serve_like_the_bare_model(mode):
    bare = _inference_made(2)
    dp = fastdp.DataParallel(bare, device_ids=DEVICES)
    x = torch.randn(7, 4)
    ctx = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    for _ in range(2):
        with ctx():
            torch.testing.assert_close(dp(x), bare(x))


def test_training_inference_made_parameters_names_the_parameter_and_the_fix():
    bare = _inference_made(2)
    x = torch.randn(7, 4)
    with pytest.raises(RuntimeError, match="Inference tensors cannot be saved for backward"):
        bare(x)  # the bare model refuses too
    dp = fastdp.DataParallel(bare, device_ids=DEVICES)
    with pytest.raises(RuntimeError, match=r"parameter '0\.weight'.*inference mode.*clone"):
        dp(x)


# ---- inputs and outputs that cannot be split or gathered along the batch ------------------------------------------


class PackedRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 4)

    def forward(self, packed):
        return self.rnn(packed)[1]


def test_packed_sequence_input_is_refused_with_the_fix():
    seqs = [torch.randn(n, 3) for n in (5, 4, 4, 3, 2, 2)]
    packed = nn.utils.rnn.pack_sequence(seqs)
    dp = fastdp.DataParallel(PackedRNN(), device_ids=DEVICES)
    with pytest.raises(TypeError, match=r"input\[0\] is a PackedSequence.*pack_padded_sequence"):
        dp(packed)
    with pytest.raises(TypeError, match=r"packed"):
        dp(packed=packed)


class PairScores(nn.Module):
    """CLIP-like: the chunk's image-text similarity matrix, (chunk, chunk)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, images, texts):
        a, b = self.fc(images), self.fc(texts)
        return {"image_embeds": a, "logits_per_image": a @ b.t()}


def test_gather_of_outputs_with_unequal_non_batch_sizes_names_the_output():
    dp = fastdp.DataParallel(PairScores(), device_ids=DEVICES)
    with pytest.raises(RuntimeError, match=r"output\['logits_per_image'\].*dim 1.*\(3, 3, 1\)"):
        dp(torch.randn(7, 4), torch.randn(7, 4))


# ---- arguments that are not batch-major: a warning, and broadcast= ---------------------------------------------------


class MaskedDecoder(nn.Module):
    """nn.TransformerDecoderLayer with a causal (T, T) target mask, the usual seq2seq pattern."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, tgt, memory, tgt_mask=None):
        return self.layer(tgt, memory, tgt_mask=tgt_mask)


def _decoder_inputs(batch=5, length=4):
    g = torch.Generator().manual_seed(6)
    tgt = torch.randn(batch, length, 8, generator=g, dtype=torch.float64)
    memory = torch.randn(batch, 3, 8, generator=g, dtype=torch.float64)
    return tgt, memory, nn.Transformer.generate_square_subsequent_mask(length, dtype=torch.float64)


def test_a_tensor_that_is_not_batch_major_warns_once_naming_the_argument():
    torch.manual_seed(0)
    dp = fastdp.DataParallel(MaskedDecoder().double(), device_ids=DEVICES)
    tgt, memory, mask = _decoder_inputs()
    with pytest.warns(UserWarning, match=r"kwargs\['tgt_mask'\] has size 4 along dim 0 but the batch has 5 "
                                         r"\(input\[0\]\).*broadcast=\('tgt_mask',\)"):
        with pytest.raises(Exception):
            dp(tgt, memory, tgt_mask=mask)  # 4 mask rows split over 3 replicas of 2, 2 and 1 samples
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(Exception) as info:
            dp(tgt, memory, tgt_mask=mask)
        assert not isinstance(info.value, UserWarning)  # warned once per argument


class _MasksInAList(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, masks=None):
        return self.lin(x)


def test_a_nested_tensor_that_is_not_batch_major_gets_the_general_advice():
    # broadcast= names whole keyword arguments: for a tensor inside one, the warning names the path and gives the
    # general advice, not a name made of the path's pieces.
    dp = fastdp.DataParallel(_MasksInAList(), device_ids=DEVICES)
    with pytest.warns(UserWarning, match=r"kwargs\['masks'\]\[0\] has size 5 along dim 0") as record:
        dp(torch.randn(6, 4), masks=[torch.ones(5, 5)])
    message = next(str(w.message) for w in record if "masks" in str(w.message))
    assert "pass it as a keyword argument named in DataParallel's broadcast=(...)" in message
    assert "broadcast=(\"" not in message and "broadcast=('" not in message


def test_broadcast_gives_named_arguments_whole_to_every_replica():
    torch.manual_seed(0)
    bare = MaskedDecoder().double()
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=DEVICES, broadcast=("tgt_mask",))
    tgt, memory, mask = _decoder_inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is split against the batch
        got = dp(tgt, memory, tgt_mask=mask)
    expected = bare(tgt, memory, tgt_mask=mask)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    got.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(bare.named_parameters(), dp.module.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-12, msg=name)


def test_broadcast_is_checked():
    with pytest.raises(TypeError, match=r"broadcast must be a tuple of keyword argument names"):
        fastdp.DataParallel(nn.Linear(2, 2), device_ids=DEVICES, broadcast="tgt_mask")


# ---- transformers caches are split along the batch and gathered back ----------------------------------------------


def _tiny_lm(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=31, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg).double()
    cfg = transformers.LlamaConfig(vocab_size=31, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, intermediate_size=24, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(cfg).double()


def _cache_tensors(cache):
    return [x for layer in cache for x in layer if isinstance(x, torch.Tensor) and x.dim() > 0]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_cache_passed_in_is_split_and_the_returned_cache_gathered(kind):
    bare = _tiny_lm(kind)
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=DEVICES)
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, 31, (7, 5), generator=g)
    expected_first, got_first = bare(prefix, use_cache=True), dp(prefix, use_cache=True)
    assert type(got_first.cache) is type(expected_first.cache)
    for a, b in zip(_cache_tensors(got_first.cache), _cache_tensors(expected_first.cache)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for step in range(2):  # generation: the next tokens with the cache of the previous ones
        nxt = torch.randint(0, 31, (7, 1), generator=g)
        expected = bare(nxt, cache=expected_first.cache, use_cache=True)
        got = dp(nxt, cache=got_first.cache, use_cache=True)
        torch.testing.assert_close(got.logits, expected.logits, rtol=1e-10, atol=1e-12)
        assert got.cache.get_seq_length() == expected.cache.get_seq_length() == 6 + step
        for a, b in zip(_cache_tensors(got.cache), _cache_tensors(expected.cache)):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        expected_first, got_first = expected, got


def _tiny_t5():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=31, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_decoder_layers=2,
                                num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(cfg).double()


def test_encoder_decoder_cache_is_split_and_gathered():
    bare = _tiny_t5()
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=DEVICES)
    g = torch.Generator().manual_seed(8)
    src = torch.randint(1, 31, (7, 6), generator=g)
    start = torch.zeros(7, 1, dtype=torch.long)
    expected, got = bare(src, decoder_input_ids=start, use_cache=True), dp(src, decoder_input_ids=start, use_cache=True)
    assert type(got.cache) is type(expected.cache)
    for step in range(2):
        nxt = torch.randint(1, 31, (7, 1), generator=g)
        expected = bare(src, decoder_input_ids=nxt, cache=expected.cache, use_cache=True)
        got = dp(src, decoder_input_ids=nxt, cache=got.cache, use_cache=True)
        torch.testing.assert_close(got.logits, expected.logits, rtol=1e-10, atol=1e-12)
        assert got.cache.get_seq_length() == expected.cache.get_seq_length() == 2 + step


def test_a_fixed_size_cache_is_refused_with_the_fix():
    transformers = pytest.importorskip("transformers")
    model = _tiny_lm("llama")
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    dp = fastdp.DataParallel(model, device_ids=DEVICES)
    with pytest.raises(TypeError, match=r"a cache argument is a StaticCache.*DynamicCache"):
        dp(torch.randint(0, 31, (7, 3)), cache=cache, use_cache=True)


# ---- outputs that do not follow the batch --------------------------------------------------------------------------


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, num_layers=2, batch_first=True)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return out, h


class WithSummary(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        y = self.fc(x)
        return y, y.mean(0, keepdim=True)  # one row per replica, whatever its chunk


def test_an_output_that_does_not_follow_the_chunks_warns_once_naming_it():
    torch.manual_seed(0)
    bare = WithSummary().double()
    dp = fastdp.DataParallel(copy.deepcopy(bare), device_ids=DEVICES)
    x = torch.randn(7, 3, dtype=torch.float64)
    with pytest.warns(UserWarning, match=r"output\[1\] has sizes \(1, 1, 1\) along dim 0 in the replicas, whose "
                                         r"chunks have \(3, 3, 1\) samples"):
        out, summary = dp(x)
    torch.testing.assert_close(out, bare(x)[0], rtol=1e-10, atol=1e-12)  # the batch-major output is right
    assert summary.shape == (3, 2)  # one row per replica, concatenated as upstream does
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp(x)  # once per output


def test_an_rnn_state_with_unequal_chunks_names_the_output():
    dp = fastdp.DataParallel(Recurrent().double(), device_ids=DEVICES)
    with pytest.raises(RuntimeError, match=r"Cannot gather output\[1\]: its size along dim 1 differs across "
                                           r"replicas \(3, 3, 1\).*h_n.transpose\(0, 1\)"):
        dp(torch.randn(7, 5, 3, dtype=torch.float64))


def test_batch_major_outputs_do_not_warn():
    dp = fastdp.DataParallel(nn.Linear(3, 2), device_ids=DEVICES)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dp(torch.randn(7, 3))
        dp(torch.randn(7, 4, 3)).flatten(0, 1)
