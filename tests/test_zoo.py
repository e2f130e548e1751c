"""A zoo of third-party models from tiny configs (no downloads): transformers encoders, decoders, seq2seq and vision
models, timm and torchvision classification, segmentation and detection. Each runs forward, backward and one SGD
step through ``fastdp.DataParallel`` on 2 emulated replicas (an uneven split) and must equal the bare model on the
full batch: the loss, every gradient and every parameter after the step. Models with BatchNorm run converted to
SyncBatchNorm (timm's converter for timm models, whose SyncBatchNormAct keeps its activation), against plain
BatchNorm in the bare model. Classifiers train through ``criterion=`` (torch's CrossEntropyLoss, computed per
replica); language models through a shifted causal-LM loss (a function, computed on the gathered output). The
"-checkpointed" rows turn on the library's own activation checkpointing in both models (transformers'
``gradient_checkpointing_enable()``, timm's ``set_grad_checkpointing()``): their synced layers are recomputed in
backward (the "-reentrant" row in torch.utils.checkpoint's reentrant mode).

The libraries are in the ``zoo`` extra (scripts/setup.sh installs them pinned); without one, its rows skip.
"""

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fastdp

DEVICES = ["cpu"] * 2
BATCH = 5  # chunks of 3 and 2

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _lib(name):
    return pytest.importorskip(name, reason=f"{name} is not installed (the zoo extra; scripts/setup.sh pins it)")


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
    return model


def _causal_lm_loss(out, labels):
    logits = out["logits"] if isinstance(out, dict) else out
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def _token_labels(batch, length, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    labels = ids.clone()
    labels[0, : length // 2] = -100  # padding: the first chunk counts fewer tokens
    return ids, labels


class Case:
    """One zoo row: how to build the model, its inputs and target, the loss, and the tolerance (float64: 1e-9 unless
    a row says otherwise)."""

    def __init__(self, build, data, criterion=None, loss=None, tol=1e-9, sync_bn=None, dtype=torch.float64):
        self.build, self.data, self.criterion, self.loss = build, data, criterion, loss
        self.tol, self.sync_bn, self.dtype = tol, sync_bn, dtype


def _checkpointed(build, enable):
    """``build`` with the library's activation checkpointing turned on by ``enable(model)``."""

    def checkpointed():
        model = build()
        enable(model)
        return model

    return checkpointed


# ---- transformers --------------------------------------------------------------------------------------------------

V = 61  # vocabulary size of the tiny language models


def _hf(config_name, model_name, **config):
    t = _lib("transformers")
    cfg = getattr(t, config_name)(**config)
    return getattr(t, model_name)(cfg)


def _hf_checkpointing(model, **kwargs):
    """transformers' activation checkpointing (``gradient_checkpointing_enable()``, named
    ``activation_checkpointing_enable()`` from transformers 5), with its defaults or with torch.utils.checkpoint's
    keyword arguments ``kwargs`` (``use_reentrant=True``: the reentrant mode, transformers' default before 5)."""
    inner = model.model
    if not kwargs:
        enable = getattr(inner, "activation_checkpointing_enable", None) or inner.gradient_checkpointing_enable
        enable()
    elif hasattr(inner, "activation_checkpointing_enable"):
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    assert any(getattr(m, "gradient_checkpointing", False) is True for m in inner.modules())


def _lm_data(length=9):
    ids, labels = _token_labels(BATCH, length, V, seed=1)
    return (ids,), {"attention_mask": torch.ones_like(ids)}, labels


def _cls_ids_data(length=8, classes=3):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (BATCH, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # a padded sample
    return (ids,), {"attention_mask": mask}, torch.randint(0, classes, (BATCH,), generator=g)


class Logits(nn.Module):
    """Returns a transformers model's logits tensor, so torch's CrossEntropyLoss can be the criterion."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs).logits


TINY = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24)
NO_DROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _seq2seq_data():
    g = torch.Generator().manual_seed(3)
    src = torch.randint(3, V, (BATCH, 7), generator=g)
    labels = torch.randint(3, V, (BATCH, 5), generator=g)
    labels[2, 3:] = -100
    return (src,), {"labels": labels}, labels  # the model builds its decoder inputs from the labels


def _seq2seq_loss(out, labels):
    return F.cross_entropy(out["logits"].flatten(0, 1), labels.flatten(), ignore_index=-100)


def _image_data(size=32, classes=4, channels=3):
    g = torch.Generator().manual_seed(4)
    return (torch.randn(BATCH, channels, size, size, generator=g, dtype=torch.float64),), {}, torch.randint(
        0, classes, (BATCH,), generator=g)


def _mobilevit():
    return Logits(_hf("MobileViTConfig", "MobileViTForImageClassification", image_size=32, hidden_sizes=[16, 16, 16],
                      neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32], num_attention_heads=2, hidden_dropout_prob=0.0,
                      classifier_dropout_prob=0.0, num_labels=4))


HF = {
    "bert-encoder": Case(lambda: Logits(_hf("BertConfig", "BertForSequenceClassification", vocab_size=V,
                                            num_labels=3, **TINY, **NO_DROP)), _cls_ids_data,
                         criterion=nn.CrossEntropyLoss()),
    "distilbert-encoder": Case(lambda: Logits(_hf("DistilBertConfig", "DistilBertForSequenceClassification",
                                                  vocab_size=V, dim=16, n_layers=2, n_heads=2, hidden_dim=24,
                                                  dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0,
                                                  num_labels=3)), _cls_ids_data, criterion=nn.CrossEntropyLoss()),
    "gpt2-decoder": Case(lambda: _hf("GPT2Config", "GPT2LMHeadModel", vocab_size=V, n_embd=16, n_layer=2, n_head=2,
                                     n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
                         _lm_data, criterion=_causal_lm_loss),
    "llama-decoder": Case(lambda: _hf("LlamaConfig", "LlamaForCausalLM", vocab_size=V, num_key_value_heads=1,
                                      max_position_embeddings=32, **TINY), _lm_data, criterion=_causal_lm_loss),
    "qwen2-decoder": Case(lambda: _hf("Qwen2Config", "Qwen2ForCausalLM", vocab_size=V, num_key_value_heads=1,
                                      max_position_embeddings=32, **TINY), _lm_data, criterion=_causal_lm_loss),
    "mistral-decoder": Case(lambda: _hf("MistralConfig", "MistralForCausalLM", vocab_size=V, num_key_value_heads=1,
                                        max_position_embeddings=32, head_dim=8, **TINY), _lm_data,
                            criterion=_causal_lm_loss),
    "t5-seq2seq": Case(lambda: _hf("T5Config", "T5ForConditionalGeneration", vocab_size=V, d_model=16, d_kv=8,
                                   d_ff=24, num_layers=2, num_decoder_layers=2, num_heads=2, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0), _seq2seq_data, criterion=_seq2seq_loss),
    "bart-seq2seq": Case(lambda: _hf("BartConfig", "BartForConditionalGeneration", vocab_size=V, d_model=16,
                                     encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                     decoder_attention_heads=2, encoder_ffn_dim=24, decoder_ffn_dim=24,
                                     max_position_embeddings=32, dropout=0.0, attention_dropout=0.0,
                                     activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                                     decoder_start_token_id=2), _seq2seq_data, criterion=_seq2seq_loss),
    "vit-vision": Case(lambda: Logits(_hf("ViTConfig", "ViTForImageClassification", image_size=32, patch_size=8,
                                          num_labels=4, **TINY, **NO_DROP)), _image_data,
                       criterion=nn.CrossEntropyLoss()),
    "clip-vision": Case(lambda: _hf("CLIPVisionConfig", "CLIPVisionModelWithProjection", image_size=32,
                                    patch_size=8, projection_dim=8, **TINY), _image_data,
                        loss=lambda out, _: out["image_embeds"].square().sum()),
    "mobilevit-vision-checkpointed": Case(_checkpointed(_mobilevit, _hf_checkpointing), _image_data,
                                          criterion=nn.CrossEntropyLoss(), sync_bn=fastdp.convert_sync_batchnorm),
    "mobilevit-vision-checkpointed-reentrant": Case(
        _checkpointed(_mobilevit, functools.partial(_hf_checkpointing, use_reentrant=True)), _image_data,
        criterion=nn.CrossEntropyLoss(), sync_bn=fastdp.convert_sync_batchnorm),
    "convnext-vision": Case(lambda: Logits(_hf("ConvNextConfig", "ConvNextForImageClassification",
                                               num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4,
                                               image_size=32)),
                            _image_data, criterion=nn.CrossEntropyLoss()),
}


# ---- timm ------------------------------------------------------------------------------------------------------


def _timm(name, **kwargs):
    return _no_dropout(_lib("timm").create_model(name, pretrained=False, num_classes=4, **kwargs))


def _timm_sync(model):
    return _lib("timm").layers.convert_sync_batchnorm(model)


TIMM = {
    "timm-regnety": Case(lambda: _timm("regnety_002"), _image_data, criterion=nn.CrossEntropyLoss(),
                         sync_bn=_timm_sync),
    "timm-resnet": Case(lambda: _timm("resnet10t"), _image_data, criterion=nn.CrossEntropyLoss(), sync_bn=_timm_sync),
    "timm-resnet-checkpointed": Case(_checkpointed(lambda: _timm("resnet10t"), lambda m: m.set_grad_checkpointing()),
                                     _image_data, criterion=nn.CrossEntropyLoss(), sync_bn=_timm_sync),
    "timm-mobilenetv3": Case(lambda: _timm("mobilenetv3_small_050"), _image_data, criterion=nn.CrossEntropyLoss(),
                             sync_bn=_timm_sync),
    "timm-vit": Case(lambda: _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=32,
                                   num_heads=2), _image_data, criterion=nn.CrossEntropyLoss()),
    "timm-convnext": Case(lambda: _timm("convnext_atto"), _image_data, criterion=nn.CrossEntropyLoss()),
}


# ---- torchvision ---------------------------------------------------------------------------------------------------


def _tv(name, **kwargs):
    """A torchvision model by builder name (dotted for submodules: ``segmentation.lraspp_mobilenet_v3_large``)."""
    builder = _lib("torchvision").models
    for part in name.split("."):
        builder = getattr(builder, part)
    return _no_dropout(builder(weights=None, **kwargs))


def _torch_sync(model):
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


class SegmentationOut(nn.Module):
    """A torchvision segmentation model's ``out`` map (the dict's auxiliary entries are not trained here)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)["out"]


def _seg_data():
    (x,), _, _ = _image_data(size=32)
    g = torch.Generator().manual_seed(5)
    return (x,), {}, torch.randint(0, 3, (BATCH, 32, 32), generator=g)


class Detections(nn.Module):
    """A torchvision detector in eval mode as a batch-major module: per image its ``keep`` best boxes and scores,
    padded with zeros (the detector itself returns one dict per image, which no gather can split by sample)."""

    def __init__(self, detector, keep=4):
        super().__init__()
        self.detector, self.keep = detector, keep

    def forward(self, images):
        found = self.detector(list(images))
        rows = []
        for d in found:
            boxes = torch.cat([d["boxes"], d["scores"][:, None]], 1)[: self.keep]
            rows.append(F.pad(boxes, (0, 0, 0, self.keep - boxes.size(0))))
        return torch.stack(rows)


def _detector():
    det = _tv("detection.fasterrcnn_mobilenet_v3_large_fpn", weights_backbone=None, num_classes=3, min_size=64,
              max_size=64, box_score_thresh=0.0, rpn_pre_nms_top_n_test=20, rpn_post_nms_top_n_test=4)
    return Detections(det.eval())


TORCHVISION = {
    "tv-resnet18": Case(lambda: _tv("resnet18", num_classes=4), _image_data, criterion=nn.CrossEntropyLoss(),
                        sync_bn=_torch_sync),
    "tv-mobilenet_v3": Case(lambda: _tv("mobilenet_v3_small", num_classes=4), _image_data,
                            criterion=nn.CrossEntropyLoss(), sync_bn=_torch_sync),
    "tv-squeezenet": Case(lambda: _tv("squeezenet1_1", num_classes=4), _image_data, criterion=nn.CrossEntropyLoss()),
    "tv-deeplabv3-segmentation": Case(
        lambda: SegmentationOut(_tv("segmentation.deeplabv3_mobilenet_v3_large", weights_backbone=None,
                                    num_classes=3, aux_loss=False)), _seg_data, criterion=nn.CrossEntropyLoss(),
        sync_bn=_torch_sync),
    "tv-lraspp-segmentation": Case(
        lambda: SegmentationOut(_tv("segmentation.lraspp_mobilenet_v3_large", weights_backbone=None, num_classes=3)),
        _seg_data, criterion=nn.CrossEntropyLoss(), sync_bn=_torch_sync),
    "tv-fasterrcnn-detection": Case(_detector, functools.partial(_image_data, size=64),
                                    loss=lambda out, _: out[..., 4].sum() + out[..., :4].mean()),
}


ZOO = {**HF, **TIMM, **TORCHVISION}


def _close(got, expected, tol, what):
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_trains_as_the_bare_model(name):
    case = ZOO[name]
    torch.manual_seed(0)
    bare = case.build().to(case.dtype)
    model = copy.deepcopy(bare)
    if case.sync_bn is not None:
        assert any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in bare.modules())
        model = case.sync_bn(model)
        assert any(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    dp = fastdp.DataParallel(model, device_ids=DEVICES, criterion=case.criterion)
    args, kwargs, target = case.data()
    args = tuple(a.to(case.dtype) if a.is_floating_point() else a for a in args)

    if case.criterion is not None:
        expected = case.criterion(bare(*args, **kwargs), target)
        got = dp(*args, **kwargs, target=target)
    else:
        expected = case.loss(bare(*args, **kwargs), target)
        got = case.loss(dp(*args, **kwargs), target)
    _close(got, expected, case.tol, f"{name} loss")

    opt_bare = torch.optim.SGD(bare.parameters(), lr=0.1)
    opt_dp = torch.optim.SGD(dp.parameters(), lr=0.1)
    expected.backward()
    got.backward()
    named = dict(bare.named_parameters())
    for key, p in model.named_parameters():
        q = named[key]
        assert (p.grad is None) == (q.grad is None), f"{name} {key}: .grad None on one side only"
        if q.grad is not None:
            _close(p.grad, q.grad, case.tol, f"{name} grad {key}")
    opt_bare.step()
    opt_dp.step()
    for key, p in model.named_parameters():
        _close(p, named[key], case.tol, f"{name} parameter {key} after the step")
    buffers = dict(bare.named_buffers())
    for key, b in model.named_buffers():
        if key in buffers and b.is_floating_point():
            _close(b, buffers[key], case.tol, f"{name} buffer {key}")
