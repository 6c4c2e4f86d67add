"""The corpus's models of the patterns issue 27 found in models from the wild (torch.nn modules only).

Each module here stands for one kind of model that users brought and backplane ran slowly or not
at all: a Paddle-style text recognizer at an old opset, a character-level transformer tagger of many
small layers, a voice-activity LSTM whose graph holds an If, a YOLOv8-style head, a hard-swish
layout detector at opset 11, a plain 4-layer nn.TransformerEncoder and a byte classifier over int32
ids. scripts/export_corpus.py exports them (their Spec entries say with which exporter and opset).
Their defaults are the small tier's sizes (tests/data/corpus); the size parameters give the full
tier (`export_corpus.py --tier full`) the widths of the models issue 27 timed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def conv_act(cin: int, cout: int, k: int, stride: int | tuple[int, int] = 1, groups: int = 1,
             act: type[nn.Module] | None = nn.ReLU) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(cout)]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


# ---------------------------------------------------------------- Paddle-style CRNN

class CRNNRecognizer(nn.Module):
    """PP-OCR's recognizer shape: a CNN that takes a 32-pixel-high text line down to height 1
    (strides (2, 1) keep the width), Im2Seq written as Paddle2ONNX leaves it (the sizes read with
    Shape and Gather, Unsqueeze, Concat and Reshape), a 2-layer bidirectional LSTM, a CTC head
    (Linear, Softmax over `classes`). Free batch and width. `widths`: the CNN's four channel
    counts; `hidden`: the LSTM's."""

    def __init__(self, classes: int = 40, widths: tuple[int, int, int, int] = (16, 32, 48, 64),
                 hidden: int = 32):
        super().__init__()
        c1, c2, c3, c4 = widths
        self.cnn = nn.Sequential(conv_act(3, c1, 3, 2), conv_act(c1, c2, 3, (2, 1)),
                                 conv_act(c2, c2, 3, 1, groups=c2), conv_act(c2, c3, 1),
                                 conv_act(c3, c3, 3, (2, 1)), nn.MaxPool2d((2, 1), (2, 1)),
                                 conv_act(c3, c4, 3, (2, 1)))
        self.rnn = nn.LSTM(c4, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x):
        f = self.cnn(x)                                       # (N, C, 1, W/2)
        n, c, h, w = f.shape
        f = f.reshape(n, c, h * w).permute(0, 2, 1)           # (N, T, C)
        y, _ = self.rnn(f)
        return torch.softmax(self.head(y), dim=2)


# ---------------------------------------------------------------- char-level tagger

class TinyBlock(nn.Module):
    """A hand-written post-norm encoder layer (as small taggers write theirs): attention with the
    heads split by view/transpose from the free length, a padding mask, a ReLU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.heads = heads

    def forward(self, x, pad):                                 # x (B, T, d), pad (B, 1, 1, T) additive
        b, t, d = x.shape
        dh = d // self.heads
        q, k, v = ((lin(x).view(b, t, self.heads, dh).transpose(1, 2)) for lin in (self.q, self.k, self.v))
        att = torch.softmax(q @ k.transpose(2, 3) / dh ** 0.5 + pad, dim=-1)
        x = self.ln1(x + self.o((att @ v).transpose(1, 2).reshape(b, t, d)))
        return self.ln2(x + self.fc2(F.relu(self.fc1(x))))


class CharTagger(nn.Module):
    """A character-level sequence tagger: character and position embeddings, 4 tiny encoder
    layers (d 32, 4 heads), padding from id 0, a per-token classifier with log-softmax."""

    def __init__(self, vocab: int = 96, d: int = 32, layers: int = 4, tags: int = 9, max_len: int = 256,
                 heads: int = 4):
        super().__init__()
        self.chars, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(TinyBlock(d, heads) for _ in range(layers))
        self.cls = nn.Linear(d, tags)

    def forward(self, chars):
        pos = torch.arange(chars.shape[1], device=chars.device)
        pad = (chars == 0).to(torch.float32)[:, None, None, :] * -1e4
        x = self.chars(chars) + self.pos(pos)
        for block in self.blocks:
            x = block(x, pad)
        return torch.log_softmax(self.cls(x), dim=-1)


# ---------------------------------------------------------------- VAD with an If

class LstmVad(nn.Module):
    """Silero-VAD's shape, one chunk per call: the sample rate picks the front end in an If (a
    scripted `if` on the `sr` input: strided Conv1d filters for 16 kHz or for 8 kHz), a mean over
    frames, one LSTMCell step from the state input, a sigmoid speech probability and the new state.
    `front`: the front end's channels and its 16 kHz kernel (the 8 kHz one is half as long, stride a
    half and padding a quarter of its kernel); `enc`: the encoder's channels."""

    def __init__(self, hidden: int = 64, front: tuple[int, int] = (32, 64), enc: int = 48):
        super().__init__()
        channels, k = front
        self.front16 = nn.Conv1d(1, channels, k, stride=k // 2, padding=k // 4)
        self.front8 = nn.Conv1d(1, channels, k // 2, stride=k // 4, padding=k // 8)
        self.enc = nn.Conv1d(channels, enc, 3, padding=1)
        self.cell = nn.LSTMCell(enc, hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x, state, sr):
        if bool(sr[0] == 16000):
            f = F.relu(self.front16(x.unsqueeze(1)))
        else:
            f = F.relu(self.front8(x.unsqueeze(1)))
        f = F.relu(self.enc(f)).mean(dim=2)                    # (N, 48)
        h, c = self.cell(f, (state[0], state[1]))
        return torch.sigmoid(self.out(h)), torch.stack([h, c])


# ---------------------------------------------------------------- YOLOv8-style detector

class C2f(nn.Module):
    """YOLOv8's C2f: 1x1 conv, Split in two, a bottleneck on the second half, Concat, 1x1 conv."""

    def __init__(self, c: int):
        super().__init__()
        self.cv1, self.cv2 = conv_act(c, c, 1, act=nn.SiLU), conv_act(3 * c // 2, c, 1, act=nn.SiLU)
        self.m = nn.Sequential(conv_act(c // 2, c // 2, 3, act=nn.SiLU), conv_act(c // 2, c // 2, 3, act=nn.SiLU))

    def forward(self, x):
        a, b = self.cv1(x).chunk(2, 1)
        return self.cv2(torch.cat([a, b, b + self.m(b)], 1))


class YoloV8ish(nn.Module):
    """A YOLOv8 detector in small: SiLU convs and C2f blocks to strides 8 and 16, a decoupled head
    per level (box distributions of 8 bins, class logits), Concat of the levels, Split, DFL
    (Softmax over bins, a 1x1 conv with weights 0..7), anchors from Range over each level's free
    height and width, dist2bbox, Sigmoid of the classes: (1, 4 + classes, anchors). `widths`: the
    stem's, stride 4's, stride 8's and stride 16's channels, and a fifth adds a level at stride 32;
    `head`: the box and class branches' channels."""

    def __init__(self, classes: int = 4, bins: int = 8, widths: tuple[int, ...] = (16, 32, 48, 64),
                 head: tuple[int, int] = (32, 32)):
        super().__init__()
        c1, c2, c3, c4 = widths[:4]
        self.body = nn.Sequential(conv_act(3, c1, 3, 2, act=nn.SiLU), conv_act(c1, c2, 3, 2, act=nn.SiLU),
                                  C2f(c2), conv_act(c2, c3, 3, 2, act=nn.SiLU), C2f(c3))
        self.down = nn.Sequential(conv_act(c3, c4, 3, 2, act=nn.SiLU), C2f(c4))
        if len(widths) > 4:  # the stride-32 level (registered here: liven draws in this order)
            self.down32 = nn.Sequential(conv_act(c4, widths[4], 3, 2, act=nn.SiLU), C2f(widths[4]))
        levels = widths[2:]
        self.box = nn.ModuleList(nn.Sequential(conv_act(c, head[0], 3, act=nn.SiLU),
                                               nn.Conv2d(head[0], 4 * bins, 1)) for c in levels)
        self.cls = nn.ModuleList(nn.Sequential(conv_act(c, head[1], 3, act=nn.SiLU),
                                               nn.Conv2d(head[1], classes, 1)) for c in levels)
        self.dfl = nn.Conv2d(bins, 1, 1, bias=False).requires_grad_(False)
        self.dfl.weight.data[:] = torch.arange(bins, dtype=torch.float32).view(1, bins, 1, 1)
        self.bins, self.classes = bins, classes

    def forward(self, x):
        p3 = self.body(x)
        levels = [(p3, 8.0), (self.down(p3), 16.0)]
        if hasattr(self, "down32"):
            levels.append((self.down32(levels[1][0]), 32.0))
        outs, anchors, strides = [], [], []
        for i, (f, stride) in enumerate(levels):
            n, _, h, w = f.shape
            outs.append(torch.cat([self.box[i](f), self.cls[i](f)], 1).view(n, 4 * self.bins + self.classes, -1))
            sy, sx = torch.meshgrid(torch.arange(h, dtype=x.dtype) + 0.5, torch.arange(w, dtype=x.dtype) + 0.5,
                                    indexing="ij")
            anchors.append(torch.stack((sx, sy), -1).view(-1, 2))
            strides.append(torch.full((h * w, 1), stride, dtype=x.dtype))
        anchor = torch.cat(anchors).transpose(0, 1).unsqueeze(0)             # (1, 2, A)
        stride = torch.cat(strides).transpose(0, 1)                          # (1, A)
        box, cls = torch.cat(outs, 2).split((4 * self.bins, self.classes), 1)
        b, _, a = box.shape
        dist = self.dfl(box.view(b, 4, self.bins, a).transpose(2, 1).softmax(1)).view(b, 4, a)
        lt, rb = dist.chunk(2, 1)
        x1y1, x2y2 = anchor - lt, anchor + rb
        xywh = torch.cat(((x1y1 + x2y2) / 2, x2y2 - x1y1), 1) * stride
        return torch.cat((xywh, cls.sigmoid()), 1)


# ---------------------------------------------------------------- hard-swish layout detector

def hard_swish(x):
    """Paddle's hard_swish as its exporter writes it: Add, Clip, Mul, Div."""
    return x * F.relu6(x + 3.0) / 6.0


class HSConv(nn.Module):
    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, groups: int = 1):
        super().__init__()
        self.conv = conv_act(cin, cout, k, stride, groups, act=None)

    def forward(self, x):
        return hard_swish(self.conv(x))


class LayoutDetector(nn.Module):
    """A PicoDet-style layout detector: depthwise-separable hard-swish backbone to strides 8, 16
    and 32, an FPN (1x1 lateral convs, nearest 2x Resize, Add), a shared-weight head per level
    (classes through Sigmoid, 4 box distances through ReLU), the levels flattened and Concat'ed.
    `width` multiplies every channel count; `depth16`: the stride-16 stage's blocks after its first."""

    def __init__(self, classes: int = 5, width: int = 1, depth16: int = 2):
        super().__init__()

        def sep(cin: int, cout: int, stride: int) -> nn.Sequential:
            return nn.Sequential(HSConv(cin, cin, 3, stride, groups=cin), HSConv(cin, cout, 1))

        c16, c24, c32, c48, c64 = (c * width for c in (16, 24, 32, 48, 64))
        self.stem = HSConv(3, c16, 3, 2)
        self.s8 = nn.Sequential(sep(c16, c24, 2), sep(c24, c24, 1), sep(c24, c32, 2), sep(c32, c32, 1))
        self.s16 = nn.Sequential(sep(c32, c48, 2), *(sep(c48, c48, 1) for _ in range(depth16)))
        self.s32 = nn.Sequential(sep(c48, c64, 2), sep(c64, c64, 1))
        self.lat = nn.ModuleList(nn.Conv2d(c, c32, 1) for c in (c32, c48, c64))
        self.head = nn.Sequential(sep(c32, c32, 1), sep(c32, c32, 1))
        self.cls, self.reg = nn.Conv2d(c32, classes, 1), nn.Conv2d(c32, 4, 1)

    def forward(self, x):
        c3 = self.s8(self.stem(x))
        c4 = self.s16(c3)
        c5 = self.s32(c4)
        p5 = self.lat[2](c5)
        p4 = self.lat[1](c4) + F.interpolate(p5, scale_factor=2.0, mode="nearest")
        p3 = self.lat[0](c3) + F.interpolate(p4, scale_factor=2.0, mode="nearest")
        scores, boxes = [], []
        for p in (p3, p4, p5):
            h = self.head(p)
            scores.append(torch.sigmoid(self.cls(h)).flatten(2))
            boxes.append(F.relu(self.reg(h)).flatten(2))
        return torch.cat(scores, 2), torch.cat(boxes, 2)


# ---------------------------------------------------------------- plain encoder, byte classifier

class PlainEncoder(nn.Module):
    """nn.TransformerEncoder as users instantiate it: 4 layers, 4 heads, batch_first, ReLU, over
    (batch, seq, d) features. d is 64 (not 256): 4 layers at d 256 hold 4 MB of float32 weights at
    the least, over the corpus's 1 MB a file (the full tier's is at d 256)."""

    def __init__(self, d: int = 64, ff: int = 128, heads: int = 4):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)

    def forward(self, x):
        return self.encoder(x)


class ByteClassifier(nn.Module):
    """A MalConv-style file classifier: an Embedding over int32 bytes, a bool validity mask, a
    gated strided Conv1d (Conv * Sigmoid(Conv)), a masked global max pool and a 2-layer MLP.
    `window`: the convolutions' kernel (their stride is half of it); `hidden`: the MLP's width."""

    def __init__(self, d: int = 16, channels: int = 64, classes: int = 6, window: int = 16, hidden: int = 32):
        super().__init__()
        self.embed = nn.Embedding(256, d)
        self.conv = nn.Conv1d(d, channels, window, window // 2)
        self.gate = nn.Conv1d(d, channels, window, window // 2)
        self.fc1, self.fc2 = nn.Linear(channels, hidden), nn.Linear(hidden, classes)

    def forward(self, data, valid):
        x = (self.embed(data) * valid.unsqueeze(-1).to(torch.float32)).transpose(1, 2)   # (N, d, L)
        x = self.conv(x) * torch.sigmoid(self.gate(x))
        return self.fc2(F.relu(self.fc1(x.amax(dim=2))))
