"""Reachability probes run inside a host (``python probe.py ...``); stdlib only, so they start fast.

- ``ping NAME_OR_ADDRESS... [--timeout S]``: one ICMP echo each over a raw socket (root); prints a
  JSON object name -> "ok" or the failure ("timeout", "ENETUNREACH", ...).
- ``connect HOST PORT [--timeout S]``: one TCP connect; prints "ok" or the errno's name.
"""

from __future__ import annotations

import errno
import json
import os
import select
import socket
import struct
import sys
import time


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def ping(target: str, timeout: float) -> str:
    """One ICMP echo request to ``target`` (RFC 792); "ok" when the matching reply arrives."""
    try:
        addr = socket.gethostbyname(target)
    except OSError as e:
        return f"resolve: {e}"
    ident, seq = os.getpid() & 0xFFFF, 1
    payload = b"apiary-hosts-probe"
    header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
    packet = struct.pack("!BBHHH", 8, 0, _checksum(header + payload), ident, seq) + payload
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as s:
        try:
            s.sendto(packet, (addr, 0))
        except OSError as e:
            return errno.errorcode.get(e.errno or 0, str(e))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([s], [], [], left)[0]:
                break
            data, (src, _) = s.recvfrom(2048)
            ihl = (data[0] & 0x0F) * 4
            kind, _, _, rid, rseq = struct.unpack("!BBHHH", data[ihl:ihl + 8])
            if kind == 0 and rid == ident and rseq == seq and src == addr:
                return "ok"
    return "timeout"


def connect(host: str, port: int, timeout: float) -> str:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return "ok"
    except TimeoutError:
        return "timeout"
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e))


def main(argv: list[str]) -> None:
    timeout = 2.0
    if "--timeout" in argv:
        i = argv.index("--timeout")
        timeout = float(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    if argv[0] == "ping":
        print(json.dumps({t: ping(t, timeout) for t in argv[1:]}))
    elif argv[0] == "connect":
        print(connect(argv[1], int(argv[2]), timeout))
    else:
        raise SystemExit(f"unknown probe {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
