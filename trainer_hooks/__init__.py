"""In-process instrumentation for training loops: timers, recorders, integrations, emitter.

Never imports the collector, the agent, the TUI, duckdb or textual (checked by a test)."""
