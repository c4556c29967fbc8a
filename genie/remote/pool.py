"""A pool of genie-servers: who they are, whether they live, and their replacement.

One notion of pool for recovery (a client rebuilds a lost session on another member) and for
placement (which member runs a tape): a :class:`Pool` is an ordered list of members, each a
server address plus the launcher's handle on it. A *launcher* starts, probes and stops servers;
:class:`RayLauncher` runs each server as a Ray actor (one accelerator each through Ray's
resources), :class:`ProcessLauncher` as a local ``genie-server`` process (no Ray needed).

Invariants: member ``i`` is ``remote_accelerator:i`` of a client that connected to the pool; a
dead member is replaced in place (same index, new address); the *pool file* (JSON: the addresses
comma-separated under ``address``, the server key and an authorized client key pair, or
``insecure``) always lists the current members, so a client that lost a server finds its
replacement there (``genie.connect(pool=path)`` re-reads it when it recovers). ``genie-pool``
(:func:`main`) prints the ``GENIE_*=value`` lines a client needs, checks the members' health,
and stops them all on exit.

Hardening: ``genie-pool`` takes every flag of ``genie-server`` that is not the pool's own
(quota, message size, sessions, run time, index checks, lease, workers, ...; see
:func:`server_flags`) and passes it to every member, replacements included. The members are
each other's only peers: the launcher registers the current member list with every member
(:meth:`Launcher.set_peers`: a peers file the process members read, ``--peers``, or a call into
each Ray actor), so a server sends values to the members of its pool and nowhere else
(:mod:`genie.remote.peer`).

Example::

    genie-pool --servers 2 --device cpu          # prints GENIE_POOL=... GENIE_SERVER=...
    GENIE_POOL=~/.config/genie/pool/pool.json python train.py
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .. import backends
from ..errors import GenieError

logger = logging.getLogger("genie.pool")


@dataclass
class Member:
    """One server of the pool: its address and the launcher's handle on it."""

    address: str
    handle: Any
    pid: int = 0


class Launcher(Protocol):
    def start(self, index: int) -> Member: ...
    def alive(self, m: Member) -> bool: ...
    def stop(self, m: Member) -> None: ...
    def close(self) -> None: ...
    def set_peers(self, members: list[Member]) -> None:
        """Register ``members`` with every member as its peers (the only servers it may send
        values to); called whenever the membership changes."""


class Pool:
    """Servers started by ``launcher``; :meth:`check` replaces the dead ones.

    Args:
        launcher: how members are started (:class:`RayLauncher`, :class:`ProcessLauncher`).
        n: how many servers.
        pool_file: where to keep the pool file (see the module docstring); None: no file.
        keys: the connection secrets for the pool file (server key, client key pair), or None
            for ``--insecure`` servers.
    """

    def __init__(self, launcher: Launcher, n: int, *, pool_file: Path | None = None,
                 keys: dict[str, str] | None = None) -> None:
        if n < 1:
            raise ValueError(f"[genie-pool] a pool needs at least one server, got {n}")
        self.launcher = launcher
        self.pool_file = pool_file
        self.keys = keys
        self.replaced = 0
        self._lock = threading.Lock()
        self._watch_stop: threading.Event | None = None
        self.members: list[Member] = []
        try:
            for i in range(n):
                self.members.append(launcher.start(i))
        except BaseException:
            self.stop()
            raise
        self._write()

    @property
    def addresses(self) -> list[str]:
        with self._lock:
            return [m.address for m in self.members]

    def check(self) -> list[int]:
        """Replace the members that died; the indices replaced."""
        out = []
        for i, m in enumerate(list(self.members)):
            if self.launcher.alive(m):
                continue
            new = self.launcher.start(i)
            with self._lock:
                self.members[i] = new
            self._write()  # before counting it: a reader of `replaced` finds the file current
            self.replaced += 1
            logger.warning("genie-pool: server %d at %s died; replaced by %s", i, m.address,
                           new.address)
            out.append(i)
        return out

    def watch(self, every: float = 2.0) -> threading.Event:
        """Run :meth:`check` every ``every`` seconds on a daemon thread until the returned event
        is set (or :meth:`stop`)."""
        done = self._watch_stop = threading.Event()

        def loop() -> None:
            while not done.wait(every):
                try:
                    self.check()
                except Exception as e:  # a failed start is retried at the next check
                    logger.warning("genie-pool: health check failed: %s", e)
        threading.Thread(target=loop, name="genie-pool-watch", daemon=True).start()
        return done

    def stop(self) -> None:
        if self._watch_stop is not None:
            self._watch_stop.set()
        for m in self.members:
            try:
                self.launcher.stop(m)
            except Exception as e:  # stopping the others matters more
                logger.warning("genie-pool: stopping %s: %s", m.address, e)
        self.members = []
        self.launcher.close()

    def connection(self) -> dict[str, Any]:
        """What a client needs: ``address`` (comma-separated) and keys or ``insecure``; the
        members' process ids (``pids``) for operators."""
        with self._lock:
            d: dict[str, Any] = {"address": ",".join(m.address for m in self.members),
                                 "pids": [m.pid for m in self.members]}
        d.update(self.keys or {"insecure": True})
        return d

    def _write(self) -> None:
        set_peers = getattr(self.launcher, "set_peers", None)
        if set_peers is not None:
            with self._lock:
                members = list(self.members)
            try:
                set_peers(members)
            except Exception as e:  # another member died meanwhile: the next check replaces
                logger.warning("genie-pool: registering the members as peers failed (%s); "
                               "retried at the next change", e)  # it and registers them again
        if self.pool_file is None:
            return
        tmp = self.pool_file.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.connection(), f, indent=1)
        os.replace(tmp, self.pool_file)  # readers never see half a file


def read_pool_file(path: str | Path) -> dict[str, Any]:
    """The pool file's contents; ``address`` as a list."""
    p = Path(path).expanduser()
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError) as e:

        raise GenieError(f"cannot read the Genie pool file {p}: {e}; start the pool with "
                         "genie-pool, which writes it") from None
    addr = d.get("address", "")
    d["address"] = [a.strip() for a in addr.split(",") if a.strip()] if isinstance(addr, str) \
        else list(addr)
    return d


# --- launchers ---------------------------------------------------------------------------------

def _server_key(keys_dir: Path | None) -> str | None:
    """The members' CURVE server public key (they share ``keys_dir``), None when insecure."""
    if keys_dir is None:
        return None
    import zmq.auth

    pub, _ = zmq.auth.load_certificate(str(keys_dir / "server.key"))
    return pub.decode() if pub is not None else None


def _peer_entries(members: list[Member], key: str | None) -> list[dict[str, Any]]:
    return [{"address": m.address, "server_public_key": key} for m in members]


def _key_files(keys_dir: Path | None) -> dict[str, str]:
    """The server's key files (relative path -> text), to recreate its key directory anywhere."""
    if keys_dir is None:
        return {}
    return {str(p.relative_to(keys_dir)): p.read_text()
            for p in sorted(keys_dir.rglob("*.key*")) if p.is_file()}


class _ServerActor:
    """A genie-server inside a Ray actor: it lives as long as the actor's process."""

    def __init__(self, device: str, host: str, key_files: dict[str, str],
                 server_args: list[str]) -> None:
        from .server import build_parser, server_from_args

        os.environ.pop("GENIE_SERVER", None)  # the server runs tapes itself
        backends.set_backends([n for n in backends.backend_order() if n != "remote"])
        keys_dir = None
        if key_files:
            keys_dir = tempfile.mkdtemp(prefix="genie-keys-")
            for rel, text in key_files.items():
                p = Path(keys_dir) / rel
                p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(text)
        sec = ["--keys", keys_dir] if keys_dir else ["--insecure"]
        a = build_parser().parse_args(["--device", device, "--listen", f"{host}:0", *sec,
                                       *server_args])
        self.server = server_from_args(a)
        self.addr = self.server.start()
        threading.Thread(target=self.server.serve, name="genie-serve", daemon=True).start()

    def info(self) -> tuple[str, int]:
        return self.addr, os.getpid()

    def set_peers(self, entries: list[dict[str, Any]]) -> int:
        self.server.peers.set([(e["address"], e["server_public_key"]) for e in entries])
        return len(self.server.peers)

    def settings(self) -> dict[str, Any]:
        """What the member serves with (tests check that the pool's flags reached it)."""
        s = self.server
        return {"quota": s.quota, "max_message": s.max_message,
                "max_sessions": s.max_sessions, "max_run_seconds": s.max_run_seconds,
                "workers": s.workers, "lease": s.lease, "index_check": s.index_check,
                "peer_timeout": s.peer_timeout, "peers": len(s.peers)}


class RayLauncher:
    """Members as Ray actors (``num_gpus=1`` each for CUDA, one CPU each otherwise).

    Args:
        device: ``cuda`` or ``cpu`` (what each actor serves).
        address: a Ray cluster (``ray.init(address=...)``); None starts a local Ray instance.
        keys_dir: CURVE key directory to serve with (copied into each actor), None: insecure.
        server_args: ``genie-server`` flags every member serves with (the hardening ones).
    """

    def __init__(self, device: str, address: str | None = None, keys_dir: Path | None = None,
                 lease: float = 60.0, server_args: list[str] | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise SystemExit("genie-pool: Ray is not installed: pip install "
                             "'genie-remote-accelerator[pool]' (or pip install ray), or use "
                             "--launcher process") from None
        self.ray = ray
        self.device = device
        self.server_args = ["--lease", str(lease), *(server_args or [])]
        self.server_key = _server_key(keys_dir)
        self._own = not ray.is_initialized()
        if self._own:
            kw: dict[str, Any] = {"address": address} if address else {
                "include_dashboard": False, "num_cpus": max(2, os.cpu_count() or 1)}
            ray.init(logging_level=logging.WARNING, log_to_driver=False, **kw)
        self.host = "127.0.0.1" if not address else ray.util.get_node_ip_address()
        self.key_files = _key_files(keys_dir)
        opts = {"num_gpus": 1} if device.startswith("cuda") else {"num_cpus": 1}
        self._cls = ray.remote(**opts)(_ServerActor)

    def start(self, index: int) -> Member:
        actor = self._cls.remote("cuda" if self.device.startswith("cuda") else "cpu", self.host,
                                 self.key_files, self.server_args)
        addr, pid = self.ray.get(actor.info.remote(), timeout=120)
        return Member(addr, actor, pid)

    def set_peers(self, members: list[Member]) -> None:
        entries = _peer_entries(members, self.server_key)
        self.ray.get([m.handle.set_peers.remote(entries) for m in members], timeout=60)

    def alive(self, m: Member) -> bool:
        try:
            self.ray.get(m.handle.info.remote(), timeout=10)
            return True
        except Exception:
            return False

    def stop(self, m: Member) -> None:
        self.ray.kill(m.handle, no_restart=True)

    def close(self) -> None:
        if self._own and self.ray.is_initialized():
            self.ray.shutdown()


class ProcessLauncher:
    """Members as local ``genie-server`` processes (for machines without Ray).

    Args:
        device: what each member serves.
        keys_dir: the CURVE key directory they share (None: ``--insecure``).
        lease: their ``--lease``.
        server_args: further ``genie-server`` flags every member serves with.

    The members' peers file (``--peers``) lives in a directory of this launcher's own (mode
    700) and is rewritten, atomically, whenever the membership changes.
    """

    def __init__(self, device: str, keys_dir: Path | None = None, lease: float = 60.0,
                 server_args: list[str] | None = None) -> None:
        self.device = device
        self.keys_dir = keys_dir
        self.lease = lease
        self.server_args = list(server_args or [])
        self.server_key = _server_key(keys_dir)
        self._dir = Path(tempfile.mkdtemp(prefix="genie-pool-peers-"))
        self.peers_file = self._dir / "peers.json"

    def set_peers(self, members: list[Member]) -> None:
        tmp = self._dir / "peers.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"peers": _peer_entries(members, self.server_key)}, f)
        os.replace(tmp, self.peers_file)

    def start(self, index: int) -> Member:
        args = [sys.executable, "-m", "genie.remote.server", "--device", self.device,
                "--listen", "127.0.0.1:0", "--lease", str(self.lease),
                "--peers", str(self.peers_file), *self.server_args]
        args += ["--keys", str(self.keys_dir)] if self.keys_dir else ["--insecure"]
        env = {k: v for k, v in os.environ.items() if k != "GENIE_SERVER"}
        p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env)
        assert p.stdout is not None
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if line.startswith("genie-server: serving") or not line:
                break
        addr = next((w for w in line.split() if w.startswith("tcp://")), None)
        if addr is None:
            p.kill()
            raise RuntimeError(f"genie-pool: server {index} did not start: {line!r}")
        threading.Thread(target=_drain, args=(p.stdout,), daemon=True).start()
        return Member(addr, p, p.pid)

    def alive(self, m: Member) -> bool:
        return m.handle.poll() is None

    def stop(self, m: Member) -> None:
        p = m.handle
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=15)

    def close(self) -> None:
        import shutil

        shutil.rmtree(self._dir, ignore_errors=True)


def _drain(f: Any) -> None:
    for _ in f:  # keep the child's pipe from filling up
        pass


# --- genie-pool ---------------------------------------------------------------------------------

#: ``genie-server`` flags the pool decides itself (never taken from the command line)
POOL_OWN = frozenset({"help", "device", "listen", "insecure", "keys", "peers", "peer_keys",
                      "log_level"})


def server_flags(p: argparse.ArgumentParser) -> list[argparse.Action]:
    """Add every ``genie-server`` flag but the pool's own (:data:`POOL_OWN`) to ``p``, unset
    unless given (a member then uses the server's default); the actions added."""
    from .server import build_parser

    g = p.add_argument_group("server settings", "passed to every member (see genie-server "
                             "--help): the hardening flags (--quota, --max-message, "
                             "--max-sessions, --max-run-seconds, --index-check, --workers, ...)")
    out = []
    for act in build_parser()._actions:
        if act.dest in POOL_OWN or not act.option_strings:
            continue
        act.default = argparse.SUPPRESS
        act.required = False
        g._add_action(act)
        out.append(act)
    return out


def member_args(a: argparse.Namespace, actions: list[argparse.Action]) -> list[str]:
    """The ``genie-server`` flags of ``a`` that were given, as a member's command line."""
    out: list[str] = []
    for act in actions:
        if not hasattr(a, act.dest):
            continue
        v = getattr(a, act.dest)
        if act.nargs == 0:  # a switch
            if v:
                out.append(act.option_strings[0])
        else:
            out += [act.option_strings[-1], str(v)]
    return out

def main(argv: list[str] | None = None) -> int:
    """Entry point of ``genie-pool``: start N servers, print how to connect, keep them alive."""
    p = argparse.ArgumentParser(prog="genie-pool", description="Start a pool of genie-servers "
                                "(Ray actors by default), replace those that die, stop them all "
                                "on exit.")
    p.add_argument("--servers", type=int, required=True, help="how many servers")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="what each server serves (default: cuda if present, else cpu)")
    p.add_argument("--address", default=None,
                   help="the Ray cluster to run on (default: a local Ray instance)")
    p.add_argument("--launcher", choices=("ray", "process"), default="ray",
                   help="ray: servers as Ray actors; process: local genie-server processes")
    p.add_argument("--insecure", action="store_true",
                   help="servers without authentication or encryption (local experiments)")
    p.add_argument("--keys", default=None, help="CURVE key directory (default $GENIE_KEYS_DIR "
                   "or ~/.config/genie/server)")
    p.add_argument("--pool-file", default=None, help="where to write the pool file (default "
                   "KEYS/pool.json, or a temporary file with --insecure)")
    p.add_argument("--check-every", type=float, default=2.0,
                   help="seconds between health checks (default 2)")
    p.add_argument("--log-level", default=os.environ.get("GENIE_LOG_LEVEL", "INFO"))
    flags = server_flags(p)
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s: %(message)s")
    margs = member_args(a, flags)
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    keys_dir = None
    secrets: dict[str, str] | None = None
    if not a.insecure:
        import zmq.auth

        from .server import ensure_keys

        keys_dir = Path(a.keys or os.environ.get("GENIE_KEYS_DIR") or
                        Path.home() / ".config" / "genie" / "server").expanduser()
        pub, _, _ = ensure_keys(keys_dir)
        cpub, csec = zmq.auth.load_certificate(str(keys_dir / "client.key_secret"))
        assert cpub is not None and csec is not None
        secrets = {"server_public_key": pub.decode(), "client_public_key": cpub.decode(),
                   "client_secret_key": csec.decode()}
    if a.pool_file:
        pool_file = Path(a.pool_file).expanduser()
    elif keys_dir is not None:
        pool_file = keys_dir / "pool.json"
    else:
        pool_file = Path(tempfile.mkdtemp(prefix="genie-pool-")) / "pool.json"
    t0 = time.monotonic()
    launcher: Launcher = (RayLauncher(device, a.address, keys_dir, server_args=margs)
                          if a.launcher == "ray" else
                          ProcessLauncher(device, keys_dir, server_args=margs))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    pool = Pool(launcher, a.servers, pool_file=pool_file, keys=secrets)
    try:
        addrs = ",".join(pool.addresses)
        print(f"genie-pool: {a.servers} {device} servers ({a.launcher}) up in "
              f"{time.monotonic() - t0:.1f} s: {addrs}", flush=True)
        print(f"GENIE_POOL={pool_file}", flush=True)
        print(f"GENIE_SERVER={addrs}", flush=True)
        print("GENIE_INSECURE=1" if a.insecure else f"GENIE_KEY_FILE={pool_file}", flush=True)
        while not stop.wait(a.check_every):
            for i in pool.check():
                print(f"genie-pool: replaced server {i}: {pool.members[i].address}", flush=True)
    finally:
        pool.stop()
        logger.info("genie-pool: stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
