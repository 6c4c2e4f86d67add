"""The corpus's control-flow and detection architectures (scripts/export_corpus.py exports them):
torch.cond and a scripted loop; YOLO-style heads with NonMaxSuppression as the TorchScript and the
dynamo exporters write it."""
from __future__ import annotations

import torch
from torch import nn

from corpus_modules import conv_bn

# ---------------------------------------------------------------- control flow

class CondNet(nn.Module):
    """torch.cond on a data-dependent predicate (the mean of a projection), a nested torch.cond in
    the true branch; branches hold their own Linear layers. The dynamo exporter writes If nodes."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.a1, self.a2, self.b1, self.c1 = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x):
        h = self.proj(x)

        def inner_true(z):
            return self.a2(torch.relu(self.a1(z)))

        def inner_false(z):
            return torch.sigmoid(self.c1(z)) - 0.5

        def true_branch(z):
            return torch.cond(z.max() > 2.0, inner_true, inner_false, (z,))

        def false_branch(z):
            return torch.tanh(self.b1(z)) * 2.0

        return torch.cond(h.mean() > 0, true_branch, false_branch, (h,))


class ScriptedLoop(nn.Module):
    """A recurrence written as a Python loop over the sequence and scripted (torch.jit.script): the
    TorchScript exporter writes a Loop whose body appends each step to a list (SequenceInsert,
    ConcatFromSequence), then a data-dependent while loop (a Loop with a condition)."""

    def __init__(self):
        super().__init__()
        self.ih = nn.Linear(12, 16)
        self.hh = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.zeros(x.size(0), 16, dtype=x.dtype)
        steps: list[torch.Tensor] = []
        for t in range(x.size(1)):
            h = torch.tanh(self.ih(x[:, t]) + self.hh(h))
            steps.append(self.out(h))
        y = torch.stack(steps, 1)
        n = torch.zeros(1, dtype=torch.long)
        while bool(h.abs().max() > 0.1) and int(n[0]) < 6:
            h = h * 0.5
            n = n + 1
        return y, h, n


# ---------------------------------------------------------------- detection

def grid_decode(p: torch.Tensor, anchors: torch.Tensor, stride: float) -> tuple[torch.Tensor, torch.Tensor]:
    """YOLO's head: (N, A*(5+C), H, W) -> dynamic Reshape to (N, A, 5+C, H, W), permute, sigmoid,
    a grid from arange(H) x arange(W), xywh -> xyxy. Returns boxes (N, A*H*W, 4), scores (N, A*H*W, C)."""
    n, _, h, w = p.shape
    a = anchors.shape[0]
    p = p.reshape(n, a, -1, h, w).permute(0, 1, 3, 4, 2).sigmoid()      # (N, A, H, W, 5+C)
    gy, gx = torch.meshgrid(torch.arange(h, dtype=p.dtype), torch.arange(w, dtype=p.dtype), indexing="ij")
    grid = torch.stack((gx, gy), -1).view(1, 1, h, w, 2)
    xy = (p[..., 0:2] * 2.0 - 0.5 + grid) * stride
    wh = (p[..., 2:4] * 2.0) ** 2 * anchors.view(1, a, 1, 1, 2)
    boxes = torch.cat((xy - wh / 2, xy + wh / 2), -1).reshape(n, -1, 4)
    scores = (p[..., 5:] * p[..., 4:5]).reshape(n, boxes.shape[1], -1)
    return boxes, scores


class DetectorBody(nn.Module):
    def __init__(self, classes: int = 3):
        super().__init__()
        self.backbone = nn.Sequential(conv_bn(3, 16, 3, 2, act=nn.SiLU), conv_bn(16, 24, 3, 2, act=nn.SiLU),
                                      conv_bn(24, 24, 3, 1, groups=24, act=nn.SiLU))
        self.detect = nn.Conv2d(24, 3 * (5 + classes), 1)
        self.register_buffer("anchors", torch.tensor([[10.0, 13.0], [16.0, 30.0], [33.0, 23.0]]))

    def candidates(self, x):
        return grid_decode(self.detect(self.backbone(x)), self.anchors, 4.0)


def _nms_reference(boxes: torch.Tensor, scores: torch.Tensor, iou: float, score_thr: float,
                   max_out: int) -> torch.Tensor:
    """Greedy NMS per batch and class, as ONNX's NonMaxSuppression (corner boxes): [K, 3] indices."""
    out = []
    for b in range(boxes.shape[0]):
        bx = boxes[b]
        x1, y1 = torch.minimum(bx[:, 0], bx[:, 2]), torch.minimum(bx[:, 1], bx[:, 3])
        x2, y2 = torch.maximum(bx[:, 0], bx[:, 2]), torch.maximum(bx[:, 1], bx[:, 3])
        area = (x2 - x1) * (y2 - y1)
        for c in range(scores.shape[1]):
            s = scores[b, c]
            order = [int(i) for i in torch.argsort(s, descending=True, stable=True) if s[i] > score_thr]
            kept: list[int] = []
            for i in order:
                if len(kept) >= max_out:
                    break
                ok = True
                for j in kept:
                    iw = (torch.minimum(x2[i], x2[j]) - torch.maximum(x1[i], x1[j])).clamp(min=0)
                    ih = (torch.minimum(y2[i], y2[j]) - torch.maximum(y1[i], y1[j])).clamp(min=0)
                    inter = iw * ih
                    if inter / (area[i] + area[j] - inter) > iou:
                        ok = False
                        break
                if ok:
                    kept.append(i)
            out += [[b, c, i] for i in kept]
    return torch.tensor(out, dtype=torch.long).reshape(-1, 3)


class _NonMaxSuppression(torch.autograd.Function):
    """How detection repositories (YOLOv5, mmdet) export NMS with the TorchScript exporter: an
    autograd.Function whose symbolic writes ONNX's NonMaxSuppression."""

    @staticmethod
    def forward(ctx, boxes, scores, max_out: int, iou: float, score_thr: float):  # noqa: ARG004
        return _nms_reference(boxes, scores, iou, score_thr, max_out)

    @staticmethod
    def symbolic(g, boxes, scores, max_out: int, iou: float, score_thr: float):
        return g.op("NonMaxSuppression", boxes, scores,
                    g.op("Constant", value_t=torch.tensor([max_out], dtype=torch.long)),
                    g.op("Constant", value_t=torch.tensor([iou], dtype=torch.float)),
                    g.op("Constant", value_t=torch.tensor([score_thr], dtype=torch.float)),
                    center_point_box_i=0)


class DetectNMSTorchScript(DetectorBody):
    """Backbone, YOLO head, TopK of the best 32 candidates per image (k fixed), GatherElements of
    their boxes and class scores, multi-class batched NonMaxSuppression, then the selected
    (batch, class, box) triples gather boxes (flattened, dynamic Reshape + Gather) and scores."""

    def forward(self, x):
        boxes, scores = self.candidates(x)                       # (N, M, 4), (N, M, C)
        best, _ = scores.max(-1)
        _, idx = best.topk(32, dim=1)                             # (N, 32)
        boxes = boxes.gather(1, idx.unsqueeze(-1).expand(-1, -1, 4))
        scores = scores.gather(1, idx.unsqueeze(-1).expand(-1, -1, scores.shape[-1])).transpose(1, 2)
        sel = _NonMaxSuppression.apply(boxes, scores, 20, 0.45, 0.25)  # (K, 3) int64
        k = boxes.shape[1]
        flat = sel[:, 0] * k + sel[:, 2]
        det_boxes = boxes.reshape(-1, 4)[flat]
        det_scores = scores.reshape(-1)[(sel[:, 0] * scores.shape[1] + sel[:, 1]) * k + sel[:, 2]]
        return sel, det_boxes, det_scores


@torch.library.custom_op("corpus::nms", mutates_args=())
def corpus_nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """torchvision.ops.nms's contract (boxes (M, 4) x1y1x2y2, scores (M,), kept indices by score)."""
    return _nms_reference(boxes[None], scores[None, None], iou_threshold, float("-inf"), 1 << 30)[:, 2]


@corpus_nms.register_fake
def _(boxes, scores, iou_threshold):  # noqa: ARG001
    return boxes.new_empty((torch.library.get_ctx().new_dynamic_size(),), dtype=torch.long)


def corpus_nms_onnx(boxes, scores, iou_threshold: float):
    """The dynamo exporter's translation, as onnxscript's torchlib writes torchvision::nms."""
    from onnxscript import opset18 as op
    sel = op.NonMaxSuppression(op.Unsqueeze(boxes, [0]), op.Unsqueeze(scores, [0, 1]),
                               op.Constant(value_ints=[0x7FFFFFFFFFFFFFFF]),
                               op.Constant(value_floats=[iou_threshold]))
    return op.Reshape(op.Slice(sel, [2], [3], [1]), [-1])


class DetectNMSDynamo(DetectorBody):
    """One image, torchvision's detection post-process: TopK of min(64, candidates) by best class
    score (k from the free height and width), score threshold, class-offset boxes (batched_nms's
    trick), torchvision-style nms (a custom op translated to NonMaxSuppression), boxes, scores and
    labels of the kept gathered by index."""

    def forward(self, x):
        boxes, scores = self.candidates(x)
        boxes, scores = boxes[0], scores[0]                       # (M, 4), (M, C)
        best, labels = scores.max(-1)
        k = min(64, best.shape[0])
        top, idx = best.topk(k)
        boxes, labels = boxes[idx], labels[idx]
        offset = labels.to(boxes.dtype).unsqueeze(1) * (boxes.max() + 1.0)
        keep = corpus_nms(boxes + offset, top, 0.5)
        return boxes[keep], top[keep], labels[keep]
