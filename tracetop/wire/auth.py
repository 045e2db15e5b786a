"""Who may talk to a collector: bearer tokens and TLS, for the servers and their clients alike.

A collector (or anything serving the tracetop.v1 services) is closed by default: it binds to
loopback or a unix socket unless it is given TLS or a token (DESIGN §4). With a token file, every
RPC must carry ``authorization: Bearer <token>``; the check is a constant-time comparison against
the file's tokens (one a line, so a token can be rotated by listing old and new together).

Roles, by RPC:
- ``ingest``: Ingest.* and Control.Subscribe / Poll / Report / Profile (what trainers' hooks and agents call);
- ``query``: Query.* (the TUI, ``tracetop query --collector``) and ``/metrics``;
- ``control``: every other Control method (issuing, approving, rejecting commands).
The operator's token (``--token-file``) grants ingest and query; with ``--query-token-file`` it grants
ingest only, and queries need the query (or control) token. The ranks need not hold it: each token
T of the file has an ingest-only twin, ``ingest_token(T)`` (an HMAC-SHA256 of a fixed label keyed by
T, printed by ``tracetop token ingest --token-file T``), which the collector accepts for ingest and
nothing else (a query with it is PERMISSION_DENIED, naming the token to use); a rank's environment
then leaks no right to read the data or to command the run, and the twin changes when T is rotated. Control needs the control token
(``--control-token-file``) where the collector has one; a collector with a token file but no control
token file refuses commands from everyone, so an ingest token leaked from a trainer's environment can
never change a run.

Tokens never appear in logs or messages: errors name the file, never its contents.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tracetop import env
from tracetop.errors import TracetopError

INGEST, QUERY, CONTROL = "ingest", "query", "control"
HEADER = "authorization"
_PREFIX = "Bearer "
#: Control methods any ingest caller may use (rank 0's hooks listen for commands and report back;
#: a profiling rank sends its window's trace).
_CONTROL_FOR_INGEST = {"Subscribe", "Poll", "Report", "Profile"}


#: what an ingest-only token is derived from (ingest_token); changing it changes every such token
_INGEST_LABEL = b"tracetop ingest-only token v1"
INGEST_PREFIX = "tti1-"


def ingest_token(token: str) -> str:
    """The ingest-only twin of an operator's token (see the module doc): ``tti1-`` and 64 hex digits.
    One-way: it tells nothing of ``token``."""
    return INGEST_PREFIX + hmac.new(token.encode(), _INGEST_LABEL, hashlib.sha256).hexdigest()


class AuthSetupError(TracetopError, ValueError):
    """A token or certificate file that cannot be used. str() names the file and the fix."""


def role_of(method: str) -> str:
    """The role an RPC needs, from its full method name (``/tracetop.v1.Query/Sql``)."""
    service, _, name = method.strip("/").partition("/")
    service = service.rpartition(".")[2]
    if service == "Query":
        return QUERY
    if service == "Control" and name not in _CONTROL_FOR_INGEST:
        return CONTROL
    return INGEST


def read_tokens(path: str, what: str = "token file") -> frozenset[str]:
    """The tokens in ``path``, one a line (blank lines and ``#`` comments ignored).

    Refuses a missing, empty, or group/world-readable file: a token other users can read is no
    secret."""
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise AuthSetupError(f"{what} {path}: cannot read it ({e.strerror}); give a readable file") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthSetupError(
            f"{what} {path} can be read by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run `chmod 600 {path}`"
        )
    tokens = frozenset(t.strip() for t in lines if t.strip() and not t.strip().startswith("#"))
    if not tokens:
        raise AuthSetupError(f"{what} {path} holds no token; put one (e.g. `openssl rand -hex 32`) on a line")
    bad = [t for t in tokens if any(c.isspace() for c in t) or not t.isprintable()]
    if bad:
        raise AuthSetupError(f"{what} {path}: a token holds spaces or control characters; use one token a line")
    return tokens


def read_pem(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise AuthSetupError(f"{what} {path}: cannot read it ({e.strerror})") from None
    if b"-----BEGIN" not in data:
        raise AuthSetupError(f"{what} {path} is not PEM (no '-----BEGIN' line); give a PEM-encoded file")
    return data


@dataclass(frozen=True)
class ServerAuth:
    """What a server demands of its callers. Empty (the default) demands nothing."""

    tokens: Mapping[str, frozenset[str]] = field(default_factory=dict)  # role -> accepted tokens
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_client_ca: bytes | None = None  # set: mutual TLS, clients must present a cert it signed
    token_required: bool = False
    tls_paths: tuple[str | None, str | None, str | None] = (None, None, None)  # cert, key, client CA (for /metrics)
    ingest_only: frozenset[str] = frozenset()  # the ranks' derived tokens (ingest_token): in tokens[INGEST] only

    @classmethod
    def from_files(
        cls,
        *,
        token_file: str | None = None,
        control_token_file: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_client_ca: str | None = None,
        query_token_file: str | None = None,
    ) -> ServerAuth:
        if bool(tls_cert) != bool(tls_key):
            raise AuthSetupError("TLS needs both --tls-cert and --tls-key (a certificate and its private key)")
        if tls_client_ca and not tls_cert:
            raise AuthSetupError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key too")
        if query_token_file and not token_file:
            raise AuthSetupError("--query-token-file needs --token-file too (the ranks' token, then for ingest only)")
        if control_token_file and not token_file:
            raise AuthSetupError("--control-token-file needs --token-file too (the token for ingest and queries)")
        tokens: dict[str, frozenset[str]] = {}
        ingest_only: frozenset[str] = frozenset()
        if token_file:
            ingest = read_tokens(token_file, "--token-file")
            tokens = {INGEST: ingest, QUERY: ingest, CONTROL: frozenset()}
            if control_token_file:
                control = read_tokens(control_token_file, "--control-token-file")
                if control & ingest:
                    raise AuthSetupError(
                        "--control-token-file and --token-file share a token; commanding a run needs a token "
                        "of its own"
                    )
                tokens[CONTROL] = control
                tokens[QUERY] = ingest | control  # whoever may command may also look
            if query_token_file:  # the ranks' token may only ingest
                query = read_tokens(query_token_file, "--query-token-file")
                if query & ingest:
                    raise AuthSetupError("--query-token-file and --token-file share a token; the point of a query "
                                         "token is that the ranks' token may not query")
                tokens[QUERY] = query | tokens[CONTROL]
            ingest_only = frozenset(ingest_token(t) for t in ingest)
            tokens[INGEST] = tokens[INGEST] | ingest_only
        return cls(
            tokens=tokens,
            tls_cert=read_pem(tls_cert, "--tls-cert") if tls_cert else None,
            tls_key=read_pem(tls_key, "--tls-key") if tls_key else None,
            tls_client_ca=read_pem(tls_client_ca, "--tls-client-ca") if tls_client_ca else None,
            token_required=bool(token_file),
            tls_paths=(tls_cert, tls_key, tls_client_ca),
            ingest_only=ingest_only,
        )

    @property
    def closed(self) -> bool:
        """True when callers must present something (TLS or a token): /metrics is then guarded."""
        return self.token_required or self.tls_cert is not None

    @property
    def authenticates_clients(self) -> bool:
        """True when the server tells callers apart: a bearer token, or mutual TLS. TLS alone
        encrypts but lets anyone in; only this may listen off loopback."""
        return self.token_required or self.tls_client_ca is not None

    def check(self, method: str, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """None when the call may go on, else the reason (never containing a token)."""
        role = role_of(method)
        if not self.token_required:
            if role == CONTROL and self.tls_cert is not None:
                # TLS (even mutual) says who may connect, not who may command: no control role
                return (f"{method} commands a run: a TLS connection may not (TLS says who may connect, not who "
                        "may command); give the collector --token-file and --control-token-file, and use the control token")
            return None
        given = None
        for key, value in metadata or ():
            if key == HEADER:
                given = value.decode() if isinstance(value, bytes) else value
                break
        if given is None:
            return f"{method} needs a bearer token (`authorization: Bearer ...`); pass --token-file or set {env.TRACETOP_TOKEN_FILE}"
        if not given.startswith(_PREFIX):
            return f"{method}: the authorization header is not `Bearer <token>`"
        token = given[len(_PREFIX):].strip()
        allowed = self.tokens.get(role, frozenset())
        if not allowed and role == CONTROL:
            return (f"{method} commands a run; this collector takes commands only with a control token, "
                    "and none is configured (--control-token-file)")
        if not any(hmac.compare_digest(token.encode(), ok.encode()) for ok in allowed):
            if role != INGEST and any(hmac.compare_digest(token.encode(), ok.encode()) for ok in self.ingest_only):
                what, use = "commands a run", "the control token (--control-token-file)"
                if role == QUERY:
                    operator = self.tokens.get(INGEST, frozenset()) - self.ingest_only
                    what = "reads the data"
                    use = ("the operator's token (the collector's --token-file)" if operator & self.tokens.get(QUERY, frozenset())
                           else "the query token (--query-token-file)")
                return (f"{method} {what}: an ingest-only token (the ranks' `tracetop token ingest`) may not; "
                        f"use {use}")
            if role == CONTROL and any(hmac.compare_digest(token.encode(), ok.encode()) for ok in self.tokens.get(INGEST, ())):
                return f"{method} commands a run: the ingest token may not; use the control token"
            if role == QUERY and any(hmac.compare_digest(token.encode(), ok.encode()) for ok in self.tokens.get(INGEST, ())):
                return f"{method} reads the data: the ingest (ranks') token may not here; use the query token"
            return f"{method}: the bearer token is not one this collector accepts"
        return None

    def check_http(self, authorization: str | None) -> str | None:
        """The same check for the /metrics endpoint (query role)."""
        if not self.token_required:
            return None
        return self.check("/tracetop.v1.Query/Metrics", [(HEADER, authorization)] if authorization else [])

    def server_credentials(self):
        import grpc

        if self.tls_cert is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls_key, self.tls_cert)],
            root_certificates=self.tls_client_ca,
            require_client_auth=self.tls_client_ca is not None,
        )


@dataclass(frozen=True)
class ClientAuth:
    """What a client presents: a bearer token, a CA to trust for TLS, a client cert for mutual TLS."""

    token: str | None = None
    tls_ca: bytes | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_server_name: str | None = None  # override the name checked in the server's certificate

    @classmethod
    def from_options(
        cls,
        *,
        token_file: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_server_name: str | None = None,
    ) -> ClientAuth:
        """Flags first, then TRACETOP_TOKEN_FILE / TRACETOP_TLS_CA / TRACETOP_TLS_CERT / TRACETOP_TLS_KEY /
        TRACETOP_TLS_SERVER_NAME, then nothing."""
        token_file = token_file or env.get(env.TRACETOP_TOKEN_FILE)
        tls_ca = tls_ca or env.get(env.TRACETOP_TLS_CA)
        tls_cert = tls_cert or env.get(env.TRACETOP_TLS_CERT)
        tls_key = tls_key or env.get(env.TRACETOP_TLS_KEY)
        tls_server_name = tls_server_name or env.get(env.TRACETOP_TLS_SERVER_NAME)
        if bool(tls_cert) != bool(tls_key):
            raise AuthSetupError("a client certificate needs both --tls-cert and --tls-key")
        if tls_cert and not tls_ca:
            raise AuthSetupError("a client certificate (mutual TLS) needs --tls-ca, the CA that signed the server's")
        token = None
        if token_file:
            tokens = read_tokens(token_file, "token file")
            if len(tokens) != 1:
                raise AuthSetupError(f"token file {token_file} holds {len(tokens)} tokens; a client presents one")
            token = next(iter(tokens))
        return cls(
            token=token,
            tls_ca=read_pem(tls_ca, "--tls-ca") if tls_ca else None,
            tls_cert=read_pem(tls_cert, "--tls-cert") if tls_cert else None,
            tls_key=read_pem(tls_key, "--tls-key") if tls_key else None,
            tls_server_name=tls_server_name,
        )

    def metadata(self) -> Sequence[tuple[str, str]]:
        return ((HEADER, _PREFIX + self.token),) if self.token else ()

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.tls_server_name)] if self.tls_server_name and self.tls_ca else []

    def channel_credentials(self):
        import grpc

        if self.tls_ca is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=self.tls_ca, private_key=self.tls_key, certificate_chain=self.tls_cert
        )

    def channel(self, target: str, options: Sequence[tuple[str, object]] = ()):
        """A sync grpc channel to ``target`` with these credentials (TLS when a CA is given)."""
        import grpc

        opts = list(options) + self.channel_options()
        creds = self.channel_credentials()
        if creds is None:
            return grpc.insecure_channel(target, options=opts)
        return grpc.secure_channel(target, creds, options=opts)

    def __repr__(self) -> str:  # never print the token
        return (f"ClientAuth(token={'set' if self.token else None}, tls_ca={'set' if self.tls_ca else None}, "
                f"client_cert={'set' if self.tls_cert else None})")


def add_client_arguments(parser) -> None:
    """The options every client of a collector takes (query, ui, control, agent, hooks' env vars)."""
    g = parser.add_argument_group("access to a collector that demands it")
    g.add_argument("--token-file", metavar="FILE", help=f"present the bearer token in FILE (or ${env.TRACETOP_TOKEN_FILE})")
    g.add_argument("--tls-ca", metavar="PEM", help=f"connect with TLS, trusting this CA (or ${env.TRACETOP_TLS_CA})")
    g.add_argument("--tls-cert", metavar="PEM", help=f"client certificate for mutual TLS (or ${env.TRACETOP_TLS_CERT})")
    g.add_argument("--tls-key", metavar="PEM", help=f"its private key (or ${env.TRACETOP_TLS_KEY})")
    g.add_argument("--tls-server-name", metavar="NAME",
                   help=f"the name to check in the collector's certificate (or ${env.TRACETOP_TLS_SERVER_NAME})")


def client_auth_from_args(args) -> ClientAuth:
    return ClientAuth.from_options(
        token_file=getattr(args, "token_file", None), tls_ca=getattr(args, "tls_ca", None),
        tls_cert=getattr(args, "tls_cert", None), tls_key=getattr(args, "tls_key", None),
        tls_server_name=getattr(args, "tls_server_name", None),
    )


def server_interceptor(auth: ServerAuth):
    """A grpc.aio server interceptor refusing calls that fail ``auth.check`` with UNAUTHENTICATED
    (PERMISSION_DENIED when a valid caller lacks the role), answered at once: never a hang."""
    import grpc

    class _Interceptor(grpc.aio.ServerInterceptor):
        async def intercept_service(self, continuation, details):
            handler = await continuation(details)
            reason = auth.check(details.method, details.invocation_metadata)
            if reason is None or handler is None:
                return handler
            code = grpc.StatusCode.PERMISSION_DENIED if "may not" in reason else grpc.StatusCode.UNAUTHENTICATED
            return _denying_handler(handler, code, reason)

    return _Interceptor()


def _denying_handler(handler, code, reason: str):
    import grpc

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}

    async def unary(request, context):
        await context.abort(code, reason)

    async def streaming(request, context):
        await context.abort(code, reason)
        yield  # pragma: no cover - makes this an async generator; abort raises first

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


def serve_metrics_http(port: int, addr: str, registry, auth: ServerAuth):
    """A Prometheus /metrics endpoint guarded by ``auth`` (the collector's and the agent's): a scrape
    without the bearer token gets 401 naming what is missing (never the token); with TLS it serves
    HTTPS (asking for a client certificate under mutual TLS). Requests are never logged (their
    headers hold tokens). Returns (server, thread); ``server.shutdown()`` stops it."""
    import ssl
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    metrics_app = make_wsgi_app(registry)

    def app(environ, start_response):
        reason = auth.check_http(environ.get("HTTP_AUTHORIZATION"))
        if reason is not None:
            body = f"{reason}\n".encode()
            start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer"),
                                                ("Content-Length", str(len(body)))])
            return [body]
        return metrics_app(environ, start_response)

    cert, key, client_ca = auth.tls_paths
    ctx = None
    if cert:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        if client_ca:
            ctx.load_verify_locations(client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED

    class _Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

        def finish_request(self, request, client_address):
            """On the request's own thread: the TLS handshake here, bounded in time, so one
            connection that never speaks cannot hold the accept loop (and every other scrape)."""
            if ctx is None:
                return super().finish_request(request, client_address)
            request.settimeout(10.0)
            try:
                tls = ctx.wrap_socket(request, server_side=True)
            except (OSError, ssl.SSLError):
                return  # a silent, plaintext or refused client: this connection only
            try:
                super().finish_request(tls, client_address)
            finally:
                tls.close()

        def handle_error(self, request, client_address):  # noqa: ARG002 - quiet: a dropped scrape
            pass

    class _Quiet(WSGIRequestHandler):
        def log_message(self, format, *args):  # noqa: A002 - never log requests (headers hold tokens)
            pass

    httpd = make_server(addr, port, app, _Server, handler_class=_Quiet)
    thread = threading.Thread(target=httpd.serve_forever, name="tracetop-metrics", daemon=True)
    thread.start()
    return httpd, thread
