"""Store addresses as elastic.addr (GLOBAL_ADDR) writes them: `host[:port]`, or several in failover order,
comma separated (zb.elastic.stores moves a run along them). A base module: the config's range check and
the elastic layer read them the same way."""

from __future__ import annotations

import re
from dataclasses import dataclass

from zb.errors import InvalidInput

WHAT = "elastic.addr (GLOBAL_ADDR)"


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_stores(text: str, default_port: int, what: str = WHAT) -> list[StoreAddress]:
    """`host[:port],host[:port]` (an IPv6 host in brackets when it has a port) in failover order."""
    entries = [e.strip() for e in text.split(",")]
    if any(not e for e in entries):
        raise InvalidInput(f"{what} {text!r} has an empty entry; write host[:port],host[:port]")
    found: list[StoreAddress] = []
    for entry in entries:
        address = _parse_entry(entry, default_port, what)
        if address in found:
            raise InvalidInput(f"{what} names the store {address} twice; name each store once, in failover order")
        found.append(address)
    return found


def _parse_entry(entry: str, default_port: int, what: str) -> StoreAddress:
    bracketed = re.fullmatch(r"\[([^\]]+)\](?::(.*))?", entry)
    if bracketed:
        host, port = bracketed.group(1), bracketed.group(2)
    elif entry.count(":") == 1:
        host, port = entry.split(":")
    elif _unbracketed_ipv6_with_port(entry):
        raise InvalidInput(f"{what}: {entry!r} reads as an IPv6 address and a port; {bracket_hint(entry)}")
    else:  # a name, an IPv4 address, or a bare IPv6 address (several colons, no port)
        host, port = entry, None
    if not host:
        raise InvalidInput(f"{what}: {entry!r} has no host; write host[:port]")
    if port is None:
        return StoreAddress(host, default_port)
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidInput(f"{what}: {entry!r} has port {port!r}; a port is a number from 1 to 65535")
    return StoreAddress(host, int(port))


def _unbracketed_ipv6_with_port(entry: str) -> str | None:
    """`::1:29721` -> "[::1]:29721": not an IPv6 address itself, but one followed by a port (read
    whole it would be a host name that does not resolve). An entry that is a valid IPv6 address
    (`fe80::1:2972`) is taken as one: the brackets are what tells the two apart."""
    import ipaddress

    host, _, port = entry.rpartition(":")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    for text, whole in ((entry, True), (host, False)):
        try:
            ipaddress.IPv6Address(text)
        except ValueError:
            continue
        return None if whole else f"[{host}]:{port}"
    return None


def bracket_hint(text: str) -> str:
    """"write IPv6 addresses in brackets: [::1]:29721" for the first entry of `text` that needs them, else ""."""
    for entry in (e.strip() for e in text.split(",")):
        fixed = _unbracketed_ipv6_with_port(entry)
        if fixed:
            return f"write IPv6 addresses in brackets: {fixed}"
    return ""


def valid_store_list(text: str) -> bool:
    """The config's range check of elastic.addr (the message of parse_stores says what is wrong)."""
    try:
        parse_stores(text, 1)
        return True
    except InvalidInput:
        return False
