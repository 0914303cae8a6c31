"""Run a command inside a fresh network namespace and count the bytes it sends.

One idea, used twice: ``unshare --user --map-root-user --net`` gives an unprivileged
process its own network stack with only a loopback device. Everything the
processes inside send to each other crosses that ``lo``, and ``/proc/net/dev`` (which
is per namespace; ``/sys/class/net`` is not) counts it. So

* the kernel's ``lo`` tx counter is ground truth for the bytes a group of local
  ranks put on the wire (``tests/test_link_bytes.py``, ``gradzip bench link``), and
* a ``tbf`` qdisc on that ``lo`` turns it into a bandwidth-limited link shared by
  all ranks (``gradzip bench comm --rate``).

``netns_available()`` says whether this machine can do it (and why not),
``run_in_netns(argv, rate="100mbit")`` runs a command in a fresh namespace, and
``loopback_bytes()``, called from inside, reads the counters.

The namespace has no other interface, so gloo must use ``lo``: ``run_in_netns`` sets
``GLOO_SOCKET_IFNAME=lo`` unless the caller's ``env`` says otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "NetnsError", "loopback_bytes", "netns_available", "netns_command", "run_in_netns",
    "run_streaming", "tbf_burst",
]

#: exit status of the namespace's setup script when ``ip``/``tc`` failed (the command
#: itself never ran); chosen to be unlikely for a real command
SETUP_FAILED = 97
SETUP_MARK = "gradzip.netns setup failed:"

_UNSHARE = ["unshare", "--user", "--map-root-user", "--net", "--"]

# bring lo up, optionally shape it, then exec the command (its pid and status become
# the namespace's: a signal to the process group reaches it directly)
_SETUP = r"""
ip link set lo up || { echo "gradzip.netns setup failed: ip link set lo up" >&2; exit 97; }
# the link's qdisc: RATE BURST IMPAIRMENTS ("-": none; else netem's options, ','
# between words, for a netem below the token bucket) or "down": every packet dropped
# (TCP retransmits)
shape() {
  if [ "$1" = down ]; then
    tc qdisc replace dev lo root pfifo limit 0
  elif [ "$3" = - ]; then
    tc qdisc replace dev lo root tbf rate "$1" burst "$2" latency "$GRADZIP_NETNS_LATENCY"
  else
    tc qdisc del dev lo root 2>/dev/null
    tc qdisc add dev lo root handle 1: tbf rate "$1" burst "$2" latency "$GRADZIP_NETNS_LATENCY" &&
      tc qdisc add dev lo parent 1:1 handle 10: netem $(echo "$3" | tr , ' ')
  fi
}
if [ -n "$GRADZIP_NETNS_RATE" ]; then
  shape "$GRADZIP_NETNS_RATE" "$GRADZIP_NETNS_BURST" "${GRADZIP_NETNS_NETEM:--}" || {
    echo "gradzip.netns setup failed: tc qdisc on lo: $GRADZIP_NETNS_RATE $GRADZIP_NETNS_NETEM" >&2
    exit 97; }
fi
if [ -n "$GRADZIP_NETNS_CHANGES" ]; then
  # a link whose rate changes: each "SECONDS RATE BURST IMPAIRMENTS" after the one before
  ( set -- $GRADZIP_NETNS_CHANGES
    while [ $# -ge 4 ]; do
      sleep "$1"
      # when it changed (Unix seconds), for the record to place the change at a step;
      # a change that failed is logged as such and placed nowhere
      if shape "$2" "$3" "$4"; then at="$(date +%s.%N)"; else at=failed; fi
      [ -n "$GRADZIP_NETNS_CHANGE_LOG" ] && echo "$at $2" >> "$GRADZIP_NETNS_CHANGE_LOG"
      shift 4
    done ) </dev/null >/dev/null 2>&1 &
  changes=$!
  "$@"
  status=$?
  kill "$changes" 2>/dev/null
  exit $status
fi
exec "$@"
"""

_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)$", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}

_USERNS_HELP = (
    "unprivileged user namespaces are disabled or restricted on this machine. Enable "
    "them as root: `sysctl kernel.unprivileged_userns_clone=1` (Debian), "
    "`sysctl user.max_user_namespaces=15000` (if it is 0), or on Ubuntu >= 23.10 "
    "`sysctl kernel.apparmor_restrict_unprivileged_userns=0`; inside a container, "
    "run it with a seccomp profile that allows unshare(CLONE_NEWUSER)"
)


class NetnsError(RuntimeError):
    """The namespace could not be made (not the command failing inside it)."""


def _missing_tools(shaping: bool) -> list[str]:
    need = {"unshare": "util-linux", "ip": "iproute2"}
    if shaping:
        need["tc"] = "iproute2"
    return [f"{tool} (package {pkg})" for tool, pkg in need.items() if shutil.which(tool) is None]


@functools.cache
def netns_available(shaping: bool = False) -> tuple[bool, str]:
    """``(True, "")`` if a fresh user+net namespace with ``lo`` up works here, else
    ``(False, why and how to fix it)``. ``shaping=True`` also requires a ``tbf``
    qdisc on ``lo`` to work. Tries it for real once per process (cached)."""
    missing = _missing_tools(shaping)
    if missing:
        return False, f"missing tools: {', '.join(missing)}; install them"
    check = "ip link set lo up && grep -q '^ *lo:' /proc/net/dev"
    if shaping:
        check += " && tc qdisc add dev lo root tbf rate 100mbit burst 256kb latency 100ms"
    try:
        proc = subprocess.run([*_UNSHARE, "sh", "-c", check], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"a trial namespace failed: {e}"
    if proc.returncode == 0:
        return True, ""
    err = proc.stderr.strip()
    if "unshare" in err and ("Operation not permitted" in err or "Permission denied" in err
                             or "No space left" in err):
        return False, f"{err}: {_USERNS_HELP}"
    if shaping and ("tc" in err or "qdisc" in err.lower()):
        return False, (f"a tbf qdisc on lo failed ({err}); the kernel needs the sch_tbf "
                       "module (`modprobe sch_tbf` as root)")
    return False, f"a trial namespace failed (exit {proc.returncode}): {err or 'no message'}"


def loopback_bytes(proc_net_dev: str | os.PathLike[str] = "/proc/net/dev") -> tuple[int, int]:
    """``(rx_bytes, tx_bytes)`` of ``lo`` in the current network namespace.

    Inside a fresh namespace both count every byte any process there sent over
    loopback (what is sent on ``lo`` is also received on it), IP and TCP headers
    included.
    """
    text = Path(proc_net_dev).read_text()
    for line in text.splitlines():
        name, sep, fields = line.partition(":")
        if sep and name.strip() == "lo":
            cols = fields.split()
            return int(cols[0]), int(cols[8])  # receive bytes, transmit bytes
    raise NetnsError(f"no 'lo' line in {proc_net_dev}; is this a Linux network namespace?")


def rate_bits_per_second(rate: str) -> float:
    """``"100mbit"`` -> 1e8 (k/m/g/t = 1000). Rates are bits per second everywhere in
    gradzip; tc's ``bps`` means *bytes* per second, so ``100mbps`` (800 Mbit/s to tc,
    100 Mbit/s to most readers) is refused with what it would have meant."""
    m = _RATE.match(rate.strip())
    if not m:
        raise ValueError(
            f"rate must be bits per second like tc's, e.g. '100mbit', '1gbit' or '500kbit', "
            f"got {rate!r}"
        )
    value = float(m.group(1)) * _SCALE[m.group(2).lower()]
    if m.group(3).lower() == "bps":
        raise ValueError(
            f"{rate!r} is tc's bytes per second ({value * 8 / 1e6:g} Mbit/s); gradzip takes "
            f"bits per second: write '{m.group(1)}{m.group(2).lower()}bit' for "
            f"{m.group(1)} {m.group(2).upper()}bit/s, or "
            f"'{float(m.group(1)) * 8:g}{m.group(2).lower()}bit' for what tc would do")
    return value


#: a "rate" of a schedule: the link is down (every packet dropped) for that span
DOWN = "down"

#: what a rate may add after ``+`` (tc netem's options): random packet loss in percent,
#: and a delay added to every packet (a spike when it lasts a few seconds)
_IMPAIRMENT = {"loss": re.compile(r"^(\d+(?:\.\d+)?)%$"),
               "delay": re.compile(r"^(\d+(?:\.\d+)?)(ms|s)$")}


def split_rate(element: str) -> tuple[str, dict[str, str]]:
    """``"100mbit+loss=2%+delay=200ms"`` -> ``("100mbit", {"loss": "2%", "delay":
    "200ms"})``: a schedule element's rate and its impairments (tc netem's ``loss`` and
    ``delay``). ValueError says what is wrong."""
    rate, *extras = (part.strip() for part in element.split("+"))
    found: dict[str, str] = {}
    for extra in extras:
        name, _, value = extra.partition("=")
        pattern = _IMPAIRMENT.get(name.strip())
        if pattern is None or not pattern.match(value.strip()):
            raise ValueError(f"{element!r}: after the rate, '+loss=P%' (random packet loss, "
                             f"0 < P < 100) or '+delay=D' (ms or s added to every packet), "
                             f"e.g. '100mbit+loss=1%'; got {extra!r}")
        found[name.strip()] = value.strip()
    loss = found.get("loss")
    if loss is not None and not 0 < float(loss[:-1]) < 100:
        raise ValueError(f"{element!r}: loss must be between 0% and 100%, got {loss}")
    return rate, found


def netem_options(impairments: dict[str, str]) -> str:
    """netem's options for ``split_rate``'s impairments, ',' between words (the setup
    script's word for them); ``-`` for none. netem sits below the link's token bucket
    (which keeps its rate, burst and latency bound): it delays and drops, the bucket
    shapes; its queue holds 1,000 packets, netem's default."""
    if not impairments:
        return "-"
    words = ["limit", "1000"]
    for name in ("delay", "loss"):
        if name in impairments:
            words += [name, impairments[name]]
    return ",".join(words)


@functools.cache
def netem_available() -> tuple[bool, str]:
    """Whether this kernel can impair a link (``sch_netem``), and how to fix it if not;
    tried for real once per process."""
    ok, why = netns_available(shaping=True)
    if not ok:
        return False, why
    try:
        proc = subprocess.run([*_UNSHARE, "sh", "-c", "ip link set lo up && tc qdisc add dev "
                               "lo root handle 1: tbf rate 100mbit burst 256kb latency 100ms "
                               "&& tc qdisc add dev lo parent 1:1 handle 10: netem loss 1% "
                               "delay 1ms"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"a trial namespace for tc netem failed: {e}"
    if proc.returncode == 0:
        return True, ""
    return False, (f"tc netem failed ({proc.stderr.strip() or 'no message'}): packet loss "
                   "and delay need the kernel's sch_netem module (`modprobe sch_netem` as "
                   "root; some distributions ship it in linux-modules-extra)")


def check_impairments(text: str) -> None:
    """ValueError unless this machine can make every impairment of rate schedule
    ``text`` (refused when a run is set up, not in the middle of it)."""
    if any(split_rate(rate)[1] for _, rate in rate_schedule(text)):
        ok, why = netem_available()
        if not ok:
            raise ValueError(f"--rate {text!r}: {why}")


def rate_schedule(text: str) -> list[tuple[float, str]]:
    """A link rate that changes during the run: ``"1gbit@60>25mbit"`` is 1 Gbit/s for
    the first 60 seconds, then 25 Mbit/s (``"1gbit@60>25mbit@120>100mbit"``: and 100
    Mbit/s from 120 s on). ``down`` is a link that drops every packet:
    ``"100mbit@30>down@40>100mbit"`` goes down for 10 s at 30 s. A rate may carry
    impairments (``split_rate``): ``"100mbit@30>100mbit+loss=2%@40>100mbit"`` loses 2%
    of packets for 10 s, ``"...>100mbit+delay=300ms@33>..."`` is a delay spike. Returns
    ``[(from_second, rate), ...]``, the first from 0; a plain rate is a schedule of
    one. ValueError says what is wrong."""
    out: list[tuple[float, str]] = []
    parts = [p.strip() for p in text.split(">")]
    start = 0.0
    for k, part in enumerate(parts):
        rate, at, until = part.partition("@")
        if rate.strip() == DOWN:
            if k in (0, len(parts) - 1):
                raise ValueError(f"rate schedule {text!r}: a link can go down only between "
                                 f"two rates, e.g. '100mbit@30>down@40>100mbit'")
        else:
            rate_bits_per_second(split_rate(rate)[0])  # ValueError for a bad rate
        out.append((start, rate.strip()))
        if k + 1 < len(parts):
            try:
                end = float(until) if at else float("nan")
            except ValueError:
                end = float("nan")
            if not end > start:
                raise ValueError(
                    f"rate schedule {text!r}: each rate but the last needs '@SECONDS', the "
                    f"time it ends (from the run's start, increasing), e.g. "
                    f"'1gbit@60>25mbit'; got {part!r}")
            start = end
        elif at:
            raise ValueError(f"rate schedule {text!r}: the last rate lasts to the end; "
                             f"drop its '@{until}'")
    return out


def rate_changes(text: str) -> list[dict[str, Any]] | None:
    """The changes of a rate schedule as records hold them (``after_s``, ``rate``); None
    for a rate that stays."""
    schedule = rate_schedule(text)
    return [{"after_s": t, "rate": r} for t, r in schedule[1:]] or None


def base_rate(element: str) -> str:
    """The rate of a schedule element, its impairments left out (``100mbit``)."""
    return split_rate(element)[0]


def tbf_burst(rate: str) -> str:
    """The token bucket size for ``rate``: 10 ms of traffic, at least 256 KiB.

    tbf drops any packet larger than its bucket, and lo's MTU is 64 KiB; the kernel
    refills the bucket once per timer tick (1-10 ms), so it must also hold a tick's
    worth of traffic or the link runs slower than ``rate``. 256 KiB covers 200 Mbit/s
    at a 10 ms tick; faster rates get 10 ms of traffic.
    """
    nbytes = max(256 * 1024, int(rate_bits_per_second(base_rate(rate)) / 8 * 0.010))
    return f"{(nbytes + 1023) // 1024}kb"  # tc's "kb" is KiB


def netns_command(argv: Sequence[str], *, rate: str | None = None,
                  latency: str = "100ms") -> tuple[list[str], dict[str, str]]:
    """The argv that runs ``argv`` in a fresh namespace, and the env entries it needs.

    ``rate`` (tc syntax, e.g. ``"100mbit"``) puts ``tbf rate RATE burst
    tbf_burst(RATE) latency LATENCY`` on ``lo``: one link shared by every process
    inside. ``latency`` bounds how long a packet may queue in the bucket (packets
    beyond that are dropped and TCP retransmits them); 100 ms is ample for TCP to
    keep the link busy without hiding a stall.
    """
    if not argv:
        raise ValueError("run_in_netns needs a command")
    extra = {"GRADZIP_NETNS_RATE": "", "GRADZIP_NETNS_CHANGES": ""}
    if rate is not None:
        schedule = rate_schedule(rate)
        first, impairments = split_rate(schedule[0][1])
        extra.update(GRADZIP_NETNS_RATE=first, GRADZIP_NETNS_BURST=tbf_burst(first),
                     GRADZIP_NETNS_LATENCY=latency,
                     GRADZIP_NETNS_NETEM=netem_options(impairments))
        steps = [f"{t - t0:g} {r} 0 -" if r == DOWN else
                 f"{t - t0:g} {base_rate(r)} {tbf_burst(r)} {netem_options(split_rate(r)[1])}"
                 for (t0, _), (t, r) in zip(schedule, schedule[1:], strict=False)]
        extra["GRADZIP_NETNS_CHANGES"] = " ".join(steps)
    return [*_UNSHARE, "sh", "-c", _SETUP, "gradzip-netns", *map(str, argv)], extra


def run_in_netns(
    argv: Sequence[str],
    *,
    rate: str | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 600.0,
    cwd: str | os.PathLike[str] | None = None,
    on_line: Callable[[str], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` in a fresh user+net namespace with ``lo`` up (shaped to ``rate``).

    Returns the ``CompletedProcess`` (text ``stdout``/``stderr``) whatever the
    command's exit status, as ``subprocess.run`` does. ``env`` defaults to this
    process's environment (plus ``GLOO_SOCKET_IFNAME=lo``). ``on_line`` is called with
    each stdout line as it arrives (for progress displays). Raises ``NetnsError`` if
    the namespace or the qdisc cannot be made, ``subprocess.TimeoutExpired`` after
    ``timeout`` seconds, having killed the command and everything it started.
    """
    ok, why = netns_available(shaping=rate is not None)
    if not ok:
        raise NetnsError(f"cannot run in a network namespace: {why}")
    cmd, extra = netns_command(argv, rate=rate)
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    full_env.update(extra)
    return run_streaming(cmd, env=full_env, timeout=timeout, cwd=cwd, on_line=on_line)


def run_streaming(
    cmd: Sequence[str],
    *,
    env: Mapping[str, str],
    timeout: float,
    cwd: str | os.PathLike[str] | None = None,
    on_line: Callable[[str], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a namespace command (``netns_command`` or ``rank_links.command``) to its end.

    Streams stdout lines to ``on_line``; kills the command's whole process tree after
    ``timeout`` (``subprocess.TimeoutExpired``) or if ``on_line`` raises; turns a failed
    namespace setup (exit ``SETUP_FAILED`` with the setup mark on stderr) into
    ``NetnsError``. Any other exit status is returned, as ``subprocess.run`` does.
    """
    lines: list[str] = []
    with tempfile.TemporaryFile("w+") as err:
        # own session: on timeout the whole process tree (ranks included) is killed
        proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=err, text=True,
                                env=dict(env), cwd=cwd, start_new_session=True)
        timed_out = threading.Event()

        def kill() -> None:
            timed_out.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append(line)
                if on_line is not None:
                    on_line(line.rstrip("\n"))
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:  # on_line raised: don't leave the tree running
                kill()
                proc.wait()
        err.seek(0)
        stderr = err.read()
    stdout = "".join(lines)
    if timed_out.is_set():
        raise subprocess.TimeoutExpired(list(cmd), timeout, output=stdout, stderr=stderr)
    if proc.returncode == SETUP_FAILED and SETUP_MARK in stderr:
        what = stderr[stderr.index(SETUP_MARK) + len(SETUP_MARK):].strip()
        hint = ("; the kernel needs the sch_tbf module and a valid rate" if "tc" in what
                else "")
        raise NetnsError(f"namespace setup failed: {what}{hint}")
    return subprocess.CompletedProcess(list(cmd), proc.returncode, stdout, stderr)
