"""Who may reach a loopback server from a browser: the ``Host`` and ``Origin`` checks against DNS rebinding and
cross-origin pages (plain functions, shared by ``serve`` and the harness's ``host``)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

LOOPBACK_NAMES = frozenset({"localhost"})
ANY = "*"


def split_list(values: Iterable[str] | None) -> tuple[str, ...]:
    """Flag values, each a name or a comma-separated list of names, as one tuple (blanks dropped)."""
    return tuple(part.strip() for value in values or () for part in value.split(",") if part.strip())


def is_loopback(name: str) -> bool:
    """Whether ``name`` (a host name or address, IPv6 with or without brackets) is a loopback name."""
    name = name.strip("[]").lower()
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """The name of a ``Host`` header value without its port (``[::1]:80`` -> ``::1``), lowercased."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header[1:]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


@dataclass(frozen=True)
class ExposurePolicy:
    """``hosts``: the names a ``Host`` header may carry (None: any); ``loopback_hosts``: loopback names and
    addresses too. ``origins``: the ``Origin`` values allowed besides the server's own (None: any)."""

    hosts: frozenset[str] | None = None
    loopback_hosts: bool = False
    origins: frozenset[str] | None = None

    @classmethod
    def build(cls, bind: str, *, allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = (),
              check_hosts: bool = True) -> ExposurePolicy:
        """The policy of a server bound to ``bind``: loopback names only when it is bound to loopback and
        ``check_hosts`` (plus ``allowed_hosts``; ``*`` lifts the check), same-origin browser requests only
        (plus ``allowed_origins``; ``*`` lifts the check)."""
        hosts_list, origins_list = split_list(allowed_hosts), split_list(allowed_origins)
        hosts: frozenset[str] | None = None
        loopback = False
        if ANY not in hosts_list and (hosts_list or (check_hosts and is_loopback(bind))):
            hosts = frozenset(host_name(h) for h in hosts_list)
            loopback = is_loopback(bind)
        origins = None if ANY in origins_list else frozenset(o.rstrip("/").lower() for o in origins_list)
        return cls(hosts, loopback, origins)

    def host_refusal(self, host: str | None) -> str | None:
        """Why a request with this ``Host`` header is refused, or None (a request without one is not a
        browser's, and passes)."""
        if self.hosts is None or host is None:
            return None
        name = host_name(host)
        if name in self.hosts or (self.loopback_hosts and is_loopback(name)):
            return None
        return (f"the Host header {host!r} is not allowed: this server answers loopback names only "
                "(--allowed-hosts adds names)")

    def origin_refusal(self, origin: str | None, host: str | None) -> str | None:
        """Why a request from this ``Origin`` is refused, or None: no Origin (not a browser), the server's own
        origin (the same host and port as ``Host``), or one of the allowed origins."""
        if self.origins is None or origin is None:
            return None
        normal = origin.strip().rstrip("/").lower()
        if normal in self.origins:
            return None
        parts = urlsplit(normal)
        if host is not None and parts.scheme in ("http", "https") and parts.netloc == host.strip().lower():
            return None
        return f"requests from the web origin {origin!r} are not allowed (--allowed-origins adds origins)"
