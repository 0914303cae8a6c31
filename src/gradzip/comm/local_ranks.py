"""``python -m gradzip.comm.local_ranks --ranks N -- COMMAND``: N ranks on this machine.

What torchrun --standalone sets for each rank (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), without its elastic agent.
``gradzip compare`` starts its ranks this way on a link that goes down (``--rate
"100mbit@30>down@40>100mbit"``): torchrun's agent polls its store over that same link
and stops the whole job when the link stays down longer than its TCP connection
survives (about 10 s here), before the ranks' own ``--comm-timeout`` could decide.

A rank that fails does not end the others at once: they get ``--grace`` seconds to
meet the failure themselves (a collective that fails writes a checkpoint and a record
on every rank); what is left then is ended. The exit status is the first failure's.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_on_signal(procs: Sequence[subprocess.Popen[bytes]]) -> Callable[..., None]:
    """Pass SIGTERM and SIGINT on to the ranks still running; returns the function that
    does it (to end them for other reasons too)."""
    def end_all(*_: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()

    signal.signal(signal.SIGTERM, end_all)
    signal.signal(signal.SIGINT, end_all)
    return end_all


def launch(argv: Sequence[str], ranks: int, grace_s: float = 60.0) -> int:
    """Start ``ranks`` ranks of ``argv``; wait for all. Returns the status of the
    first rank to fail, else 0."""
    port = str(_free_port())
    procs = [subprocess.Popen(list(argv), env={
        **os.environ, "RANK": str(r), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(r),
        "LOCAL_WORLD_SIZE": str(ranks), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port}) for r in range(ranks)]

    end_all = stop_on_signal(procs)
    status, deadline = 0, float("inf")
    while True:
        codes = [p.poll() for p in procs]
        if status == 0 and (failed := [c for c in codes if c not in (None, 0)]):
            status, deadline = failed[0], time.monotonic() + grace_s
        if all(c is not None for c in codes):
            return status
        if time.monotonic() > deadline:
            end_all()
            deadline = float("inf")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, required=True)
    p.add_argument("--grace", type=float, default=60.0,
                   help="seconds the other ranks get after one fails (default 60)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd or args.ranks < 1:
        p.error("--ranks N (>= 1) and a COMMAND after -- are needed")
    return launch(cmd, args.ranks, args.grace)


if __name__ == "__main__":
    sys.exit(main())
