"""Export backplane's ONNX models from PyTorch: the demo model, the tiny test models, the anchors.

Usage (with a Python that has torch and torchvision; transformers for the BERT / GPT-2 models):
    python scripts/export_models.py                       # demo -> models/, tiny test models -> tests/data/
    python scripts/export_models.py --only tiny_bert      # just the named ones
    python scripts/export_models.py --anchors /tmp/anchors/models     # the anchor models (large)
    python scripts/export_models.py --anchors DIR --only resnet50 bert_base_s128
    python scripts/export_models.py --list                # every name and where it goes

Every model is a real architecture (torchvision, or transformers built from a Config) with random
weights from a fixed seed: nothing pretrained is ever downloaded. Every export is ONNX opset 17 with
static shapes (but tiny_gpt2_decode's free past length), batch 1 unless the name says otherwise, through the TorchScript exporter
(dynamo=False, which emits opset 17 natively) and the dynamo exporter only if that one fails.

The anchor builders repeat those of the project's yardstick (shared/tools/export_anchor_models.py):
same constructors in the same order, seed 0 set just before each build, same wrappers, names and
export settings, so `--anchors` writes the same models. Each tiny test model is written with an
`.npz` beside it holding one fixed input set, keyed by input name (`dict(np.load(path))` is a feed).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

OPSET = 17
SEQ = 128  # anchor sequence length
TINY_SEQ = 16  # tiny test models' sequence length
ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR = ROOT / "models"
TEST_DATA = ROOT / "tests" / "data"

# A builder returns (module, example args, input names, output names).
Built = tuple[torch.nn.Module, tuple[torch.Tensor, ...], list[str], list[str]]
Builder = Callable[[], Built]


# ---------------------------------------------------------------- wrappers (as in the yardstick)

class _Bert(torch.nn.Module):
    """Keyword-only call into BertModel (its positional signature changed across versions)."""

    def __init__(self, m: torch.nn.Module):
        super().__init__()
        self.m = m

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.m(input_ids=input_ids, attention_mask=attention_mask,
                      token_type_ids=token_type_ids, return_dict=False)[:2]


class _LogitsOnly(torch.nn.Module):
    """GPT-2 LM: input_ids -> logits. An explicit all-ones attention_mask keeps
    transformers off its packed-sequence detection (aten::diff, not exportable)."""

    def __init__(self, m: torch.nn.Module):
        super().__init__()
        self.m = m

    def forward(self, input_ids):
        mask = torch.ones_like(input_ids)
        return self.m(input_ids=input_ids, attention_mask=mask, use_cache=False,
                      return_dict=False)[0]


class _DecodeStep(torch.nn.Module):
    """GPT-2 LM, one decoding step with its key / value cache: (input_ids, attention_mask, past key
    and value of each layer) -> (logits, present key and value of each layer). The past length is a
    free dimension (``dynamic_axes``), as in every exported decoder that keeps its cache."""

    def __init__(self, m: torch.nn.Module, layers: int):
        super().__init__()
        self.m = m
        self.layers = layers

    def forward(self, input_ids, attention_mask, *past):
        from transformers.cache_utils import DynamicCache
        cache = DynamicCache()
        for i in range(self.layers):
            cache.update(past[2 * i], past[2 * i + 1], i)
        out = self.m(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache,
                     use_cache=True)
        present = []
        for layer in out.past_key_values.layers:
            present += [layer.keys, layer.values]
        return (out.logits, *present)


# ---------------------------------------------------------------- builders

def liven(m: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """Redraw the weights of a small model so that tests on it can see every kernel's mistakes.

    Library inits leave every bias and norm shift at 0, norm scales at 1 and BatchNorm statistics at
    (0, 1), so a kernel that drops them still passes; and a tiny MobileNet's logits come out near 1e-7.
    Here weights are N(0, 1/fan_in) (activations stay near unit scale) and biases, norm parameters
    and running statistics are random. Embeddings keep their init. Uses its own generator, so the
    global seed (and with it the example inputs) is untouched.
    """
    g = torch.Generator().manual_seed(seed)

    def normal(t: torch.Tensor, std: float, mean: float = 0.0) -> None:
        t.copy_(torch.randn(t.shape, generator=g) * std + mean)

    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, (torch.nn.Conv2d, torch.nn.Linear)):
                normal(mod.weight, mod.weight[0].numel() ** -0.5)
            elif type(mod).__name__ == "Conv1D":  # transformers' GPT-2 linear: weight is (in, out)
                normal(mod.weight, mod.weight.shape[0] ** -0.5)
            elif isinstance(mod, (torch.nn.BatchNorm2d, torch.nn.LayerNorm)):
                normal(mod.weight, 0.2, mean=1.0)
                if isinstance(mod, torch.nn.BatchNorm2d):
                    normal(mod.running_mean, 0.1)
                    mod.running_var.copy_(torch.rand(mod.running_var.shape, generator=g) + 0.5)
            else:
                continue
            if getattr(mod, "bias", None) is not None:
                normal(mod.bias, 0.1)
    return m


def cnn(ctor: Callable[..., torch.nn.Module], batch: int = 1, size: int = 224, live: bool = False,
        **kwargs: Any) -> Builder:
    """A torchvision classifier with random weights and a (batch, 3, size, size) input."""
    def build() -> Built:
        m = ctor(weights=None, **kwargs).eval()
        if live:
            liven(m)
        x = torch.randn(batch, 3, size, size)
        return m, (x,), ["input"], ["logits"]
    return build


def bert(seq: int = SEQ, live: bool = False, batch: int = 1, **config: Any) -> Builder:
    """BertModel from a BertConfig (eager attention); ids, mask of ones, token types of zeros."""
    def build() -> Built:
        from transformers import BertConfig, BertModel
        cfg = BertConfig(**config)
        cfg._attn_implementation = "eager"
        m = _Bert(BertModel(cfg).eval()).eval()
        if live:
            liven(m)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))
        mask = torch.ones(batch, seq, dtype=torch.long)
        tt = torch.zeros(batch, seq, dtype=torch.long)
        return m, (ids, mask, tt), ["input_ids", "attention_mask", "token_type_ids"], \
            ["last_hidden_state", "pooler_output"]
    return build


def gpt2(seq: int = SEQ, live: bool = False, batch: int = 1, **config: Any) -> Builder:
    """GPT2LMHeadModel from a GPT2Config (eager attention, no cache): input_ids -> logits."""
    def build() -> Built:
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(**config)
        cfg._attn_implementation = "eager"
        m = _LogitsOnly(GPT2LMHeadModel(cfg).eval()).eval()
        if live:
            liven(m)
        ids = torch.randint(0, cfg.vocab_size, (batch, seq))
        return m, (ids,), ["input_ids"], ["logits"]
    return build


def gpt2_decode(past: int, live: bool = False, **config: Any) -> Builder:
    """One decoding step of GPT2LMHeadModel with a cache of ``past`` positions (eager attention);
    the module carries the export's ``dynamic_axes`` (the past and total lengths)."""
    def build() -> Built:
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(**config)
        cfg._attn_implementation = "eager"
        layers, heads = cfg.n_layer, cfg.n_head
        m = _DecodeStep(GPT2LMHeadModel(cfg).eval(), layers).eval()
        if live:
            liven(m)
        ids = torch.randint(0, cfg.vocab_size, (1, 1))
        mask = torch.ones(1, past + 1, dtype=torch.long)
        cache = [torch.randn(1, heads, past, cfg.n_embd // heads) for _ in range(2 * layers)]
        names = ["input_ids", "attention_mask"] + [f"past_{kind}_{i}" for i in range(layers)
                                                   for kind in ("key", "value")]
        outs = ["logits"] + [f"present_{kind}_{i}" for i in range(layers) for kind in ("key", "value")]
        m.dynamic_axes = {"attention_mask": {1: "total"}, **{n: {2: "past"} for n in names[2:]},
                          **{n: {2: "total"} for n in outs[1:]}}
        return m, (ids, mask, *cache), names, outs
    return build


class _TorchVision:
    """torchvision.models, imported when one of its models is built: listing the models, and
    building transformers' ones, needs no torchvision (``backplane bench``'s eager column)."""

    def __getattr__(self, name: str) -> Callable[..., torch.nn.Module]:
        def ctor(**kwargs: Any) -> torch.nn.Module:
            import torchvision.models
            return getattr(torchvision.models, name)(**kwargs)
        return ctor


def anchors(batch: int = 1) -> dict[str, Builder]:
    """The yardstick's models, in its order, with its settings (at another batch where asked)."""
    tvm = _TorchVision()
    return {
        "resnet50": cnn(tvm.resnet50, batch=batch),
        "resnet50_b8": cnn(tvm.resnet50, batch=8),
        "mobilenet_v3_large": cnn(tvm.mobilenet_v3_large, batch=batch),
        "efficientnet_b0": cnn(tvm.efficientnet_b0, batch=batch),
        "bert_base_s128": bert(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                               intermediate_size=3072, max_position_embeddings=512, batch=batch),
        "gpt2_6l_512_s128": gpt2(n_layer=6, n_embd=512, n_head=8, n_positions=SEQ, use_cache=False,
                                 batch=batch),
    }


def small() -> dict[str, tuple[Path, Builder]]:
    """The committed models: name -> (directory, builder). Those in tests/data get an .npz."""
    tvm = _TorchVision()
    return {
        # The README's demo: MobileNetV2 at 0.2 width, 10 classes, one 224x224 image (< 1 MB).
        "mobilenet_v2_w020_c10": (DEMO_DIR, cnn(tvm.mobilenet_v2, live=True, width_mult=0.2,
                                                num_classes=10)),
        "tiny_bert": (TEST_DATA, bert(seq=TINY_SEQ, live=True, vocab_size=100, hidden_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=64, max_position_embeddings=TINY_SEQ)),
        # One decoding step with a cache of 6 positions (free past length).
        "tiny_gpt2_decode": (TEST_DATA, gpt2_decode(6, live=True, vocab_size=100, n_positions=32,
                                                    n_embd=32, n_layer=2, n_head=2,
                                                    bos_token_id=99, eos_token_id=99)),
        # bos / eos set inside the vocabulary: GPT-2's 50256 is not (transformers warns).
        "tiny_gpt2": (TEST_DATA, gpt2(seq=TINY_SEQ, live=True, vocab_size=100, n_positions=TINY_SEQ,
                                      n_embd=32, n_layer=2, n_head=2, use_cache=False,
                                      bos_token_id=99, eos_token_id=99)),
        "tiny_mobilenet_v3": (TEST_DATA, cnn(tvm.mobilenet_v3_small, size=64, live=True,
                                             width_mult=0.1, num_classes=10)),
    }


# ---------------------------------------------------------------- export

def export(name: str, build: Builder, out_dir: Path, save_inputs: bool = False) -> bool:
    """Build with seed 0 and export to out_dir/name.onnx; True on success (the error is printed)."""
    torch.manual_seed(0)
    m, args, in_names, out_names = build()
    path = out_dir / f"{name}.onnx"
    errors = []
    for dynamo in (False, True):
        try:
            t0 = time.perf_counter()
            with torch.inference_mode(False), torch.no_grad():
                torch.onnx.export(m, args, str(path), opset_version=OPSET, dynamo=dynamo,
                                  input_names=in_names, output_names=out_names,
                                  do_constant_folding=True,
                                  dynamic_axes=getattr(m, "dynamic_axes", None))
            summary = check(path)
            print(f"OK  {name}: dynamo={dynamo} {summary} ({time.perf_counter() - t0:.1f}s)")
            break
        except Exception as e:  # noqa: BLE001 - report, then try the other exporter
            errors.append(f"dynamo={dynamo}: {type(e).__name__}: {e}"[:2000])
            traceback.print_exc(limit=3)
    else:
        print(f"FAIL {name}:\n  " + "\n  ".join(errors))
        return False
    if save_inputs:
        feeds = test_inputs(name, args, in_names)
        np.savez(out_dir / f"{name}.npz", **feeds)
        if not runs_in_onnxruntime(path, feeds):
            return False
    return True


def check(path: Path) -> str:
    """onnx.checker on the file; returns a one-line summary (opset, nodes, size, op types)."""
    import onnx
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    opset = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    ops = sorted({n.op_type for n in model.graph.node})
    size = os.path.getsize(path)
    size_text = f"{size / 1e6:.1f}MB" if size > 1e6 else f"{size / 1e3:.0f}KB"
    return f"opset={opset} nodes={len(model.graph.node)} size={size_text} ops={','.join(ops)}"


def test_inputs(name: str, args: tuple[torch.Tensor, ...], in_names: list[str]) -> dict[str, np.ndarray]:
    """The fixed test feed: the example inputs of the export, except that the tiny BERT gets a
    padded mask (last 4 positions off) and a second segment, to exercise those paths."""
    feeds = {n: a.numpy().copy() for n, a in zip(in_names, args)}
    if name == "tiny_bert":
        feeds["attention_mask"][:, -4:] = 0
        feeds["token_type_ids"][:, TINY_SEQ // 2:] = 1
    return feeds


def runs_in_onnxruntime(path: Path, feeds: dict[str, np.ndarray]) -> bool:
    """Run the model once in onnxruntime on its saved feed; skipped (True) without onnxruntime."""
    try:
        import onnxruntime as ort
    except ImportError:
        print(f"    (onnxruntime not installed: {path.name} not run)")
        return True
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    outs = sess.run(None, feeds)
    finite = all(np.isfinite(o).all() for o in outs)
    shapes = ", ".join(f"{o.name}{list(v.shape)}" for o, v in zip(sess.get_outputs(), outs))
    print(f"    onnxruntime: {shapes}{'' if finite else '  NOT FINITE'}")
    return finite


# ---------------------------------------------------------------- command line

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--anchors", metavar="DIR", type=Path,
                    help="export the anchor models into DIR instead of the committed models")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="export only these models")
    ap.add_argument("--list", action="store_true", help="list the model names and exit")
    a = ap.parse_args()
    if a.anchors:
        jobs = {name: (a.anchors, build) for name, build in anchors().items()}
    else:
        jobs = small()
    if a.list:
        for name, (out_dir, _) in jobs.items():
            print(f"{name:24s} {out_dir}")
        return
    unknown = sorted(set(a.only or ()) - set(jobs))
    if unknown:
        sys.exit(f"Unknown model(s) {unknown}. Known models here are: {', '.join(jobs)}")
    ok = True
    for name, (out_dir, build) in jobs.items():
        if a.only and name not in a.only:
            continue
        out_dir.mkdir(parents=True, exist_ok=True)
        ok &= export(name, build, out_dir, save_inputs=out_dir == TEST_DATA)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
