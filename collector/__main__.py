"""`python -m collector ...` = `tracetop collector ...`."""

import sys

from tracetop.cli import main

sys.exit(main(["collector", *sys.argv[1:]]))
