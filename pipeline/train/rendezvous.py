"""The process group of a multi-rank run, listening on this host's address only.

``torch.distributed``'s ``env://`` rendezvous (what ``deepspeed.init_distributed`` does
by itself) starts rank 0's TCPStore on every interface (``:::MASTER_PORT`` in
``ss -ltn``), whatever MASTER_ADDR says. On a cluster each host must listen on its own
address only, so we create the group ourselves, before DeepSpeed (which finds it in place
and only wraps it, deepspeed/comm/comm.py ``init_distributed``):

* rank 0 binds a socket to MASTER_ADDR:MASTER_PORT (resolved with getaddrinfo, IPv4 or
  IPv6) and hands it to ``TCPStore(master_listen_fd=...)``, which owns it from then on
  (it closes the fd; the libuv and the classic store backends alike, torch 2.13); the
  other ranks connect to it as clients;
* gloo's listening sockets (one per process group, DeepSpeed makes several) bind to the
  address its device resolves: by default the address of this host's *hostname* (here
  ``vm`` -> 127.0.0.1), a specific address but not necessarily the one the cluster uses
  (in network namespaces that share a hostname, one another's peers could not reach it).
  Unless GLOO_SOCKET_IFNAME names the interfaces, every gloo group is given a device on
  this host's address towards rank 0 (MASTER_ADDR itself on rank 0's host; elsewhere the
  source address the kernel routes to MASTER_ADDR from), see ``bind_gloo``.

A port that is taken or a MASTER_ADDR that is not an address of rank 0's host is a
ConfigError naming MASTER_ADDR/MASTER_PORT and the fix, instead of a C++ traceback.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from pipeline.errors import ConfigError
from pipeline.train.faults import RendezvousUnreachable, summary


def master_addr_port() -> tuple[str, int]:
    """MASTER_ADDR (brackets of an IPv6 literal dropped) and MASTER_PORT from the env."""
    addr = os.environ.get("MASTER_ADDR", "").strip()
    port = os.environ.get("MASTER_PORT", "").strip()
    if not addr or not port:
        raise ConfigError(
            f"RANK and WORLD_SIZE={os.environ.get('WORLD_SIZE')} are set but MASTER_ADDR="
            f"{addr or '(unset)'} MASTER_PORT={port or '(unset)'}: set both to rank 0's address "
            "and a free port there (the deepspeed launcher's --master_addr/--master_port)"
        )
    if addr.startswith("[") and addr.endswith("]"):
        addr = addr[1:-1]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"MASTER_PORT={port} is not a TCP port (1-65535)")
    return addr, int(port)


def resolve(addr: str, port: int, wait_s: float) -> list[tuple[Any, ...]]:
    """getaddrinfo's TCP addresses of ADDR, retried for up to WAIT_S seconds: a pod's DNS
    record can appear a moment after the pod starts (k8s/training/indexed-job)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
        except socket.gaierror as err:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"MASTER_ADDR={addr} does not resolve ({err.strerror}) after {wait_s:.0f} s: "
                    "set it to rank 0's address or a name of it that resolves on every host"
                ) from None
            time.sleep(1.0)


def listen(addr: str, port: int, wait_s: float = 0.0) -> socket.socket:
    """Rank 0's store socket, listening on ADDR:PORT only (the first of ADDR's addresses
    that belongs to this host). Binding fails locally, without a packet sent, when the
    address is not this host's; ConfigError then, and when the port is taken."""
    infos = resolve(addr, port, wait_s)
    not_here = []
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            # As torch's own store: a restart may bind while old connections linger in
            # TIME_WAIT; a socket that listens on the port still makes bind fail.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(socket.SOMAXCONN)
            return sock
        except OSError as err:
            sock.close()
            where = addr if sockaddr[0] == addr else f"{addr} ({sockaddr[0]})"
            if err.errno == errno.EADDRNOTAVAIL:
                not_here.append(sockaddr[0])
                continue
            if err.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"MASTER_PORT={port} is taken on MASTER_ADDR={where}: "
                    f"another process listens there (`ss -ltnp 'sport = :{port}'` names it); "
                    "stop it or give a free port (the deepspeed launcher's --master_port, or "
                    "MASTER_PORT)"
                ) from None
            raise ConfigError(
                f"rank 0 cannot listen on MASTER_ADDR={where} "
                f"MASTER_PORT={port}: {err.strerror}; give another address or port"
            ) from None
    resolved = [a for a in dict.fromkeys(not_here) if a != addr]
    shown = f" ({', '.join(resolved)})" if resolved else ""
    raise ConfigError(
        f"MASTER_ADDR={addr}{shown} is not an address of this host, where rank 0 runs and "
        f"binds the rendezvous store on MASTER_PORT={port}: set MASTER_ADDR to an address of "
        "rank 0's host that the other hosts reach (`ip -br addr` lists this host's)"
    )


def local_address(addr: str, port: int) -> str:
    """This host's address towards rank 0: MASTER_ADDR itself where it is one of this
    host's addresses, else the source address the kernel would use to reach it (a UDP
    socket's connect only looks the route up; nothing is sent)."""
    family, _, _, _, sockaddr = resolve(addr, port, 0.0)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((sockaddr[0], 0))
            return sockaddr[0]
        except OSError:
            pass
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]


_GLOO_ADDRESS: str | None = None


def bind_gloo(address: str) -> None:
    """Every gloo process group this process creates from now on listens on ADDRESS.

    torch 2.13 builds a group's gloo backend as ``ProcessGroupGloo(store, rank, size,
    timeout=...)`` (distributed_c10d ``_new_process_group_helper``), whose device comes
    from GLOO_SOCKET_IFNAME (interface names: an interface's first address) or else the
    hostname; ``pg_options`` are ignored for gloo. So the name is pointed at a subclass
    that gives each group its own device on ADDRESS (``create_device(hostname=ADDRESS)``,
    one per group as before, the other options as torch's defaults). Its metaclass keeps
    torch's ``isinstance(backend, ProcessGroupGloo)`` checks true for the backends C++
    hands back (plain ``ProcessGroupGloo`` objects)."""
    global _GLOO_ADDRESS
    from torch.distributed import distributed_c10d as c10d

    _GLOO_ADDRESS = address
    if getattr(c10d.ProcessGroupGloo, "_plm_bound", False):
        return
    base = c10d.ProcessGroupGloo

    class _IsGloo(type(base)):
        def __instancecheck__(cls, obj):
            return isinstance(obj, base)

        def __subclasscheck__(cls, sub):
            return issubclass(sub, base)

    class BoundGloo(base, metaclass=_IsGloo):
        _plm_bound = True

        def __init__(self, store, rank, size, timeout=timedelta(minutes=30)):
            options = base._Options()
            options._timeout = timeout
            options._devices = [base.create_device(hostname=_GLOO_ADDRESS)]
            super().__init__(store, rank, size, options)

    BoundGloo.__name__ = BoundGloo.__qualname__ = "ProcessGroupGloo"
    BoundGloo.__module__ = base.__module__
    c10d.ProcessGroupGloo = BoundGloo


def init_process_group(backend: str, timeout: timedelta) -> None:
    """The default process group of RANK of WORLD_SIZE (env), its store and gloo bound as
    the module says. TIMEOUT: how long rank 0 waits for the others to join (and a
    client for rank 0's store, and each collective afterwards)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, port = master_addr_port()
    wait_s = timeout.total_seconds()
    # Under torch's elastic agent (torchrun, launch/elastic_train.py) the agent of node
    # rank 0 already serves a store at MASTER_ADDR:MASTER_PORT, a new one for each round
    # of its rendezvous: every rank is its client.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if agent_store and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        # That store outlives the round, and so do the keys a failed round's ranks left in
        # it: the next round's gloo would read them and dial ports nobody listens on.
        raise ConfigError(
            "torchrun --max-restarts with the agents' shared store: set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (launch/elastic_train.py does), so each "
            "round's ranks get a store of their own"
        )
    if rank == 0 and not agent_store:
        sock = listen(addr, port, wait_s)
        host = sock.getsockname()[0]  # an address literal: what its own client dials
        fd = sock.detach()  # the store closes it
        store = dist.TCPStore(host, port, world, True, timeout=timeout, master_listen_fd=fd)
    else:
        try:
            store = dist.TCPStore(addr, port, world, False, timeout=timeout)
        except dist.DistError as err:
            raise RendezvousUnreachable(
                f"rank {rank} on {socket.gethostname()} cannot reach the rendezvous store at "
                f"MASTER_ADDR={addr} MASTER_PORT={port} within {wait_s:.0f} s "
                f"(train.collective_timeout_s): {summary(err)}. Check that rank 0's host "
                "is up and that this host reaches it (`nc -zv ADDR PORT`)"
            ) from None
        host = addr
    if not os.environ.get("GLOO_SOCKET_IFNAME"):
        bind_gloo(host if rank == 0 and not agent_store else local_address(addr, port))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
