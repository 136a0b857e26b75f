"""``python -m hsdp_tools``: the same command line as ``python -m hsdp``."""

import sys

from hsdp_tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
