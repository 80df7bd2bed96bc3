"""Test hosts for the separate-host deployment: processes not parented by one launcher, on loopback or in
network namespaces of their own.

:class:`Processes` starts each command in a session of its own (``start_new_session``), as a host's own
supervisor would, and kills and reaps them all, by process group. :class:`Namespaces` makes one network
namespace per test host, joined by a bridge inside a hub namespace (veth pairs, private addresses), plus one
veth into the test's own namespace so the test reaches them as a client; everything is removed at the end.
Nothing is routed outside the machine.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    netns: str | None = None  # None: this machine's own namespace

    def command(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *args] if self.netns else args


class Processes:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, tuple[subprocess.Popen, Host]] = {}

    def nexus(self, name: str, host: Host, *args: str) -> subprocess.Popen:
        """``nexus ARGS`` on ``host``, in a session of its own; output in ``logs/NAME.log``."""
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 (kept open for the child's lifetime)
        proc = subprocess.Popen(host.command([sys.executable, "-m", "nexus.client.cli", *args]), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        log.close()
        self.procs[name] = (proc, host)
        return proc

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal the process group of ``name`` (its nanny and worker: a host lost at once) and reap it."""
        proc, _ = self.procs.pop(name)
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)

    def alive(self) -> dict[str, int | None]:
        return {n: p.poll() for n, (p, _) in self.procs.items()}

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def listening(self) -> list[tuple[str, str, str]]:
        """(process, bound address, its host's address) of every listening TCP socket and bound UDP socket of
        every process and child, read from the process's own network namespace (psutil reads the caller's)."""
        out = []
        for name, (proc, host) in self.procs.items():
            try:
                family = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
            except psutil.NoSuchProcess:
                continue
            for pid in family:
                out += [(name, ip, host.address) for ip in _bound_addresses(pid)]
        return out

    def stop_all(self) -> None:
        """SIGTERM every group (workers first, the scheduler last), SIGKILL what is left after 20 s; reap all."""
        for proc, _ in reversed(list(self.procs.values())):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc, _ in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)
        self.procs.clear()


def _hex_ip(text: str) -> str:
    """A /proc/net address (little-endian 32-bit words) as text."""
    raw = bytes.fromhex(text)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _bound_addresses(pid: int) -> list[str]:
    """Local addresses of ``pid``'s listening TCP and unconnected UDP sockets (its namespace's /proc tables)."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except FileNotFoundError:
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed in between
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6", "udp", "udp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            f = line.split()
            local, remote, state, inode = f[1], f[2], f[3], f[9]
            bound = state == "0A" if table.startswith("tcp") else set(remote.split(":")[1]) == {"0"}
            if inode in inodes and bound:
                out.append(_hex_ip(local.split(":")[0]))
    return out


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Namespaces:
    """Test hosts ``name -> 10.R.K.i`` in namespaces of their own; the test's client address is ``10.R.K.254``."""

    def __init__(self, names: list[str]) -> None:
        self.prefix = f"nx{os.getpid() % 100000}"
        self.subnet = _free_subnet()
        self.hub = f"{self.prefix}-hub"
        self.client_if = f"{self.prefix}c"
        self.hosts = {n: Host(n, f"{self.subnet}.{i + 1}", f"{self.prefix}-{n}") for i, n in enumerate(names)}
        self.client_address = f"{self.subnet}.254"
        self._made: list[str] = []

    @staticmethod
    def unavailable() -> str | None:
        """Why namespaces cannot be made here (None: they can), tried with a namespace made and removed."""
        if shutil.which("ip") is None:
            return "no `ip` command (iproute2)"
        probe = f"nxprobe{os.getpid() % 100000}"
        r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            return f"`ip netns add` failed: {r.stderr.strip() or r.returncode} (needs root / CAP_SYS_ADMIN)"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
        return None

    def __enter__(self) -> Namespaces:
        try:
            self._add(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, h in enumerate(self.hosts.values()):
                self._add(h.netns)
                inside, peer = f"{self.prefix}h{i}", f"{self.prefix}p{i}"
                _ip("link", "add", inside, "type", "veth", "peer", "name", peer)
                _ip("link", "set", inside, "netns", h.netns)
                _ip("link", "set", peer, "netns", self.hub)
                _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", inside)
                _ip("-n", h.netns, "link", "set", inside, "up")
                _ip("-n", self.hub, "link", "set", peer, "master", "br0", "up")
            _ip("link", "add", self.client_if, "type", "veth", "peer", "name", f"{self.prefix}cp")
            _ip("link", "set", f"{self.prefix}cp", "netns", self.hub)
            _ip("-n", self.hub, "link", "set", f"{self.prefix}cp", "master", "br0", "up")
            _ip("addr", "add", f"{self.client_address}/24", "dev", self.client_if)
            _ip("link", "set", self.client_if, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "link", "del", self.client_if], capture_output=True, timeout=30)
        for ns in reversed(self._made):  # removing a namespace removes the veth ends inside it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()


def _free_subnet() -> str:
    """A 10.213.K /24 that no interface of this machine uses."""
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, timeout=30).stdout
    used += subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, timeout=30).stdout
    for k in range(1 + os.getpid() % 200, 255):
        if f"10.213.{k}." not in used:
            return f"10.213.{k}"
    raise RuntimeError("no free 10.213.K.0/24 subnet")
