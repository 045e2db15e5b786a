"""``from trainer_hooks.lightning import TracetopCallback``, the path the README shows users; the
callback lives in :mod:`trainer_hooks.integrations.lightning`."""

from trainer_hooks.integrations.lightning import TracetopCallback

__all__ = ["TracetopCallback"]
