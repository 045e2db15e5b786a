"""``python -m reference_trainer`` / ``torchrun ... -m reference_trainer``: one rank of a run."""

import sys

from reference_trainer.train import main

if __name__ == "__main__":
    sys.exit(main())
