"""Admission: a strict bound on the requests an ingress replica lets through, each place
given back once. CachedCheck, behind /health and /ready: concurrent and repeated callers share
one run of the check for its time to live, a failure included, and a caller that leaves
cancels nothing."""
import asyncio

import pytest

from app.admission import Admission, CachedCheck
from app.errors import OpenAIError


def test_admission_refuses_past_its_limit_and_each_place_comes_back_once():
    admission = Admission(limit=2)
    first, second = admission.admit(), admission.admit()
    with pytest.raises(OpenAIError) as refused:
        admission.admit()
    assert (refused.value.status_code, refused.value.code) == (503, "overloaded")
    assert refused.value.message == ("the service is overloaded: 2 requests are running or waiting "
                                     "(max_num_seqs + max_waiting_requests per engine replica); retry later")
    assert refused.value.response().headers["Retry-After"] == "1"
    first()
    first()  # a second release of the same place changes nothing
    assert admission.num_admitted == 1
    third = admission.admit()
    with pytest.raises(OpenAIError):
        admission.admit()
    second(), third()
    assert admission.num_admitted == 0


def test_a_batchs_places_are_taken_and_given_back_together():
    admission = Admission(limit=5)
    first = admission.admit()
    batch = admission.admit(3)  # a completions batch of 4 prompts: the middleware took the first place
    with pytest.raises(OpenAIError):
        admission.admit(2)  # 4 + 2 > 5: none taken
    assert admission.num_admitted == 4
    last = admission.admit()
    batch()
    batch()
    assert admission.num_admitted == 2
    first(), last()
    assert admission.num_admitted == 0 and admission.admit(0)() is None


def test_callers_share_one_run_until_it_expires():
    runs = []

    async def check():
        runs.append(len(runs))
        await asyncio.sleep(0.05)
        return {"run": runs[-1]}

    async def main():
        cached = CachedCheck(check, ttl_s=1.0)
        together = await asyncio.gather(*(cached() for _ in range(20)))
        again = await cached()  # within the time to live
        await asyncio.sleep(1.05)
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
