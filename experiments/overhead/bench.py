"""What the service's own machinery costs: an idle service, Dask's worker environment, MLflow tracking.

One entry, three subcommands, each a helper module with its own options (``bench.py <subcommand> --help``);
each writes its section of ``results.json`` here:

* ``idle``: CPU of an idle ``Nexus.local`` service with the service's Dask settings vs Dask's defaults
  (``idle.py``; ``--each``: Dask's defaults with one service setting at a time, section ``idle_each``);
* ``malloc``: CPU a busy worker pays for Dask's nanny's ``MALLOC_TRIM_THRESHOLD_`` (``malloc.py``);
* ``tracking``: CPU of the MLflow tracker link and host, sending at once vs gathering calls (``tracking.py``).

    python experiments/overhead/bench.py idle        # ~3 min on 2 cores
    python experiments/overhead/bench.py malloc      # ~3 min
    python experiments/overhead/bench.py tracking    # ~2 min
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUBCOMMANDS = ("idle", "malloc", "tracking")


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in SUBCOMMANDS:
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    name = sys.argv[1]
    sys.path.insert(0, str(HERE))
    module = importlib.import_module(name)
    sys.argv = [str(HERE / f"{name}.py"), *sys.argv[2:]]  # malloc.py reruns its own file for each child
    module.main()


if __name__ == "__main__":
    main()
