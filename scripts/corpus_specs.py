"""The corpus's models (scripts/export_corpus.py writes them): each one's module, exporter, opset,
free axes and their two sizes, what it exercises, at the small tier (`specs`) and at the sizes users
run them (`full_specs`). Split from export_corpus.py."""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus_wild as wild  # noqa: E402 - beside this script
from corpus_detect import (  # noqa: E402
    CondNet, ScriptedLoop, DetectNMSTorchScript, corpus_nms_onnx, DetectNMSDynamo)
from corpus_modules import (  # noqa: E402
    liven, MobileNetish, BasicBlock, ResNetish, UNetish, FakeQuantCNN, AudioConv1d, LSTMTagger, LSTMEncoder, GRUNet, Encoder, GPT)

Feeds = dict[str, np.ndarray]


@dataclass
class Spec:
    """One corpus model: how it is built and exported, its inputs at two sizes, what it exercises."""

    name: str
    build: Callable[[], nn.Module]
    exporter: str                       # "torchscript", "dynamo", "torchscript+ort-quant"
    opset: int
    inputs: dict[str, tuple[str, tuple[int | str, ...], str]]  # name -> (kind, shape, dtype)
    sizes: tuple[dict[str, int], dict[str, int]]                 # axis name -> size, twice
    exercises: str
    outputs: list[str]
    script: bool = False                # torch.jit.script the module before the TorchScript export
    quantize: str | None = None         # "qdq", "qoperator", "dynamic": onnxruntime.quantization
    export_size: int = 1                # which size the example inputs of the export have (1: no
    #                                     dimension of size 1 for torch.export to specialize)
    grad_for_export: bool = False       # export with autograd on (keeps nn.Transformer* off its fast path)
    custom_translation: dict = field(default_factory=dict)
    export_options: dict = field(default_factory=dict)  # more keyword arguments of torch.onnx.export
    vocab: int = 0
    torch_tolerance: float = 1e-4

    @property
    def free_axes(self) -> list[str]:
        return list(self.sizes[0])


def make_feeds(spec: Spec, which: int) -> Feeds:
    """The inputs at size `which` (0 or 1), from a seed of the model's name and the size."""
    rng = np.random.default_rng([sum(map(ord, spec.name)), which])
    sizes = spec.sizes[which]
    feeds: Feeds = {}
    for name, (kind, shape_t, dtype) in spec.inputs.items():
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in shape_t)
        if kind == "normal":
            a = rng.standard_normal(shape)
        elif kind == "cond":  # torch.cond's predicate is the mean: s0 takes one branch, s1 the other
            a = rng.standard_normal(shape) + (1.5 if which == 0 else -1.5)
        elif kind == "image":
            a = rng.uniform(-1.0, 1.0, shape)
        elif kind == "ids":
            a = rng.integers(0, spec.vocab, shape)
        elif kind == "mask":  # 1 = token, 0 = padding; row i pads its last i positions (never all)
            a = np.ones(shape)
            for i in range(shape[0]):
                if i:
                    a[i, shape[1] - min(i * 2, shape[1] - 1):] = 0
        elif kind == "rate":  # a sample rate: s0 16 kHz, s1 8 kHz (an If's two branches)
            a = np.full(shape, 16000 if which == 0 else 8000)
        elif kind == "wave":
            t = np.arange(shape[1]) / 16000.0
            a = np.sin(2 * np.pi * rng.uniform(100, 800, (shape[0], 1)) * t) + 0.1 * rng.standard_normal(shape)
        else:
            raise ValueError(kind)
        feeds[name] = a.astype(dtype)
    return feeds


NCHW = ("N", 3, "H", "W")
IMAGE_SIZES = ({"N": 1, "H": 32, "W": 32}, {"N": 3, "H": 40, "W": 24})
SEQ_SIZES = ({"batch": 1, "seq": 8}, {"batch": 3, "seq": 13})


def specs() -> dict[str, Spec]:
    image = {"input": ("image", NCHW, "float32")}
    image16 = {"input": ("image", NCHW, "float16")}
    seq16 = {"x": ("normal", ("batch", "seq", 16), "float32")}
    ids = {"input_ids": ("ids", ("batch", "seq"), "int64")}
    s = [
        Spec("mobilenet_dw_ts13", lambda: liven(MobileNetish(), 1), "torchscript", 13, image, IMAGE_SIZES,
             "depthwise convs with strides (2,1) and (1,2), dilated depthwise, grouped convs (groups 4, 8), "
             "BatchNorm folded, ReLU6 as Clip, HardSwish, residual Add, GlobalAveragePool, Gemm",
             ["logits", "features"]),
        Spec("mobilenet_dw_dyn18", lambda: liven(MobileNetish(), 1), "dynamo", 18, image, IMAGE_SIZES,
             "the same CNN through the dynamo exporter (its spellings: ReduceMean pool, Clip, MatMul+Add)",
             ["logits", "features"]),
        Spec("mobilenet_fp16_ts17", lambda: liven(MobileNetish(), 1).half(), "torchscript", 17, image16,
             IMAGE_SIZES, "the same CNN in float16 end to end (fp16 weights, inputs, outputs)",
             ["logits", "features"], torch_tolerance=2e-2),
        Spec("resnet_basic_ts16", lambda: liven(ResNetish(), 2), "torchscript", 16, image, IMAGE_SIZES,
             "5x5 stride-2 stem, MaxPool 3x3/2 pad 1, basic blocks with strided 1x1 shortcut, "
             "AveragePool ceil_mode count_include_pad=0 on odd sizes, Flatten, Gemm; each BasicBlock an "
             "ONNX local function (export_modules_as_functions), called twice",
             ["logits", "features"], export_options={"export_modules_as_functions": {BasicBlock}}),
        Spec("resnet_basic_dyn21", lambda: liven(ResNetish(), 2), "dynamo", 21, image, IMAGE_SIZES,
             "the ResNet through the dynamo exporter at opset 21", ["logits", "features"]),
        Spec("unet_resize_dyn20", lambda: liven(UNetish(), 3), "dynamo", 20, image, IMAGE_SIZES,
             "MaxPool down, ConvTranspose stride 2, bilinear Resize (half_pixel) by scale, skip Concat, Sigmoid",
             ["mask"]),
        Spec("unet_resize_ts13", lambda: liven(UNetish(), 3), "torchscript", 13, image, IMAGE_SIZES,
             "the U-Net through the TorchScript exporter at opset 13 (Resize with sizes from Shape)",
             ["mask"]),
        Spec("fakequant_qdq_ts13", lambda: liven(FakeQuantCNN(), 4).observe(), "torchscript", 13, image, IMAGE_SIZES,
             "QAT export: QuantizeLinear/DequantizeLinear pairs, uint8 and int8 activations per tensor, "
             "int8 weights per channel (axis 0) on Conv, depthwise Conv and Gemm", ["logits"],
             torch_tolerance=0.05),  # one quantum flips where torch and onnxruntime round a tie apart
        Spec("resnet_qdq_ort17", lambda: liven(ResNetish(), 2), "torchscript+ort-quant", 17, image, IMAGE_SIZES,
             "onnxruntime.quantization.quantize_static QDQ: uint8 activations, int8 per-channel weights "
             "around every Conv/Gemm/pool/Add of the ResNet", ["logits", "features"], quantize="qdq"),
        Spec("resnet_qlinear_ort15", lambda: liven(ResNetish(matmul_head=True), 2), "torchscript+ort-quant", 15, image,
             IMAGE_SIZES, "quantize_static QOperator: QuantizeLinear, QLinearConv (uint8 x int8 per-channel), "
             "QLinearMatMul, DequantizeLinear between float ops", ["logits", "features"], quantize="qoperator"),
        Spec("lstm_bi2_ts14", lambda: liven(LSTMTagger(), 5), "torchscript", 14,
             {"x": ("normal", ("batch", "seq", 16), "float32"),
              "h0": ("normal", (4, "batch", 24), "float32"), "c0": ("normal", (4, "batch", 24), "float32")},
             SEQ_SIZES, "LSTM, 2 layers, bidirectional, batch_first, initial states as inputs, Y_h/Y_c outputs",
             ["y", "h", "c"]),
        Spec("lstm_bi2_dyn18", lambda: liven(LSTMEncoder(), 5), "dynamo", 18, seq16, SEQ_SIZES,
             "LSTM, 2 layers, bidirectional, zero initial states, through the dynamo exporter",
             ["y", "last"]),
        Spec("gru_bi2_dyn19", lambda: liven(GRUNet(True, True), 6), "dynamo", 19,
             {"x": ("normal", ("batch", "seq", 12), "float32")}, SEQ_SIZES,
             "GRU, 2 layers, bidirectional, batch_first (linear_before_reset=1)", ["y", "h"]),
        Spec("gru_tm3_ts13", lambda: liven(GRUNet(False, False, 3), 6), "torchscript", 13,
             {"x": ("normal", ("seq", "batch", 12), "float32")}, SEQ_SIZES,
             "GRU, 3 layers, unidirectional, time-major; the weights are graph inputs too, with their "
             "initializers as defaults (keep_initializers_as_inputs, older exporters' layout)", ["y", "h"],
             export_options={"keep_initializers_as_inputs": True}),
        # The TorchScript exporter of torch 2.13 writes nn.MultiheadAttention's sequence length into
        # a Reshape as a constant (any other length fails in onnxruntime), so only the batch is free.
        Spec("encoder_padmask_ts17", lambda: liven(Encoder(), 7), "torchscript", 17,
             {"input_ids": ("ids", ("batch", 16), "int64"), "attention_mask": ("mask", ("batch", 16), "int64")},
             ({"batch": 1}, {"batch": 3}),
             "nn.TransformerEncoder (2 layers, 4 heads, GELU) with a key padding mask from attention_mask "
             "(Equal, Where to -inf, Softmax), embeddings with arange positions, LayerNormalization; "
             "sequence fixed at 16 (the TorchScript exporter bakes it into MultiheadAttention's Reshape)",
             ["hidden"], grad_for_export=True, vocab=50),
        Spec("encoder_padmask_dyn17", lambda: liven(Encoder(), 7), "dynamo", 17,
             {**ids, "attention_mask": ("mask", ("batch", "seq"), "int64")}, SEQ_SIZES,
             "the TransformerEncoder through the dynamo exporter asked for opset 17: it exports at 18 "
             "and converts down with onnx's version converter", ["hidden"], vocab=50),
        Spec("gpt_causal_ts15", lambda: liven(GPT(sdpa=False), 8).tie(), "torchscript", 15, ids, SEQ_SIZES,
             "GPT-2-style decoder: causal mask sliced from a tril buffer (dynamic Slice), masked_fill with "
             "finfo.min, LayerNorm decomposed (opset 15), tanh GELU, tied LM head", ["logits"], vocab=64),
        Spec("gpt_sdpa_dyn18", lambda: liven(GPT(sdpa=True), 8).tie(), "dynamo", 18, ids, SEQ_SIZES,
             "the GPT with scaled_dot_product_attention(is_causal=True) through the dynamo exporter",
             ["logits"], vocab=64),
        Spec("gpt_fp16_dyn19", lambda: liven(GPT(sdpa=True), 8).tie().half(), "dynamo", 19, ids, SEQ_SIZES,
             "the SDPA GPT in float16 (weights and activations; logits float16)", ["logits"], vocab=64,
             torch_tolerance=2e-2),
        Spec("gpt_dynquant_ort15", lambda: liven(GPT(sdpa=False), 8).tie(), "torchscript+ort-quant", 15, ids,
             SEQ_SIZES, "onnxruntime.quantization.quantize_dynamic of the GPT's MatMuls: DynamicQuantizeLinear, "
             "MatMulInteger (uint8 x int8), Cast, Mul by the scales", ["logits"], quantize="dynamic",
             vocab=64),
        Spec("cond_nested_dyn18", lambda: liven(CondNet(), 9), "dynamo", 18,
             {"x": ("cond", ("batch", 16), "float32")}, ({"batch": 2}, {"batch": 5}),
             "torch.cond -> If on a data-dependent predicate, a nested If in the then-branch; size 0 "
             "takes the else-branch, size 1 the then-branch and its nested then-branch", ["y"]),
        Spec("loop_scripted_ts16", lambda: torch.jit.script(liven(ScriptedLoop(), 10)), "torchscript", 16,
             {"x": ("normal", ("batch", "seq", 12), "float32")}, SEQ_SIZES,
             "torch.jit.script'ed Python loops: Loop over the sequence with a list append "
             "(SequenceInsert, ConcatFromSequence), a while loop with a data-dependent condition",
             ["y", "h", "n"], script=True),
        Spec("detect_nms_ts14", lambda: liven(DetectNMSTorchScript(), 11), "torchscript", 14, image, IMAGE_SIZES,
             "YOLO head: dynamic Reshape to (N, A, 5+C, H, W), meshgrid from Range, TopK (k=32), "
             "GatherElements, multi-class batched NonMaxSuppression, Gather of boxes by the selected indices",
             ["selected", "boxes", "scores"]),
        Spec("detect_nms_dyn21", lambda: liven(DetectNMSDynamo(), 11), "dynamo", 21,
             {"input": ("image", (1, 3, "H", "W"), "float32")},
             ({"H": 32, "W": 32}, {"H": 40, "W": 24}),
             "torchvision-style post-process: TopK with k = min(64, candidates) from the free size, "
             "class-offset boxes, NonMaxSuppression (custom-op translation), Gather of boxes, scores, labels",
             ["boxes", "scores", "labels"], custom_translation={torch.ops.corpus.nms.default: corpus_nms_onnx}),
        Spec("audio_conv1d_dyn19", lambda: liven(AudioConv1d(), 12), "dynamo", 19,
             {"wav": ("wave", ("batch", "time"), "float32")}, ({"batch": 1, "time": 400}, {"batch": 3, "time": 560}),
             "wav2vec-style feature encoder: strided Conv1d, GroupNorm, erf GELU, Transpose, "
             "LayerNormalization, MatMul", ["frames"]),
        *wild_specs(),
    ]
    return {spec.name: spec for spec in s}


def wild_specs() -> list[Spec]:
    """The patterns of models from the wild (issue 27): scripts/corpus_wild.py's modules."""
    image = {"input": ("image", (1, 3, "H", "W"), "float32")}
    return [
        Spec("crnn_paddle_ts12", lambda: liven(wild.CRNNRecognizer(), 13), "torchscript", 12,
             {"input": ("image", ("N", 3, 32, "W"), "float32")}, ({"N": 1, "W": 160}, {"N": 2, "W": 96}),
             "Paddle-style CRNN text recognizer at opset 12: CNN with (2,1) strides to height 1, Im2Seq as "
             "Shape/Gather/Mul/Unsqueeze/Concat/Reshape, Transpose, 2-layer bidirectional LSTM, Linear, Softmax",
             ["probs"]),
        Spec("char_tagger_ts14", lambda: liven(wild.CharTagger(), 14), "torchscript", 14,
             {"chars": ("ids", ("batch", "seq"), "int64")}, ({"batch": 1, "seq": 48}, {"batch": 2, "seq": 23}),
             "character-level transformer tagger of many small layers: embeddings, 4 hand-written encoder "
             "layers (d 32, heads split by Reshape/Transpose from the free length, additive padding mask, "
             "LayerNorm decomposed at opset 14), per-token Linear and LogSoftmax", ["tags"], vocab=96),
        Spec("vad_lstm_if_ts16", lambda: torch.jit.script(liven(wild.LstmVad(), 15)), "torchscript", 16,
             {"x": ("wave", ("batch", 576), "float32"), "state": ("normal", (2, "batch", 64), "float32"),
              "sr": ("rate", (1,), "int64")}, ({"batch": 1}, {"batch": 2}),
             "Silero-style VAD run on one 36 ms chunk: a scripted if on the sr input (an If whose "
             "branches hold strided Conv1d front ends; s0 16 kHz, s1 8 kHz), ReduceMean, one LSTMCell step "
             "from the state input (LSTM of one step), Sigmoid, the new state out", ["prob", "state_out"],
             script=True),
        Spec("yolo_v8_ts17", lambda: liven(wild.YoloV8ish(), 16), "torchscript", 17, image,
             ({"H": 160, "W": 160}, {"H": 96, "W": 128}),
             "YOLOv8-style detector: SiLU convs, C2f (Split, Concat), decoupled head on two levels, "
             "Concat/Split, DFL (Softmax, 1x1 Conv), anchors from Range over the free H/W, dist2bbox, Sigmoid",
             ["output0"]),
        Spec("layout_hswish_ts11", lambda: liven(wild.LayoutDetector(), 17), "torchscript", 11, image,
             ({"H": 256, "W": 192}, {"H": 160, "W": 224}),
             "PicoDet-style layout detector at opset 11: 40 hard-swish chains as Paddle writes them (Add, "
             "Clip with min/max inputs, Mul, Div), depthwise-separable convs, FPN with nearest Resize by "
             "scales, Sigmoid/ReLU heads, Flatten and Concat of three levels", ["scores", "boxes"]),
        Spec("encoder4_plain_dyn18", lambda: liven(wild.PlainEncoder(), 18), "dynamo", 18,
             {"x": ("normal", ("batch", "seq", 64), "float32")}, ({"batch": 1, "seq": 32}, {"batch": 2, "seq": 19}),
             "plain nn.TransformerEncoder, 4 layers, d 64, 4 heads, ReLU, free batch and length through the "
             "dynamo exporter (the TorchScript exporter bakes the length into MultiheadAttention's Reshape); "
             "d 64, not 256: 4 layers at d 256 are 4 MB of weights", ["y"]),
        Spec("bytes_int32_dyn20", lambda: liven(wild.ByteClassifier(), 19), "dynamo", 20,
             {"data": ("ids", ("batch", "length"), "int32"), "valid": ("mask", ("batch", "length"), "bool")},
             ({"batch": 1, "length": 512}, {"batch": 3, "length": 300}),
             "byte-level file classifier: Gather of an Embedding by int32 bytes, a bool validity mask "
             "(Cast, Mul), gated strided Conv1d (Sigmoid, Mul), ReduceMax over the free length, MLP",
             ["logits"], vocab=256),
    ]


# ---------------------------------------------------------------- the full tier

def full_specs() -> dict[str, Spec]:
    """The full tier (issue 27): the seven wild models and five of the others at the sizes the
    models users brought have, each its small twin's module, exporter, opset and outputs with size
    parameters, its first size the wild model's. Too large for the repository (1-30 MB a file):
    `--tier full` writes them to FULL_OUT."""
    small = specs()

    def twin(name: str, build: Callable[[], nn.Module], sizes: tuple[dict[str, int], dict[str, int]],
             exercises: str, **changes: Any) -> Spec:
        return replace(small[name], build=build, sizes=sizes, exercises=exercises, **changes)

    at224 = ({"N": 1, "H": 224, "W": 224}, {"N": 2, "H": 192, "W": 160})
    seq = ({"batch": 1, "seq": 64}, {"batch": 2, "seq": 37})
    s = [
        twin("mobilenet_dw_ts13", lambda: liven(MobileNetish(width=2, classes=1000), 1), at224,
             "the small MobileNet twice as wide (32-64 channels), 1000 classes, at 224x224 (260 MMAC, "
             "MobileNetV2's 300)"),
        twin("resnet_basic_dyn21", lambda: liven(ResNetish(width=4, classes=1000), 2), at224,
             "the small ResNet 4x as wide (64 and 128 channels: ResNet-18's first two stages), 1000 "
             "classes, at 224x224"),
        twin("unet_resize_dyn20", lambda: liven(UNetish(width=2), 3),
             ({"N": 1, "H": 256, "W": 256}, {"N": 2, "H": 192, "W": 128}),
             "the small U-Net twice as wide (16 and 32 channels) at 256x256"),
        twin("lstm_bi2_ts14", lambda: liven(LSTMTagger(64, 128, 32), 5),
             ({"batch": 1, "seq": 100}, {"batch": 2, "seq": 57}),
             "2-layer bidirectional LSTM, 64 features, hidden 128, over 100 steps",
             inputs={"x": ("normal", ("batch", "seq", 64), "float32"),
                     "h0": ("normal", (4, "batch", 128), "float32"), "c0": ("normal", (4, "batch", 128), "float32")}),
        twin("gpt_causal_ts15", lambda: liven(GPT(False, vocab=1024, d=256, heads=4, layers=4, max_len=128), 8).tie(),
             seq, "the GPT at d 256, 4 layers, 4 heads, vocabulary 1024, 64 tokens", vocab=1024),
        *full_wild_specs(small),
    ]
    return {spec.name: spec for spec in s}


def full_wild_specs(small: dict[str, Spec]) -> list[Spec]:
    """The seven wild patterns at the sizes issue 27's models had."""
    return [
        replace(small["crnn_paddle_ts12"], build=lambda: liven(wild.CRNNRecognizer(6625, (32, 64, 96, 128), 96), 13),
                sizes=({"N": 1, "W": 320}, {"N": 2, "W": 256}),
                exercises="the CRNN recognizer at a PP-OCR line's 32x320, 32-128 channels, LSTM hidden 96, "
                          "6625 classes (PP-OCR's Chinese dictionary)"),
        replace(small["char_tagger_ts14"], build=lambda: liven(wild.CharTagger(300, 64, 7, 9, 512), 14),
                sizes=({"batch": 1, "seq": 128}, {"batch": 2, "seq": 77}), vocab=300,
                exercises="the character tagger at d 64, 7 layers (about 680 nodes, as the wild one), 128 characters"),
        replace(small["vad_lstm_if_ts16"],
                build=lambda: torch.jit.script(liven(wild.LstmVad(128, (258, 256), 128), 15)),
                inputs={**small["vad_lstm_if_ts16"].inputs, "state": ("normal", (2, "batch", 128), "float32")},
                exercises="the VAD at Silero's widths: a 258-channel STFT-sized front end (kernel 256), "
                          "128-channel encoder, LSTM state 128, one 36 ms chunk"),
        replace(small["yolo_v8_ts17"],
                build=lambda: liven(wild.YoloV8ish(80, 16, (16, 32, 64, 128, 256), (64, 80)), 16),
                sizes=({"H": 320, "W": 320}, {"H": 256, "W": 320}),
                exercises="the YOLOv8 detector at YOLOv8n's widths (16-256 channels, three levels, 16 bins, "
                          "80 classes) at 320x320"),
        replace(small["layout_hswish_ts11"], build=lambda: liven(wild.LayoutDetector(5, 3, 5), 17),
                sizes=({"H": 800, "W": 608}, {"H": 640, "W": 480}),
                exercises="the layout detector 3x as wide (48-192 channels), 5 blocks at stride 16, at 800x608"),
        replace(small["encoder4_plain_dyn18"], build=lambda: liven(wild.PlainEncoder(256, 1024, 4), 18),
                inputs={"x": ("normal", ("batch", "seq", 256), "float32")},
                sizes=({"batch": 1, "seq": 32}, {"batch": 2, "seq": 19}),
                exercises="the plain nn.TransformerEncoder at d 256 (feed-forward 1024, 4 heads, 4 layers), 32 steps"),
        replace(small["bytes_int32_dyn20"], build=lambda: liven(wild.ByteClassifier(8, 128, 6, 32, 64), 19),
                sizes=({"batch": 1, "length": 16384}, {"batch": 2, "length": 9000}),
                exercises="the byte classifier over 16 KB: 128-channel gated Conv1d (kernel 32, stride 16), MLP 64"),
    ]

