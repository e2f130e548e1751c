"""The models the training benchmarks run: a deep narrow MLP, a small ResNet-style CNN, a small transformer, and
the chain of N x Linear(8, 8) of the per-tensor sweep, each built on the device with a batch and its loss."""

import torch
from torch import nn


MODELS = ("mlp", "cnn", "transformer")


# Model sizes per device kind: small enough for a 2-core CPU, larger on a GPU so the CNN and transformer are not
# purely launch-bound there. The MLP stays deep and narrow (overhead-bound) everywhere.
_SIZES = {
    "cpu": {"mlp": dict(depth=20, width=128, batch=64),
            "cnn": dict(width=16, image=16, blocks=2, batch=32),
            "transformer": dict(d_model=64, layers=2, seq=16, batch=32)},
    "cuda": {"mlp": dict(depth=20, width=256, batch=256),
             "cnn": dict(width=64, image=32, blocks=3, batch=128),
             "transformer": dict(d_model=256, layers=4, seq=64, batch=64)},
}


class _Block(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with batch norm and an identity shortcut."""

    def __init__(self, width):
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class _SmallTransformer(nn.Module):
    """A few encoder layers over a batch-first float sequence, mean-pooled into 10 classes."""

    def __init__(self, d_model, layers):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=2 * d_model, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def forward(self, x):
        return self.head(self.encoder(x).mean(dim=1))


def build(name, kind, batch):
    """(module, input, target, batch) for one model on the CPU; the caller moves them."""
    s = _SIZES[kind][name]
    batch = batch or s["batch"]
    if name == "mlp":
        layers = [nn.Linear(s["width"], s["width"]) if i % 2 == 0 else nn.ReLU() for i in range(2 * s["depth"])]
        module = nn.Sequential(*layers, nn.Linear(s["width"], 10))
        x = torch.randn(batch, s["width"])
    elif name == "cnn":
        w = s["width"]
        module = nn.Sequential(nn.Conv2d(3, w, 3, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU(),
                               *[_Block(w) for _ in range(s["blocks"])],
                               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(w, 10))
        x = torch.randn(batch, 3, s["image"], s["image"])
    elif name == "transformer":
        module = _SmallTransformer(s["d_model"], s["layers"])
        x = torch.randn(batch, s["seq"], s["d_model"])
    else:
        raise ValueError(f"unknown model {name!r} (choose from {', '.join(MODELS)})")
    return module, x, torch.randint(0, 10, (batch,)), batch


class Chain(nn.Module):
    """n bias-free Linear(8, 8) layers with tanh between: n parameter tensors of 64 values, so replicate and the
    reduction grow with the tensor count while the bytes and the compute stay small."""

    def __init__(self, n):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x
