"""Compile once per fleet: a second replica's time-to-compiled with the remote cache warm.

A transformer block (``nn.TransformerEncoderLayer`` d_model=256, key-padding mask, as in
bench/cold_start.py) guarded by ``safe_compile(backend="inductor")`` with padded buckets
(``pow2(32, 128)`` by default: 3 graphs) and a blocking ``Warmup``, under
``torch.no_grad()``, one intra-op thread. A real ``redis-server`` is started on
127.0.0.1. Every replica is a fresh subprocess with a fresh, empty
``SAFECOMPILE_CACHE_DIR`` (so torch's local caches start empty: only Redis is shared):

- ``cold``: no remote cache;
- ``first replica``: ``SAFECOMPILE_REMOTE_CACHE`` set, Redis empty (it fills it);
- ``second replica``: the same, Redis warm: the figure, against ``cold``;
- ``restart, same disk`` (reference): ``cold``'s cache directory again, no remote cache.

Time-to-compiled: from the ``safe_compile(...)`` call to its return (the blocking warmup
has compiled every bucket); also as CPU seconds (the replica's and its C++ compiler
processes'), which other processes' load inflates far less than wall time. inductor's
CPU vector-ISA checks (ten small C++ programs built and loaded, once per process) run
inside the clock, as in a real replica: a cold one pays them, the second replica reads
the checks the first one passed from Redis (signed; per CPU, compiler and torch), a
restart from its cache dir. ``--isa-first`` runs them before the clock instead (the
"ISA probe" column), leaving them out of every scenario. Target: second replica <= 10%
of cold.

    python bench/remote_cache.py                    # ~4-6 min on 2 idle cores
    python bench/remote_cache.py --sizes 32,64,128,256,512 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
BATCH, D_MODEL = 8, 256


# ---------------------------------------------------------------- the replica


BENCH_CACHE_KEY = "safecompile-bench-key-0123456789"  # the same in every process


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One replica: import, probe, guard with a blocking warmup, serve one request."""
    t_import = time.perf_counter()
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(HERE.parent))
    import torch
    from _models import Block
    from torch._dynamo.utils import counters

    from safecompile import Buckets, Warmup, safe_compile

    out: dict[str, Any] = {"import_s": time.perf_counter() - t_import}
    torch.set_num_threads(1)
    t_probe = time.perf_counter()
    if args.isa_first:
        from torch._inductor import cpu_vec_isa

        cpu_vec_isa.pick_vec_isa()
    out["isa_probe_s"] = time.perf_counter() - t_probe

    torch.manual_seed(0)
    model = Block().eval()
    sizes = [int(s) for s in args.sizes.split(",")]
    example = (torch.randn(BATCH, sizes[0], D_MODEL), torch.zeros(BATCH, sizes[0], dtype=bool))
    x = torch.randn(BATCH, sizes[-1] - 3, D_MODEL)
    mask = torch.zeros(BATCH, sizes[-1] - 3, dtype=torch.bool)
    with torch.no_grad():
        expected = model(x, mask)
        cpu_start = _cpu_seconds()
        start = time.perf_counter()
        guarded = safe_compile(
            model,
            backend="inductor",
            name="bench.remote_cache",
            shadow=None,
            buckets=Buckets(
                dims={"x": 1, "mask": 1},
                sizes=sizes,
                pad_value={"x": 0, "mask": 1},
                strategy=args.strategy,
            ),
            warmup=Warmup(inputs=[example]),
        )
        out["time_to_compiled"] = time.perf_counter() - start
        out["cpu_s"] = _cpu_seconds() - cpu_start
        got = guarded(x, mask)
    stats = guarded.safecompile.stats()
    from safecompile.persist import remote as _remote

    links = _remote.links()
    out["redis_commands"] = sum(link.commands for link in links)
    out["redis_s"] = sum(link.seconds for link in links)
    out.update(
        graphs=stats.graphs,
        state=guarded.safecompile.state.value,
        close=bool(torch.allclose(got, expected, atol=1e-5, rtol=1e-4)),
        fx_hits=counters["inductor"].get("fxgraph_cache_hit", 0),
        fx_misses=counters["inductor"].get("fxgraph_cache_miss", 0),
        aot_hits=counters["aot_autograd"].get("autograd_cache_hit", 0),
        aot_misses=counters["aot_autograd"].get("autograd_cache_miss", 0),
    )
    return out


def _cpu_seconds() -> float:
    """CPU time of this process and of the children it waited for (the C++ compiler)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


# ---------------------------------------------------------------- the parent


def run_child(
    args: argparse.Namespace, cache: Path, remote: str | None, label: str
) -> dict[str, Any]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "SAFECOMPILE_"))
    }
    env["SAFECOMPILE_CACHE_DIR"] = str(cache)
    # every replica signs and verifies with the fleet's key (without one the remote is off)
    env["SAFECOMPILE_CACHE_KEY"] = os.environ.get("SAFECOMPILE_CACHE_KEY", BENCH_CACHE_KEY)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "torch")  # where safecompile puts it, but
    # already for the ISA checks when --isa-first runs them before the first safe_compile
    if remote is not None:
        env["SAFECOMPILE_REMOTE_CACHE"] = remote
    cmd = [sys.executable, str(HERE), "--child", "--sizes", args.sizes, "--strategy", args.strategy]
    cmd += ["--isa-first"] if args.isa_first else []
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{label}: replica failed with exit {proc.returncode}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - started
    result["label"] = label
    print(f"  {label}: {result['time_to_compiled']:.1f} s", file=sys.stderr, flush=True)
    return result


def one_round(args: argparse.Namespace, url: str, flush: Any, work: Path) -> list[dict[str, Any]]:
    flush()
    cold_dir = Path(tempfile.mkdtemp(dir=work))
    rows = [run_child(args, cold_dir, None, "cold")]
    rows.append(run_child(args, Path(tempfile.mkdtemp(dir=work)), url, "first replica"))
    rows.append(run_child(args, Path(tempfile.mkdtemp(dir=work)), url, "second replica"))
    rows.append(run_child(args, cold_dir, None, "restart, same disk"))
    return rows


def table(rounds: list[list[dict[str, Any]]]) -> str:
    """Medians per replica; "of cold" for wall time and for CPU time (CPU time of the
    replica and its compiler processes: what load from other processes inflates least)."""
    cold = statistics.median(r[0]["time_to_compiled"] for r in rounds)
    cold_cpu = statistics.median(r[0]["cpu_s"] for r in rounds)
    lines = [
        "| replica | time-to-compiled, s | of cold | CPU, s | of cold | Redis, s (commands) "
        "| ISA probe, s | import, s | FX hits / misses | AOT hits / misses | graphs | state |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: | --- |",
    ]
    for i, label in enumerate(r["label"] for r in rounds[0]):
        rows = [rnd[i] for rnd in rounds]
        ttc = statistics.median(r["time_to_compiled"] for r in rows)
        cpu = statistics.median(r["cpu_s"] for r in rows)
        last = rows[-1]
        lines.append(
            f"| {label} | {ttc:.1f} | {ttc / cold:.0%} | {cpu:.1f} | {cpu / cold_cpu:.0%} "
            f"| {statistics.median(r['redis_s'] for r in rows):.2f} ({last['redis_commands']}) "
            f"| {statistics.median(r['isa_probe_s'] for r in rows):.1f} "
            f"| {statistics.median(r['import_s'] for r in rows):.1f} "
            f"| {last['fx_hits']} / {last['fx_misses']} "
            f"| {last['aot_hits']} / {last['aot_misses']} "
            f"| {last['graphs']} | {last['state']}{'' if last['close'] else ' (NOT CLOSE)'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="32,64,128", help="bucket sizes (comma-separated)")
    parser.add_argument(
        "--strategy",
        default="pad",
        choices=["pad", "dynamic", "auto"],
        help="Buckets(strategy=...): pad (one static graph per size, the default here) or "
        "dynamic (ranges: one FX-graph key per code object, see the module doc)",
    )
    parser.add_argument(
        "--isa-first",
        action="store_true",
        help="run inductor's vector-ISA checks before the clock starts (out of every scenario)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="rounds (medians reported)")
    parser.add_argument("--json", type=Path, help="also write every row here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return

    sys.path.insert(0, str(ROOT / "tests"))
    import redis
    from redis_server import RedisServer

    server = RedisServer.start()
    client = redis.Redis.from_url(server.url)
    work = Path(tempfile.mkdtemp(prefix="safecompile-remote-bench-"))
    load_before = os.getloadavg()
    try:
        rounds = [one_round(args, server.url, client.flushall, work) for _ in range(args.repeat)]
        keys = client.dbsize()
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(table(rounds))
    print(
        f"\nbuckets {args.sizes}, strategy {args.strategy}; {args.repeat} round(s); "
        f"Redis keys after the last round: {keys}; load average before "
        f"{load_before[0]:.2f}, after {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    if args.json:
        args.json.write_text(json.dumps(rounds, indent=1))


if __name__ == "__main__":
    main()
