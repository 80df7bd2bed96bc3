"""Learning is real: SFT of every action-module family, PPO in one process, PPO and GRPO as service jobs.

One entry, three subcommands, each a helper module with its own options (``run.py <subcommand> --help``):

* ``service``: PPO and GRPO tenants of one ``Nexus.local`` service trained at once through the public client
  (``service_rl.py``) -> ``service_rl.json`` and ``service_rl.png``;
* ``sft``: every action-module family's SFT in one process (``sft_families.py``) -> section ``sft_families`` of
  ``in_process.json``, ``sft_families.png``;
* ``ppo``: PPO with the OFT Gaussian head in one process, for a fixed CPU budget (``ppo_maniskill.py``) ->
  section ``ppo_<task>`` of ``in_process.json``.

    python experiments/rl_learning/run.py service --updates 100 --eval-every 20 --eval-episodes 32   # ~35 min
    python experiments/rl_learning/run.py sft --steps 1500 --eval-every 100                         # ~4 min
    python experiments/rl_learning/run.py ppo                                                       # 15 min
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULES = {"service": "service_rl", "sft": "sft_families", "ppo": "ppo_maniskill"}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in MODULES:
        print(__doc__)
        sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)
    name = MODULES[sys.argv[1]]
    sys.path.insert(0, str(HERE))
    module = importlib.import_module(name)
    sys.argv = [str(HERE / f"{name}.py"), *sys.argv[2:]]
    module.main()


if __name__ == "__main__":
    main()
