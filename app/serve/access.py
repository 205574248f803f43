"""Who `llmlocal serve` answers: the Host names it serves, the browser origins it lets in, and
whether its bind needs an API key.

A web page the user opens can send requests to a server on loopback. Two checks keep it out:

* **Host.** With DNS rebinding a page re-points its own domain at 127.0.0.1 and then reads
  the answers as same-origin; its requests still carry its domain in ``Host``. So a loopback
  server answers only ``localhost``, ``127.0.0.1``, ``[::1]`` and the names given with
  ``--allow-host``; one bound wider also answers this machine's own addresses and host name.
* **Origin.** A page's cross-site request (a "simple" text/plain POST needs no preflight)
  carries its ``Origin``: only local pages' origins and those named with ``--cors-origin``
  get in. Clients that send no ``Origin`` (curl, SDKs, editors) are not browsers and pass.

A server that other machines can reach needs an API key (`require_key`).
"""

from __future__ import annotations

import functools
import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from llmlocal.models.errors import LLMLocalError

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_PORT = re.compile(r"(?::\d{0,5})?")
_NAME = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)*")  # a DNS name or an IPv4 address
_ORIGIN = re.compile(r"https?://[^/\s]+")  # what --cors-origin takes (scheme, host, port)
_ORIGIN_PARTS = re.compile(r"(https?)://(\[[0-9a-f:.]+\]|[^/:\[\]\s]+)(?::\d{1,5})?")


def host_name(value: str) -> str | None:
    """The host a Host header names, lowercased, without its port, brackets
    or trailing dot: ``LocalHost.:8080`` -> ``localhost``, ``[::1]:80`` -> ``::1``; None when
    ``value`` is not a ``host[:port]``."""
    value = value.strip().lower()
    if value.startswith("["):  # an IPv6 literal
        name, bracket, port = value[1:].partition("]")
        if not bracket or not _PORT.fullmatch(port):
            return None
        try:
            return str(ipaddress.IPv6Address(name))
        except ValueError:
            return None
    name, colon, port = value.partition(":")
    name = name.removesuffix(".")
    if not _NAME.fullmatch(name) or not _PORT.fullmatch(colon + port):
        return None
    return name


def origin_host(origin: str) -> str | None:
    """The host of an ``Origin`` header (``http://[::1]:3000`` -> ``::1``), None when it is not
    an http(s) origin (``null``, ``file://``, an extension's scheme)."""
    match = _ORIGIN_PARTS.fullmatch(origin.strip().lower())
    return None if match is None else match[2].strip("[]").removesuffix(".")


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` reaches this machine only: every address it names is a
    loopback one (a name that does not resolve is not)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


@functools.lru_cache(maxsize=256)  # names come from requests: the cache stays bounded
def is_own_address(name: str) -> bool:
    """Whether ``name`` is an IP address of this machine, which is what a socket can bind to."""
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    if ip.is_unspecified or ip.is_multicast:  # bindable, yet no one machine's address
        return False
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((name, 0))
        except OSError:
            return False
    return True


def require_key(host: str, api_key: str | None, insecure_no_key: bool) -> None:
    """Refuse to serve beyond this machine without an API key, unless told to."""
    if api_key is None and not insecure_no_key and not is_loopback(host):
        raise LLMLocalError(
            f"Listening on {host or 'every address'} lets other machines in, so it needs an API key: pass --api-key KEY "
            "(or set LLMLOCAL_SERVE_API_KEY), or --insecure-no-key to serve without one."
        )


def checked_hosts(names: Iterable[str]) -> frozenset[str]:
    """The ``--allow-host`` names, normalised as `host_name` reads them from a Host header."""
    out = set()
    for name in names:
        host = _bare_host(name)
        if host is None:
            raise LLMLocalError(f"--allow-host takes a host name or address without a scheme or port, like mybox.lan "
                                f"or 192.168.1.5: got '{name}'.")
        out.add(host)
    return frozenset(out)


def _bare_host(value: str) -> str | None:
    """A host name or IP address (an IPv6 one bracketed or not), normalised; None for anything else."""
    value = value.strip().lower().removesuffix(".")
    try:
        return str(ipaddress.ip_address(value[1:-1] if value.startswith("[") and value.endswith("]") else value))
    except ValueError:
        return value if _NAME.fullmatch(value) else None


def checked_origins(origins: Iterable[str]) -> frozenset[str]:
    """The ``--cors-origin`` values, lowercased (browsers send scheme and host so)."""
    out = set()
    for origin in origins:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise LLMLocalError(f"--cors-origin takes an origin like http://localhost:3000 (scheme, host, port; no path), "
                                f"or *: got '{origin}'.")
        out.add(origin.lower())
    return frozenset(out)


@dataclass(frozen=True)
class Access:
    """The names and origins a server answers; `for_bind` builds it from the flags."""

    loopback: bool  # bound to this machine only
    hosts: frozenset[str]  # answered besides LOCAL_NAMES (and, bound wider, this machine's addresses)
    origins: frozenset[str]  # browser origins let in besides local pages'; "*" lets any in

    @classmethod
    def for_bind(cls, bound: str, allow_hosts: Iterable[str] = (), cors_origins: Iterable[str] = ()) -> Access:
        """For a server bound to the address ``bound``."""
        hosts = set(checked_hosts(allow_hosts))
        if not ipaddress.ip_address(bound.split("%")[0]).is_unspecified:
            hosts.add(bound.lower())  # a server on 127.0.0.2 answers to 127.0.0.2
        loopback = is_loopback(bound)
        if not loopback:
            machine = socket.gethostname().lower()
            hosts |= {machine, machine.split(".")[0]}
        return cls(loopback, frozenset(hosts), checked_origins(cors_origins))

    def host_allowed(self, header: str | None) -> bool:
        if header is None:
            return True  # an HTTP/1.0 tool; browsers always send one
        name = host_name(header)
        if name is None:
            return False
        if name in LOCAL_NAMES or name in self.hosts:
            return True
        return not self.loopback and is_own_address(name)

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.origins or origin.strip().lower() in self.origins or origin_host(origin) in LOCAL_NAMES

    def cors_value(self, origin: str | None) -> str | None:
        """The Access-Control-Allow-Origin answer to ``origin``: None when it is not let in."""
        if origin is None or not self.origin_allowed(origin):
            return None
        return "*" if "*" in self.origins else origin


def refused_host(header: str) -> str:
    name = host_name(header)
    if name is None:
        return f"The Host header '{header[:100]}' is not a host name: send the server's address, like localhost:PORT."
    return (f"This server does not answer requests addressed to '{name}': if that name is this machine, "
            f"start the server with --allow-host {name}.")


def refused_origin(origin: str) -> str:
    named = origin if _ORIGIN.fullmatch(origin) else "'*'"  # 'null' (a sandboxed frame, a file) has no origin to name
    return f"Cross-origin requests from {origin[:100]} are not allowed: start the server with --cors-origin {named}."
