"""How long torch's idle OpenMP threads spin: ``GOMP_SPINCOUNT``, set where no one else has.

torch's CPU kernels run their parallel regions on libgomp's threads, and at the end of a region
each idle thread spins before it sleeps: 300,000 spins by default, 3.6-5.4 ms of the other CPU
after a 2-thread convolution on this 2-core AMD EPYC. Between the layers of one run that spinning
makes the next region start at once; after the run's last region it is CPU taken from whatever
else runs on that core while the process waits for its next input, and on a busy machine the
spinning waiter holds the CPU its preempted partner needs. ``GOMP_SPINCOUNT=10000`` spins 0-0.3
ms: enough to span the gaps between a run's regions, not the idle time after it.

libgomp reads the variable once, when it is loaded (when torch is first imported), so it can
only be set before that: a torch backend's creation (``TorchBackend.__init__``, which imports
torch) calls ``prefer_short_spins`` first, which sets it where torch is not imported yet and
neither ``GOMP_SPINCOUNT`` nor ``OMP_WAIT_POLICY`` is set. A user's own setting of either, or a
torch imported before backplane's first torch backend, is left as it is (``GOMP_SPINCOUNT=300000``
brings libgomp's default back). The figures: docs/torch-backends.md, "Busy machines".
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SPINCOUNT = "10000"
"""libgomp's spins before an idle thread sleeps, where backplane sets them (300,000 unset)."""


def prefer_short_spins(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``GOMP_SPINCOUNT`` to ``SPINCOUNT`` in ``environ`` (the process's) where torch is not
    imported and no OpenMP wait setting is given; whether it did."""
    environ = os.environ if environ is None else environ
    if "torch" in sys.modules or "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = SPINCOUNT
    return True
