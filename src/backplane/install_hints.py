"""What to install for an optional part, said so that it works from wherever the user is.

``backplane-nn`` is not on the package index (``backplane`` there is another project), so a hint
never names an extra of it: it names the third-party packages themselves, with the versions
pyproject.toml's extras ask for (tests/test_install_hints.py holds the two together). torch's hint
is PyTorch's own command for its CPU build: from the package index alone, pip brings the CUDA
build and its nvidia-* wheels (several GB) even on a machine without a GPU.
"""

from __future__ import annotations

TORCH_CPU = "pip install torch --index-url https://download.pytorch.org/whl/cpu"

HINTS = {
    "torch": f"{TORCH_CPU} (the CPU build; with CUDA: pip install torch)",
    "openvino": "pip install 'openvino>=2024.0'",
    "ray": "pip install 'ray[data,serve]>=2.60'",
    "image": "pip install 'pillow>=9'",
}
"""Extra of pyproject.toml -> the command that installs what it adds."""


def hint(extra: str) -> str:
    """The install command for ``extra`` (a key of ``HINTS``)."""
    return HINTS[extra]
