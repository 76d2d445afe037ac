"""CachedCheck, behind /health and /ready: concurrent and repeated callers share one run of
the check for its time to live, a failure included, and a caller that leaves cancels nothing."""
import asyncio

import pytest

from app.ingress import CachedCheck


def test_callers_share_one_run_until_it_expires():
    runs = []

    async def check():
        runs.append(len(runs))
        await asyncio.sleep(0.05)
        return {"run": runs[-1]}

    async def main():
        cached = CachedCheck(check, ttl_s=0.2)
        together = await asyncio.gather(*(cached() for _ in range(20)))
        again = await cached()  # within the time to live
        await asyncio.sleep(0.25)
        return together, again, await cached()

    together, again, expired = asyncio.run(main())
    assert together == [{"run": 0}] * 20 and again == {"run": 0} and expired == {"run": 1}
    assert runs == [0, 1]


def test_a_failure_is_shared_and_a_leaving_caller_cancels_nothing():
    runs = []

    async def check():
        runs.append(1)
        await asyncio.sleep(0.05)
        raise RuntimeError("engine down")

    async def main():
        cached = CachedCheck(check, ttl_s=10)
        leaving = asyncio.ensure_future(cached())
        await asyncio.sleep(0.01)
        leaving.cancel()
        for _ in range(3):
            with pytest.raises(RuntimeError, match="engine down"):
                await cached()

    asyncio.run(main())
    assert runs == [1]
