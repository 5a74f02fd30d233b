"""Which addresses ``POST /nodes/add`` may name (``docs/security.md``).

The proxy polls every node and sends engines requests, so a node URL is an address the proxy
will connect to. An admin key must not turn that into a way to reach cloud metadata services,
other hosts' link-local services or the internet: a node is a scheme, host and port
(``registry.normalize_url``), its host must resolve only to allowed networks (by default
loopback and the private ranges clusters give pods: ``tandem up`` and in-cluster pod IPs
work), and link-local and metadata addresses are refused whatever is allowed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

DEFAULT_NODE_NETWORKS = (
    "127.0.0.0/8",
    "::1/128",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "fc00::/7",
)
# Never a node, even inside an allowed network: link-local (169.254.169.254 is the metadata
# service of most clouds), the unspecified and multicast ranges, and the metadata addresses
# that sit inside private ranges (Alibaba's, AWS's IPv6 one).
REFUSED_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "169.254.0.0/16",
        "fe80::/10",
        "0.0.0.0/8",
        "::/128",
        "224.0.0.0/4",
        "ff00::/8",
        "100.100.100.200/32",
        "fd00:ec2::254/128",
    )
)


def parse_networks(value: str | Iterable[str]) -> tuple[IPNetwork, ...]:
    """``"10.0.0.0/8,::1/128"`` (or a list of them) -> networks; ValueError names a bad one."""
    items = value.split(",") if isinstance(value, str) else list(value)
    networks = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError as exc:
            raise ValueError(f"{item!r} is not a network (CIDR): {exc}") from None
    return tuple(networks)


@dataclass(frozen=True)
class NodeNetworks:
    """The networks a registered node's address may lie in (``--allow-node-networks``)."""

    allowed: tuple[IPNetwork, ...] = field(
        default_factory=lambda: parse_networks(DEFAULT_NODE_NETWORKS)
    )

    def problem(self, address: IPAddress) -> str | None:
        """Why a node may not have this address, or None when it may."""
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if any(address in n for n in REFUSED_NETWORKS):
            return f"{address} is a link-local, metadata or reserved address"
        if not any(address in n for n in self.allowed if n.version == address.version):
            return f"{address} is outside the networks nodes may be in (--allow-node-networks)"
        return None

    async def check_url(self, url: str) -> None:
        """ValueError unless every address the URL's host resolves to is allowed (a name
        that resolves to one refused address is refused: the client may pick any of them)."""
        host = urllib.parse.urlsplit(url).hostname or ""
        for address in await _resolve(host):
            if (why := self.problem(address)) is not None:
                raise ValueError(f"node url {url!r}: {why}")


async def _resolve(host: str) -> Sequence[IPAddress]:
    """The host's addresses: a literal as is, a name through the resolver (off the loop)."""
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        raise ValueError(f"node host {host!r} does not resolve") from None
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
