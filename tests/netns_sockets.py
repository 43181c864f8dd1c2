"""Plain TCP probes between a namespaced cluster's nodes, without Ray: can one node reach another, and how fast.

Run as ``python -m tests.netns_sockets NAME ARGS`` inside a node's namespace; each prints one
``REPORT {json}`` line (tests.drivers.print_report).  Nothing here imports Ray, so a probe
costs a bare interpreter start.

* ``connect ADDRESS PORT TIMEOUT_S``: ``connected``, ``refused`` (the address answered) or
  ``timeout`` / the error's name (it did not).
* ``serve ADDRESS PORT``: accept one connection, read to its end, answer one byte, report the
  bytes read.  Prints ``LISTENING`` once it listens.
* ``send ADDRESS PORT NBYTES``: send NBYTES, wait for the answer byte, report the seconds.
"""

from __future__ import annotations

import socket
import sys
import time

from tests.drivers import print_report

#: Every wait of a probe ends by this.
PROBE_TIMEOUT_S = 30.0


def connect(address: str, port: int, timeout: float) -> str:
    try:
        socket.create_connection((address, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return "refused"
    except (socket.timeout, TimeoutError):
        return "timeout"
    except OSError as exc:
        return type(exc).__name__
    return "connected"


def serve(address: str, port: int) -> int:
    with socket.create_server((address, port)) as server:
        server.settimeout(PROBE_TIMEOUT_S)
        print("LISTENING", flush=True)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(PROBE_TIMEOUT_S)
            total = 0
            while chunk := conn.recv(1 << 16):
                total += len(chunk)
            conn.sendall(b"k")
    return total


def send(address: str, port: int, nbytes: int) -> float:
    payload = b"x" * nbytes
    with socket.create_connection((address, port), timeout=PROBE_TIMEOUT_S) as conn:
        t0 = time.monotonic()
        conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        if conn.recv(1) != b"k":
            raise SystemExit("the server did not answer")
        return time.monotonic() - t0


if __name__ == "__main__":
    name, args = sys.argv[1], sys.argv[2:]
    if name == "connect":
        print_report(connect(args[0], int(args[1]), float(args[2])))
    elif name == "serve":
        print_report(serve(args[0], int(args[1])))
    elif name == "send":
        print_report(send(args[0], int(args[1]), int(args[2])))
    else:
        raise SystemExit(f"unknown probe {name!r}; use connect, serve or send")
