"""A unix socket another user could control gets nothing from the hooks (tracetop/wire/local.py).

The fake agent here is a plain listening socket that records every byte it receives: the hooks'
first stream would carry their bearer token in its headers. Checked on one uid: a socket folder
others may write, a symlinked folder, a folder of another uid (as root: chown), and the listener's
uid through SO_PEERCRED (as root: a real listener of uid 65534; on any uid: the same check with an
allowed-uid set that excludes this one). Also the agent's side: its default folder is created 0700
and one that is a symlink, loose or another user's is refused.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.support.services import start_collector
from tracetop.errors import ListenError
from tracetop.wire import local

TOKEN = "s3cret-local-peer-token"


class FakeAgent:
    """A listening unix socket that accepts and keeps every byte sent to it."""

    def __init__(self, path: Path, sock: socket.socket | None = None) -> None:
        self.path = path
        if sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(path))
            sock.listen(16)
        self.sock = sock
        self.sock.settimeout(0.2)
        self.received = b""
        self.connections = 0
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # a timeout, or the socket closed by close()
                continue
            self.connections += 1
            conn.settimeout(0.5)
            try:
                while True:
                    data = conn.recv(65536)
                    if not data:
                        break
                    self.received += data
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(5.0)
        self.sock.close()


@pytest.fixture
def token_env(tmp_path, monkeypatch):
    tok = tmp_path / "token"
    tok.write_text(TOKEN + "\n")
    tok.chmod(0o600)
    monkeypatch.setenv("TRACETOP_TOKEN_FILE", str(tok))
    monkeypatch.setenv("TRACETOP_FLUSH_S", "0.2")
    return tok


def _trace_a_step(endpoint: str):
    import trainer_hooks

    t = trainer_hooks.Tracer(endpoint=endpoint, run_id="peer", rank=0, world_size=1, wrap_collectives=False,
                             close_timeout_s=2.0)
    with t.step(0):
        time.sleep(0.01)
    time.sleep(0.5)
    t.close()
    return t


def test_hooks_send_nothing_to_a_socket_in_a_folder_others_may_write(tmp_path, token_env, monkeypatch):
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)  # anyone could have put the socket there
    fake = FakeAgent(loose / "agent.sock")
    col = start_collector(tmp_path, "unix", extra_args=["--token-file", str(token_env)])
    monkeypatch.setenv("TRACETOP_COLLECTOR", col.addr)
    before = local.refused()
    try:
        t = _trace_a_step(f"unix://{fake.path}")
    finally:
        fake.close()
        col.stop()
    assert t.endpoint == col.addr, "the hooks did not fall back to the collector"
    assert local.refused() == before + 1, "the refusal was not counted"
    assert fake.connections == 0 and fake.received == b"", f"the fake agent got {len(fake.received)} bytes"
    import duckdb  # the fallback really carried the step

    con = duckdb.connect(str(col.db), read_only=True)
    n = con.execute("SELECT count(*) FROM step WHERE run_id='peer'").fetchone()[0]
    con.close()
    assert n == 1, f"{n} step rows reached the collector after the fallback"


def test_folder_checks_symlink_other_uid_loose(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(local.LocalPeerError, match="symbolic link"):
        local.verify(f"unix://{link}/agent.sock")
    loose = tmp_path / "g"
    loose.mkdir()
    loose.chmod(0o770)
    with pytest.raises(local.LocalPeerError, match="written by other users"):
        local.verify(f"unix://{loose}/agent.sock")
    local.verify(f"unix://{real}/agent.sock")  # ours, tight, nobody listening yet: fine
    local.verify("127.0.0.1:7000")  # TCP: token and TLS say who is who
    # a folder owned by a uid that is neither ours nor root's (as root: a real chown; else the set)
    if os.geteuid() == 0:
        os.chown(real, 65534, 65534)
        with pytest.raises(local.LocalPeerError, match="belongs to uid 65534"):
            local.verify(f"unix://{real}/agent.sock")
    else:
        with pytest.raises(local.LocalPeerError, match="belongs to uid"):
            local.verify(f"unix://{real}/agent.sock", allowed_uids=(os.geteuid() + 1,))


def test_listener_of_another_uid_is_refused_by_so_peercred(tmp_path):
    folder = tmp_path / "sock"
    folder.mkdir(mode=0o700)
    path = folder / "agent.sock"
    own = FakeAgent(path)
    try:
        assert local.peer_uid(str(path)) == os.geteuid()
        local.verify(f"unix://{path}")
        # the same listener, judged by a set that does not hold this uid: SO_PEERCRED is what refuses it
        with pytest.raises(local.LocalPeerError, match=f"runs as uid {os.geteuid()}"):
            local.verify(f"unix://{path}", peer_uids=(os.geteuid() + 1,))
    finally:
        own.close()
        path.unlink()
    if os.geteuid() != 0:
        return  # a listener of another uid needs root to make; the check above covered the comparison
    # root binds the socket in its own tight folder, a child of uid 65534 calls listen(): the
    # credentials SO_PEERCRED reports are the listener's
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no exec (uid 65534 may not read the venv), only setuid, listen, wait
        try:
            os.setgid(65534)
            os.setuid(65534)
            s.listen(4)
            os.write(ready_w, b"1")
            os.read(stop_r, 1)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"1"
        s.close()
        assert local.peer_uid(str(path)) == 65534
        target, reason = local.trusted(f"unix://{path}", "127.0.0.1:1")
        assert target == "127.0.0.1:1" and "runs as uid 65534" in reason
    finally:
        os.write(stop_w, b"x")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, stop_r, stop_w):
            os.close(fd)


def test_agent_makes_its_folder_0700_and_refuses_one_it_cannot_trust(tmp_path):
    from agent.relay import Relay
    from tracetop.wire.shipper import Shipper
    from tracetop.wire.transport import MemoryTransport

    made = tmp_path / "new" / "tracetop"
    local.ensure_private_dir(made)
    assert (os.stat(made).st_mode & 0o777) == 0o700
    local.ensure_private_dir(made)  # ours already: fine
    made.chmod(0o755)
    local.ensure_private_dir(made)  # readable, not writable by others: fine
    made.chmod(0o775)
    with pytest.raises(local.LocalPeerError, match="written by other users"):
        local.ensure_private_dir(made)
    link = tmp_path / "linked"
    link.symlink_to(tmp_path / "new")
    with pytest.raises(local.LocalPeerError, match="symbolic link"):
        local.ensure_private_dir(link)
    shipper = Shipper(None, run_id="r", transport=MemoryTransport())
    try:
        with pytest.raises(ListenError, match="written by other users"):
            Relay(shipper, [f"unix://{made}/agent.sock"]).start()
    finally:
        shipper.close(1)


def test_default_socket_is_per_user_in_a_private_folder(monkeypatch, tmp_path):
    from tracetop import env

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert env.default_agent_socket() == f"unix:///tmp/tracetop-{os.geteuid()}/agent.sock"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert env.default_agent_socket() == f"unix://{tmp_path}/tracetop/agent.sock"
    assert str(os.geteuid()) in env.DEFAULT_SPOOL_DIR


def test_hooks_find_and_trust_the_agents_default_socket(tmp_path, monkeypatch):
    """End to end on one uid: an agent started with the default socket (XDG_RUNTIME_DIR set) makes
    its folder 0700; hooks with no TRACETOP_ENDPOINT find it there, trust it, and their rows reach
    the collector through it."""
    import duckdb

    from tests.support.services import start_agent
    from tracetop import env
    from tracetop.wire.shipper import Shipper

    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("TRACETOP_ENDPOINT", raising=False)
    sock = env.default_agent_socket()
    col = start_collector(tmp_path, "unix")
    agent = start_agent(col.addr, sock, tmp_path / "spool")
    try:
        assert (os.stat(runtime / "tracetop").st_mode & 0o777) == 0o700
        before = local.refused()
        t = _trace_a_step(None)
        assert t.endpoint == sock and local.refused() == before
        assert isinstance(t.shipper, Shipper) and t.shipper.stats()["unacked_batches"] == 0
        agent.wait_drained()
    finally:
        agent.service.stop()
        col.stop()
    con = duckdb.connect(str(col.db), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM step WHERE run_id = 'peer'").fetchone()[0] == 1
    finally:
        con.close()
