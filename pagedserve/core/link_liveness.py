"""Liveness of the executor link at the ZeroMQ level, set the same way on both ends.

ZMTP heartbeats (PING/PONG commands) are sent and answered by libzmq's I/O thread, not by the
process's Python thread: an executor busy in a long step still answers them, while a stopped
process (SIGSTOP, a frozen VM) or a cut network answers nothing. When nothing at all has come
from the peer for the timeout, libzmq closes the connection; the scheduler's socket monitor
sees the close (executor_link.py) and treats it as the executor's loss, and a connecting
executor reconnects by itself once it can.
"""

from __future__ import annotations

import asyncio

import zmq


def keep_alive(sock: zmq.Socket, timeout_s: float) -> None:
    """Ping the peer every quarter of timeout_s and drop the connection when nothing has come
    from it for timeout_s (the peer is told the same through the TTL); 0 or less: off."""
    if timeout_s <= 0:
        return
    ms = max(1, round(timeout_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, ms // 4))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(ms, 6_553_500))  # sent in deciseconds, 16 bits


async def close_link(tasks: list[asyncio.Task], sock: zmq.Socket,
                     monitor: zmq.Socket | None) -> None:
    """End a link's tasks, then its socket monitor and the socket itself (the context is the
    caller's: an authenticator may still have to stop before it ends)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if monitor is not None:
        sock.disable_monitor()
        monitor.close(linger=0)
    sock.close(linger=0)
