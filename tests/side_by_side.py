"""``side_by_side(*calls)``: independent test subprocesses (training runs, refused runs, benchmark scripts) at the
same time instead of one after the other."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def side_by_side(*calls):
    """Run zero-argument callables (each typically waiting on a subprocess) at the same time, one thread each; their
    results in the order given. An exception raised by a call is raised here, after every call has ended."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
        return [f.result() for f in futures]
