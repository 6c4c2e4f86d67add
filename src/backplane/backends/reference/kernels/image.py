"""ImageDecoder: encoded bytes (BMP, JPEG, JPEG 2000, PNG, PNM, TIFF, WebP) to an (H, W, C) uint8 image.

Decoding is Pillow's, the library the field uses; without it the op is refused with that reason.
"""

from __future__ import annotations

import importlib.util
import io
from collections.abc import Sequence

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.install_hints import hint
from backplane.ir.graph import Layer, TensorInfo

MODES = {"RGB": "RGB", "BGR": "RGB", "Grayscale": "L"}  # ONNX pixel_format -> Pillow's mode


def image_decoder(encoded_stream, pixel_format="RGB"):
    from PIL import Image

    with Image.open(io.BytesIO(np.asarray(encoded_stream, np.uint8).tobytes())) as image:
        pixels = np.asarray(image.convert(MODES[pixel_format]), dtype=np.uint8)
    if pixel_format == "Grayscale":
        return (pixels[:, :, np.newaxis],)
    return (np.ascontiguousarray(pixels[:, :, ::-1]) if pixel_format == "BGR" else pixels,)


def check_image_decoder(layer: Layer, inputs: Sequence[TensorInfo]) -> str | None:
    if importlib.util.find_spec("PIL") is None:
        return f"ImageDecoder needs Pillow ({hint('image')})"
    pixel_format = layer.attrs.get("pixel_format", "RGB")
    if pixel_format not in MODES:
        return f"pixel_format {pixel_format!r} not known (known: {', '.join(MODES)})"
    return None


KERNELS: KernelTable = {"ImageDecoder": {20: image_decoder}}
CHECKS = {"ImageDecoder": check_image_decoder}
