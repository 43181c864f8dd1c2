#!/usr/bin/env python
"""Measure DataProto transport and row operations.

Prints, for 64 and 256 MiB batches: ray.put, ray.get (which includes the one receive-side copy
that keeps receivers isolated), the cost of that copy alone (numpy copy of the same bytes) and
ray.get of plain numpy arrays (the zero-copy lower bound).  Then chunk and concat of a 256 MiB
batch against numpy.concatenate of the same bytes.

Usage: PYTHONPATH=src python scripts/bench_dataproto.py [--repeat N] [--no-ray]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from rankmesh.data import DataProto

MIB = 1 << 20
ROWS = 1024


def batch_of(total_mib: int) -> DataProto:
    """Four keys of a quarter each: float32, bfloat16, int64, bool-as-uint8."""
    quarter = total_mib * MIB // 4
    return DataProto.from_dict(
        {
            "f32": torch.randn(ROWS, quarter // (4 * ROWS)),
            "bf16": torch.randn(ROWS, quarter // (2 * ROWS)).to(torch.bfloat16),
            "i64": torch.randint(0, 1000, (ROWS, quarter // (8 * ROWS))),
            "mask": torch.randint(0, 2, (ROWS, quarter // ROWS), dtype=torch.uint8),
        },
        {"uid": np.array([f"u{i}" for i in range(ROWS)], dtype=object)},
        {"step": 1},
    )


def best(fn: Callable[[], object], repeat: int) -> float:
    """Best wall time of ``repeat`` runs, in milliseconds."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def bench_ray(repeat: int) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=1,
             object_store_memory=2048 * MIB, log_to_driver=False)
    try:
        print(f"{'size':>8} {'put':>9} {'get':>9} {'copy':>9} {'get np':>9}  (ms, best of {repeat})")
        for mib in (64, 256):
            d = batch_of(mib)
            arrays = {k: v.view(torch.uint8).numpy() for k, v in d.batch.items()}
            put = best(lambda: ray.put(d), repeat)
            ref = ray.put(d)
            get = best(lambda: ray.get(ref), repeat)
            flat = np.concatenate([a.reshape(-1) for a in arrays.values()])
            copy = best(lambda: flat.copy(), repeat)
            np_ref = ray.put(arrays)
            get_np = best(lambda: ray.get(np_ref), repeat)
            got = ray.get(ref)
            assert all(torch.equal(got.batch[k], d.batch[k]) for k in d.batch.keys())
            print(f"{mib:>5}MiB {put:9.1f} {get:9.1f} {copy:9.1f} {get_np:9.1f}")
            del ref, np_ref, got
    finally:
        ray.shutdown()


def bench_rows(repeat: int, chunks: int = 8) -> None:
    d = batch_of(256)
    chunk_ms = best(lambda: d.chunk(chunks), repeat)
    parts = d.chunk(chunks)
    for key in d.batch.keys():  # views: every chunk starts inside the parent's storage
        base = d.batch[key].untyped_storage().data_ptr()
        assert all(p.batch[key].untyped_storage().data_ptr() == base for p in parts)
    np_parts = {k: [p.batch[k].view(torch.uint8).numpy() for p in parts] for k in d.batch.keys()}
    concat_ms, np_ms = float("inf"), float("inf")
    for _ in range(repeat):  # alternate, so both see the same state of the machine's memory
        concat_ms = min(concat_ms, best(lambda: DataProto.concat(parts), 1))
        np_ms = min(np_ms, best(lambda: [np.concatenate(v, axis=0) for v in np_parts.values()], 1))
    print(f"256MiB chunk({chunks}): {chunk_ms:8.3f} ms (views, no bytes copied)")
    print(f"256MiB concat({chunks} parts): {concat_ms:8.1f} ms; numpy.concatenate: {np_ms:8.1f} ms; "
          f"ratio {concat_ms / np_ms:4.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray put/get measurements")
    args = parser.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if not args.no_ray:
        bench_ray(args.repeat)
    bench_rows(args.repeat)


if __name__ == "__main__":
    main()
