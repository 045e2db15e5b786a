"""``python -m reference_trainer`` / ``torchrun ... -m reference_trainer``: one rank of a run."""

import gc
import sys

from reference_trainer.train import main

if __name__ == "__main__":
    rc = main()
    # The run is over (its hooks closed, its checkpoint saved): the interpreter's last garbage
    # collection would walk every torch and DeepSpeed object for nothing, ~1 CPU-s a rank
    # (`tracetop bench close`, its "freeze" row). A user's own loop need not do this.
    gc.freeze()
    sys.exit(rc)
