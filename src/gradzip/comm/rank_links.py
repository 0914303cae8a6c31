"""Per-rank links: every rank in its own network namespace, behind its own shaped NIC.

The shared link of ``netns.py`` is one token bucket on a loopback that all ranks send
through: W ranks sending at once share RATE. A cluster with one NIC per node is a
different link: each node sends at RATE and receives at RATE, at the same time as
every other node. This module builds that on one machine, without root::

    unshare --user --map-root-user --net --mount        (the "switch" namespace)
      bridge br0
      rank i: namespace rank{i}, veth pair  v{i} (on br0) <-> eth0 (10.77.0.{i+1}/24)
              tbf RATE on eth0 (what rank i sends) and on v{i} (what rank i receives)

and starts rank i's command with ``ip netns exec rank{i}`` and the environment
torchrun would give it (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK=0``,
``LOCAL_WORLD_SIZE=1``, ``MASTER_ADDR`` = rank 0's address, ``MASTER_PORT``), plus
``GLOO_SOCKET_IFNAME=eth0`` and ``GRADZIP_RANK_ADDRS`` (every rank's address). It is
a minimal launcher: when one rank fails, the others are ended and its exit status is
the launcher's.

``command(argv, ranks=W, rate=R)`` is the argv (and environment) that does all of
this; ``available()`` says whether this machine can; ``python -m
gradzip.comm.rank_links`` is the part that runs inside the switch namespace.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from gradzip.comm.netns import SETUP_FAILED, SETUP_MARK, rate_bits_per_second, tbf_burst

#: the switch namespace also needs its own mounts: ``ip netns`` keeps namespaces on
#: ``/run/netns``, which gets a private tmpfs here
_UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--mount", "--"]
SUBNET = "10.77.0"
MASTER_PORT = 29500


def address(rank: int) -> str:
    """Rank ``rank``'s address on the bridge."""
    return f"{SUBNET}.{rank + 1}"


def command(argv: Sequence[str], *, ranks: int, rate: str | None,
            latency: str = "100ms") -> list[str]:
    """The argv that runs ``argv`` once per rank, each rank behind its own link.

    ``rate`` (tc syntax) shapes each rank's NIC both ways; ``None`` leaves the
    links unshaped (the bridge still separates the ranks)."""
    if not argv:
        raise ValueError("rank_links.command needs a command")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if rate is not None:
        rate_bits_per_second(rate)  # a bad rate fails here, not in the namespace
    shaping = [] if rate is None else ["--rate", rate.strip(), "--latency", latency]
    return [*_UNSHARE, sys.executable, "-m", "gradzip.comm.rank_links", "--ranks", str(ranks),
            *shaping, "--", *map(str, argv)]


@functools.cache
def available() -> tuple[bool, str]:
    """``(True, "")`` if per-rank links work here (two shaped ranks that reach each
    other), else ``(False, why)``. Tries it for real once per process."""
    missing = [t for t in ("unshare", "ip", "tc") if shutil.which(t) is None]
    if missing:
        return False, f"missing tools: {', '.join(missing)} (packages util-linux, iproute2)"
    probe = [sys.executable, "-c", "import os; assert os.environ['RANK'] in '01'"]
    try:
        proc = subprocess.run(command(probe, ranks=2, rate="100mbit"), capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"a trial of per-rank links failed: {e}"
    if proc.returncode == 0:
        return True, ""
    err = proc.stderr.strip()
    return False, f"a trial of per-rank links failed (exit {proc.returncode}): {err[-500:]}"


# ---- inside the switch namespace -------------------------------------------------------

def _ip(*args: str) -> None:
    """Run one ``ip``/``tc`` command; a failure ends setup with the setup mark."""
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"{SETUP_MARK} {' '.join(args)}: {proc.stderr.strip()}", file=sys.stderr, flush=True)
        raise SystemExit(SETUP_FAILED)


def _mount_netns_dir() -> None:
    """A private tmpfs on /run/netns (this mount namespace's own), for ``ip netns``."""
    os.makedirs("/run/netns", exist_ok=True)
    _ip("mount", "-t", "tmpfs", "tmpfs", "/run/netns")


def _shape(dev: str, rate: str, latency: str, netns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    _ip(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
        "burst", tbf_burst(rate), "latency", latency)


def build(ranks: int, rate: str | None, latency: str) -> None:
    """The bridge, and one namespace with a (shaped) veth NIC per rank."""
    _mount_netns_dir()
    _ip("ip", "link", "set", "lo", "up")
    _ip("ip", "link", "add", "br0", "type", "bridge")
    _ip("ip", "link", "set", "br0", "up")
    for i in range(ranks):
        ns, outer = f"rank{i}", f"v{i}"
        _ip("ip", "netns", "add", ns)
        _ip("ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("ip", "link", "set", outer, "master", "br0")
        _ip("ip", "link", "set", outer, "up")
        for args in (("link", "set", "lo", "up"), ("addr", "add", f"{address(i)}/24", "dev",
                     "eth0"), ("link", "set", "eth0", "up")):
            _ip("ip", "netns", "exec", ns, "ip", *args)
        if rate is not None:
            _shape(outer, rate, latency)  # what rank i receives
            _shape("eth0", rate, latency, netns=ns)  # what rank i sends


def rank_env(rank: int, ranks: int) -> dict[str, str]:
    """The environment of rank ``rank``: what torchrun sets, on this rank's own NIC."""
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank), "MASTER_ADDR": address(0),
            "MASTER_PORT": str(MASTER_PORT), "GLOO_SOCKET_IFNAME": "eth0",
            "GRADZIP_RANK_ADDRS": ",".join(address(i) for i in range(ranks))}


def launch(argv: Sequence[str], ranks: int) -> int:
    """Start every rank; wait for all; if one fails, end the rest. Returns the status
    of the first rank to fail, else 0."""
    procs = [subprocess.Popen(["ip", "netns", "exec", f"rank{i}", *argv], env=rank_env(i, ranks))
             for i in range(ranks)]

    def end_all(*_: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()

    signal.signal(signal.SIGTERM, end_all)
    signal.signal(signal.SIGINT, end_all)
    status = 0
    while True:
        codes = [p.poll() for p in procs]  # every rank, each time
        failed = [c for c in codes if c not in (None, 0)]
        if failed and status == 0:
            status = failed[0]
            end_all()
            _reap_after(procs, grace_s=10.0)
        if all(c is not None for c in codes):
            return status
        time.sleep(0.05)


def _reap_after(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """Give terminated ranks ``grace_s`` to exit, then kill what is left."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Run COMMAND once per rank, each rank in its own network namespace "
                    "behind its own (shaped) link. Run it inside `unshare --user "
                    "--map-root-user --net --mount`; see gradzip.comm.rank_links.command.")
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--rate", default=None, help="tc rate of each rank's NIC, both ways")
    p.add_argument("--latency", default="100ms", help="tbf latency (queueing bound)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("a COMMAND to run per rank is needed after --")
    build(args.ranks, args.rate, args.latency)
    return launch(cmd, args.ranks)


if __name__ == "__main__":
    raise SystemExit(main())
