"""Which hosts of a cluster are this machine, and how many machines a cluster spans.
Torch-free; nothing is sent anywhere."""

from __future__ import annotations

import ipaddress
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protocol.cluster import ClusterConfig
    from protocol.cluster_sections import NodeConfig


def is_local_host(host: str) -> bool:
    """True if `host` is a loopback address or an address of this machine.

    An address is this machine's if a socket can bind it; nothing is sent anywhere."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        addr = str(sockaddr[0])
        if ipaddress.ip_address(addr.split("%")[0]).is_loopback:
            return True
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((addr, 0, *sockaddr[2:]) if family == socket.AF_INET6 else (addr, 0))
            return True
        except OSError:
            continue
    return False


def is_loopback_host(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and "localhost"."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_nodes(cluster: ClusterConfig) -> tuple[NodeConfig, ...]:
    """The nodes whose host is a loopback address or an address of this machine."""
    return tuple(n for n in cluster.nodes if is_local_host(n.host))


def cluster_hosts(c: ClusterConfig) -> list[str]:
    """The distinct hosts of the cluster's nodes; loopback addresses are one host (two
    "nodes" on 127.0.0.1 and 127.0.0.2 share a machine)."""
    hosts: list[str] = []
    for n in c.nodes:
        host = "loopback" if is_loopback_host(n.host) else n.host
        if host not in hosts:
            hosts.append(host)
    return hosts
