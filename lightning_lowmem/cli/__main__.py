"""``python -m lightning_lowmem.cli``: the ``lowmem`` command."""

import sys

from lightning_lowmem.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
