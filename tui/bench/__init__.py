"""The TUI's benchmarks, apart from the product: `tracetop bench tui` (render.py), `tracetop bench e2e`
(e2e.py), and the simulated large-run snapshots both use (sim.py)."""
