"""Raw NIXL READ bandwidth between two processes on one GPU, against a device-to-device
copy: whether UCX moves GPU memory by cuda_ipc here, and what a first READ from a peer
costs against later ones (no engine, no checksums).

    PYTHONPATH=. python3 bench/probe_nixl_vram.py [--gib 2]
    UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto PYTHONPATH=. python3 bench/probe_nixl_vram.py

A producer process registers a CUDA tensor; this process registers its own, adds the
producer's agent and READs the whole tensor three times per descriptor count (1, 64, 2048
and 32768 pieces), checking the bytes, then times a D2D copy of as many bytes. The agents
are the connector's (`_nixl_agent(..., gpu=True)`: cuda_ipc's GET on unless the
environment says otherwise; UCX's own default, `auto`, shows the difference).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import time

import torch

from kvrecover.kv_transfer.p2p.nixl_connector import _nixl_agent


def produce(nbytes: int, metadata: multiprocessing.Queue, done: multiprocessing.Queue) -> None:
    source = torch.arange(nbytes // 4, dtype=torch.int32, device="cuda").view(torch.uint8)
    agent = _nixl_agent("probe-producer", gpu=True)
    agent.register_memory([source])
    metadata.put((agent.get_agent_metadata(), source.data_ptr()))
    end = time.monotonic() + 300
    while time.monotonic() < end and done.empty():
        agent.get_new_notifs()  # progresses the agent's backends
        time.sleep(0.0002)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0)
    nbytes = int(parser.parse_args().gib * (1 << 30)) // (32768 * 4) * (32768 * 4)
    print("UCX_CUDA_IPC_ENABLE_GET_ZCOPY =",
          os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "(the connector's default)"))
    multiprocessing.set_start_method("spawn")
    metadata, done = multiprocessing.Queue(), multiprocessing.Queue()
    producer = multiprocessing.Process(target=produce, args=(nbytes, metadata, done))
    producer.start()
    remote_metadata, remote_base = metadata.get(timeout=120)
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    agent = _nixl_agent("probe-consumer", gpu=True)
    agent.register_memory([target])
    peer = agent.add_remote_agent(remote_metadata)
    expected = torch.arange(4096, dtype=torch.int32)
    for pieces in (1, 64, 2048, 32768):
        size = nbytes // pieces
        local = [(target.data_ptr() + i * size, size, 0) for i in range(pieces)]
        remote = [(remote_base + i * size, size, 0) for i in range(pieces)]
        for attempt in range(3):
            target.zero_()
            torch.cuda.synchronize()
            started = time.perf_counter()
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "VRAM"),
                                           agent.get_xfer_descs(remote, "VRAM"), peer, b"")
            state = agent.transfer(handle)
            while state not in ("DONE", "ERR"):
                state = agent.check_xfer_state(handle)
            seconds = time.perf_counter() - started
            agent.release_xfer_handle(handle)
            exact = torch.equal(target[:16384].view(torch.int32).cpu(), expected)
            print(f"{pieces:>6} descriptors, READ {attempt}: {state} {seconds * 1e3:8.2f} ms "
                  f"{nbytes / seconds / 1e9:8.1f} GB/s bytes right: {exact}", flush=True)
    source = torch.ones_like(target)
    best = float("inf")
    for _ in range(4):
        torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(source)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    print(f"D2D copy: {best * 1e3:.2f} ms {nbytes / best / 1e9:.1f} GB/s (bytes moved once)")
    done.put(True)
    producer.join(timeout=10)


if __name__ == "__main__":
    main()
