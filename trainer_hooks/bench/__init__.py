"""Benchmarks and probes of the hooks alone (``tracetop bench commands``, ``tracetop bench hooks --ddp``); not
imported by the hooks themselves."""
