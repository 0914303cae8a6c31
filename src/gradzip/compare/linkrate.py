"""The rate a link actually delivers, measured once per compare and recorded.

Run inside the shaped namespace (``python -m gradzip.compare.linkrate``): one TCP
connection over ``lo`` first sends enough to drain the token bucket's burst (untimed),
then sends for about ``--seconds`` at the nominal rate, timed from the first to the
last byte the receiver gets. Prints one JSON line ``{"bits_per_s": ...}``.

This is what one sender gets alone; when W ranks send at once they share it (one
token bucket on ``lo`` is one link), which the report states.
"""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time

CHUNK = 1 << 16


def _receive(server: socket.socket, total: int, out: dict[str, float]) -> None:
    conn, _ = server.accept()
    with conn:
        got = 0
        while got < total:
            data = conn.recv(CHUNK)
            if not data:
                break
            if got == 0:
                out["first"] = time.perf_counter()
            got += len(data)
        out["last"] = time.perf_counter()
        out["bytes"] = got


def measure(nominal_bits_per_s: float, seconds: float = 1.0,
            warmup_bytes: int = 1 << 20) -> float:
    """Bits per second delivered over loopback after ``warmup_bytes`` of burst."""
    timed = max(int(nominal_bits_per_s / 8 * seconds), CHUNK)
    payload = b"\0" * CHUNK
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        warm: dict[str, float] = {}
        result: dict[str, float] = {}
        for total, out in ((warmup_bytes, warm), (timed, result)):
            t = threading.Thread(target=_receive, args=(server, total, out))
            t.start()
            with socket.create_connection(server.getsockname()) as client:
                sent = 0
                while sent < total:
                    client.sendall(payload)
                    sent += len(payload)
            t.join()
    elapsed = result["last"] - result["first"]
    return result["bytes"] * 8 / elapsed if elapsed > 0 else float("inf")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nominal", type=float, required=True, help="nominal rate, bits/s")
    p.add_argument("--seconds", type=float, default=1.0, help="timed sending time")
    args = p.parse_args(argv)
    print(json.dumps({"bits_per_s": measure(args.nominal, args.seconds)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
