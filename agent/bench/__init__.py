"""The agent's benchmarks, apart from the product: `tracetop bench agent` (cost.py) and the agent's
part of `tracetop bench gpu` (gpu.py, started as `python -m agent.bench.gpu`)."""
