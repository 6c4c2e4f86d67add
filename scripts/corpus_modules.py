"""The corpus's small torch.nn architectures (scripts/export_corpus.py exports them): CNNs,
recurrent nets and transformers, and ``liven``, the random weights every corpus model gets."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------- weights

def liven(m: nn.Module, seed: int) -> nn.Module:
    """Random weights that let a test see every kernel's mistakes (as export_models.liven does, for
    every module kind used here): matrices and kernels N(0, 1/fan_in), so that activations stay near
    unit scale; biases N(0, 0.1); norm scales N(1, 0.2); BatchNorm statistics random. Library inits
    leave biases and norm shifts at 0 and norm scales at 1, where a kernel that drops them passes."""
    g = torch.Generator().manual_seed(seed)
    norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)
    with torch.no_grad():
        for mod in m.modules():
            for pname, p in mod.named_parameters(recurse=False):
                if isinstance(mod, nn.Embedding):
                    p.copy_(torch.randn(p.shape, generator=g))
                elif isinstance(mod, norms) and pname == "weight":
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2 + 1.0)
                elif p.dim() >= 2:
                    fan_in = p[0].numel()
                    if isinstance(mod, nn.ConvTranspose2d):
                        fan_in = p.shape[0] * p[0, 0].numel() // max(1, p.shape[1])
                    p.copy_(torch.randn(p.shape, generator=g) * fan_in ** -0.5)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)):
                mod.running_mean.copy_(torch.randn(mod.running_mean.shape, generator=g) * 0.1)
                mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=g) + 0.5)
    return m.eval()


# ---------------------------------------------------------------- CNNs

def conv_bn(cin: int, cout: int, k: int, stride: int | tuple[int, int] = 1, groups: int = 1,
            dilation: int = 1, act: type[nn.Module] | None = nn.ReLU6) -> nn.Sequential:
    pad = dilation * (k - 1) // 2
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, pad, dilation=dilation, groups=groups,
                                         bias=False), nn.BatchNorm2d(cout)]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """MobileNetV2's block: expand 1x1, depthwise 3x3, project 1x1, residual Add when shapes agree."""

    def __init__(self, cin: int, cout: int, stride: int | tuple[int, int], expand: int,
                 dilation: int = 1, act: type[nn.Module] = nn.ReLU6):
        super().__init__()
        mid = cin * expand
        self.residual = stride in (1, (1, 1)) and cin == cout
        self.block = nn.Sequential(conv_bn(cin, mid, 1, act=act),
                                   conv_bn(mid, mid, 3, stride, groups=mid, dilation=dilation, act=act),
                                   conv_bn(mid, cout, 1, act=None))

    def forward(self, x):
        y = self.block(x)
        return x + y if self.residual else y


class MobileNetish(nn.Module):
    """A small MobileNet: strided stem, depthwise convolutions with strides (2, 1) and (1, 2), a
    dilated depthwise one, grouped convolutions (groups 4), inverted residuals with Add, HardSwish,
    global average pool and a classifier. Outputs the logits and the last feature map (so that a
    wrong stride or padding shows in the spatial output, not only through the pool). `width`
    multiplies every channel count; `classes`: the classifier's outputs."""

    def __init__(self, width: int = 1, classes: int = 10):
        super().__init__()
        c16, c24, c32 = 16 * width, 24 * width, 32 * width
        self.stem = conv_bn(3, c16, 3, stride=2)
        self.features = nn.Sequential(
            InvertedResidual(c16, c16, 1, 2),
            InvertedResidual(c16, c24, (2, 1), 2),            # depthwise stride (2, 1)
            InvertedResidual(c24, c24, 1, 2, dilation=2, act=nn.Hardswish),
            conv_bn(c24, c32, 3, stride=(1, 2), groups=4),      # grouped, stride (1, 2)
            InvertedResidual(c32, c32, 1, 2, act=nn.Hardswish),
            conv_bn(c32, c32, 3, groups=8, act=nn.ReLU),
        )
        self.head = nn.Linear(c32, classes)

    def forward(self, x):
        f = self.features(self.stem(x))
        return self.head(F.adaptive_avg_pool2d(f, 1).flatten(1)), f


class BasicBlock(nn.Module):
    __module__ = "corpus"  # the domain of its ONNX local function where exported as one

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = conv_bn(cin, cout, 3, stride, act=nn.ReLU)
        self.conv2 = conv_bn(cout, cout, 3, act=None)
        self.down = conv_bn(cin, cout, 1, stride, act=None) if stride != 1 or cin != cout else None

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        return F.relu(self.conv2(self.conv1(x)) + identity)


class ResNetish(nn.Module):
    """ResNet's shape: 5x5 stem stride 2, MaxPool 3x3/2 pad 1, basic blocks with 1x1 strided
    downsample shortcuts, an AvgPool with ceil_mode, global pool, classifier. `width` multiplies
    every channel count; `classes`: the classifier's outputs."""

    def __init__(self, matmul_head: bool = False, width: int = 1, classes: int = 10):
        super().__init__()
        self.matmul_head = matmul_head  # the classifier written as x @ W.T + b: MatMul, not Gemm
        c16, c32 = 16 * width, 32 * width
        self.stem = conv_bn(3, c16, 5, 2, act=nn.ReLU)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = BasicBlock(c16, c16, 1)
        self.layer2 = BasicBlock(c16, c32, 2)
        self.avg = nn.AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)
        self.fc = nn.Linear(c32, classes)

    def forward(self, x):
        f = self.layer2(self.layer1(self.pool(self.stem(x))))
        f = self.avg(f)
        x = torch.flatten(F.adaptive_avg_pool2d(f, 1), 1)
        return (x @ self.fc.weight.t() + self.fc.bias if self.matmul_head else self.fc(x)), f


class UNetish(nn.Module):
    """A two-level U-Net: MaxPool down, ConvTranspose2d (stride 2) and bilinear Resize up, skip
    Concats, sigmoid mask. Height and width must be multiples of 4. `width` multiplies every
    channel count but the mask's."""

    def __init__(self, width: int = 1):
        super().__init__()
        c8, c16 = 8 * width, 16 * width
        self.enc1 = conv_bn(3, c8, 3, act=nn.ReLU)
        self.enc2 = conv_bn(c8, c16, 3, act=nn.ReLU)
        self.mid = conv_bn(c16, c16, 3, act=nn.ReLU)
        self.up2 = nn.ConvTranspose2d(c16, c16, 2, stride=2)
        self.dec2 = conv_bn(2 * c16, c8, 3, act=nn.ReLU)
        self.dec1 = conv_bn(2 * c8, c8, 3, act=nn.ReLU)
        self.out = nn.Conv2d(c8, 2, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1))
        d1 = self.dec1(torch.cat([F.interpolate(d2, scale_factor=2.0, mode="bilinear",
                                                align_corners=False), e1], 1))
        return torch.sigmoid(self.out(d1))


class FakeQuantCNN(nn.Module):
    """Quantization-aware training's export: activations fake-quantized per tensor (uint8 and int8),
    convolution and linear weights per output channel (int8, symmetric), as torch.ao's QAT leaves a
    model; the TorchScript exporter writes each as a QuantizeLinear / DequantizeLinear pair."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, 2, 1)
        self.c2 = nn.Conv2d(16, 16, 3, 1, 1, groups=16)
        self.c3 = nn.Conv2d(16, 24, 1)
        self.fc = nn.Linear(24, 10)

    @staticmethod
    def act_u8(x, scale: float, zp: int):
        return torch.fake_quantize_per_tensor_affine(x, scale, zp, 0, 255)

    @staticmethod
    def act_s8(x, scale: float):
        return torch.fake_quantize_per_tensor_affine(x, scale, 0, -128, 127)

    def observe(self) -> FakeQuantCNN:
        """What QAT's observers leave: per-channel weight scales as buffers (max |w| / 127)."""
        for name in ("c1", "c2", "c3", "fc"):
            w = getattr(self, name).weight.detach()
            self.register_buffer(f"{name}_scale", w.abs().amax(dim=tuple(range(1, w.dim()))) / 127.0)
            self.register_buffer(f"{name}_zp", torch.zeros(w.shape[0], dtype=torch.int32))
        return self

    def weight(self, name: str):
        return torch.fake_quantize_per_channel_affine(getattr(self, name).weight, getattr(self, f"{name}_scale"),
                                                      getattr(self, f"{name}_zp"), 0, -128, 127)

    def forward(self, x):
        x = self.act_s8(x, 0.03)
        x = self.act_u8(F.relu(F.conv2d(x, self.weight("c1"), self.c1.bias, 2, 1)), 0.02, 0)
        x = F.conv2d(x, self.weight("c2"), self.c2.bias, 1, 1, 1, 16)
        x = self.act_s8(F.hardtanh(x, -2.0, 2.0), 2.0 / 127)
        x = self.act_u8(F.relu(F.conv2d(x, self.weight("c3"), self.c3.bias)), 0.02, 0)
        x = x.mean((2, 3))
        return F.linear(x, self.weight("fc"), self.fc.bias)


class AudioConv1d(nn.Module):
    """A wav2vec-style feature encoder: strided Conv1d over the waveform, GroupNorm, GELU (erf),
    more strided Conv1d, then transpose, LayerNorm and a projection, frames out."""

    def __init__(self):
        super().__init__()
        self.conv0 = nn.Conv1d(1, 16, 10, stride=5, bias=False)
        self.norm0 = nn.GroupNorm(16, 16)
        self.conv1 = nn.Conv1d(16, 16, 3, stride=2, bias=False)
        self.conv2 = nn.Conv1d(16, 16, 2, stride=2, bias=False)
        self.ln = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 24)

    def forward(self, wav):
        x = F.gelu(self.norm0(self.conv0(wav.unsqueeze(1))))
        x = F.gelu(self.conv2(F.gelu(self.conv1(x))))
        return self.proj(self.ln(x.transpose(1, 2)))


# ---------------------------------------------------------------- recurrent

class LSTMTagger(nn.Module):
    """Two-layer bidirectional LSTM over (batch, seq, features) with initial states, a linear head
    on every step; returns the head, and the final hidden and cell states."""

    def __init__(self, features: int = 16, hidden: int = 24, tags: int = 8):
        super().__init__()
        self.rnn = nn.LSTM(features, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * hidden, tags)

    def forward(self, x, h0, c0):
        y, (h, c) = self.rnn(x, (h0, c0))
        return self.head(y), h, c


class LSTMEncoder(nn.Module):
    """The same LSTM with zero initial states (the exporter's default), last step's features out."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(16, 24, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(48, 8)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y), y[:, -1]


class GRUNet(nn.Module):
    """GRU, multi-layer (bidirectional where asked), time-major or batch-first."""

    def __init__(self, bidirectional: bool, batch_first: bool, layers: int = 2):
        super().__init__()
        self.rnn = nn.GRU(12, 20, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first)
        self.head = nn.Linear(20 * (2 if bidirectional else 1), 6)

    def forward(self, x):
        y, h = self.rnn(x)
        return self.head(y), h


# ---------------------------------------------------------------- transformers

class Encoder(nn.Module):
    """nn.TransformerEncoder (2 layers, d_model 32, 4 heads, GELU) over embedded token ids, with
    the padding mask from an attention_mask input (1 = token, 0 = padding), as a BERT takes it."""

    def __init__(self, vocab: int = 50, d: int = 32, max_len: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)

    def forward(self, input_ids, attention_mask):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok(input_ids) + self.pos(pos)
        return self.norm(self.encoder(x, src_key_padding_mask=attention_mask == 0))


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, max_len: int, sdpa: bool):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.heads, self.sdpa = heads, sdpa
        # GPT-2's causal mask: a (1, 1, max_len, max_len) buffer sliced to the sequence.
        self.register_buffer("bias", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))
                             .view(1, 1, max_len, max_len), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / (d // self.heads) ** 0.5)
            att = att.masked_fill(~self.bias[:, :, :t, :t], torch.finfo(att.dtype).min)
            y = torch.softmax(att, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int, max_len: int, sdpa: bool):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, max_len, sdpa)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """A GPT-2-shaped decoder: token and position embeddings, pre-norm blocks with causal
    self-attention (a sliced tril buffer, or scaled_dot_product_attention(is_causal=True)),
    tanh-GELU MLPs, final LayerNorm and an LM head tied to the token embedding."""

    def __init__(self, sdpa: bool, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2,
                 max_len: int = 32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(GPTBlock(d, heads, max_len, sdpa) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def tie(self) -> GPT:
        self.head.weight = self.wte.weight
        return self

    def forward(self, input_ids):
        pos = torch.arange(input_ids.shape[1], dtype=torch.long, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
