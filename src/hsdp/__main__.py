"""``python -m hsdp``: the command line, which lives beside the library in ``hsdp_tools``.

Only running ``python -m hsdp`` loads this module; ``import hsdp`` never does, so the
library still imports no tool."""

import sys

from hsdp_tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
