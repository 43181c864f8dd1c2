"""How long RankMesh takes to build the coordinate table and one token's groups for a big world.

Usage: python scripts/bench_mesh.py [--world 131072] [--tp 8 --pp 8 --cp 2] [--repeat 5]
Prints the median of ``--repeat`` fresh builds, and megatron-core's RankGenerator on the same
token for comparison when megatron-core is installed (it is pure Python, so expect it slower).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

from rankmesh import RankMesh


def time_it(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=131072)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--token", default="dp")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-megatron", action="store_true", help="skip the megatron-core comparison")
    args = parser.parse_args()

    def build_table_and_groups():
        mesh = RankMesh.for_world(args.world, tp=args.tp, pp=args.pp, cp=args.cp)
        mesh.coord_table()
        return mesh.groups(args.token)

    seconds = time_it(build_table_and_groups, args.repeat)
    print(f"world={args.world} tp={args.tp} pp={args.pp} cp={args.cp} token={args.token}")
    print(f"rankmesh: coordinate table + all {args.token} groups: {seconds * 1000:.1f} ms (median of {args.repeat})")
    if not args.no_megatron:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from megatron.core.parallel_state import RankGenerator
        except ImportError:
            return
        dp = args.world // (args.tp * args.pp * args.cp)
        gen = RankGenerator(tp=args.tp, ep=1, dp=dp, pp=args.pp, cp=args.cp, order="tp-cp-ep-dp-pp")
        mseconds = time_it(lambda: gen.get_ranks(args.token), 1)
        print(f"megatron-core RankGenerator.get_ranks({args.token!r}) alone: {mseconds * 1000:.1f} ms "
              f"({mseconds / seconds:.1f}x rankmesh's table + groups)")


if __name__ == "__main__":
    main()
