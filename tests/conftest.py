"""Suite-wide setup.

`tracemalloc` is imported here, before any test starts threads: pytest's unraisable-exception hook
imports it lazily, and when several gRPC threads report unraisable objects at once (channels torn
down after a TLS handshake failure), the second sees a partially initialised module and the hook
itself crashes, failing an unrelated test (seen in tests/collector/test_auth.py).
"""

import tracemalloc  # noqa: F401
