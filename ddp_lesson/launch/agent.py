"""The torchrun agent every run starts: ``python -m ddp_lesson.launch.agent FLAGS PROGRAM``.

It is torch's own launcher, ``torch.distributed.run.main``, with two sockets of torch's elastic
rendezvous made safe for a run whose every process is on this machine (the launcher says so
with ``DDP_LESSON_ALL_RANKS_LOCAL=1``); anything else runs exactly as ``torchrun``:

* **The workers' store, shared** (runs that cannot restart: the launcher leaves torchrun's
  store sharing on, see :func:`ddp_lesson.launch.command.launch_env`). Node 0's agent starts it
  (``DynamicRendezvousHandler._create_tcp_store_server``) before any worker exists, and every
  worker is a client (``TORCHELASTIC_USE_AGENT_STORE=True``). torch binds it to every
  interface; here it listens on a socket bound to 127.0.0.1 (``master_listen_fd``), on the
  port the kernel gave that very socket, so no other process can take it in between.
* **The workers' port, unshared** (runs that can restart: sharing off). Then
  ``RendezvousStoreInfo.build`` takes ``MASTER_PORT`` from ``get_free_port()``: a socket bound
  to port 0 and closed at once. Worker rank 0 binds that port seconds later, once Python and
  torch have started, and in between any ``connect()`` or ``bind(port 0)`` on the machine may
  be given it: rank 0 then fails with ``EADDRINUSE`` (seen about once in six loaded suite
  runs). Here the port stays bound by the agent (``SO_REUSEADDR``, never listening) until the
  next round chooses another: Linux gives a bound port to no ``connect()`` and no
  ``bind(port 0)``, while rank 0, which binds it with ``SO_REUSEADDR``
  (:func:`ddp_lesson.env.loopback_store_server`), can still bind it and listen.

Where torch's names moved (another torch version), the agent runs unchanged.
Sources: torch 2.13, ``torch/distributed/elastic/rendezvous/api.py``
(``RendezvousStoreInfo.build``), ``dynamic_rendezvous.py`` (``next_rendezvous``),
``torch/distributed/elastic/utils/distributed.py`` (``get_free_port``: "not reserved and may
be taken by another process after this function returns").
"""
from __future__ import annotations

import os
import socket

from .. import env

_held: list[socket.socket] = []  # the port of the current round, kept bound


def held_port() -> int:
    """A free port on 127.0.0.1 that stays bound (not listening) until the next call.

    The socket has ``SO_REUSEADDR``: a process that binds the same address with
    ``SO_REUSEADDR`` too (worker rank 0's store) can bind it and listen while it is held.
    The previous call's port is released: its round is over.
    """
    for sock in _held:
        sock.close()
    _held.clear()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    _held.append(sock)
    return sock.getsockname()[1]


def loopback_store_server(handler, master_addr, master_port):
    """The shared workers' store, listening on 127.0.0.1 only (``master_addr`` is not used).

    Replaces ``DynamicRendezvousHandler._create_tcp_store_server`` (same arguments, same
    ``TCPStore``, ``multi_tenant``); ``master_port`` 0 (what torch passes) lets the kernel
    choose the port of the listening socket itself.
    """
    return env.loopback_store_server(master_port, multi_tenant=True, wait_for_workers=False)


def install(environ=None) -> bool:
    """Put :func:`held_port` and :func:`loopback_store_server` in torch's rendezvous, when every
    process of the run is local (``DDP_LESSON_ALL_RANKS_LOCAL=1`` in ``environ``, default this
    process's). Returns whether it did (False also when torch's names are not there)."""
    if (os.environ if environ is None else environ).get(env.LOCAL_RUN_ENV) != "1":
        return False
    from torch.distributed.elastic.rendezvous import api, dynamic_rendezvous

    handler = getattr(dynamic_rendezvous, "DynamicRendezvousHandler", None)
    if not hasattr(api, "get_free_port") or not hasattr(handler, "_create_tcp_store_server"):
        return False
    api.get_free_port = held_port
    handler._create_tcp_store_server = loopback_store_server
    return True


def main(argv: list[str] | None = None) -> None:
    """Run torchrun (``torch.distributed.run.main``) on ``argv`` (default ``sys.argv[1:]``)."""
    install()
    from torch.distributed.run import main as torchrun_main

    torchrun_main(argv)


if __name__ == "__main__":
    main()
