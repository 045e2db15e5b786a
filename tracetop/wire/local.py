"""Who is on the other end of a unix socket: the node agent's folder and its peer, checked.

The hooks hand their bearer token to whatever listens on their endpoint and apply the commands it
returns, so a unix socket is trusted only when nobody else could have put a listener there:

- its folder is a real folder (not a symlink), owned by this user or root, and writable by nobody
  else (then only this user or root can create, replace or remove a socket in it); and
- the process listening on it (``SO_PEERCRED``, the credentials it had when it called listen())
  runs as this user or root.

The agent's default socket lives in such a folder of its own: ``$XDG_RUNTIME_DIR/tracetop/agent.sock``
where that variable is set, else ``/tmp/tracetop-<uid>/agent.sock``; the agent creates the folder
0700 and refuses one that exists as a symlink, belongs to another user, or that others may write.
(A socket directly in ``/tmp``, as ``/tmp/tracetop-agent.sock`` was, can be created by any local
user before the agent starts.)

Both checks happen when the hooks set up (and when rank 0 opens its command channel). With the
folder rule a socket cannot be swapped afterwards by another user, so gRPC's own reconnects go to
a listener of the same trust. An endpoint that fails a check gets nothing: the hooks ship to the
collector instead (``tracetop.env.collector()``), say so once, and count it (``refused()``).
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
from collections.abc import Collection
from pathlib import Path

from tracetop import env
from tracetop.errors import TracetopError

_lock = threading.Lock()
_refused = 0


class LocalPeerError(TracetopError, PermissionError):
    """A unix socket, or its folder, that another user could control. str() names it and the fix."""


def default_agent_dir() -> Path:
    """The agent's default socket folder (tracetop.env.default_agent_dir)."""
    return Path(env.default_agent_dir())


def unix_path(endpoint: str) -> str | None:
    """The filesystem path of a ``unix://`` (or ``unix:``) address, else None."""
    if endpoint.startswith("unix://"):
        return endpoint[len("unix://"):]
    if endpoint.startswith("unix:"):
        return endpoint[len("unix:"):]
    return None


def _allowed(allowed_uids: Collection[int] | None) -> Collection[int]:
    return (os.geteuid(), 0) if allowed_uids is None else allowed_uids


def check_folder(folder: Path, *, allowed_uids: Collection[int] | None = None, what: str = "socket folder") -> None:
    """Raise LocalPeerError unless ``folder`` is a real folder owned by an allowed uid (this user or
    root) that no other user may write."""
    try:
        st = os.lstat(folder)
    except OSError as e:
        raise LocalPeerError(f"tracetop: {what} {folder}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise LocalPeerError(f"tracetop: {what} {folder} is a symbolic link (to {os.readlink(folder)}); another user "
                             "may have made it: remove it, or point at a real folder of yours")
    if not stat.S_ISDIR(st.st_mode):
        raise LocalPeerError(f"tracetop: {what} {folder} is not a folder")
    if st.st_uid not in _allowed(allowed_uids):
        raise LocalPeerError(f"tracetop: {what} {folder} belongs to uid {st.st_uid}, not to this user (uid "
                             f"{os.geteuid()}) or root; another user may have made it: remove it, or use a folder of yours")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise LocalPeerError(f"tracetop: {what} {folder} may be written by other users (mode "
                             f"{stat.S_IMODE(st.st_mode):o}), who could put a socket there; run `chmod go-w {folder}` "
                             "or use another folder")


def ensure_private_dir(folder: Path, *, what: str = "socket folder") -> None:
    """The agent's side: create ``folder`` 0700 (parents too) or accept an existing one only if it
    passes check_folder for this user alone (root's folder is not ours to use)."""
    try:
        folder.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as e:
        raise LocalPeerError(f"tracetop: cannot create {what} {folder}: {e.strerror}; pass --listen elsewhere") from None
    check_folder(folder, allowed_uids=(os.geteuid(),), what=what)


def peer_uid(path: str, timeout_s: float = 1.0) -> int:
    """The uid of the process listening on the unix socket ``path`` (SO_PEERCRED). Raises OSError
    when nobody listens."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(path)
        _pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return uid
    finally:
        s.close()


def verify(endpoint: str, *, allowed_uids: Collection[int] | None = None,
           peer_uids: Collection[int] | None = None) -> None:
    """Raise LocalPeerError when ``endpoint`` is a unix socket another user could control: its folder
    (check_folder) or, when something listens there already, the listener's uid. Other endpoints
    (TCP: authenticated by token and TLS) pass. ``allowed_uids`` (default: this user and root) may
    own the folder and listen; ``peer_uids``, when given, replaces them for the listener only."""
    path = unix_path(endpoint)
    if path is None:
        return
    allowed = _allowed(allowed_uids)
    check_folder(Path(os.path.abspath(path)).parent, allowed_uids=allowed)
    try:
        uid = peer_uid(path)
    except OSError:
        return  # nobody listens yet: the folder rule says only this user or root can start to
    if uid not in (allowed if peer_uids is None else peer_uids):
        raise LocalPeerError(f"tracetop: the process listening on {path} runs as uid {uid}, not as this user (uid "
                             f"{os.geteuid()}) or root; it could be another user's fake agent: stop it, or point "
                             "TRACETOP_ENDPOINT at your own agent")


def trusted(endpoint: str, fallback: str, *, allowed_uids: Collection[int] | None = None) -> tuple[str, str | None]:
    """``(endpoint, None)`` when it passes ``verify``; else ``(fallback, reason)``, counted."""
    global _refused
    try:
        verify(endpoint, allowed_uids=allowed_uids)
    except LocalPeerError as e:
        with _lock:
            _refused += 1
        return fallback, str(e)
    return endpoint, None


def refused() -> int:
    """How many endpoints this process refused (``trusted`` fell back)."""
    return _refused
