"""Several streams of fragments as one: the `n` choices of an answer, each fragment as
it comes (a choice's own fragments stay in order). An error of one stream ends them
all; closing the merged stream closes every stream (aborting what still runs)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TypeVar

F = TypeVar("F")


async def interleave(streams: list[AsyncGenerator[F, None]]
                     ) -> AsyncGenerator[F, None]:
    """The chunks of every stream as they come; an error of one ends them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for alone in only:
                yield alone
        return
    queue: asyncio.Queue[tuple[F | None, BaseException | None]] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[F, None]) -> None:
        try:
            async with aclosing(stream):
                async for chunk in stream:
                    await queue.put((chunk, None))
        except Exception as error:
            await queue.put((None, error))
            return
        await queue.put((None, None))

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        running = len(tasks)
        while running:
            got, error = await queue.get()
            if error is not None:
                raise error
            if got is None:
                running -= 1
                continue
            yield got
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
