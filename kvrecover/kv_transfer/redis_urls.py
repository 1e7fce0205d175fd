"""Redis URLs: which schemes the Redis store accepts, a cluster URL's seed nodes, and
the URL as it may be shown (without its password).

One server: `redis://[user:password@]host:port/db`, `rediss://...`, `unix:///path.sock`
(`valkey://`, `valkeys://` are aliases). A cluster:
`redis+cluster://[user:password@]host:port[,host:port...]` (`rediss+cluster://` for
TLS; `valkey+cluster://`, `valkeys+cluster://` are aliases): the seed nodes from which
redis-py's cluster client discovers the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit, urlunsplit

SERVER_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster", "valkey+cluster", "valkeys+cluster")
URL_SCHEMES = SERVER_SCHEMES + CLUSTER_SCHEMES


def redact_url(url: str) -> str:
    """The URL with any password replaced by `***` (for messages and repr)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def is_cluster_url(url: str) -> bool:
    """Whether `url` names a Redis Cluster (a `+cluster` scheme)."""
    return urlsplit(url).scheme in CLUSTER_SCHEMES


@dataclass(frozen=True)
class ClusterURL:
    """A parsed cluster URL: its seed nodes, TLS or not, and the credentials it carries."""

    seeds: tuple[tuple[str, int], ...]
    tls: bool
    username: str | None = None
    password: str | None = field(default=None, repr=False)


def parse_cluster_url(url: str) -> ClusterURL:
    """The seed nodes and credentials of a `redis+cluster://` URL; ValueError (without
    the password) for anything else."""
    scheme, _, rest = url.partition("://")
    if scheme not in CLUSTER_SCHEMES:
        raise ValueError(f"{redact_url(url)!r} is not a {'/'.join(CLUSTER_SCHEMES)} URL")
    netloc, _, path = rest.partition("/")
    if path not in ("", "0"):
        raise ValueError(f"{redact_url(url)!r}: a Redis Cluster has only database 0")
    userinfo, _, hosts = netloc.rpartition("@")
    username = password = None
    if userinfo:
        user, has_password, secret = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(secret) if has_password else None
    seeds = []
    for seed in hosts.split(","):
        host, _, port = seed.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{redact_url(url)!r}: each seed node must be host:port, "
                             f"got {seed!r}")
        seeds.append((host.strip("[]"), int(port)))
    return ClusterURL(tuple(seeds), scheme.startswith(("rediss", "valkeys")), username, password)


def url_problem(url: str) -> str | None:
    """None for a URL the Redis store accepts, else what it must be (for the setting's
    error message)."""
    scheme = urlsplit(url).scheme
    if scheme in CLUSTER_SCHEMES:
        try:
            parse_cluster_url(url)
        except ValueError:
            return "a redis+cluster:// URL whose seed nodes are host:port[,host:port...]"
        return None
    return None if scheme in SERVER_SCHEMES else "a URL"
