"""The address a worker tells others to reach it at (registry entry, KV-transfer descriptors).

On one machine a worker listens on 127.0.0.1 and says so. In a container it
listens on every interface (``--host 0.0.0.0``) and must advertise an address
the other containers can reach: ``--advertise-host`` if given (Kubernetes passes
the pod IP from the downward API), otherwise the address this host's name
resolves to, which Docker and Kubernetes both write into the container's
/etc/hosts. A wildcard is never advertised: peers would connect to themselves.
"""

from __future__ import annotations

import ipaddress
import socket

WILDCARDS = ("0.0.0.0", "::", "")


def advertised_host(listen_host: str, configured: str | None = None) -> str:
    """``configured``, else ``listen_host`` unless it is a wildcard, else this host's own address."""
    if configured:
        if configured in WILDCARDS:
            raise ValueError(f"--advertise-host {configured!r} is a wildcard; give an address peers can reach")
        return configured
    if listen_host not in WILDCARDS:
        return listen_host
    name = socket.gethostname()
    try:
        candidates = [info[4][0] for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)]
    except OSError:
        candidates = []
    for address in candidates:
        if not ipaddress.ip_address(address.split("%")[0]).is_loopback:
            return address
    raise ValueError(f"listening on {listen_host or 'every interface'}, but this host's name {name!r} resolves to "
                     f"no address other machines can reach ({', '.join(candidates) or 'none'}): give "
                     "--advertise-host (PDSERVE_ADVERTISE_HOST)")


def host_port(host: str, port: int) -> str:
    """``host:port``, bracketing an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
