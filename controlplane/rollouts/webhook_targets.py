"""Which webhook URLs the control plane may POST to, checked after DNS resolution.

A target is refused unless it is http or https without credentials in the URL, and
every address its host resolves to is globally reachable: no loopback, private (RFC 1918,
fc00::/7), link-local (169.254.0.0/16 with the cloud metadata address, fe80::/10),
unspecified, multicast, reserved or carrier-grade NAT (100.64.0.0/10) address, IPv4-mapped
or otherwise embedded forms of them included. `ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS` names
networks an operator allows all the same (a receiver on the host itself, say).

The check runs when an endpoint is created and again before each delivery, which then
connects to an address the check passed, not to the name: a DNS answer that changes
between the check and the connection (rebinding) cannot redirect the POST.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

import httpx
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

ALLOWED_SCHEMES = frozenset({"http", "https"})
# Shared address space: not covered by `is_private` on every Python version.
CARRIER_GRADE_NAT = ipaddress.IPv4Network("100.64.0.0/10")
# The well-known NAT64 prefix: its last 32 bits are an IPv4 address the gateway connects to.
NAT64_PREFIX = ipaddress.IPv6Network("64:ff9b::/96")
HOST_NOT_ALLOWED = "the host must resolve, and only to public addresses"


class TargetForbidden(Exception):
    """The URL's shape, or an address its host resolves to, is not allowed."""


class TargetUnresolvable(Exception):
    """The host did not resolve (worth retrying at delivery: DNS may recover)."""


@dataclass(frozen=True, slots=True)
class CheckedTarget:
    url: httpx.URL
    addresses: tuple[IPAddress, ...]  # every one passed the check, in resolver order

    def url_for(self, address: IPAddress) -> httpx.URL:
        """The URL with its host replaced by one checked address."""
        return self.url.copy_with(host=str(address))

    @property
    def host_header(self) -> str:
        return self.url.netloc.decode("ascii")

    @property
    def hostname(self) -> str:
        """The name TLS sends (SNI) and verifies the certificate against."""
        return self.url.raw_host.decode("ascii")


def target_check(url: str) -> CheckedTarget:
    """The URL with the addresses it may be delivered to; raises TargetForbidden or
    TargetUnresolvable."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise TargetForbidden("not a valid URL") from exc
    if parsed.scheme not in ALLOWED_SCHEMES:
        raise TargetForbidden("the scheme must be http or https")
    if parsed.userinfo:
        raise TargetForbidden("the URL must not carry credentials")
    if not parsed.raw_host:
        raise TargetForbidden("the URL has no host")
    addresses = _resolve(parsed.raw_host.decode("ascii"), parsed.port or _default_port(parsed))
    allowed = allowed_networks()
    if not all(address_is_allowed(address, allowed) for address in addresses):
        raise TargetForbidden(HOST_NOT_ALLOWED)
    return CheckedTarget(url=parsed, addresses=addresses)


def _default_port(url: httpx.URL) -> int:
    return 443 if url.scheme == "https" else 80


def _resolve(host: str, port: int) -> tuple[IPAddress, ...]:
    try:
        answers = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise TargetUnresolvable(host) from exc
    addresses: list[IPAddress] = []
    for _family, _type, _protocol, _name, sockaddr in answers:
        address = _normalized(ipaddress.ip_address(sockaddr[0]))
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise TargetUnresolvable(host)
    return tuple(addresses)


def _normalized(address: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address is the IPv4 address the socket reaches."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def allowed_networks() -> tuple[IPNetwork, ...]:
    networks = []
    for item in settings.ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS:
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError as exc:
            raise ImproperlyConfigured(
                f"ROLLOUTS_WEBHOOK_ALLOWED_NETWORKS: {item!r} is not a network"
            ) from exc
    return tuple(networks)


def address_is_allowed(address: IPAddress, allowed: tuple[IPNetwork, ...] = ()) -> bool:
    address = _normalized(address)
    # `in` compares integers only, so an IPv4 address could match an IPv6 network.
    if any(address.version == network.version and address in network for network in allowed):
        return True
    return not address_is_forbidden(address)


def address_is_forbidden(address: IPAddress) -> bool:
    address = _normalized(address)
    embedded = _embedded_ipv4(address)
    if embedded is not None and address_is_forbidden(embedded):
        return True
    return (
        address.is_loopback
        or address.is_private
        or address.is_link_local
        or address.is_unspecified
        or address.is_multicast
        or address.is_reserved
        or address in CARRIER_GRADE_NAT
        # Documentation, benchmarking and protocol ranges: nothing a receiver listens on.
        or not address.is_global
    )


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address a 6to4 or NAT64 address leads to."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.sixtofour is not None:
        return address.sixtofour
    if address in NAT64_PREFIX:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None
