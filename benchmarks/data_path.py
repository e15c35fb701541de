"""The data path alone: meshforge's loader (no model) against a plain numpy memmap loop
over the same shards, tokens/s delivered per rank, alternating in one run so machine
noise hits both alike; then `meshforge bench io` on the same storage.

  loader  DistributedBatchLoader over load_tokens(SHARDS).train as rank 0 of --dp ranks
          (its prefetch thread and --readers reader threads): next() for --steps steps
  plain   what a hand-written loop does (nanoGPT's get_batch): the same global-batch
          offsets, each rank's rows sliced from np.memmap's of the shard files, turned into
          int64 x / y tensors; no thread, no checks

Both deliver the same rows (checked on the first step). tokens/s per rank =
steps x (global_batch / dp) x seq_len / wall time. Goals (issue 11): the loader at least
0.8x the plain loop, and at least 20x the tokens/s per rank the demo job consumes (from
runs/demo/report.json when it exists, else the README's figure: 18,600 tokens/s on 2 ranks).
`bench io` then reads the same shards in 4 MiB blocks (both orders) and in reads of one
sequence, (seq_len + 1) x 2 bytes at random offsets, as the loader reads.

The shards are made once (random byte tokens, --tokens of them in shards of
--shard-tokens) under --work (default: a temporary folder). Each --path DIR is another
storage location (an NFS or MooseFS mount: helper M's fixture passes its mount here): the
shards are copied there and everything runs on it too, side by side with local disk.

    python benchmarks/data_path.py [--rounds 7] [--steps 2000] [--path DIR ...] [--moosefs]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from meshforge.bench import io as bench_io
from meshforge.data.corpus import load_tokens
from meshforge.data.loader import DistributedBatchLoader, global_batch_offsets, rank_slice
from meshforge.data.shards import prepare

REPO = Path(__file__).resolve().parents[1]
README_DEMO = (18_600.0, 2)  # tokens/s and ranks of `make demo` (README) when no run exists


def make_shards(work: Path, tokens: int, shard_tokens: int) -> Path:
    out = work / "shards"
    if (out / "index.json").is_file():
        return out
    text = work / "corpus.txt"
    rng = np.random.default_rng(0)
    with open(text, "wb") as f:
        for start in range(0, tokens, 1 << 22):
            f.write(rng.integers(32, 127, min(1 << 22, tokens - start), dtype=np.uint8).tobytes())
    prepare(text, out, shard_tokens=shard_tokens)
    text.unlink()
    return out


class PlainLoop:
    """nanoGPT's get_batch over memmaps of the shard files, with the loader's offsets."""

    def __init__(self, shards: Path, n_train: int, args: argparse.Namespace) -> None:
        index = json.loads((shards / "index.json").read_text())
        self.maps = [
            np.memmap(shards / s["file"], dtype=np.uint16, mode="r") for s in index["shards"]
        ]
        self.starts = np.cumsum([0] + [len(m) for m in self.maps])
        self.n_train, self.args = n_train, args
        self.mine = rank_slice(args.global_batch, 0, args.dp)

    def _row(self, offset: int, length: int) -> np.ndarray:
        i = int(np.searchsorted(self.starts, offset, side="right")) - 1
        local = offset - self.starts[i]
        row = self.maps[i][local : local + length]
        if len(row) < length:  # crosses into the next shard
            row = np.concatenate([row, self.maps[i + 1][: length - len(row)]])
        return row

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.args
        offsets = global_batch_offsets(a.seed, step, self.n_train, a.seq_len, a.global_batch)
        rows = [self._row(o, a.seq_len + 1) for o in offsets[self.mine].tolist()]
        x = torch.stack([torch.from_numpy(r[:-1].astype(np.int64)) for r in rows])
        y = torch.stack([torch.from_numpy(r[1:].astype(np.int64)) for r in rows])
        return x, y


def loader_for(train: object, args: argparse.Namespace, start: int = 0) -> DistributedBatchLoader:
    return DistributedBatchLoader(
        train, args.seq_len, args.global_batch, args.global_batch // args.dp, 0, args.dp,
        args.seed, start, args.prefetch, readers=args.readers,
    )  # fmt: skip


def time_loader(train: object, args: argparse.Namespace, start: int) -> float:
    with loader_for(train, args, start) as loader:
        next(loader)  # the thread is up and the first step is ready: not part of the figure
        t0 = time.perf_counter()
        for _ in range(args.steps):
            next(loader)
        return time.perf_counter() - t0


def time_plain(plain: PlainLoop, args: argparse.Namespace, start: int) -> float:
    plain.batch(start)
    t0 = time.perf_counter()
    for step in range(start + 1, start + 1 + args.steps):
        plain.batch(step)
    return time.perf_counter() - t0


def same_rows(train: object, plain: PlainLoop, args: argparse.Namespace) -> bool:
    with loader_for(train, args) as loader:
        batch = next(loader)
    x = torch.cat([x for x, _ in batch.micro_batches])
    y = torch.cat([y for _, y in batch.micro_batches])
    px, py = plain.batch(0)
    return torch.equal(x, px) and torch.equal(y, py)


def demo_tokens_per_rank() -> tuple[float, str]:
    report = REPO / "runs" / "demo" / "report.json"
    try:
        r = json.loads(report.read_text())
        return r["tokens_per_s"] / r["world_size"], f"{report.relative_to(REPO)}"
    except (OSError, ValueError, KeyError):
        tokens, ranks = README_DEMO
        return tokens / ranks, "the README's demo figure"


def compare(shards: Path, args: argparse.Namespace, say) -> dict:
    train = load_tokens(str(shards), 0.05).train
    plain = PlainLoop(shards, len(train), args)
    assert same_rows(train, plain, args), "the plain loop and the loader disagree"
    per_step = args.global_batch // args.dp * args.seq_len
    loader_tps, plain_tps, ratios = [], [], []
    for r in range(args.rounds):
        first = "loader" if r % 2 == 0 else "plain"
        times = {}
        for which in (first, "plain" if first == "loader" else "loader"):
            start = 1000 * (r + 1)
            if which == "loader":
                times[which] = time_loader(train, args, start)
            else:
                times[which] = time_plain(plain, args, start)
        lt, pt = per_step * args.steps / times["loader"], per_step * args.steps / times["plain"]
        loader_tps.append(lt)
        plain_tps.append(pt)
        ratios.append(lt / pt)
        say(f"  round {r + 1}: loader {lt:>12,.0f}  plain {pt:>12,.0f} tokens/s  ({lt / pt:.2f}x)")
    return {
        "loader": statistics.median(loader_tps),
        "plain": statistics.median(plain_tps),
        "ratio": statistics.median(ratios),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=2000, help="Steps timed per setting and round.")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--dp", type=int, default=8, help="Ranks; this process is rank 0.")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--readers", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokens", type=int, default=64 << 20, help="Tokens in the shards.")
    p.add_argument("--shard-tokens", type=int, default=16 << 20)
    p.add_argument("--io-seconds", type=float, default=2.0, help="bench io: time per row.")
    p.add_argument("--page-cache", default="fadvise", help="bench io: fadvise, drop or keep.")
    p.add_argument("--work", type=Path, default=None, help="Where the shards are made.")
    p.add_argument(
        "--path", type=Path, action="append", default=[],
        help="Another storage location (a mount): shards copied there, run there too.",
    )  # fmt: skip
    p.add_argument(
        "--moosefs", action="store_true",
        help="Also on a MooseFS started here on 3 namespace hosts (root; tests/cluster.py).",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=None, help="Also write the results here.")
    args = p.parse_args()
    if not args.moosefs:
        return run(args)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from cluster import moosefs, moosefs_unavailable, netns_hosts

    why = moosefs_unavailable()
    if why:
        print(f"data_path: --moosefs: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="meshforge-mfs-") as root:
        with netns_hosts(3, prefix="dpb") as hosts, moosefs(hosts, Path(root)) as fs:
            args.path.append(fs.mount)
            return run(args)


def run(args: argparse.Namespace) -> int:

    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="meshforge-data-path-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        local = make_shards(work, args.tokens, args.shard_tokens)
        places = [("local disk", local)]
        for extra in args.path:
            target = extra / "meshforge-data-path"
            if not (target / "index.json").is_file():
                shutil.copytree(local, target, dirs_exist_ok=True)
            places.append((str(extra), target))

        demo, demo_from = demo_tokens_per_rank()
        per_rank = args.global_batch // args.dp
        say("# data path: loader (no model) vs a plain numpy memmap loop, tokens/s per rank")
        say(
            f"# {args.tokens:,} tokens in shards of {args.shard_tokens:,}; seq_len {args.seq_len}, "
            f"{per_rank} sequences per rank and step (global batch {args.global_batch}, "
            f"dp {args.dp}); loader prefetch {args.prefetch}, readers {args.readers}; "
            f"{args.steps} steps x {args.rounds} rounds, alternating; page cache warm"
        )
        say(f"# python {sys.version.split()[0]}, numpy {np.__version__}, torch {torch.__version__}")
        results = {}
        for name, shards in places:
            say(f"\n## {name}: {shards}")
            res = compare(shards, args, say)
            results[name] = res
            goal_plain = "met" if res["ratio"] >= 0.8 else "NOT met"
            goal_demo = "met" if res["loader"] >= 20 * demo else "NOT met"
            say(
                f"  median: loader {res['loader']:,.0f}, plain {res['plain']:,.0f} tokens/s per "
                f"rank; loader / plain {res['ratio']:.2f}x (goal >= 0.8x: {goal_plain})"
            )
            say(
                f"  the demo job consumes {demo:,.0f} tokens/s per rank ({demo_from}): "
                f"the loader delivers {res['loader'] / demo:,.0f}x (goal >= 20x: {goal_demo})"
            )
        loader_read = (args.seq_len + 1) * 2  # bytes of one sequence: the loader's read
        for name, shards in places:
            for block, orders in ((4 << 20, bench_io.ORDERS), (loader_read, ("random",))):
                say(f"\n## bench io on {name}, {block:,}-byte reads")
                options = bench_io.IoBenchOptions(
                    path=str(shards), orders=orders, seconds=args.io_seconds,
                    block_bytes=block, page_cache=args.page_cache,
                )  # fmt: skip
                result = bench_io.run_bench(options)
                for line in bench_io.format_table(result).splitlines():
                    say(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
