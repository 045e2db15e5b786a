"""``trainer_hooks.deepspeed.instrument(engine)``, the path the README shows users; the integration
lives in :mod:`trainer_hooks.integrations.deepspeed`."""

from trainer_hooks.integrations.deepspeed import AXIS_ROLES, instrument, topology_axes

__all__ = ["AXIS_ROLES", "instrument", "topology_axes"]
