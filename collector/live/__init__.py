"""Live judgments (DESIGN §9): live state fed after each commit, signals, rules, alerts, and the
records that leave this package (alerts, per-run gauges) for the exporters in collector/export."""
