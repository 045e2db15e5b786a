"""``from trainer_hooks.hf import TracetopCallback``, the path the README shows users; the callback
lives in :mod:`trainer_hooks.integrations.hf`."""

from trainer_hooks.integrations.hf import TracetopCallback

__all__ = ["TracetopCallback"]
