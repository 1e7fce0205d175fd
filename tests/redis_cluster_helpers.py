"""A private three-node Redis Cluster on loopback ports for the tests (no persistence,
no replicas), and the faults they inject: a node killed, paused, restarted empty, and
slots moved between nodes while a run uses them."""

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


@dataclass
class ClusterNodeProcess:
    """One redis-server of the cluster."""

    port: int
    folder: Path
    process: subprocess.Popen | None = None

    def start(self, binary: str) -> None:
        """Start (or restart, empty, keeping its node id and slots from nodes.conf)."""
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", str(self.folder / "nodes.conf"),
             "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
             "--cluster-require-full-coverage", "no", "--appendonly", "no", "--save", "",
             "--dir", str(self.folder), "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def client(self) -> redis.Redis:
        """A plain (non-cluster) client of this node."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

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
    `redis-cli --cluster create`, each slot range on one primary."""

    def __init__(self, size: int = 3, binary: str = "redis-server") -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kvr-cluster-"))
        self.binary = shutil.which(binary) or binary
        self.nodes = [ClusterNodeProcess(port, self.root / str(port))
                      for port in free_cluster_ports(size)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> RedisClusterProcesses:
        for node in self.nodes:
            node.folder.mkdir()
            node.start(self.binary)
        for node in self.nodes:
            wait_until(lambda n=node: _pings(n), "a cluster node to start")
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli") or "redis-cli"
        subprocess.run([cli, "--cluster", "create",
                        *[f"127.0.0.1:{n.port}" for n in self.nodes],
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        self.wait_ok()
        return self

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
                return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no node serves slot {slot}")

    def node_of_key(self, key: bytes) -> ClusterNodeProcess:
        return self.node_of_slot(key_slot(key))

    def keys(self) -> dict[int, set[bytes]]:
        """Every node's keys, by port."""
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
        for node in self.nodes:
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
        return bool(redis.Redis(host="127.0.0.1", port=node.port, socket_timeout=1,
                                socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


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
