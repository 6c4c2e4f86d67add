"""backplane's own C kernels (``build``: compiled once per machine, loaded with ``ctypes``), where
torch's cost per call is larger than the work: small recurrent steps, small convolutions."""

from backplane.native.build import NativeUnavailable, available, library

__all__ = ["NativeUnavailable", "available", "library"]
