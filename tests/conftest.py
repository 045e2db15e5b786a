"""Suite-wide setup.

`tracemalloc` is imported here, before any test starts threads: pytest's unraisable-exception hook
imports it lazily, and when several gRPC threads report unraisable objects at once (channels torn
down after a TLS handshake failure), the second sees a partially initialised module and the hook
itself crashes, failing an unrelated test (seen in tests/collector/test_auth.py).
"""

import tracemalloc  # noqa: F401

# hypothesis' pytest plugin imports hypothesis at the end of a session that collected no
# hypothesis test; on CPython 3.11.7 that import, deep in pytest's summary hooks, can fail with
# "SystemError: AST constructor recursion depth mismatch" (assertion rewriting compiles it there)
# and turn a green run into exit 1. Importing it up front avoids the deep-stack compile.
import hypothesis  # noqa: E402, F401
