"""Listening ports that belong to one server, and to no other process.

Linux lets every socket of the same user that sets SO_REUSEPORT join a port, and the
kernel then spreads new connections over all of them. The front-end processes of
``rnnserve serve --frontends N`` share their ports that way on purpose, and grpc sets
SO_REUSEPORT on its listening sockets by default. So, unguarded, a second server
started on the ports of a running one came up without an error and took a share of
its connections, perhaps with other models behind them (grpc/grpc#17298): a client
could get another server's answer. Here:

- :func:`bind_listener` binds one listening socket and turns "address in use" into an
  error that says what to change;
- :func:`claim_port` reserves a port for a family of front-end processes: it checks
  that nothing listens there, then holds it with a socket that lets only SO_REUSEPORT
  sockets of this user join. Another server's own check then fails, while this
  server's front-ends still bind with SO_REUSEPORT. The holding socket never listens,
  so it takes no connections.
"""
from __future__ import annotations

import errno
import logging
import socket

from .errors import RNNServeError

log = logging.getLogger("rnnserve.ports")


def _socket(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets whose proto says TCP; with proto 0
    # every response pays Nagle + delayed ACK (~40 ms).
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)


def _address(host: str, port: int, flag: str) -> str:
    return f"{host}:{port}" + (f" ({flag})" if flag else "")


def listen_error(address: str, exc: OSError | None) -> RNNServeError:
    """The error for an address a server cannot listen on, saying what to change (HTTP and gRPC alike)."""
    code = exc.errno if exc is not None else None
    if exc is None:
        why = "grpc could not bind it (its log line above says why); choose another port"
    elif code == errno.EADDRINUSE:
        why = ("address already in use; another process (perhaps another rnnserve) listens there: "
               "stop it or choose another port")
    elif code == errno.EACCES:
        why = "permission denied (ports below 1024 need privileges); choose a port above 1023"
    elif code == errno.EADDRNOTAVAIL:
        why = "this machine has no such address; check --host"
    else:
        why = f"{exc.strerror or exc}; choose another port or --host"
    return RNNServeError(f"cannot listen on {address}: {why}")


def bind_listener(host: str, port: int, reuse_port: bool = False, flag: str = "") -> socket.socket:
    """A bound, inheritable TCP socket on ``host:port`` (0: a free port), for a server to listen on.

    ``reuse_port`` lets sibling front-end processes bind the same port (see :func:`claim_port`);
    ``flag`` names the setting of the port in errors.
    """
    sock = _socket(host)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise listen_error(_address(host, port, flag), exc) from exc
    sock.set_inheritable(True)
    return sock


class PortClaim:
    """``host:port`` reserved for this server's front-end processes until :meth:`close`."""

    def __init__(self, port: int, holder: socket.socket | None) -> None:
        self.port = port
        self._holder = holder

    def close(self) -> None:
        """Release the port (the front-ends' own sockets keep it while they run)."""
        if self._holder is not None:
            self._holder.close()
            self._holder = None


def claim_port(host: str, port: int, avoid: int = 0, flag: str = "") -> PortClaim:
    """Reserve ``host:port`` (0: a free port other than ``avoid``) for sockets that set SO_REUSEPORT.

    First a plain bind (SO_REUSEADDR, as every server sets it, so connections of an earlier run in
    TIME_WAIT do not count) checks that no socket listens there: a server already on the port, rnnserve
    or not, fails it. Then a holder binds with SO_REUSEPORT and without SO_REUSEADDR, and stays bound
    without listening. Linux refuses a plain bind next to it, so a later server's first step fails,
    while SO_REUSEPORT sockets of this user (the front-ends) may join it.
    """
    if port:
        bind_listener(host, port, flag=flag).close()
    holder = _socket(host)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    for _ in range(100):
        try:
            holder.bind((host, port))
        except OSError as exc:
            holder.close()
            if exc.errno != errno.EADDRINUSE or not port:
                raise listen_error(_address(host, port, flag), exc) from exc
            # Connections of a server without SO_REUSEPORT (a single-process rnnserve) that ended on this
            # port in the last minute are in TIME_WAIT and refuse the holder, though nothing listens: the
            # check above stands alone then.
            log.info("port %s:%d: held by the start-up check only (sockets of an earlier server are closing)",
                     host, port)
            return PortClaim(port, None)
        bound = holder.getsockname()[1]
        if bound != avoid:
            return PortClaim(bound, holder)
        holder.close()
        holder = _socket(host)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.close()
    raise RNNServeError(f"could not find a free port on {host} other than {avoid}; set --http-port and --grpc-port")
