"""``python -m backplane``: the ``backplane`` command (backplane.cli)."""

import sys

from backplane.cli import main

sys.exit(main())
