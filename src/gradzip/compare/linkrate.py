"""The rate a link actually delivers, measured once per compare and recorded.

Run inside the shaped namespace (``python -m gradzip.compare.linkrate``): one TCP
connection first carries enough to drain the token bucket's burst (untimed), then
about ``--seconds`` at the nominal rate, timed by the receiver from the end of the
burst to the last byte. Prints one JSON line ``{"bits_per_s": ...}``.

* Shared link (the default): both ends in one process, over ``lo``. This is what one
  sender gets alone; when W ranks send at once they share it (one token bucket on
  ``lo`` is one link), which the report states.
* ``--between-ranks`` (under ``gradzip.comm.rank_links``): rank 0 sends to rank 1 over
  their own links (rank 0's NIC out, rank 1's NIC in); rank 1 prints the result.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time

CHUNK = 1 << 16
PROBE_PORT = 29600


def _sink(conn: socket.socket, warmup_bytes: int) -> float:
    """Receive until the sender closes; bits/s of what arrived after ``warmup_bytes``."""
    got, base, start = 0, 0, 0.0
    with conn:
        while data := conn.recv(CHUNK):
            got += len(data)
            if not start and got >= warmup_bytes:
                base, start = got, time.perf_counter()
    elapsed = time.perf_counter() - start
    return (got - base) * 8 / elapsed if start and elapsed > 0 else float("nan")


def _source(addr: tuple[str, int], total: int, connect_s: float = 30.0) -> None:
    """Send ``total`` bytes to ``addr`` (retrying the connection while the peer starts)."""
    deadline = time.monotonic() + connect_s
    while True:
        try:
            client = socket.create_connection(addr, timeout=connect_s)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    payload = b"\0" * CHUNK
    with client:
        for _ in range(0, total, CHUNK):
            client.sendall(payload)


def _total(nominal_bits_per_s: float, seconds: float, warmup_bytes: int) -> int:
    return warmup_bytes + max(int(nominal_bits_per_s / 8 * seconds), CHUNK)


def measure(nominal_bits_per_s: float, seconds: float = 1.0,
            warmup_bytes: int = 1 << 20) -> float:
    """Bits per second delivered over loopback after ``warmup_bytes`` of burst."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        total = _total(nominal_bits_per_s, seconds, warmup_bytes)
        sender = threading.Thread(target=_source, args=(server.getsockname(), total))
        sender.start()
        conn, _ = server.accept()
        rate = _sink(conn, warmup_bytes)
        sender.join()
    return rate


def measure_between_ranks(nominal_bits_per_s: float, seconds: float = 1.0,
                          warmup_bytes: int = 1 << 20) -> float | None:
    """Rank 0 sends to rank 1 over their own links; rank 1 returns the rate (others
    return ``None``). Addresses come from ``GRADZIP_RANK_ADDRS`` (rank_links)."""
    rank, addrs = int(os.environ["RANK"]), os.environ["GRADZIP_RANK_ADDRS"].split(",")
    if rank == 1:
        with socket.create_server((addrs[1], PROBE_PORT)) as server:
            conn, _ = server.accept()
            return _sink(conn, warmup_bytes)
    if rank == 0:
        _source((addrs[1], PROBE_PORT), _total(nominal_bits_per_s, seconds, warmup_bytes))
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nominal", type=float, required=True, help="nominal rate, bits/s")
    p.add_argument("--seconds", type=float, default=1.0, help="timed sending time")
    p.add_argument("--between-ranks", action="store_true",
                   help="rank 0 sends to rank 1 (under gradzip.comm.rank_links)")
    args = p.parse_args(argv)
    rate = (measure_between_ranks(args.nominal, args.seconds) if args.between_ranks
            else measure(args.nominal, args.seconds))
    if rate is not None:
        print(json.dumps({"bits_per_s": rate}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
