"""Which network interface and address replication uses, and what a node may advertise.

- ``choose_endpoint``: the IPv4 address the TCP listener binds and advertises to the other
  nodes (through the c10d store), and the interface that carries it. One of, in this order:
  ``replication_interface`` (the address of that NIC, like NCCL_SOCKET_IFNAME), else
  ``replication_host``, else the local address that routes to MASTER_ADDR.
- ``unreachable_advertisement``: the pure rule that refuses a loopback address in a job whose
  nodes are on different hosts.
- ``link_speed``: what a NIC says its speed is, for the default bandwidth budget (budget.py).
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass

from ...errors import ConfigError
from ...settings import default

SIOCGIFADDR = 0x8915  # ioctl: the IPv4 address of an interface (linux/sockios.h)
IFNAMSIZ = 16  # interface names are at most 15 bytes (linux/if.h)

# What chose the endpoint, as the error messages and the log name it.
BY_INTERFACE = "replication_interface"
BY_HOST = "replication_host"
BY_ROUTE = "the route to MASTER_ADDR"


@dataclass(frozen=True)
class Endpoint:
    """Where this rank's replication listener binds, which is also what it advertises."""

    address: str  # an IPv4 address
    interface: str | None  # the interface holding it; None when no interface has it (0.0.0.0)
    chosen_by: str  # BY_INTERFACE, BY_HOST or BY_ROUTE


def interface_ipv4(name: str) -> str:
    """The IPv4 address of the network interface ``name`` (as seen from this process's network
    namespace). OSError with errno ENODEV when there is no such interface, EADDRNOTAVAIL when it
    has no IPv4 address."""
    raw = name.encode()
    if not raw or len(raw) >= IFNAMSIZ or b"/" in raw or b"\0" in raw:
        raise OSError(errno.ENODEV, "not an interface name")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        # struct ifreq: the name, then a sockaddr_in whose address starts at byte 4
        reply = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("16s16s", raw, b""))
    return socket.inet_ntoa(reply[IFNAMSIZ + 4:IFNAMSIZ + 8])


def interface_names() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def interface_address(name: str, setting: str) -> str:
    """The IPv4 address of interface ``name``; a ConfigError naming ``setting`` (the argument or
    the variable that gave the name) when it does not exist or has no IPv4 address."""
    try:
        return interface_ipv4(name)
    except OSError as e:
        if e.errno == errno.EADDRNOTAVAIL:
            why = "has no IPv4 address"
        elif e.errno == errno.ENODEV:
            why = f"is not a network interface here (this machine has: {', '.join(interface_names())})"
        else:
            why = f"cannot be read ({e.strerror or e})"
        raise ConfigError(f"{setting}={name!r} {why}: name the interface the nodes reach each "
                          "other on (as for NCCL_SOCKET_IFNAME)") from None


def interface_of(address: str) -> str | None:
    """The interface whose (first) IPv4 address is ``address``; None if none is."""
    for name in interface_names():
        try:
            if interface_ipv4(name) == address:
                return name
        except OSError:
            continue
    return None


def resolve_host(host: str, setting: str) -> str:
    """``host`` (an address or a name) as an IPv4 address; a ConfigError naming ``setting``."""
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ConfigError(f"{setting}={host!r} is not an IPv4 address or a name that resolves to "
                          f"one ({e})") from None


def route_to_master(master_addr: str, master_port: int) -> str:
    """The local address that routes to MASTER_ADDR: the nodes reach each other there, at least
    where they reach the master (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, master_port))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def choose_endpoint(host: str | None = None, interface: str | None = None, *,
                    master_addr: str = default("master_addr"),
                    master_port: int = default("master_port")) -> Endpoint:
    """Where the listener binds: the interface's address, else ``host``, else the route to
    ``master_addr`` (the launcher's MASTER_ADDR, ``topology.Topology``). Options.resolve has checked that ``host`` and ``interface`` agree when both
    are given; here the interface wins."""
    if interface:
        return Endpoint(interface_address(interface, BY_INTERFACE), interface, BY_INTERFACE)
    if host:
        address = resolve_host(host, BY_HOST)
        return Endpoint(address, interface_of(address), BY_HOST)
    address = route_to_master(master_addr, master_port)
    return Endpoint(address, interface_of(address), BY_ROUTE)


def _is_loopback(host: str) -> bool:
    """A loopback address or the name localhost (other names are taken for remote hosts)."""
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _names_no_remote_host(address: str) -> bool:
    """Loopback, or 0.0.0.0/:: (which a peer's connect() takes for its own host)."""
    if _is_loopback(address):
        return True
    try:
        return ipaddress.ip_address(address).is_unspecified
    except ValueError:
        return False


def unreachable_advertisement(advertised: str, master: str, num_nodes: int) -> bool:
    """Whether the other nodes of a job could not reach a listener that advertises the address
    ``advertised``: a loopback address (or 0.0.0.0, which names no host) in a job of several
    nodes whose MASTER_ADDR (``master``) is not loopback, i.e. whose nodes run on different
    hosts or network namespaces.

    With a loopback MASTER_ADDR every node runs on this machine (as in simulated clusters) and
    loopback is right. A MASTER_ADDR given as a host name other than localhost counts as
    remote, so a name that /etc/hosts maps to 127.0.1.1 on the master's own host still catches
    the master advertising loopback."""
    return num_nodes > 1 and _names_no_remote_host(advertised) and not _is_loopback(master)


def check_advertisable(endpoint: Endpoint, num_nodes: int, master: str) -> None:
    """ConfigError, naming the setting to change, when ``unreachable_advertisement``
    (``master``: the launcher's MASTER_ADDR)."""
    if not unreachable_advertisement(endpoint.address, master, num_nodes):
        return
    fix = ("set MLCHECKPOINT_REPLICATION_IFNAME (or replication_interface=) to the network "
           "interface the nodes reach each other on")
    if endpoint.chosen_by == BY_HOST:
        fix = (f"replication_host (MLCHECKPOINT_REPLICATION_HOST) is {endpoint.address}: set it "
               f"to this node's address on the network between the nodes, or {fix} instead")
    raise ConfigError(
        f"replication would advertise {endpoint.address} (chosen by {endpoint.chosen_by}) to the "
        f"other nodes, which cannot reach it there: MASTER_ADDR={master} says the {num_nodes} "
        f"nodes run on different hosts. {fix[0].upper()}{fix[1:]}.")


def link_speed(interface: str, sysfs: str = "/sys/class/net") -> int | None:
    """Bytes per second that a physical NIC says it runs at; None for virtual devices and where
    the speed is unknown. Virtual devices (veth, bridges, bonds, dummies, loopback) have no
    ``device`` in sysfs and report a nominal speed or none: veth says 10 Gbit/s whatever `tc`
    shapes it to. Many cloud NICs report none either (-1)."""
    base = os.path.join(sysfs, interface)
    if "/" in interface or not os.path.exists(os.path.join(base, "device")):
        return None
    try:
        with open(os.path.join(base, "speed")) as f:
            mbit = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return mbit * 1_000_000 // 8 if mbit > 0 else None


def check_listen_settings(host: str | None, interface: str | None, *, host_given: bool,
                          interface_given: bool) -> None:
    """The listener's settings, checked once the manager's are resolved (``*_given``: passed
    as an argument rather than read from the environment, for the message). The interface
    must exist and have an IPv4 address; with a host as well, the two must name the same
    address (else which one the listener binds would be a guess)."""
    if interface is None:
        return
    host_from = ("replication_host" if host_given
                 else "MLCHECKPOINT_REPLICATION_HOST")
    interface_from = ("replication_interface" if interface_given
                      else "MLCHECKPOINT_REPLICATION_IFNAME")
    address = interface_address(interface, interface_from)
    if host is not None:
        host_address = resolve_host(host, host_from)
        if host_address != address:
            raise ConfigError(
                f"{host_from}={host!r} ({host_address}) and {interface_from}={interface!r} "
                f"({address}) name different addresses for the replication listener: give one "
                "of them (the interface is usually what you mean)")
