"""The server's key directory: who may connect, as a client or as a peer server.

Layout (``--keys``; created on first start, see :func:`genie.remote.server.ensure_keys`)::

    server.key, server.key_secret     the server's CURVE pair (clients and peers check it)
    client.key_secret, client.json    the client pair handed to clients (the connection file)
    peer.key_secret                   this server's peer pair: how it authenticates to its peers
    authorized/*.key                  client public keys allowed to open sessions
    peers/*.key                       peer public keys allowed to ``put`` values (the pool's)

A pool's members share one directory (``genie-pool`` copies it into every member), so they
share the peer pair and authorize each other. A peer key is not a client key: it may only
``put`` (a transfer's values, under a ticket of the destination session) and a client key may
never ``put`` (:class:`KeyRing`).

Permissions are checked on every start, as sshd's ``StrictModes`` does: the directory and its
``authorized/`` and ``peers/`` subdirectories must belong to this user (or root) and be writable
by no one else (whoever can write there can authorize a key), and no secret file may be
readable by anyone else (:func:`check_modes`); the server refuses to start otherwise and says
which ``chmod`` fixes it.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

#: files that hold a secret (a secret key, or a connection file with the client's secret)
SECRET_GLOBS = ("*.key_secret", "client.json", "pool.json")
#: subdirectories of authorized public keys
KEY_DIRS = ("authorized", "peers")


def check_modes(keys_dir: Path) -> None:
    """Refuse (SystemExit, with the fix) a key directory that others could change or read."""
    uid = os.getuid()
    problems: list[str] = []
    for d in (keys_dir, *(keys_dir / s for s in KEY_DIRS)):
        try:
            st = d.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            st = d.stat()
        if st.st_uid not in (uid, 0):
            problems.append(f"{d} belongs to user {st.st_uid}, not to this user ({uid}): "
                            f"chown {uid} {d}")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            problems.append(f"{d} is writable by {_who(st.st_mode, write=True)} (anyone who "
                            f"can write there can authorize a key): chmod 700 {d}")
        if d is not keys_dir:
            for f in sorted(d.glob("*.key")):
                fs = f.stat()
                if fs.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                    problems.append(f"{f} is writable by {_who(fs.st_mode, write=True)}: "
                                    f"chmod 600 {f}")
    for pat in SECRET_GLOBS:
        for f in sorted(keys_dir.glob(pat)):
            fs = f.stat()
            if fs.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                problems.append(f"{f} holds a secret and is open to "
                                f"{_who(fs.st_mode, write=False)}: chmod 600 {f}")
    if problems:
        raise SystemExit("genie-server: refusing to use the key directory " + str(keys_dir) +
                         ":\n  " + "\n  ".join(problems) + "\n(as sshd's StrictModes: fix the "
                         "permissions and start again)")


def _who(mode: int, write: bool) -> str:
    g = stat.S_IWGRP if write else stat.S_IRWXG
    o = stat.S_IWOTH if write else stat.S_IRWXO
    return " and ".join(w for w, bit in (("its group", g), ("others", o)) if mode & bit)


def ensure_peer_pair(keys_dir: Path) -> tuple[bytes, bytes]:
    """This directory's peer key pair (``peer.key_secret``), created with its public key
    authorized in ``peers/`` on first use."""
    import zmq
    import zmq.auth

    peers = keys_dir / "peers"
    peers.mkdir(exist_ok=True, mode=0o700)
    secret = keys_dir / "peer.key_secret"
    if not secret.exists():
        pub, sec = zmq.curve_keypair()
        write_cert(secret, pub, sec)
        write_cert(peers / "peer.key", pub, None)
    pub, sec = zmq.auth.load_certificate(str(secret))
    assert pub is not None and sec is not None
    return pub, sec


def write_cert(path: Path, public: bytes, secret: bytes | None) -> None:
    lines = ["#   ZeroMQ CURVE certificate written by genie-server", "metadata", "curve",
             f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")


class KeyRing:
    """The public keys a server accepts (its ZAP handler's ``credentials_provider``): clients'
    from ``authorized/``, peers' from ``peers/``, each directory read again when it changes.

    :meth:`refusal` says why a request of a given kind may not come from a given key: ``put``
    comes from peers only, everything else from clients only.
    """

    def __init__(self, keys_dir: Path) -> None:
        self.dirs = {s: keys_dir / s for s in KEY_DIRS}
        self._lock = threading.Lock()
        self._keys: dict[str, set[bytes]] = {s: set() for s in KEY_DIRS}
        self._stamps: dict[str, int | None] = {s: None for s in KEY_DIRS}
        self._refresh()

    def _refresh(self) -> None:
        import zmq.auth

        for s, d in self.dirs.items():
            try:
                stamp = max([d.stat().st_mtime_ns] + [f.stat().st_mtime_ns
                                                      for f in d.glob("*.key")])
            except OSError:
                stamp = None
            if stamp == self._stamps[s]:
                continue
            try:
                keys = set(zmq.auth.load_certificates(str(d))) if stamp is not None else set()
            except (OSError, ValueError):
                keys = set()
            with self._lock:
                self._keys[s], self._stamps[s] = keys, stamp

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: whether ``key`` (Z85) may connect at all."""
        self._refresh()
        with self._lock:
            return key in self._keys["authorized"] or key in self._keys["peers"]

    def is_peer(self, key: bytes | str | None) -> bool:
        if key is None:
            return False
        k = key.encode() if isinstance(key, str) else key
        with self._lock:
            return k in self._keys["peers"]

    def is_client(self, key: bytes | str | None) -> bool:
        if key is None:
            return False
        k = key.encode() if isinstance(key, str) else key
        with self._lock:
            return k in self._keys["authorized"]

    def refusal(self, key: bytes | str | None, kind: str) -> str | None:
        """Why a ``kind`` request from ``key`` (a message's User-Id) is refused, or None."""
        if kind == "put":
            if not self.is_peer(key):
                return ("a put comes only from a peer server of this pool (authenticated with a "
                        "peer key in the keys directory's peers/), never from a client key; "
                        "clients move values between servers with send")
            return None
        if not self.is_client(key):
            return (f"a {kind} request comes from a client key (authorized/), not from a peer "
                    "server's key")
        return None
