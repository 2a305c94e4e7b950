"""A TCP relay from a network namespace's loopback to the control plane's, for the network experiment.

``python -m apiary.chaos.netproxy --netns NS --target 127.0.0.1:8470 --ready FILE [--delay-file F]``

The listening socket is created inside network namespace ``NS`` (on its ``127.0.0.1``, a free
port written to ``FILE``) and each connection is relayed to ``--target`` from the namespace this
process started in. A socket keeps the namespace it was created in, so one process bridges both
loopbacks and no interface leaves the machine: an agent in ``NS`` reaches the control plane only
through this relay, over ``NS``'s own ``lo``, where ``tc``/``iptables`` rules degrade it.

``--delay-file``: a file holding milliseconds (re-read twice a second) that every relayed chunk
waits, in both directions; the stand-in for ``tc netem delay`` on kernels without ``sch_netem``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import socket
import sys
from pathlib import Path

CLONE_NEWNET = 0x40000000


def listen_in_netns(netns: str) -> socket.socket:
    """A listening socket on ``127.0.0.1:<free port>`` inside ``/run/netns/<netns>``; the calling
    thread is back in its own namespace on return."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    other = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(other, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns} failed")
        try:
            sock = socket.create_server(("127.0.0.1", 0))
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back failed")
    finally:
        os.close(own)
        os.close(other)
    return sock


class Delay:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.seconds = 0.0

    async def watch(self) -> None:
        while self.path is not None:
            try:
                self.seconds = max(0.0, float(self.path.read_text().strip() or 0) / 1000.0)
            except (OSError, ValueError):
                self.seconds = 0.0
            await asyncio.sleep(0.5)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: Delay) -> None:
    try:
        while data := await reader.read(65536):
            if delay.seconds:
                await asyncio.sleep(delay.seconds)
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            writer.close()
        except OSError:
            pass


async def serve(sock: socket.socket, host: str, port: int, delay: Delay) -> None:
    async def relay(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection(host, port)
        except OSError:
            w.close()
            return
        await asyncio.gather(_pump(r, uw, delay), _pump(ur, w, delay))

    watcher = asyncio.create_task(delay.watch())
    server = await asyncio.start_server(relay, sock=sock)
    async with server:
        await server.serve_forever()
    watcher.cancel()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m apiary.chaos.netproxy")
    ap.add_argument("--netns", required=True)
    ap.add_argument("--target", required=True, help="host:port in this process's own namespace")
    ap.add_argument("--ready", required=True, type=Path, help="file to write the listening port to")
    ap.add_argument("--delay-file", type=Path)
    args = ap.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    sock = listen_in_netns(args.netns)
    tmp = args.ready.with_name(args.ready.name + ".tmp")
    tmp.write_text(str(sock.getsockname()[1]))
    tmp.replace(args.ready)
    try:
        asyncio.run(serve(sock, host, int(port), Delay(args.delay_file)))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
