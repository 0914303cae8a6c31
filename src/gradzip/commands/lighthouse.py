"""``gradzip lighthouse``: the torchft Lighthouse of a job on several machines.

Start it on one machine, then one replica group per machine joins it:

    gradzip lighthouse --bind 0.0.0.0:29510 --min-replicas 2
    # on machine K (K = 0 .. N-1):
    GRADZIP_FT_HOST=<this machine's address> gradzip train --ft N --ft-replica K \\
        --ft-lighthouse http://<lighthouse host>:29510 --outer diloco --outer-codec int8 ...

It forms each round's quorum of the groups alive; it runs until Ctrl-C. On one machine,
``gradzip train --ft N`` starts its own (on localhost) and needs none of this.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

HELP = "run a torchft Lighthouse for gradzip train --ft on several machines"


def register(sub: Any) -> None:
    p = sub.add_parser("lighthouse", help=HELP, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bind", default="127.0.0.1:29510", metavar="HOST:PORT",
                   help="where to listen; 0.0.0.0:PORT for other machines (default: "
                        "127.0.0.1:29510, this machine only)")
    p.add_argument("--min-replicas", type=int, default=2, metavar="N",
                   help="replica groups a round needs (default: 2)")
    p.add_argument("--join-ms", type=int, default=2000, metavar="MS",
                   help="how long a round waits for a live group that is late (default: 2000)")
    p.add_argument("--heartbeat-ms", type=int, default=2000, metavar="MS",
                   help="a group silent this long is dead to the Lighthouse (default: 2000)")
    p.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gradzip.comm.ft import Lighthouse

    if args.min_replicas < 1:
        raise ValueError(f"--min-replicas must be >= 1, got {args.min_replicas}")
    lighthouse = Lighthouse(args.bind, min_replicas=args.min_replicas, join_ms=args.join_ms,
                            heartbeat_ms=args.heartbeat_ms)
    print(f"torchft Lighthouse at {lighthouse.address} (Ctrl-C stops it)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        lighthouse.close()
