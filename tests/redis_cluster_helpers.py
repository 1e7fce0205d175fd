"""A private three-node Redis Cluster on loopback ports for the tests (no persistence;
optionally replicas, optionally TLS only), and the faults they inject: a node killed,
paused, restarted empty, slots moved between nodes while a run uses them, a replica cut
off from its primary and promoted."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.crc import key_slot

NODE_TIMEOUT_MS = 30000  # longer than any test: no node is ever marked failed meanwhile


@dataclass(frozen=True)
class TLSFiles:
    """A throwaway CA and a certificate for 127.0.0.1 signed by it (the nodes' server and
    client certificate, and the tests' client certificate), made with the openssl CLI."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def make(cls, folder: Path) -> TLSFiles:
        folder.mkdir(parents=True, exist_ok=True)
        files = cls(folder / "ca.crt", folder / "node.crt", folder / "node.key")
        ca_key, request, extensions = folder / "ca.key", folder / "node.csr", folder / "san.ext"
        extensions.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
        curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        for command in (
            ["req", "-x509", *curve, "-keyout", ca_key, "-out", files.ca, "-days", "2",
             "-subj", "/CN=kvrecover test CA"],
            ["req", "-new", *curve, "-keyout", files.key, "-out", request,
             "-subj", "/CN=127.0.0.1"],
            ["x509", "-req", "-in", request, "-CA", files.ca, "-CAkey", ca_key,
             "-CAcreateserial", "-out", files.cert, "-days", "2", "-extfile", extensions],
        ):
            subprocess.run(["openssl", *map(str, command)], check=True, capture_output=True,
                           timeout=30)
        return files

    def server_args(self, port: int) -> list[str]:
        """redis-server flags: TLS only on `port` (no plain port), on the bus and to replicas."""
        return ["--port", "0", "--tls-port", str(port), "--tls-cert-file", str(self.cert),
                "--tls-key-file", str(self.key), "--tls-ca-cert-file", str(self.ca),
                "--tls-cluster", "yes", "--tls-replication", "yes"]

    def cli_args(self) -> list[str]:
        return ["--tls", "--cacert", str(self.ca), "--cert", str(self.cert),
                "--key", str(self.key)]

    def client_kwargs(self) -> dict:
        """redis-py's TLS options for these files (a client certificate: the nodes ask one)."""
        return dict(ssl=True, ssl_ca_certs=str(self.ca), ssl_certfile=str(self.cert),
                    ssl_keyfile=str(self.key))

    def url_query(self) -> str:
        """The same options as a URL's query (`rediss://` and `rediss+cluster://`)."""
        return (f"?ssl_ca_certs={self.ca}&ssl_certfile={self.cert}&ssl_keyfile={self.key}"
                "&ssl_cert_reqs=required")


@dataclass
class ClusterNodeProcess:
    """One redis-server of the cluster."""

    port: int
    folder: Path
    process: subprocess.Popen | None = None
    tls: TLSFiles | None = None

    def start(self, binary: str) -> None:
        """Start (or restart, empty, keeping its node id and slots from nodes.conf)."""
        ports = ["--port", str(self.port)] if self.tls is None else self.tls.server_args(self.port)
        self.process = subprocess.Popen(
            [binary, *ports, "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", str(self.folder / "nodes.conf"),
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
             "--cluster-require-full-coverage", "no", "--appendonly", "no", "--save", "",
             "--repl-diskless-sync-delay", "0",  # a replica syncs at once, not after 5 s
             "--dir", str(self.folder), "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def client(self, timeout_s: float = 5) -> redis.Redis:
        """A plain (non-cluster) client of this node."""
        tls = {} if self.tls is None else self.tls.client_kwargs()
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout_s,
                           socket_connect_timeout=timeout_s, **tls)

    def node_id(self) -> str:
        return self.client().execute_command("CLUSTER", "MYID").decode()

    def kill(self) -> None:
        """SIGKILL: the node vanishes."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def pause(self) -> None:
        """SIGSTOP: the node keeps its sockets open and never answers."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause`."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)


class RedisClusterProcesses:
    """Three (by default) cluster nodes on free 127.0.0.1 ports, joined by
    `redis-cli --cluster create`, each slot range on one primary (`nodes`). With
    `replicas=k`, k more nodes (`replicas`), the i-th a replica of `nodes[i]`; with
    `tls`, every node speaks TLS only (clients, cluster bus, replication)."""

    def __init__(self, size: int = 3, binary: str = "redis-server", replicas: int = 0,
                 tls: TLSFiles | None = None) -> None:
        if replicas > size:
            raise ValueError(f"at most one replica per primary: replicas={replicas} > {size}")
        self.root = Path(tempfile.mkdtemp(prefix="kvr-cluster-"))
        self.binary = shutil.which(binary) or binary
        self.tls = tls
        ports = free_cluster_ports(size + replicas)
        self.nodes = [ClusterNodeProcess(port, self.root / str(port), tls=tls)
                      for port in ports[:size]]
        self.replicas = [ClusterNodeProcess(port, self.root / str(port), tls=tls)
                         for port in ports[size:]]

    @property
    def url(self) -> str:
        """The seed nodes (the primaries), with the TLS options when it speaks TLS."""
        seeds = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        if self.tls is None:
            return "redis+cluster://" + seeds
        return "rediss+cluster://" + seeds + self.tls.url_query()

    def start(self) -> RedisClusterProcesses:
        for node in self.nodes + self.replicas:
            node.folder.mkdir()
            node.start(self.binary)
        for node in self.nodes + self.replicas:
            wait_until(lambda n=node: _pings(n), "a cluster node to start")
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli") or "redis-cli"
        tls = [] if self.tls is None else self.tls.cli_args()
        subprocess.run([cli, *tls, "--cluster", "create",
                        *[f"127.0.0.1:{n.port}" for n in self.nodes],
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        self.wait_ok()
        for replica, primary in zip(self.replicas, self.nodes):
            self._attach(replica, primary)
        return self

    def _attach(self, replica: ClusterNodeProcess, primary: ClusterNodeProcess) -> None:
        """Join `replica` to the cluster as a replica of `primary`, synced."""
        primary_id = primary.node_id()
        replica.client().execute_command("CLUSTER", "MEET", "127.0.0.1", primary.port)
        wait_until(lambda: primary_id in _known_node_ids(replica),
                   "a new node to learn the cluster")
        replica.client().execute_command("CLUSTER", "REPLICATE", primary_id)
        wait_until(lambda: replica.client().info("replication").get("master_link_status")
                   == "up", "a replica to sync")
        self.wait_ok()
        # Gossip done: every node knows every other (connected) and the same current epoch,
        # else a later takeover's new epoch may not reach (or not win on) every node.
        everyone = self.nodes + self.replicas

        def settled() -> bool:
            ids = {n.node_id() for n in everyone}
            epochs = {n.client().cluster("info")["cluster_current_epoch"] for n in everyone}
            return len(epochs) == 1 and all(
                {known["node_id"] for known in n.client().cluster("nodes").values()
                 if known["connected"]} >= ids - {n.node_id()} for n in everyone)
        wait_until(settled, "the cluster to learn its new replica")

    def cut_replication(self, replica: ClusterNodeProcess) -> None:
        """Cut `replica` off from its primary, which keeps serving: the replica never gets
        the writes that follow (its reconnects fail: it sends a password its primary
        does not have)."""
        client = replica.client()
        client.config_set("masterauth", "not-the-primary's")
        client.execute_command("CLIENT", "KILL", "TYPE", "master")
        wait_until(lambda: client.info("replication").get("master_link_status") == "down",
                   "a replica to lose its primary")

    def promote(self, replica: ClusterNodeProcess) -> None:
        """`CLUSTER FAILOVER TAKEOVER` on `replica` (its primary may be dead): until every
        running node says it serves the slots its primary served."""
        replica.client().execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
        wait_until(lambda: replica.client().info("replication").get("role") == "master",
                   "a replica to take over")

        def agreed() -> bool:
            running = [n for n in self.nodes + self.replicas if n.process is not None]
            try:
                maps = [self._owners(n) for n in running]
            except redis.RedisError:
                return False
            return all(m == maps[0] for m in maps) and any(
                port == replica.port for *_, port in maps[0])
        wait_until(agreed, "every node to see the promoted replica")

    def wait_ok(self) -> None:
        """Until every running node says cluster_state:ok and agrees on the slots."""
        def ok() -> bool:
            running = [n for n in self.nodes if n.process is not None]
            try:
                states = [n.client().cluster("info")["cluster_state"] for n in running]
                maps = [self._owners(n) for n in running]
            except redis.RedisError:
                return False
            return all(state == "ok" for state in states) and all(m == maps[0] for m in maps)
        wait_until(ok, "cluster_state:ok")

    def _owners(self, node: ClusterNodeProcess) -> list[tuple[int, int, int]]:
        slots = node.client().execute_command("CLUSTER", "SLOTS")
        return sorted((int(start), int(end), int(owner[1])) for start, end, owner, *_ in slots)

    def node_of_slot(self, slot: int) -> ClusterNodeProcess:
        """The node that `cluster slots` (asked of a running node) says serves `slot`."""
        asked = next(n for n in self.nodes if n.process is not None)
        for start, end, port in self._owners(asked):
            if start <= slot <= end:
                return self.node_of_port(port)
        raise LookupError(f"no node serves slot {slot}")

    def node_of_key(self, key: bytes) -> ClusterNodeProcess:
        return self.node_of_slot(key_slot(key))

    def node_of_port(self, port: int) -> ClusterNodeProcess:
        return next(n for n in self.nodes + self.replicas if n.port == port)

    def keys(self) -> dict[int, set[bytes]]:
        """Every primary's keys, by port."""
        return {n.port: set(n.client().keys("*")) for n in self.nodes}

    def flush(self) -> None:
        for node in self.nodes:
            node.client().flushall()

    def move_slot(self, slot: int, target: ClusterNodeProcess, keys_to_move: int | None = None
                  ) -> None:
        """Migrate `slot` to `target` (CLUSTER SETSLOT ... MIGRATING/IMPORTING, MIGRATE).
        With `keys_to_move`, only that many of its keys move and the slot stays migrating:
        the source answers ASK for the moved ones."""
        source = self.node_of_slot(slot)
        if source is target:
            raise ValueError(f"slot {slot} is on {target.port} already")
        source_id, target_id = source.node_id(), target.node_id()
        target.client().execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
        source.client().execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
        keys = source.client().execute_command("CLUSTER", "GETKEYSINSLOT", slot, 1000)
        keys = keys if keys_to_move is None else keys[:keys_to_move]
        if keys:
            source.client().execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000,
                                            "KEYS", *keys)
        if keys_to_move is not None:
            return
        for node in self.nodes:
            node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)

    def cleanup(self) -> None:
        for node in self.nodes + self.replicas:
            if node.process is not None:
                try:
                    node.resume()  # a paused node cannot die of SIGTERM
                except ProcessLookupError:
                    pass
                node.process.terminate()
                try:
                    node.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    node.kill()
                node.process = None
        shutil.rmtree(self.root, ignore_errors=True)


def _pings(node: ClusterNodeProcess) -> bool:
    if node.process is None or node.process.poll() is not None:
        raise RuntimeError(f"redis-server on port {node.port} exited at start")
    try:
        return bool(node.client(timeout_s=1).ping())
    except redis.RedisError:
        return False


def _known_node_ids(node: ClusterNodeProcess) -> set[str]:
    return {known["node_id"] for known in node.client().cluster("nodes").values()}


def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    """Poll `condition` every 50 ms; RuntimeError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def free_cluster_ports(count: int) -> list[int]:
    """`count` free 127.0.0.1 ports whose cluster bus ports (port + 10000) are free too."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port + 10000 < 65536 and port not in ports and _free(port + 10000):
            ports.append(port)
    return ports


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
