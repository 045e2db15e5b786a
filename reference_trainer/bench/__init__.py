"""Benchmarks of the hooks that drive the reference trainer (``tracetop bench hooks``, ``tracetop bench gpu``) and
its probes; not imported by the trainer itself."""
