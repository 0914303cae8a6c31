"""``gradzip.comm.netns``: counters, tbf settings, and a real namespace when possible."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

from gradzip.comm.netns import (
    NetnsError,
    loopback_bytes,
    netem_available,
    netns_available,
    rate_bits_per_second,
    run_in_netns,
    tbf_burst,
)

# the format of /proc/net/dev (header lines, then "name: 8 rx fields 8 tx fields")
PROC_NET_DEV = "\n".join([
    "Inter-|   Receive                                     |  Transmit",
    " face |bytes packets errs drop fifo frame compressed multicast|bytes packets ...",
    "  eth0: 999 9 0 0 0 0 0 0 888 8 0 0 0 0 0 0",
    "    lo: 1234 5 0 0 0 0 0 0 5678 6 0 0 0 0 0 0",
]) + "\n"


def test_loopback_bytes_reads_lo(tmp_path):
    path = tmp_path / "dev"
    path.write_text(PROC_NET_DEV)
    assert loopback_bytes(path) == (1234, 5678)
    path.write_text(PROC_NET_DEV.replace("    lo:", "  eth1:"))
    with pytest.raises(NetnsError, match="no 'lo' line"):
        loopback_bytes(path)


def test_rates_and_burst():
    assert rate_bits_per_second("100mbit") == 1e8
    with pytest.raises(ValueError, match=r"bytes per second \(80 Mbit/s\).*'10mbit'"):
        rate_bits_per_second("10mbps")  # tc's bytes/s: refused, with what it means
    assert tbf_burst("100mbit") == "256kb"  # at least 256 KiB: above lo's 64 KiB MTU
    assert tbf_burst("10gbit") == "12208kb"  # 10 ms of traffic
    with pytest.raises(ValueError, match="100mbit"):
        tbf_burst("fast")


@pytest.mark.skipif(not netns_available(shaping=True)[0],
                    reason=f"no network namespace here: {netns_available(shaping=True)[1]}")
def test_run_in_netns_counts_and_shapes():
    code = ("import socket\n"
            "from gradzip.comm.netns import loopback_bytes\n"
            "srv = socket.create_server(('127.0.0.1', 0))\n"
            "a = socket.create_connection(srv.getsockname()); b, _ = srv.accept()\n"
            "before = loopback_bytes()[1]\n"
            "a.sendall(b'x' * 100000); n = 0\n"
            "while n < 100000: n += len(b.recv(65536))\n"
            "print(loopback_bytes()[1] - before)\n")
    lines: list[str] = []
    proc = run_in_netns([sys.executable, "-c", code], rate="100mbit", on_line=lines.append)
    assert proc.returncode == 0, proc.stderr
    sent = int(proc.stdout.split()[-1])
    assert 100000 <= sent < 110000  # payload plus TCP/IP headers and ACKs
    assert lines == proc.stdout.splitlines()
    shown = run_in_netns(["tc", "qdisc", "show", "dev", "lo"], rate="100mbit")
    assert "tbf" in shown.stdout and "100Mbit" in shown.stdout
    assert run_in_netns(["sh", "-c", "exit 3"]).returncode == 3


def test_a_rate_schedule_parses_and_says_what_is_wrong():
    from gradzip.comm.netns import rate_changes, rate_schedule

    assert rate_schedule("100mbit") == [(0.0, "100mbit")] and rate_changes("100mbit") is None
    assert rate_schedule("1gbit@60>25mbit@120>100mbit") == [
        (0.0, "1gbit"), (60.0, "25mbit"), (120.0, "100mbit")]
    assert rate_changes("1gbit@60>25mbit") == [{"after_s": 60.0, "rate": "25mbit"}]
    for bad, says in (("1gbit>25mbit", "needs '@SECONDS'"), ("1gbit@60>2mbit@9", "lasts to"),
                      ("1gbit@60>2mbit@30>1mbit", "increasing"), ("1gbit@60>2mbps", "bytes")):
        with pytest.raises(ValueError, match=says):
            rate_schedule(bad)


@pytest.mark.skipif(not netns_available(shaping=True)[0],
                    reason=f"no network namespace here: {netns_available(shaping=True)[1]}")
def test_the_link_changes_rate_on_schedule_and_the_command_keeps_its_status():
    show = "tc qdisc show dev lo; sleep 1.5; tc qdisc show dev lo; exit 3"
    proc = run_in_netns(["sh", "-c", show], rate="100mbit@0.5>10mbit", timeout=60)
    before, after = proc.stdout.strip().splitlines()
    assert "rate 100Mbit" in before and "rate 10Mbit" in after
    assert proc.returncode == 3


@pytest.mark.skipif(not netns_available(shaping=True)[0],
                    reason=f"no network namespace here: {netns_available(shaping=True)[1]}")
def test_each_change_is_logged_with_its_time_and_placed_at_a_step(tmp_path: Path) -> None:
    """The namespace logs when it changed the rate (``GRADZIP_NETNS_CHANGE_LOG``); a
    run's step clock places that time at a step."""
    import time

    from gradzip.compare.harness import place_rate_changes

    log = tmp_path / "changes.txt"
    began = time.time()
    # the command outlives the change by 2.5 s: a loaded machine may start the
    # namespace's change loop late (with 0.7 s to spare it once never ran)
    proc = run_in_netns(["sh", "-c", "sleep 3"], rate="100mbit@0.5>10mbit", timeout=60,
                        env={**os.environ, "GRADZIP_NETNS_CHANGE_LOG": str(log)})
    assert proc.returncode == 0
    (at, rate), = [line.split() for line in log.read_text().splitlines()]
    assert rate == "10mbit" and began + 0.4 < float(at) < time.time()
    ends = [began + 0.1 * i for i in range(1, 30)]  # a step every 0.1 s from ``began``
    placed = place_rate_changes([{"after_s": 0.5, "rate": "10mbit"}], log.read_text(),
                                {"first_step": 11, "end_unix": ends})
    step = placed[0]["at_step"]
    assert ends[step - 12] < float(at) <= ends[step - 11]  # the step it fell in
    assert place_rate_changes([{"after_s": 0.5, "rate": "10mbit"}], "",
                              None)[0]["at_step"] is None


def test_a_rate_may_lose_or_delay_packets() -> None:
    from gradzip.comm.netns import netem_options, rate_schedule, split_rate

    assert split_rate("100mbit+loss=2%+delay=300ms") == ("100mbit",
                                                        {"loss": "2%", "delay": "300ms"})
    assert netem_options({"loss": "2%", "delay": "300ms"}) == \
        "limit,1000,delay,300ms,loss,2%"
    assert netem_options({}) == "-"
    assert rate_schedule("100mbit@5>100mbit+loss=1.5%@9>100mbit")[1] == \
        (5.0, "100mbit+loss=1.5%")
    for bad, message in (("100mbit+loss=2", "+loss=P%"), ("100mbit+jitter=5ms", "+delay"),
                         ("100mbit+loss=100%", "between 0% and 100%"),
                         ("100mbit+delay=5", "+delay=D")):
        with pytest.raises(ValueError, match=re.escape(message)):
            split_rate(bad)


def test_the_namespace_is_told_which_qdisc_each_change_needs() -> None:
    from gradzip.comm.netns import netns_command

    _, env = netns_command(["true"], rate="100mbit+delay=50ms@5>down@7>100mbit")
    assert env["GRADZIP_NETNS_RATE"] == "100mbit"
    assert env["GRADZIP_NETNS_NETEM"] == "limit,1000,delay,50ms"
    assert env["GRADZIP_NETNS_CHANGES"] == "5 down 0 - 2 100mbit 256kb -"


def test_loss_and_delay_are_refused_where_the_kernel_has_no_netem(monkeypatch: Any) -> None:
    from gradzip.comm import netns

    monkeypatch.setattr(netns, "netem_available", lambda: (False, "no sch_netem here"))
    with pytest.raises(ValueError, match="no sch_netem here"):
        netns.check_impairments("100mbit@5>100mbit+loss=1%@9>100mbit")
    netns.check_impairments("100mbit@5>down@9>100mbit")  # needs no netem


@pytest.mark.skipif(not netns_available(shaping=True)[0] or not netem_available()[0],
                    reason=f"no tc netem here: {netem_available()[1]}")
def test_the_link_loses_packets_on_schedule() -> None:
    one_line = "tc qdisc show dev lo | tr '\\n' ' '"
    show = f"{one_line}; echo; sleep 1.5; {one_line}"
    proc = run_in_netns(["sh", "-c", show], rate="100mbit@0.5>100mbit+loss=5%", timeout=60)
    before, after = proc.stdout.strip().splitlines()
    assert "netem" not in before and "tbf" in after and "loss 5%" in after
