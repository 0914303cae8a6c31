"""Per-rank links: every rank in its own network namespace, behind its own shaped NIC.

The shared link of ``netns.py`` is one token bucket on a loopback that all ranks send
through: W ranks sending at once share RATE. A cluster with one NIC per node is a
different link: each node sends at RATE and receives at RATE, at the same time as
every other node. This module builds that on one machine, without root::

    unshare --user --map-root-user --net --mount        (the "switch" namespace)
      bridge br0
      rank i: namespace rank{i}, veth pair  v{i} (on br0) <-> eth0 (10.77.0.{i+1}/24)
              tbf RATE on eth0 (what rank i sends) and on v{i} (what rank i receives)

Nodes (``per_node=L``): the ranks of a node share an unshaped bridge of their own, and
each node reaches the others through one uplink shaped to RATE in each direction, like
a node of L GPUs behind one NIC::

      bridge br0 (the network)
      node k: bridge nb{k}; veth pair u{k} (on nb{k}) <-> d{k} (on br0),
              tbf RATE on u{k} (what node k sends) and on d{k} (what it receives)
      rank i: veth v{i} on nb{i // L} <-> eth0 in namespace rank{i}, unshaped

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
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from gradzip.comm.local_ranks import stop_on_signal
from gradzip.comm.netns import SETUP_FAILED, SETUP_MARK, rate_bits_per_second, tbf_burst

#: the switch namespace also needs its own mounts: ``ip netns`` keeps namespaces on
#: ``/run/netns``, which gets a private tmpfs here
_UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--mount", "--"]
SUBNET = "10.77.0"
MASTER_PORT = 29500
#: the stderr line, after the ranks end, with the bytes each node's uplink carried
UPLINK_MARK = "GRADZIP_UPLINK_BYTES"


def address(rank: int) -> str:
    """Rank ``rank``'s address on the bridge."""
    return f"{SUBNET}.{rank + 1}"


def command(argv: Sequence[str], *, ranks: int, rate: str | None,
            latency: str = "100ms", per_node: int = 0) -> list[str]:
    """The argv that runs ``argv`` once per rank, each rank behind its own link.

    ``rate`` (tc syntax) shapes each rank's NIC both ways (with ``per_node``: each
    node's uplink, the ranks of a node unshaped between them); ``None`` leaves the
    links unshaped (the bridge still separates the ranks)."""
    if not argv:
        raise ValueError("rank_links.command needs a command")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    if per_node < 0 or (per_node and ranks % per_node):
        raise ValueError(f"per_node {per_node} must divide ranks {ranks}")
    if rate is not None:
        rate_bits_per_second(rate)  # a bad rate fails here, not in the namespace
    shaping = [] if rate is None else ["--rate", rate.strip(), "--latency", latency]
    nodes = ["--per-node", str(per_node)] if per_node else []
    return [*_UNSHARE, sys.executable, "-m", "gradzip.comm.rank_links", "--ranks", str(ranks),
            *shaping, *nodes, "--", *map(str, argv)]


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


def _bridge(name: str) -> None:
    _ip("ip", "link", "add", name, "type", "bridge")
    _ip("ip", "link", "set", name, "up")


def _uplinks(nodes: int, rate: str | None, latency: str) -> None:
    """Node k's bridge nb{k}, joined to br0 by the veth pair u{k} <-> d{k} (shaped)."""
    for k in range(nodes):
        _bridge(f"nb{k}")
        _ip("ip", "link", "add", f"u{k}", "type", "veth", "peer", "name", f"d{k}")
        for dev, bridge in ((f"u{k}", f"nb{k}"), (f"d{k}", "br0")):
            _ip("ip", "link", "set", dev, "master", bridge)
            _ip("ip", "link", "set", dev, "up")
        if rate is not None:
            _shape(f"u{k}", rate, latency)  # what node k sends
            _shape(f"d{k}", rate, latency)  # what node k receives


def build(ranks: int, rate: str | None, latency: str, per_node: int = 0) -> None:
    """The bridge, and one namespace with a (shaped) veth NIC per rank; with
    ``per_node``, a bridge per node behind a shaped uplink and unshaped rank NICs."""
    _mount_netns_dir()
    _ip("ip", "link", "set", "lo", "up")
    _bridge("br0")
    if per_node:
        _uplinks(ranks // per_node, rate, latency)
    for i in range(ranks):
        ns, outer = f"rank{i}", f"v{i}"
        _ip("ip", "netns", "add", ns)
        _ip("ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("ip", "link", "set", outer, "master", f"nb{i // per_node}" if per_node else "br0")
        _ip("ip", "link", "set", outer, "up")
        for args in (("link", "set", "lo", "up"), ("addr", "add", f"{address(i)}/24", "dev",
                     "eth0"), ("link", "set", "eth0", "up")):
            _ip("ip", "netns", "exec", ns, "ip", *args)
        if rate is not None and not per_node:
            _shape(outer, rate, latency)  # what rank i receives
            _shape("eth0", rate, latency, netns=ns)  # what rank i sends


def rank_env(rank: int, ranks: int, per_node: int = 0) -> dict[str, str]:
    """The environment of rank ``rank``: what torchrun sets, on this rank's own NIC (a
    node of ``per_node`` ranks: its local rank and size, its node as group rank)."""
    local = per_node or 1
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks),
            "LOCAL_RANK": str(rank % local), "LOCAL_WORLD_SIZE": str(local),
            "GROUP_RANK": str(rank // local), "MASTER_ADDR": address(0),
            "MASTER_PORT": str(MASTER_PORT), "GLOO_SOCKET_IFNAME": "eth0",
            "GRADZIP_RANK_ADDRS": ",".join(address(i) for i in range(ranks))}


def launch(argv: Sequence[str], ranks: int, per_node: int = 0) -> int:
    """Start every rank; wait for all; if one fails, end the rest. Returns the status
    of the first rank to fail, else 0."""
    procs = [subprocess.Popen(["ip", "netns", "exec", f"rank{i}", *argv],
                              env=rank_env(i, ranks, per_node)) for i in range(ranks)]

    end_all = stop_on_signal(procs)
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
    p.add_argument("--per-node", type=int, default=0,
                   help="ranks per node: a bridge per node, the uplinks shaped instead")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("a COMMAND to run per rank is needed after --")
    build(args.ranks, args.rate, args.latency, args.per_node)
    status = launch(cmd, args.ranks, args.per_node)
    if args.per_node:
        print(UPLINK_MARK, json.dumps(uplink_bytes(args.ranks // args.per_node)),
              file=sys.stderr, flush=True)
    return status


def uplink_bytes(nodes: int) -> dict[str, list[int]]:
    """The kernel's count of the bytes each node sent and received over its uplink
    (``u{k}``'s and ``d{k}``'s transmitted bytes: frames with their TCP/IP headers),
    from this network namespace's ``/proc/net/dev`` (``/sys`` shows the host's)."""
    tx = transmitted_bytes(Path("/proc/net/dev").read_text())
    return {"sent": [tx[f"u{k}"] for k in range(nodes)],
            "received": [tx[f"d{k}"] for k in range(nodes)]}


def transmitted_bytes(proc_net_dev: str) -> dict[str, int]:
    """Device -> bytes transmitted, from the text of ``/proc/net/dev``."""
    out = {}
    for line in proc_net_dev.splitlines()[2:]:
        name, _, counters = line.partition(":")
        fields = counters.split()
        if len(fields) >= 9:
            out[name.strip()] = int(fields[8])  # rx: 8 fields, then tx bytes
    return out


def read_uplink_bytes(stderr: str) -> dict[str, list[int]] | None:
    """``uplink_bytes`` as a run of ``command(..., per_node=L)`` reported it."""
    for line in reversed(stderr.splitlines()):
        if line.startswith(UPLINK_MARK):
            return json.loads(line[len(UPLINK_MARK):])
    return None


if __name__ == "__main__":
    raise SystemExit(main())
