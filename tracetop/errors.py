"""The one root of every error tracetop raises on purpose, and the conditions shared by packages.

Each package names its own conditions under :class:`TracetopError` (httpx's ``HTTPError`` tree):
``except TracetopError`` catches everything tracetop means to tell a user, and nothing it does not
(a bug stays a bug). A condition that also *is* a standard one keeps that base as well, so code that
caught ``ValueError`` or ``RuntimeError`` before the root existed still catches it:
``class LayoutError(TracetopError, ValueError)``.

The tree (each package's module defines its own leaves):

    TracetopError
    ├── ListenError            an address we cannot serve on (collector, agent relay)
    ├── wire:      BatchError, AuthSetupError, TransportError (Rejected, Unsupported, Disconnected)
    ├── core:      ServiceError (tracetop.procs)
    ├── agent:     NVMLUnavailable
    ├── collector: SchemaError, PostFileError (ExportError), QueryLimit, ReadOnlyViolation,
    │              SnapshotError, UnknownRun, MultiFileError, ReportError, RulesError, CostError,
    │              SettingsError, ControlError, ExportConfigError, SendError, OtlpUnavailable
    ├── hooks:     SetupError
    ├── tui:       SourceError
    └── trainer:   LayoutError, FaultSpecError, AdjustError, PlanError (reference_trainer)
"""

from __future__ import annotations


class TracetopError(Exception):
    """Something tracetop refuses or cannot do, said so that a person can act on it."""


class ListenError(TracetopError, ValueError):
    """An address a server of ours cannot listen on: malformed, not loopback while the door is open,
    or taken by another process. The collector and the agent's relay raise it alike."""
