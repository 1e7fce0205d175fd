"""Redis URLs: which schemes the Redis store accepts, a cluster URL's seed nodes, and
the URL as it may be shown (without its password).

One server: `redis://[user:password@]host:port/db`, `rediss://...`, `unix:///path.sock`
(`valkey://`, `valkeys://` are aliases). A cluster:
`redis+cluster://[user:password@]host:port[,host:port...]` (`rediss+cluster://` for
TLS; `valkey+cluster://`, `valkeys+cluster://` are aliases): the seed nodes from which
redis-py's cluster client discovers the others.

TLS options travel in the query, as redis-py reads them from a `rediss://` URL (there
redis-py parses the whole URL itself): `?ssl_ca_certs=/path/ca.crt&ssl_certfile=...
&ssl_keyfile=...&ssl_cert_reqs=required`. A cluster URL's query is parsed by the same
redis-py function and may carry these options only (`TLS_OPTIONS`), on a TLS scheme.
A server URL's query may not set what the store's own settings bound
(`SETTINGS_OPTIONS`): redis-py would let it override them without a word.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

from redis.asyncio.connection import parse_url

SERVER_SCHEMES = ("redis", "rediss", "unix", "valkey", "valkeys")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster", "valkey+cluster", "valkeys+cluster")
URL_SCHEMES = SERVER_SCHEMES + CLUSTER_SCHEMES
# What a cluster URL's query may set: redis-py's TLS options of its cluster client.
# What the store's settings decide (timeout_s, max_connections): not for a URL's query.
SETTINGS_OPTIONS = ("socket_timeout", "socket_connect_timeout", "timeout", "max_connections")
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs",
               "ssl_check_hostname", "ssl_ciphers")


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
    """A parsed cluster URL: its seed nodes, TLS or not (and the TLS options of its
    query), and the credentials it carries."""

    seeds: tuple[tuple[str, int], ...]
    tls: bool
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_options: tuple[tuple[str, Any], ...] = ()

    def client_options(self) -> dict[str, Any]:
        """The TLS keyword arguments of redis-py's cluster client."""
        return {"ssl": self.tls, **dict(self.tls_options)} if self.tls else {}


def parse_cluster_url(url: str) -> ClusterURL:
    """The seed nodes and credentials of a `redis+cluster://` URL; ValueError (without
    the password) for anything else."""
    scheme, _, rest = url.partition("://")
    if scheme not in CLUSTER_SCHEMES:
        raise ValueError(f"{redact_url(url)!r} is not a {'/'.join(CLUSTER_SCHEMES)} URL")
    tls = scheme.startswith(("rediss", "valkeys"))
    rest, _, query = rest.partition("?")
    tls_options = _tls_options(url, query, tls)
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
    return ClusterURL(tuple(seeds), tls, username, password, tls_options)


def _tls_options(url: str, query: str, tls: bool) -> tuple[tuple[str, Any], ...]:
    """The query's options, typed as redis-py types those of a `rediss://` URL."""
    if not query:
        return ()
    names = set(parse_qs(query, keep_blank_values=True))
    unknown = sorted(names - set(TLS_OPTIONS))
    if unknown:
        raise ValueError(f"{redact_url(url)!r}: a cluster URL's query may set only "
                         f"{', '.join(TLS_OPTIONS)}, got {', '.join(unknown)}")
    if not tls:
        raise ValueError(f"{redact_url(url)!r}: TLS options need a rediss+cluster:// "
                         "(or valkeys+cluster://) URL")
    options = parse_url("rediss://localhost?" + query)
    return tuple(sorted((name, value) for name, value in options.items() if name in names))


def url_problem(url: str) -> str | None:
    """None for a URL the Redis store accepts, else what it must be (for the setting's
    error message)."""
    scheme = urlsplit(url).scheme
    if scheme in CLUSTER_SCHEMES:
        try:
            parse_cluster_url(url)
        except ValueError:
            return ("a redis+cluster:// URL whose seed nodes are host:port[,host:port...] "
                    "(rediss+cluster:// for TLS, whose query may set only "
                    f"{', '.join(TLS_OPTIONS)})")
        return None
    if scheme not in SERVER_SCHEMES:
        return "a URL"
    owned = sorted(set(parse_qs(urlsplit(url).query)) & set(SETTINGS_OPTIONS))
    if owned:
        return (f"a URL whose query does not set {', '.join(owned)} (set timeout_s and "
                "max_connections in kv_connector_extra_config instead)")
    return None
