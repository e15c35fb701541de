"""Preflight: is this cluster fit to train on? One row per check, each PASS, WARN, FAIL
or SKIP, with a detail that names the ranks and hosts to blame.

Every rank reports itself (probes.process_report) and one rank per node reports the
node (GPUs, InfiniBand, disk); the reports are gathered on gloo to every rank. Then:

- versions that must agree (torch, CUDA, cuDNN, NCCL, meshforge, Python major.minor,
  the NVIDIA driver's branch) FAIL when they differ: mismatched libraries make
  collectives hang or fail in ways that look like network faults;
- the rest WARN when they differ or look wrong (GPU models and counts, NCCL_/GLOO_
  variables, InfiniBand missing on some nodes or a port not Active, low free disk);
- every rank opens a TCP connection to the rendezvous address (MASTER_ADDR:MASTER_PORT),
  and to `--port` on global rank 0's host, where rank 0 listens for the test;
- an all-reduce of known values (the sum of rank+1, compared exactly), and a short
  all-reduce bandwidth test reported as nccl-tests does: busbw = algbw * 2(n-1)/n.
  Both are skipped when a version check failed: a collective between mismatched
  libraries could hang instead of answering.

`evaluate` is the pure part (reports in, checks out); `run_checks` is the distributed
part, run by every process of the group."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from meshforge.fileio import write_text_atomic
from meshforge.health import probes
from meshforge.units import format_bytes

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
RESULT_FILE = "preflight.json"  # in RUN_DIR/health/
LOW_DISK_BYTES = 10 * 1024**3  # below this, a checkpoint of a mid-sized model may not fit
ALLREDUCE_NUMEL = 4099  # odd, so no size is special-cased
BANDWIDTH_ITERS, BANDWIDTH_WARMUP = 5, 1

# Versions every rank must share, in the order they are reported.
MUST_AGREE = ("torch", "cuda", "cudnn", "nccl", "meshforge")


@dataclass
class Check:
    name: str
    status: str
    detail: str
    ranks: list[int] = field(default_factory=list)  # the ranks to blame
    hosts: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PreflightOptions:
    run_dir: Path
    port: int | None = None
    bandwidth_mb: float = 64.0
    timeout_s: float = 120.0
    # the training data: each node reads it for a second (bench io), and with a job's
    # tokens/s per device (a previous run's) says whether the storage keeps up
    data: Path | None = None
    data_run: Path | None = None
    data_tokens_per_s_per_device: float | None = None


def overall_status(checks: list[Check]) -> str:
    statuses = {c.status for c in checks}
    return FAIL if FAIL in statuses else WARN if WARN in statuses else PASS


# --- describing who differs ------------------------------------------------------------


def _rank_list(ranks: list[int]) -> str:
    """[0, 2, 3, 4, 7] -> '0,2-4,7'."""
    parts, run = [], []
    for r in sorted(ranks):
        if run and r != run[-1] + 1:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(r)
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def _where(ranks: list[int], hosts: dict[int, str]) -> str:
    names = list(dict.fromkeys(hosts[r] for r in sorted(ranks)))
    shown = ", ".join(names[:4]) + (f" +{len(names) - 4} more" if len(names) > 4 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {_rank_list(ranks)} ({shown})"


def _groups(values: dict[int, Any]) -> list[tuple[Any, list[int]]]:
    """Ranks grouped by value; the reference group (the largest, rank 0's on a tie) last."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    for rank in sorted(values):
        key = json.dumps(values[rank], sort_keys=True)
        groups.setdefault(key, (values[rank], []))[1].append(rank)
    ordered = sorted(groups.values(), key=lambda g: (len(g[1]), -g[1][0]))
    return ordered


def _differ(
    name: str,
    values: dict[int, Any],
    hosts: dict[int, str],
    status: str,
    show: Callable[[Any], str] = str,
) -> Check:
    """One check over a value per rank: PASS when all agree, else STATUS naming the
    ranks outside the reference group."""
    groups = _groups(values)
    reference, _ = groups[-1]
    if len(groups) == 1:
        return Check(name, PASS, show(reference))
    odd = [(value, ranks) for value, ranks in groups[:-1]]
    detail = "; ".join(f"{show(v)} on {_where(r, hosts)}" for v, r in odd)
    detail += f" vs {show(reference)} on {_where(groups[-1][1], hosts)}"
    return _blame(name, status, f"differs: {detail}", [r for _, ranks in odd for r in ranks], hosts)


def _blame(name: str, status: str, detail: str, ranks: list[int], hosts: dict[int, str]) -> Check:
    ranks = sorted(set(ranks))
    return Check(name, status, detail, ranks, list(dict.fromkeys(hosts[r] for r in ranks)))


def _na(value: Any, why: str = "n/a") -> str:
    return why if value is None else str(value)


# --- the checks (pure) -----------------------------------------------------------------


def version_checks(reports: list[dict], hosts: dict[int, str]) -> list[Check]:
    by_rank = {r["rank"]: r["versions"] for r in reports}
    checks = []
    python = {rank: ".".join(v["python"].split(".")[:2]) for rank, v in by_rank.items()}
    check = _differ("python", python, hosts, FAIL)
    if check.status == PASS:
        full = {rank: v["python"] for rank, v in by_rank.items()}
        check = _differ("python", full, hosts, WARN)
    checks.append(check)
    for key in MUST_AGREE:
        why = "n/a (no CUDA)" if key in ("cuda", "cudnn", "nccl") else "n/a"
        values = {rank: v.get(key) for rank, v in by_rank.items()}
        check = _differ(key, values, hosts, FAIL, show=lambda v, why=why: _na(v, why))
        if key == "torch" and check.status == PASS:  # one version, two builds?
            builds = {
                rank: f"{v['torch']} (git {str(v.get('torch_git') or '?')[:7]})"
                for rank, v in by_rank.items()
            }
            check = _differ(key, builds, hosts, FAIL)
        checks.append(check)
    checks.append(_driver_check(reports, hosts))
    return checks


def _node_reports(reports: list[dict]) -> dict[int, dict]:
    return {r["rank"]: r["node"] for r in reports if r.get("node")}


def _driver_check(reports: list[dict], hosts: dict[int, str]) -> Check:
    """The driver's branch (535, 550) must agree; within a branch a difference is a WARN."""
    drivers = {rank: node["gpus"]["driver"] for rank, node in _node_reports(reports).items()}
    if not any(drivers.values()):
        return Check("driver", PASS, "n/a (no GPU)")
    branch = {rank: d.split(".")[0] if d else None for rank, d in drivers.items()}
    check = _differ("driver", branch, hosts, FAIL, show=lambda b: f"branch {_na(b, 'none')}")
    if check.status == PASS:
        check = _differ("driver", drivers, hosts, WARN, show=lambda d: _na(d, "none"))
    return check


def gpu_check(reports: list[dict], hosts: dict[int, str]) -> Check:
    nodes = _node_reports(reports)
    errors = {
        rank: n["gpus"]["detail"] for rank, n in nodes.items() if n["gpus"]["status"] == "error"
    }
    if errors:
        detail = "; ".join(f"{hosts[r]}: {d}" for r, d in errors.items())
        return _blame("gpus", WARN, detail, list(errors), hosts)
    if all(n["gpus"]["status"] == "none" for n in nodes.values()):
        reason = next(iter(nodes.values()))["gpus"]["detail"] if nodes else "no node report"
        return Check("gpus", PASS, f"no GPU on any node ({reason}): CPU processes on gloo")
    models = {rank: probes.describe_gpus(n["gpus"]["gpus"]) for rank, n in nodes.items()}
    check = _differ("gpus", models, hosts, WARN)
    mixed = [r for r, n in nodes.items() if len({g["name"] for g in n["gpus"]["gpus"]}) > 1]
    if check.status == PASS and mixed:
        where = ", ".join(hosts[r] for r in mixed)
        detail = f"mixed GPU models on {where}: {models[mixed[0]]}"
        return _blame("gpus", WARN, detail, mixed, hosts)
    if check.status == PASS:
        check.detail = f"{check.detail} on each of {len(nodes)} node(s)"
    return check


def infiniband_check(reports: list[dict], hosts: dict[int, str]) -> Check:
    ib = {rank: n["infiniband"] for rank, n in _node_reports(reports).items()}
    present = [r for r, i in ib.items() if i["present"]]
    unknown = [r for r, i in ib.items() if i["present"] is None]
    if not present:
        reason = next(iter(ib.values()))["detail"] if ib else "no node report"
        if len(unknown) == len(ib):
            return Check("infiniband", SKIP, f"{reason} on any node")
        return Check("infiniband", PASS, f"none on any node ({reason}): NCCL uses TCP sockets")
    problems, blamed = [], []
    missing = [r for r in ib if r not in present and r not in unknown]
    for ranks, what in ((missing, "missing"), (unknown, "not checked (no ibv_devinfo)")):
        if ranks:
            problems.append(f"{what} on {', '.join(hosts[r] for r in ranks)}")
            blamed += ranks
    for rank in present:
        ports = ib[rank]["ports"]
        if not ports:  # never read silence as health: ibstat printing nothing is not "Active"
            problems.append(f"{hosts[rank]}: {', '.join(ib[rank]['devices'])} with no port state")
            blamed.append(rank)
        down = [p for p in ports if not probes.port_is_up(p)]
        if down:
            problems.append(f"{hosts[rank]}: " + "; ".join(probes.describe_port(p) for p in down))
            blamed.append(rank)
    if problems:
        return _blame("infiniband", WARN, "; ".join(problems), blamed, hosts)
    ports = probes.describe_ports(ib[present[0]]["ports"])
    return Check("infiniband", PASS, f"{ports} on each of {len(present)} node(s)")


def env_check(reports: list[dict], hosts: dict[int, str]) -> Check:
    envs = {r["rank"]: r["env"] for r in reports}
    names = sorted({k for env in envs.values() for k in env})
    if not names:
        return Check("env", PASS, "no NCCL_* or GLOO_* variable set")
    differing = [k for k in names if len({env.get(k) for env in envs.values()}) > 1]
    if not differing:
        shown = ", ".join(f"{k}={v}" for k, v in next(iter(envs.values())).items())
        return Check("env", PASS, f"same on every rank: {shown}")
    details, blamed = [], set()
    for key in differing:
        values = {r: env.get(key) for r, env in envs.items()}
        check = _differ(key, values, hosts, WARN, show=lambda v: _na(v, "unset"))
        details.append(f"{key} {check.detail}")
        blamed.update(check.ranks)
    return _blame("env", WARN, "; ".join(details), list(blamed), hosts)


def disk_check(
    reports: list[dict], hosts: dict[int, str], low_bytes: int = LOW_DISK_BYTES
) -> Check:
    disks = {rank: n["disk"] for rank, n in _node_reports(reports).items()}
    if not disks:
        return Check("disk", WARN, "no node report")
    broken = {r: d for r, d in disks.items() if not d["writable"]}
    if broken:
        detail = "; ".join(
            f"{hosts[r]}: cannot write in {d['path']} ({d['error']})" for r, d in broken.items()
        )
        return _blame("disk", FAIL, detail, list(broken), hosts)
    low = {
        r: d
        for r, d in disks.items()
        if d["free_bytes"] is not None and d["free_bytes"] < low_bytes
    }
    if low:
        detail = "; ".join(
            f"{hosts[r]}: {format_bytes(d['free_bytes'])} free in {d['path']}"
            for r, d in low.items()
        )
        return _blame("disk", WARN, f"{detail} (below {format_bytes(low_bytes)})", list(low), hosts)
    rank = min(disks, key=lambda r: disks[r]["free_bytes"] or 0)
    return Check(
        "disk",
        PASS,
        f"writable on {len(disks)} node(s); least free {format_bytes(disks[rank]['free_bytes'])} "
        f"({hosts[rank]}: {disks[rank]['path']})",
    )


def _reach_check(name: str, reach: dict, hosts: dict[int, str]) -> Check:
    results = reach["results"]
    failed = [r for r in results if not r["ok"]]
    target = reach["target"]
    if failed:
        errors = "; ".join(f"{_where([r['rank']], hosts)}: {r['error']}" for r in failed)
        blamed = [r["rank"] for r in failed]
        return _blame(name, FAIL, f"{target} unreachable from {errors}", blamed, hosts)
    slowest_ms = 1e3 * max(r["connect_s"] for r in results)
    note = f"; {reach['note']}" if reach.get("note") else ""
    return Check(
        name,
        PASS,
        f"{target} reachable from all {len(results)} rank(s) "
        f"(slowest connect {slowest_ms:.1f} ms){note}",
    )


def communication_checks(comm: dict, hosts: dict[int, str]) -> list[Check]:
    checks = [_reach_check("rendezvous", comm["rendezvous"], hosts)]
    if comm.get("port"):
        checks.append(_reach_check("port", comm["port"], hosts))
    allreduce = comm["allreduce"]
    if allreduce.get("skipped"):
        checks.append(Check("allreduce", SKIP, allreduce["skipped"]))
    else:
        wrong = [r for r in allreduce["results"] if not r["ok"]]
        if wrong:
            detail = "; ".join(
                f"{_where([r['rank']], hosts)}: {r['mismatches']} of {allreduce['numel']} values "
                f"wrong (index {r['first_bad']}: {r['got']}, expected {r['expected']})"
                for r in wrong
            )
            blamed = [r["rank"] for r in wrong]
            checks.append(_blame("allreduce", FAIL, detail, blamed, hosts))
        else:
            checks.append(
                Check(
                    "allreduce",
                    PASS,
                    f"sum of rank+1 over {allreduce['numel']} {allreduce['dtype']} values exact "
                    f"on all {len(allreduce['results'])} rank(s) ({allreduce['backend']})",
                )
            )
    bw = comm["bandwidth"]
    if bw.get("skipped"):
        checks.append(Check("bandwidth", SKIP, bw["skipped"]))
    else:
        checks.append(
            Check(
                "bandwidth",
                PASS,
                f"busbw {bw['busbw_gbps']:.2f} GB/s, algbw {bw['algbw_gbps']:.2f} GB/s "
                f"({bw['size_bytes'] / 2**20:g} MiB all_reduce, {1e3 * bw['time_s']:.2f} ms each, "
                f"{bw['iterations']} iterations, {bw['backend']})",
            )
        )
    return checks


def evaluate(
    reports: list[dict], comm: dict | None = None, tokens_per_s_per_device: float | None = None
) -> list[Check]:
    """The checks over every rank's report (and the network tests' results, when given)."""
    hosts = host_labels(reports)
    checks = version_checks(reports, hosts)
    checks += [
        gpu_check(reports, hosts),
        infiniband_check(reports, hosts),
        env_check(reports, hosts),
        disk_check(reports, hosts),
    ]
    if any("data_read" in (r.get("node") or {}) for r in reports):
        checks.append(data_check(reports, hosts, tokens_per_s_per_device))
    if comm is not None:
        checks += communication_checks(comm, hosts)
    return checks


def data_check(
    reports: list[dict], hosts: dict[int, str], tokens_per_s_per_device: float | None
) -> Check:
    """Each node read the training data (one reader, random order, as the loader reads).
    With the job's tokens/s per device: what the node's ranks need against what it read
    (bench/io.py's verdict: 2x or more PASS, 1-2x WARN, under 1x FAIL)."""
    from meshforge.bench.io import _rate

    nodes = _node_reports(reports)
    ranks_on = {}
    for r in reports:
        ranks_on.setdefault(hosts[r["rank"]], []).append(r["rank"])
    failed, slow, tight, parts = [], [], [], []
    for rank, node in nodes.items():
        probe, host = node["data_read"], hosts[rank]
        if probe.get("error"):
            failed.append(rank)
            parts.append(f"{host}: {probe['error']}")
            continue
        rate = probe["bytes_per_s"]
        text = f"{host} {_rate(rate)}" + (" (from the page cache)" if probe.get("cached") else "")
        if tokens_per_s_per_device:
            need = tokens_per_s_per_device * len(ranks_on[host]) * probe["bytes_per_token"]
            headroom = rate / need if need > 0 else float("inf")
            text += f", {headroom:,.1f}x the {_rate(need)} its ranks need"
            (slow if headroom < 1 else tight if headroom < 2 else []).append(rank)
        parts.append(text)
    path = next(iter(nodes.values()))["data_read"]["path"]
    detail = f"{path}: " + "; ".join(parts)
    if failed or slow:
        return _blame("data read", FAIL, detail, failed + slow, hosts)
    if tight:
        return _blame("data read", WARN, detail + " (under 2x: expect data waits)", tight, hosts)
    return Check("data read", PASS, detail)


def host_labels(reports: list[dict]) -> dict[int, str]:
    """Each rank's host name; where two nodes share a name (network namespaces, cloned
    images), the name and the address they are reached at."""
    addrs: dict[str, set] = {}
    for r in reports:
        addrs.setdefault(r["host"], set()).add(r.get("addr"))
    return {
        r["rank"]: r["host"] if len(addrs[r["host"]]) == 1 else f"{r['host']}/{r.get('addr')}"
        for r in reports
    }


def collective_blocker(checks: list[Check]) -> str | None:
    """Why the collectives are skipped: a failed version check (they could hang)."""
    failed = [c.name for c in checks if c.status == FAIL and c.name in ("python", *MUST_AGREE)]
    if failed:
        what = f"{failed[0]} differs" if len(failed) == 1 else f"{', '.join(failed)} differ"
        return f"skipped: {what} across ranks (a collective could hang)"
    return None


def busbw_factor(world_size: int) -> float:
    """All-reduce bus bandwidth factor, as nccl-tests: each rank sends and receives
    2(n-1)/n of the buffer in a ring."""
    return 2 * (world_size - 1) / world_size


# --- the distributed part ---------------------------------------------------------------


def run_checks(options: PreflightOptions) -> dict[str, Any]:
    """Run on every process of the job; every rank returns the same result document, and
    one rank per node writes it to RUN_DIR/health/preflight.json."""
    import torch.distributed as dist

    from meshforge.runtime.dist import distributed

    with distributed(timeout_s=options.timeout_s) as rt:
        # Objects travel on gloo whatever the device backend (NCCL would move them via GPUs).
        group = None if rt.backend == "gloo" else dist.new_group(backend="gloo")

        def gather(obj: Any) -> list[Any]:
            out: list[Any] = [None] * rt.world_size
            dist.all_gather_object(out, obj, group=group)
            return out

        me = probes.process_report(rt.rank, rt.env.local_rank)
        nodes = gather((me["host"], me["addr"]))
        is_node_reporter = nodes.index(nodes[rt.rank]) == rt.rank
        if is_node_reporter:
            me["node"] = probes.node_report(options.run_dir)
            if options.data is not None:
                me["node"]["data_read"] = probes.data_read_probe(options.data)
        probes.inject_version_fault(me)
        reports = gather(me)
        hosts = host_labels(reports)
        versions = version_checks(reports, hosts)
        connect_s = min(5.0, options.timeout_s)
        comm: dict[str, Any] = {
            "rendezvous": {
                "target": f"{rt.env.master_addr}:{rt.env.master_port}",
                "results": gather(
                    {"rank": rt.rank}
                    | probes.tcp_connect(rt.env.master_addr, rt.env.master_port, connect_s)
                ),
            }
        }
        if options.port:
            comm["port"] = _port_reachability(options.port, reports, rt, gather, group, connect_s)
        blocker = collective_blocker(versions)
        if blocker:
            comm["allreduce"] = {"skipped": blocker}
            comm["bandwidth"] = {"skipped": blocker}
        else:
            comm["allreduce"] = _allreduce_correctness(rt, gather)
            comm["bandwidth"] = _allreduce_bandwidth(rt, options.bandwidth_mb)
    checks = evaluate(reports, comm, options.data_tokens_per_s_per_device)
    doc = {
        "status": overall_status(checks),
        "world_size": len(reports),
        "nodes": len(set(hosts.values())),
        "hosts": list(dict.fromkeys(hosts.values())),
        "backend": rt.backend,
        "time": time.time(),
        "checks": [asdict(c) for c in checks],
        "ranks": reports,
        "communication": comm,
    }
    if is_node_reporter:
        write_result(options.run_dir, doc)
    return doc


def _port_reachability(port, reports, rt, gather, group, connect_s) -> dict[str, Any]:
    """Global rank 0 listens on PORT at its own address (the one the ranks are given,
    not every interface); every rank connects to it there."""
    import torch.distributed as dist

    host = reports[0]["addr"] or reports[0]["host"]
    note = None
    listener = None
    if rt.rank == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            # on the address the ranks connect to, never on every interface
            listener.bind((host, port))
            listener.listen(max(16, rt.world_size))
        except OSError as exc:
            listener.close()
            listener = None
            ours = port == rt.env.master_port
            note = (
                "in use by this preflight's rendezvous store"
                if ours
                else f"in use on {reports[0]['host']} ({exc.strerror}): "
                "a rendezvous there would fail"
            )
    note = gather(note)[0]
    dist.barrier(group=group)
    try:
        result = {"rank": rt.rank} | probes.tcp_connect(host, port, connect_s)
        results = gather(result)
    finally:
        if listener is not None:
            listener.close()
    reach = {"target": f"{host}:{port}", "results": results, "note": note}
    if note and not note.startswith("in use by this"):
        for r in reach["results"]:
            r.update(ok=False, error=note)
    return reach


def _allreduce_correctness(rt, gather) -> dict[str, Any]:
    """Each rank contributes (rank+1) * pattern; the sum is n(n+1)/2 * pattern, exactly
    (float32 while the largest sum is below 2**24, float64 beyond)."""
    import torch
    import torch.distributed as dist

    n = rt.world_size
    dtype = torch.float32 if 2 * n * (n + 1) < 2**24 else torch.float64
    pattern = (torch.arange(ALLREDUCE_NUMEL) % 4 + 1).to(dtype)  # values 1..4
    x = (pattern * (rt.rank + 1)).to(rt.device)
    dist.all_reduce(x)
    got = x.cpu()
    expected = pattern * (n * (n + 1) // 2)
    bad = (got != expected).nonzero().flatten()
    first = int(bad[0]) if len(bad) else None
    result = {
        "rank": rt.rank,
        "ok": len(bad) == 0,
        "mismatches": int(len(bad)),
        "first_bad": first,
        "got": float(got[first]) if first is not None else None,
        "expected": float(expected[first]) if first is not None else None,
    }
    return {
        "numel": ALLREDUCE_NUMEL,
        "dtype": str(dtype).removeprefix("torch."),
        "backend": rt.backend,
        "results": gather(result),
    }


def _allreduce_bandwidth(rt, size_mb: float) -> dict[str, Any]:
    """Average time of an all-reduce of SIZE_MB MiB (float32) on the slowest rank;
    algbw = bytes / time, busbw = algbw * 2(n-1)/n (nccl-tests' convention)."""
    import torch
    import torch.distributed as dist

    if rt.world_size == 1:
        return {"skipped": "skipped: one rank, nothing crosses a link"}
    if size_mb <= 0:
        return {"skipped": "skipped: --bandwidth-mb 0"}
    numel = max(1, int(size_mb * 2**20) // 4)
    x = torch.zeros(numel, dtype=torch.float32, device=rt.device)

    def sync() -> None:
        if rt.device.type == "cuda":
            torch.cuda.synchronize(rt.device)

    for _ in range(BANDWIDTH_WARMUP):
        dist.all_reduce(x)
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(BANDWIDTH_ITERS):
        dist.all_reduce(x)
    sync()
    elapsed = torch.tensor([(time.perf_counter() - start) / BANDWIDTH_ITERS], device=rt.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    time_s = float(elapsed.item())
    size_bytes = numel * 4
    algbw = size_bytes / time_s / 1e9
    return {
        "size_bytes": size_bytes,
        "iterations": BANDWIDTH_ITERS,
        "time_s": time_s,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * busbw_factor(rt.world_size),
        "backend": rt.backend,
    }


# --- the result file ----------------------------------------------------------------------


def result_path(run_dir: Path) -> Path:
    return Path(run_dir) / "health" / RESULT_FILE


def write_result(run_dir: Path, doc: dict[str, Any]) -> Path:
    """Atomically: nodes sharing a run directory write the same document."""
    path = result_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(doc, indent=2, default=str))
    return path


def read_result(run_dir: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, json.JSONDecodeError):
        return json.loads(result_path(run_dir).read_text())
    return None
