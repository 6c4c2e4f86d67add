"""Whether ONNX Runtime's int8 products are exact on this CPU, and a model whose are, for the tests
that hold backplane to ONNX Runtime's quantized ops.

Without VNNI (AVX2, or AVX-512 without it) ONNX Runtime's u8 x s8 kernels (MLAS's VPMADDUBSW) add
pairs of products in 16 bits and saturate (255 * 127 * 2 > 32767), as its quantization guide says
(``reduce_range`` exists for it); its u8 x u8 kernels widen to 16 bits first and are exact. CpuRef
is exact on every CPU, so where ONNX Runtime saturates a test compares with the same model's int8
weights moved to uint8 (``with_uint8_weights``: w + 128 against a zero point + 128, the same
integers after the zero points are taken off), which ONNX Runtime multiplies exactly."""

from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

NO_VNNI = ("this CPU has no VNNI: ONNX Runtime's u8 x s8 products saturate in 16 bits "
           "(VPMADDUBSW), so its int8 results are not the exact ones")

WEIGHTS = {
    # op: (weight input, its zero point input) pairs, ONNX Runtime's contrib schemas
    "MatMulInteger": [(1, 3)],
    "MatMulIntegerToFloat": [(1, 5)],
    "DynamicQuantizeMatMul": [(1, 3)],
    "DynamicQuantizeLSTM": [(1, 9), (2, 11)],
    "QAttention": [(1, 7)],
    "QLinearMatMul": [(3, 5)],
}
"""The ops whose int8 weight ``with_uint8_weights`` moves to uint8 (not QGemm: ONNX Runtime has
it for an int8 B only)."""


def _probe(weight_type: int, weight: int) -> bool:
    import onnxruntime as ort

    dtype = helper.tensor_dtype_to_np_dtype(weight_type)
    b = helper.make_tensor("b", weight_type, [64, 8], np.full(64 * 8, weight, dtype))
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "probe",
        [helper.make_tensor_value_info("a", TensorProto.UINT8, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [2, 8])], [b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = session.run(None, {"a": np.full((2, 64), 255, np.uint8)})
    return bool((y == 64 * 255 * weight).all())


@functools.cache
def ort_int8_exact() -> bool:
    """Whether ONNX Runtime's MatMulInteger of uint8 255s by int8 127s over 64 sums exactly
    (2,072,640; it gives 1,048,544, 32 pairs of 32,767, where it saturates), probed once."""
    return _probe(TensorProto.INT8, 127)


@functools.cache
def ort_uint8_exact() -> bool:
    """The same probe of uint8 255s by uint8 255s (ONNX Runtime's u8 x u8 kernels)."""
    return _probe(TensorProto.UINT8, 255)


def with_uint8_weights(model: onnx.ModelProto, feeds: dict[str, np.ndarray] | None = None,
                       ops: dict[str, list[tuple[int, int]]] | None = None) -> onnx.ModelProto:
    """A copy of ``model`` whose int8 weights (and their zero points) of the ``WEIGHTS`` ops read
    by uint8 or float activations are uint8, 128 above: the same integer products, exact in ONNX
    Runtime where its u8 x s8 ones saturate. A weight fed at run time (in ``feeds``) is moved
    there. ``ops``: the ops and their (weight, zero point) inputs, ``WEIGHTS`` by default."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    types = {v.name: v.type.tensor_type.elem_type for v in graph.input}
    types.update({t.name: t.data_type for t in graph.initializer})
    moved: set[str] = set()

    def shift(name: str) -> str:
        if name in moved:
            return name
        if name in inits:
            value = numpy_helper.to_array(inits[name])
            shifted = (value.astype(np.int16) + 128).astype(np.uint8)
            inits[name].CopyFrom(numpy_helper.from_array(shifted, name))
        else:
            feeds[name] = (feeds[name].astype(np.int16) + 128).astype(np.uint8)
            for v in graph.input:
                if v.name == name:
                    v.type.tensor_type.elem_type = TensorProto.UINT8
        moved.add(name)
        return name

    for node in graph.node:
        pairs = (WEIGHTS if ops is None else ops).get(node.op_type, [])
        if not pairs or types.get(node.input[0]) == TensorProto.INT8:
            continue  # an int8 activation (float ones are quantized to uint8): no u8 x u8 product
        for w, zp in pairs:
            if types.get(node.input[w]) != TensorProto.INT8:
                continue
            shift(node.input[w])
            while len(node.input) <= zp:
                node.input.append("")
            if node.input[zp]:
                shift(node.input[zp])
            else:
                name = f"{node.input[w]}_uint8_zero_point"
                if name not in inits:
                    inits[name] = numpy_helper.from_array(np.array(128, np.uint8), name)
                    graph.initializer.append(inits[name])
                    moved.add(name)
                node.input[zp] = name
    return model


def with_uint8_steps(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of a QDQ ``model`` whose int8 steps are uint8, 128 above: every int8 zero point of
    a QuantizeLinear or DequantizeLinear (an initializer, a Constant, or an Identity's source)
    and every int8 initializer a DequantizeLinear reads. The same real values and the same
    integer products after the zero points are taken off, which ONNX Runtime then multiplies u8
    x u8, exactly, where its u8 x s8 products saturate (no VNNI)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    zeros = {n.input[2] for n in graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear")
             and len(n.input) > 2 and n.input[2]}
    zeros |= {n.input[0] for n in graph.node if n.op_type == "Identity" and n.output[0] in zeros}
    read = {n.input[0] for n in graph.node if n.op_type == "DequantizeLinear"}

    def shifted(tensor: onnx.TensorProto) -> onnx.TensorProto:
        value = numpy_helper.to_array(tensor).astype(np.int16) + 128
        return numpy_helper.from_array(value.astype(np.uint8), tensor.name)

    for name in zeros | read:
        if name in inits and inits[name].data_type == TensorProto.INT8:
            inits[name].CopyFrom(shifted(inits[name]))
    for node in graph.node:
        if node.op_type == "Constant" and node.output[0] in zeros \
                and node.attribute[0].t.data_type == TensorProto.INT8:
            node.attribute[0].t.CopyFrom(shifted(node.attribute[0].t))
    for value in (*graph.value_info, *graph.output):
        if value.type.tensor_type.elem_type == TensorProto.INT8:
            value.type.tensor_type.elem_type = TensorProto.UINT8
    return model
