"""`python -m agent …` is `tracetop agent …`."""

import sys

from tracetop.cli import main

sys.exit(main(["agent", *sys.argv[1:]]))
