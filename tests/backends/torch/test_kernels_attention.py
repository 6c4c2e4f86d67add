"""Differential tests of the attention torch kernels (``kernels/attention.py``: Attention,
RotaryEmbedding, LinearAttention, CausalConvWithState) against CpuRef, over cases that hypothesis
generates, in the harness of ``differential.py``; then the node suite's single-op cases of each
op through CpuAcc, CpuRef. Float results agree within a tolerance of their type scaled by the
length of the products.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from backplane.backends.torch.kernels import attention  # noqa: E402
from tests.backends.torch.node_cases import case_names, check_case  # noqa: E402
from tests.backends.torch.differential import (  # noqa: E402
    BOOL,
    F16,
    F32,
    I64,
    SETTINGS,
    differential,
    place,
    run,
    tensor,
)


def _values(draw: Any, dtype: np.dtype, shape: list[int], low: float = -2, high: float = 2) \
        -> Any:
    return tensor(draw, dtype, shape, low=low, high=high, special=False)


@SETTINGS
@given(data=st.data())
def _attention(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from([F32, F32, F16]))
    batch, kv_heads = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    q_heads = kv_heads * draw(st.integers(1, 2))
    q_len, kv_len, past = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(0, 2))
    size, v_size = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    three_d = draw(st.booleans())
    attrs: dict[str, Any] = {}
    if three_d:
        attrs.update(q_num_heads=q_heads, kv_num_heads=kv_heads)
        shapes = ([batch, q_len, q_heads * size], [batch, kv_len, kv_heads * size],
                  [batch, kv_len, kv_heads * v_size])
    else:
        shapes = ([batch, q_heads, q_len, size], [batch, kv_heads, kv_len, size],
                  [batch, kv_heads, kv_len, v_size])
    args: list[Any] = [_values(draw, dtype, s) for s in shapes]
    total = kv_len + past
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    mask_width = draw(st.sampled_from([total, total, kv_len]))
    if mask_kind == "bool":
        args.append(tensor(draw, BOOL, [q_len, mask_width]))
    elif mask_kind == "float":
        args.append(_values(draw, dtype, [q_len, mask_width]))
    else:
        args.append(None)
    if past:
        args += [_values(draw, dtype, [batch, kv_heads, past, size]),
                 _values(draw, dtype, [batch, kv_heads, past, v_size])]
    if draw(st.booleans()):
        attrs["is_causal"] = 1
    if draw(st.booleans()):
        attrs["scale"] = draw(st.sampled_from([0.5, 0.1, 2.0]))
    if draw(st.booleans()):
        attrs["softcap"] = draw(st.sampled_from([1.0, 5.0]))
    if dtype == F16 and draw(st.booleans()):
        attrs["softmax_precision"] = 1  # float32
    n_outputs = 1 + 2 * bool(past) if not draw(st.booleans()) else 4 if past else 1
    if n_outputs == 4:
        attrs["qk_matmul_output_mode"] = draw(st.integers(0, 3))
    differential(op, args, attrs, opset=23, n_outputs=n_outputs, tol=8 * (size + total))


def test_attention() -> None:
    run(_attention, "Attention")


@SETTINGS
@given(data=st.data())
def _rotary(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from([F32, F16]))
    batch, seq, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 2))
    head_size = 2 * draw(st.integers(1, 3))
    dim = draw(st.sampled_from([head_size, 2 * draw(st.integers(1, head_size // 2))]))
    attrs: dict[str, Any] = {"interleaved": draw(st.sampled_from([0, 1]))}
    if dim != head_size:
        attrs["rotary_embedding_dim"] = dim
    if draw(st.booleans()):
        attrs["num_heads"] = heads
        x = _values(draw, dtype, [batch, seq, heads * head_size])
    else:
        x = _values(draw, dtype, [batch, heads, seq, head_size])
    if draw(st.booleans()):
        positions = draw(st.integers(seq, 6))
        cos, sin = (_values(draw, dtype, [positions, dim // 2], -1, 1) for _ in range(2))
        ids = np.array([[draw(st.integers(0, positions - 1)) for _ in range(seq)]
                        for _ in range(batch)], I64)
        args = [x, cos, sin, place(ids)]
    else:
        cos, sin = (_values(draw, dtype, [batch, seq, dim // 2], -1, 1) for _ in range(2))
        args = [x, cos, sin]
    differential(op, args, attrs, opset=23, tol=4)


def test_rotary_embedding() -> None:
    run(_rotary, "RotaryEmbedding")


RULES = {"linear": (False, False), "gated": (True, False), "delta": (False, True),
         "gated_delta": (True, True)}


@SETTINGS
@given(data=st.data())
def _linear_attention(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from([F32, F16]))
    batch, steps, kv_heads = draw(st.integers(1, 2)), draw(st.integers(0, 3)), draw(st.integers(1, 2))
    q_heads = kv_heads * draw(st.integers(1, 2))
    d_k, d_v = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    rule = draw(st.sampled_from(sorted(RULES)))
    attrs = {"q_num_heads": q_heads, "kv_num_heads": kv_heads, "update_rule": rule}
    if draw(st.booleans()):
        attrs["scale"] = draw(st.sampled_from([0.5, 2.0]))
    args: list[Any] = [_values(draw, dtype, [batch, steps, q_heads * d_k], -1, 1),
                       _values(draw, dtype, [batch, steps, kv_heads * d_k], -1, 1),
                       _values(draw, dtype, [batch, steps, kv_heads * d_v], -1, 1)]
    args.append(_values(draw, dtype, [batch, kv_heads, d_k, d_v], -1, 1)
                if draw(st.booleans()) else None)
    gated, delta = RULES[rule]
    decay_width = draw(st.sampled_from([kv_heads, kv_heads * d_k]))
    args.append(_values(draw, dtype, [batch, steps, decay_width], -1, 0) if gated else None)
    beta_width = draw(st.sampled_from([kv_heads, 1]))
    args.append(_values(draw, dtype, [batch, steps, beta_width], 0, 1) if delta else None)
    while args[-1] is None:
        args.pop()
    differential(op, args, attrs, opset=27, n_outputs=draw(st.integers(1, 2)),
                 tol=8 * (steps + d_k + 1))


def test_linear_attention() -> None:
    run(_linear_attention, "LinearAttention")


@SETTINGS
@given(data=st.data())
def _causal_conv(op: str, data: Any) -> None:
    draw = data.draw
    dtype = draw(st.sampled_from([F32, F16]))
    batch, channels, steps, taps = (draw(st.integers(1, 3)) for _ in range(4))
    args: list[Any] = [_values(draw, dtype, [batch, channels, steps]),
                       _values(draw, dtype, [channels, 1, taps])]
    args.append(_values(draw, dtype, [channels]) if draw(st.booleans()) else None)
    args.append(_values(draw, dtype, [batch, channels, taps - 1]) if draw(st.booleans()) else None)
    while args[-1] is None:
        args.pop()
    attrs = {"activation": draw(st.sampled_from(["none", "silu", "swish"]))}
    differential(op, args, attrs, opset=27, n_outputs=draw(st.integers(1, 2)), tol=4 * taps)


def test_causal_conv_with_state() -> None:
    run(_causal_conv, "CausalConvWithState")


OPS = ("Attention", "RotaryEmbedding", "LinearAttention", "CausalConvWithState")


@pytest.mark.parametrize("name", case_names(OPS))
def test_node_case(name: str) -> None:
    check_case(name)


def test_every_op_has_node_cases() -> None:
    assert [op for op in OPS if not case_names((op,))] == []


def test_every_attention_kernel_is_covered() -> None:
    assert sorted(set(attention.KERNELS) - set(OPS)) == []
