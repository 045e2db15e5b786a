"""The node agent: NVML and host sampling, the local relay of hook events with a disk spool,
clock offset measurement, and a Prometheus endpoint."""
