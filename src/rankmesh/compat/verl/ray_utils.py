"""verl's ``verl.utils.ray_utils.parallel_put``: put a list of objects into Ray's object store from a pool of threads.

verl's dispatch puts each rank's piece of a call this way, and verl code calls it itself to put
a list of objects ahead of time.  rankmesh's own dispatch needs none of it (a group puts each
distinct piece of a call once itself, ``Backend.share``): this is for ported code, with verl's
contract (the ObjectRefs in input order; an empty list fails verl's assert).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import ray

from rankmesh.errors import DispatchAssertionError

#: verl's default cap on the threads that put at once.
MAX_PUT_THREADS = 16


def parallel_put(data_list: Sequence[Any], max_workers: int | None = None) -> list[Any]:
    """One ``ray.put`` per object of ``data_list``, ``max_workers`` threads at once; the ObjectRefs in input order.

    ``max_workers`` defaults to verl's ``min(len(data_list), 16)``.  An empty list fails verl's
    assert (:class:`~rankmesh.errors.DispatchAssertionError`, an ``AssertionError``).
    """
    items = list(data_list)
    if not items:
        raise DispatchAssertionError("parallel_put(data_list): data_list must not be empty, give at least one object to put")
    threads = min(len(items), MAX_PUT_THREADS) if max_workers is None else max_workers
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="parallel_put") as pool:
        return list(pool.map(ray.put, items))


__all__ = ["MAX_PUT_THREADS", "parallel_put"]
