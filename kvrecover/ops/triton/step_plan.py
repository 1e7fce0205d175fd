"""A step's recurrent requests as the index tensors the Triton linear-attention kernels
read (`StepPlan`): built per eager step (`build_plan`, one host-to-device copy), or
packed into a CUDA graph's static step buffer for a padded decode step
(`pack_decode_plan`, `decode_plan_views`).

A padded decode step has a fixed layout per graph size P: `meta` [4, P] (first row,
row count, first position, state slot), `snapshot_begin` [P + 1], `snapshot_position`
and `snapshot_slot` [P] (a one-token row reaches at most one block boundary). Padding
requests bring 0 rows: the kernels then write nothing (no output, state, tail or
checkpoint), so their slot (0) is only read. Needs no Triton.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvrecover.ops.interface import RecurrentRequestRows


@dataclass
class StepPlan:
    """A step's requests as device index tensors (int32), for every layer's kernels.
    The kernels' grid covers `meta.shape[1]` requests (padding ones included)."""

    requests: Sequence[RecurrentRequestRows]  # the list it was built from (identity key)
    meta: torch.Tensor  # [4, R]: first row, row count, first position, state slot
    snapshot_begin: torch.Tensor  # [R + 1]: request r's checkpoints are entries [b[r], b[r+1])
    snapshot_position: torch.Tensor  # [max(N, 1)] boundary positions, by request then position
    snapshot_slot: torch.Tensor  # [max(N, 1)] checkpoint slots
    max_rows: int  # the most rows any request brings
    num_snapshots: int  # checkpoint entries over all requests (0 in a graph's static plan)

    @property
    def num_requests(self) -> int:
        """Requests the kernels' grid covers."""
        return self.meta.shape[1]


class PlannedRequests(Sequence[RecurrentRequestRows]):
    """The request list a graphed step hands its recurrent layers: `plan` is prebuilt in
    the graph's static buffer, so no layer builds one (`TritonLinearAttention`)."""

    def __init__(self, plan: StepPlan, rows: Sequence[RecurrentRequestRows]) -> None:
        self.plan = plan
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index):  # an int or a slice, as the list's
        return self._rows[index]

    def __iter__(self) -> Iterator[RecurrentRequestRows]:
        return iter(self._rows)


def build_plan(requests: Sequence[RecurrentRequestRows], device: torch.device) -> StepPlan:
    """The index tensors of `requests` (one host-to-device copy)."""
    starts = [r.start_row for r in requests]
    counts = [r.end_row - r.start_row for r in requests]
    positions = [r.position for r in requests]
    slots = [r.slot for r in requests]
    begin, snap_positions, snap_slots = [0], [], []
    for request in requests:
        wanted = sorted(request.checkpoints)
        if len({p for p, _ in wanted}) != len(wanted):
            raise ValueError(f"request at row {request.start_row} asks for two checkpoints of "
                             "one boundary; give each boundary one checkpoint slot")
        snap_positions += [p for p, _ in wanted]
        snap_slots += [s for _, s in wanted]
        begin.append(len(snap_positions))
    entries = len(snap_positions)
    flat = starts + counts + positions + slots + begin + (snap_positions or [-1]) + (
        snap_slots or [0])
    packed = torch.tensor(flat, dtype=torch.int32).to(device, non_blocking=True)
    num = len(requests)
    meta, rest = packed[: 4 * num].view(4, num), packed[4 * num :]
    width = max(entries, 1)
    return StepPlan(requests, meta, rest[: num + 1], rest[num + 1 : num + 1 + width],
                    rest[num + 1 + width :], max(counts, default=0), entries)


def decode_plan_lengths(num_reqs: int) -> dict[str, int]:
    """The int32 segments of a padded decode step's plan and their lengths."""
    return {"rec_meta": 4 * num_reqs, "rec_snap_begin": num_reqs + 1,
            "rec_snap_position": num_reqs, "rec_snap_slot": num_reqs}


def pack_decode_plan(segments: dict[str, np.ndarray],
                     requests: Sequence[RecurrentRequestRows], num_reqs: int) -> None:
    """Write a one-token-per-request step's `requests` (request i on row i), padded to
    `num_reqs` requests of 0 rows, into the host `segments` of `decode_plan_lengths`."""
    num_real = len(requests)
    meta = segments["rec_meta"].reshape(4, num_reqs)
    meta[0] = np.arange(num_reqs)  # padding request i "starts" at its own padding row
    meta[1, num_real:] = 0
    meta[2:, num_real:] = 0
    begin, positions, slots = (segments[name] for name in (
        "rec_snap_begin", "rec_snap_position", "rec_snap_slot"))
    begin[0] = 0
    entries = 0
    for index, request in enumerate(requests):
        if request.start_row != index or request.end_row != index + 1:
            raise ValueError(f"a graphed decode step gives request {index} row {index} "
                             f"alone, not rows [{request.start_row}, {request.end_row})")
        meta[1, index] = 1
        meta[2, index] = request.position
        meta[3, index] = request.slot
        if len(request.checkpoints) > 1:
            raise ValueError("a one-token row reaches one block boundary, not "
                             f"{len(request.checkpoints)} checkpoints")
        for position, slot in request.checkpoints:
            positions[entries] = position
            slots[entries] = slot
            entries += 1
        begin[index + 1] = entries
    begin[num_real + 1 :] = entries
    positions[entries:] = -1
    slots[entries:] = 0


def decode_plan_views(segments: dict[str, torch.Tensor], num_reqs: int) -> PlannedRequests:
    """The plan of a padded decode step as views of the uploaded `segments`, wrapped as
    the request list the layers get (its rows are placeholders: the plan is the truth)."""
    plan = StepPlan(
        (), segments["rec_meta"].view(4, num_reqs), segments["rec_snap_begin"],
        segments["rec_snap_position"], segments["rec_snap_slot"], max_rows=1, num_snapshots=0)
    plan.requests = rows = PlannedRequests(plan, [_PaddingRow(i) for i in range(num_reqs)])
    return rows


@dataclass(frozen=True)
class _PaddingRow:
    """A placeholder row of a graphed step's request list (the plan holds the real data)."""

    start_row: int

    @property
    def end_row(self) -> int:
        return self.start_row

    position = 0
    slot = 0
    checkpoints: tuple[tuple[int, int], ...] = ()
