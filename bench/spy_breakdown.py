"""Where `kvrecover serve`'s time goes, from a py-spy speedscope profile of its process.

    python bench/spy_breakdown.py PROFILE.json [...]

`bench_guidellm.py --profile-dir` records one profile per kvrecover turn (py-spy
`record --threads --idle`, so a thread's waits are sampled too) and prints this
breakdown for each. Only the busy window counts: from the engine thread's first
sample inside `Engine.step` to its last, so the load generator's start-up and
shut-down are left out. The engine thread's samples are split into the model
forward, sampling, the rest of the runner (step inputs, outputs), the scheduler,
the rest of the step, adding requests (prompt tokenizing), waiting for commands
(idle) and other; the HTTP thread's (the asyncio loop) into idle in `select`, the
detokenizer, the rest of our serving code, and the HTTP framework.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

# (category, any of these in a frame's "file:function" puts a sample there), first match wins.
ENGINE_RULES = (
    ("forward", ("ModelRunner._forward",)),
    ("sampling", ("worker/sampler.py",)),
    ("runner other", ("worker/model_runner.py",)),
    ("scheduler", ("engine/scheduler.py",)),
    ("step other", ("Engine.step",)),
    ("add request", ("EngineLoop._add",)),
    ("idle", ("EngineLoop._drain_commands",)),
)
HTTP_RULES = (
    ("detokenizer", ("server/detokenizer.py",)),
    ("our serving code", ("kvrecover/entrypoints/",)),
    ("http framework", ("uvicorn", "h11", "starlette", "fastapi", "anyio")),
)


def _names(frames: list[dict], stack: list[int]) -> list[str]:
    return [f"{frames[i]['file']}:{frames[i]['name']}" for i in stack]


def _category(names: list[str], rules: tuple) -> str:
    for category, needles in rules:
        if any(needle in name for name in names for needle in needles):
            return category
    return "other"


def breakdown(path: Path) -> dict[str, dict[str, float]]:
    """{"engine": {category: share}, "http": {...}} over the busy window of `path`."""
    data = json.loads(path.read_text())
    frames = data["shared"]["frames"]
    threads = {p["name"]: p["samples"] for p in data["profiles"]}
    engine = next(s for name, s in threads.items() if "kvrecover-engine" in name)
    http = next(s for name, s in threads.items() if "MainThread" in name)
    busy = [k for k, stack in enumerate(engine)
            if any("Engine.step" in n for n in _names(frames, stack))]
    if not busy:
        return {}
    window = slice(busy[0], busy[-1] + 1)

    def http_category(stack: list[int]) -> str:
        if "select" in frames[stack[-1]]["name"]:
            return "idle"
        return _category(_names(frames, stack), HTTP_RULES)

    shares = {}
    for thread, samples, classify in (
            ("engine", engine, lambda s: _category(_names(frames, s), ENGINE_RULES)),
            ("http", http, http_category)):
        counts = collections.Counter(classify(stack) for stack in samples[window])
        total = sum(counts.values())
        shares[thread] = {name: count / total for name, count in counts.most_common()}
    shares["window_samples"] = {"count": float(window.stop - window.start)}
    return shares


def format_breakdown(path: Path) -> str:
    """One line per thread: category shares in percent."""
    shares = breakdown(path)
    if not shares:
        return f"{path.name}: no engine step sampled"
    lines = [f"{path.name} ({shares['window_samples']['count']:.0f} samples in the busy window)"]
    for thread in ("engine", "http"):
        parts = ", ".join(f"{name} {share:.1%}" for name, share in shares[thread].items())
        lines.append(f"  {thread} thread: {parts}")
    return "\n".join(lines)


if __name__ == "__main__":
    for argument in sys.argv[1:]:
        print(format_breakdown(Path(argument)))
