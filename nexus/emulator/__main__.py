import sys

from nexus.emulator.cli import main

sys.exit(main())
