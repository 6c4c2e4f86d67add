"""Spectral ops: DFT, STFT and MelWeightMatrix, through NumPy's FFT.

A signal's last axis is 1 (real) or 2 (real, imaginary); spectra always come out as pairs.
"""

from __future__ import annotations

import numpy as np

from backplane.backends.api.kernels import KernelTable
from backplane.frontends.onnx_types import onnx_to_numpy_dtype


def _complex(x):
    return x[..., 0] if x.shape[-1] == 1 else x[..., 0] + 1j * x[..., 1]


def _pairs(z):
    return np.stack([z.real, z.imag], axis=-1)


def dft(input, dft_length=None, axis=None, inverse=0, onesided=0):  # noqa: A002
    axis = -2 if axis is None else int(np.reshape(axis, -1)[0])
    axis = axis % input.ndim  # counts the trailing (real, imaginary) axis
    signal = _complex(input)
    if dft_length is not None:
        n = int(np.reshape(dft_length, -1)[0])
    else:  # a one-sided spectrum of n // 2 + 1 bins comes from n = 2 (bins - 1) samples
        n = 2 * (signal.shape[axis] - 1) if inverse and onesided else signal.shape[axis]
    if inverse and onesided:  # the real signal of a one-sided spectrum
        return (np.fft.irfft(signal, n, axis=axis)[..., None].astype(input.dtype),)
    if inverse:
        return (_pairs(np.fft.ifft(signal, n, axis=axis)).astype(input.dtype),)
    spectrum = np.fft.fft(signal, n, axis=axis)
    if onesided:
        spectrum = np.take(spectrum, np.arange(n // 2 + 1), axis=axis)
    return (_pairs(spectrum).astype(input.dtype),)


def dft_v17(input, dft_length=None, axis=1, inverse=0, onesided=0):  # noqa: A002
    return dft(input, dft_length, np.array(axis), inverse, onesided)


def stft(signal, frame_step, window=None, frame_length=None, onesided=1):
    # (B, L, 1 or 2) -> (B, frames, bins, 2): the spectrum of each windowed frame.
    x = _complex(signal)  # (B, L)
    if frame_length is not None:
        length = int(np.reshape(frame_length, -1)[0])
    else:
        length = len(window) if window is not None else x.shape[-1]
    step = int(np.reshape(frame_step, -1)[0])
    count = 1 + (x.shape[-1] - length) // step
    frames = np.stack([x[:, i * step:i * step + length] for i in range(count)], axis=1)
    if window is not None:
        frames = frames * window
    spectrum = np.fft.fft(frames, axis=-1)
    if onesided:
        spectrum = spectrum[..., :length // 2 + 1]
    return (_pairs(spectrum).astype(signal.dtype),)


def mel_weight_matrix(num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz,
                      output_datatype=1):
    # (dft_length // 2 + 1, num_mel_bins): mel bin i is a triangle over the DFT bins, rising from
    # point i to point i + 1 and falling to point i + 2 of num_mel_bins + 2 points spaced evenly on
    # the mel scale (the arithmetic follows the spec's reference, types included).
    bins, n_fft = int(num_mel_bins), int(dft_length)
    low_mel = 2595 * np.log1p(lower_edge_hertz / 700) / np.log(10)
    high_mel = 2595 * np.log1p(upper_edge_hertz / 700) / np.log(10)
    mels = np.arange(bins + 2) * ((high_mel - low_mel) / (bins + 2)) + low_mel
    hertz = 700 * np.expm1(mels / 2595 * np.log(10))
    points = (((n_fft + 1) * hertz) // sample_rate).astype(int)
    weights = np.zeros((n_fft // 2 + 1, bins))
    for i, (left, centre, right) in enumerate(zip(points, points[1:], points[2:])):
        if centre == left:
            weights[centre, i] = 1
        else:
            rising = np.arange(left, centre + 1)
            weights[rising, i] = (rising - left) / (centre - left)
        if right > centre:
            falling = np.arange(centre, right)
            weights[falling, i] = (right - falling) / (right - centre)
    return (weights.astype(onnx_to_numpy_dtype(output_datatype)),)


KERNELS: KernelTable = {
    "DFT": {17: dft_v17, 20: dft},
    "STFT": {17: stft},
    "MelWeightMatrix": {17: mel_weight_matrix},
}
