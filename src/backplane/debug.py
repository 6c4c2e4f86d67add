"""One debug knob by level (BACKPLANE_DEBUG): 1 prints the placement plan, 2 also every layer as it runs."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich at the first debug print: every optimize reads the level (import cost)
    from rich.console import Console


def level() -> int:
    try:
        return int(os.environ.get("BACKPLANE_DEBUG", "0") or 0)
    except ValueError:
        return 0


def console() -> Console:
    from rich.console import Console

    return Console(file=sys.stderr, width=160)
