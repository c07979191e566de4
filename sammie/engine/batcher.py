"""Dynamic batching across requests under a latency budget.

Requests `submit` a job and await its result. One collector task takes the first waiting job,
then keeps taking jobs until the batch holds `max_batch` images or `max_wait_ms` have passed
since that first job arrived, and runs the batch on the one model thread (the event loop stays
free to read and decode the next requests meanwhile). While a batch runs, new jobs queue; the
next batch starts when it ends, so under load batches fill without waiting at all.

One request's fault stays its own: `run` may answer an exception in a job's place (that job
fails, the others get their results), and when a batch of several fails as a whole, each of its
jobs runs again alone, so only the job that fails alone gets the error (one request with a
pathological input once failed every request batched with it: a helper's attack, sammie-hard).
The collector goes on.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable


class Batcher:
    def __init__(self, run: Callable[[list[Any]], list[Any]], *, max_batch: int = 8,
                 max_wait_ms: float = 5.0) -> None:
        if max_batch < 1 or max_wait_ms < 0:
            raise ValueError("max_batch must be >= 1 and max_wait_ms >= 0")
        self.run, self.max_batch, self.max_wait = run, max_batch, max_wait_ms / 1e3
        self.queue: asyncio.Queue | None = None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sammie-model")
        self.task: asyncio.Task | None = None
        self.batch_sizes: list[int] = []
        self.dead: str | None = None

    def start(self) -> None:
        self.queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._collect())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass
        self.pool.shutdown(wait=True, cancel_futures=True)

    @property
    def healthy(self) -> bool:
        return self.task is not None and not self.task.done() and self.dead is None

    @property
    def waiting(self) -> int:
        return self.queue.qsize() if self.queue is not None else 0

    async def submit(self, job) -> Any:
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put((job, fut))
        return await fut

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            deadline = time.monotonic() + self.max_wait
            while len(batch) < self.max_batch:
                left = deadline - time.monotonic()
                try:
                    batch.append(self.queue.get_nowait() if left <= 0
                                 else await asyncio.wait_for(self.queue.get(), left))
                except (asyncio.QueueEmpty, asyncio.TimeoutError):
                    break
            batch = [(j, f) for j, f in batch if not f.cancelled()]  # clients gone
            if not batch:
                continue
            self.batch_sizes = (self.batch_sizes + [len(batch)])[-1000:]
            try:
                results = await loop.run_in_executor(self.pool, self.run, [j for j, _ in batch])
            except Exception as e:  # noqa: BLE001 - alone, each job meets only its own fault
                if len(batch) == 1:
                    results = [e]
                else:
                    results = [await self._alone(loop, j) for j, _ in batch]
            for (_, f), r in zip(batch, results):
                if f.done():
                    continue
                if isinstance(r, BaseException):
                    f.set_exception(r)
                else:
                    f.set_result(r)

    async def _alone(self, loop, job):
        try:
            return (await loop.run_in_executor(self.pool, self.run, [job]))[0]
        except Exception as e:  # noqa: BLE001 - this job's own error
            return e
