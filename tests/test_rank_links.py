"""``gradzip.comm.rank_links``: every rank in its own namespace behind its own link."""

from __future__ import annotations

import json
import math
import os
import sys
import time

import pytest

from gradzip.comm import rank_links
from gradzip.comm.netns import run_streaming

OK, WHY = rank_links.available()
needs_links = pytest.mark.skipif(not OK, reason=f"no per-rank links here: {WHY}")


def test_command_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="needs a command"):
        rank_links.command([], ranks=2, rate=None)
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        rank_links.command(["true"], ranks=0, rate=None)
    with pytest.raises(ValueError, match="100mbit"):
        rank_links.command(["true"], ranks=2, rate="fast")


def test_rank_env_is_what_torchrun_would_set() -> None:
    env = rank_links.rank_env(2, 3)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("2", "3", "0")
    assert env["MASTER_ADDR"] == rank_links.address(0) == "10.77.0.1"
    assert env["GRADZIP_RANK_ADDRS"] == "10.77.0.1,10.77.0.2,10.77.0.3"
    assert env["GLOO_SOCKET_IFNAME"] == "eth0"


def _run(argv: list[str], ranks: int, rate: str | None) -> tuple[int, str]:
    proc = run_streaming(rank_links.command(argv, ranks=ranks, rate=rate),
                         env=dict(os.environ), timeout=120)
    return proc.returncode, proc.stdout


@needs_links
def test_each_rank_has_its_own_shaped_nic() -> None:
    show = ("echo $RANK $(ip -br -4 addr show eth0 | awk '{print $3}') "
            "$(tc qdisc show dev eth0 | grep -o 'rate [0-9A-Za-z]*')")
    rc, out = _run(["sh", "-c", show], ranks=3, rate="50mbit")
    assert rc == 0
    assert sorted(out.split("\n")[:3]) == [
        f"{i} 10.77.0.{i + 1}/24 rate 50Mbit" for i in range(3)]


@needs_links
def test_a_failing_rank_ends_the_others_and_its_status_is_returned() -> None:
    start = time.monotonic()
    rc, _ = _run(["sh", "-c", '[ "$RANK" = 1 ] && exit 3; exec sleep 60'], ranks=3, rate=None)
    assert rc == 3 and time.monotonic() - start < 30


@needs_links
def test_the_rank_to_rank_probe_measures_across_the_links() -> None:
    """The probe compare records runs from rank 0 to rank 1 over their own links and
    prints one rate. What rate a shaped link delivers is a benchmark figure, not a test
    bar (docs/benchmarks/race.md: 95.6 Mbit/s of TCP payload at 100mbit, bar 85-105%);
    that the links are shaped is checked above, on the qdiscs themselves."""
    rc, out = _run([sys.executable, "-m", "gradzip.compare.linkrate", "--nominal", "1e8",
                    "--between-ranks"], ranks=2, rate="100mbit")
    assert rc == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1  # rank 1 reports, rank 0 only sends
    rate = json.loads(lines[0])["bits_per_s"]
    assert math.isfinite(rate) and rate > 0


@needs_links
def test_gloo_ranks_all_reduce_across_their_links() -> None:
    code = ("import torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\n"
            "t = torch.tensor([float(dist.get_rank() + 1)])\n"
            "dist.all_reduce(t)\n"
            "import os; os.write(1, f'{dist.get_rank()}:{int(t.item())}\\n'.encode())\n"
            "dist.destroy_process_group()\n")
    rc, out = _run([sys.executable, "-c", code], ranks=3, rate="1gbit")
    assert rc == 0
    assert sorted(out.split()) == ["0:6", "1:6", "2:6"]  # one write per rank: no interleaving


def test_node_ranks_know_their_node() -> None:
    env = rank_links.rank_env(3, 4, per_node=2)
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == ("1", "2", "1")
    with pytest.raises(ValueError, match="per_node 3 must divide ranks 4"):
        rank_links.command(["true"], ranks=4, rate=None, per_node=3)


def test_uplink_bytes_are_read_from_proc_net_dev() -> None:
    text = ("Inter-|   Receive                                                |  Transmit\n"
            " face |bytes    packets errs drop fifo frame compressed multicast|bytes ...\n"
            "    u0: 100 2 0 0 0 0 0 0 5000 7 0 0 0 0 0 0\n"
            "    d0: 5000 7 0 0 0 0 0 0 100 2 0 0 0 0 0 0\n")
    assert rank_links.transmitted_bytes(text) == {"u0": 5000, "d0": 100}
    line = rank_links.UPLINK_MARK + ' {"sent": [1, 2], "received": [3, 4]}'
    assert rank_links.read_uplink_bytes(f"noise\n{line}\n") == {"sent": [1, 2],
                                                                  "received": [3, 4]}


@needs_links
def test_nodes_share_a_bridge_and_only_uplinks_are_shaped() -> None:
    show = ("echo node $RANK $LOCAL_RANK $(tc qdisc show dev eth0 | grep -c tbf); "
            f"{sys.executable} -c \"import os, torch, torch.distributed as d; "
            "d.init_process_group('gloo'); t = torch.ones(1); d.all_reduce(t); "
            "os.write(1, f'sum {int(t.item())}\\\\n'.encode()); "
            "d.destroy_process_group()\"")  # one write: no interleaving; a live gloo group
    # at exit can abort the interpreter ("terminate called without an active exception")
    proc = run_streaming(rank_links.command(["sh", "-c", show], ranks=4, rate="50mbit",
                                            per_node=2), env=dict(os.environ), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    nodes = sorted(line for line in lines if line.startswith("node"))
    assert nodes == ["node 0 0 0", "node 1 1 0", "node 2 0 0", "node 3 1 0"]  # unshaped
    assert [line for line in lines if line.startswith("sum")] == ["sum 4"] * 4
    uplinks = rank_links.read_uplink_bytes(proc.stderr)
    assert uplinks is not None and min(uplinks["sent"]) > 0
