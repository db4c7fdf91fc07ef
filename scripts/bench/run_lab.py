"""Throughput of every system on the simulated low-bandwidth cluster, at one link rate.

    sudo .venv/bin/python -m scripts.bench.run_lab --rate 100mbit \\
        --systems zero3,qwz,hpz,qgz,zeropp,fsdp2,fsdp2_hybrid,ds_zero3,ds_zero3_hpz \\
        --iters 3 --nodes 2 --ranks-per-node 2 --out results/lab_100mbit.json

Brings the cluster up (``scripts/sim_cluster.sh up NODES RATE``), measures the link once
(``check_links``), runs ``bench_step`` for each system through ``launch_ranks``,
and takes the cluster down again, also after an error or Ctrl-C (``--keep-cluster`` leaves
it up). A system that fails is recorded with its error message and the run goes on.
``--local`` runs the ranks on localhost without namespaces or shaping (no root needed).

The JSON holds, per system, ``median_step_s``, ``tokens_per_sec``,
``inter_node_bytes_per_iter`` (source: the engine's counters or the collective calls) and the
measured ``wire_inter_node_bytes_per_iter``, plus the machine, the date, the load average before and
after (the machine may be shared) and the exact command. It is rewritten after every system,
so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import sys
from pathlib import Path

from scripts.bench import check_links
from scripts.bench.cluster import ROOT, SimCluster, check_rate, unavailable_reason
from scripts.bench.launch_ranks import LaunchError, RankOutput, describe_failure, launch

BENCH_STEP = "scripts.bench.bench_step"  # run as a module, from ROOT, by every rank
RESULT_PREFIX = "LAB_RESULT "
ALL_SYSTEMS = ("zero3", "qwz", "hpz", "qgz", "zeropp", "zeropp_deltas", "zeropp_deltas2",
               "zeropp_deltas_grad2", "fsdp2", "fsdp2_hybrid", "ds_zero3", "ds_zero3_hpz",
               "ds_zeropp")
# Passed through to bench_step unchanged: (flag, type, default, help).
SHAPE_FLAGS = (
    ("--num-layers", int, 4, "transformer layers"),
    ("--hidden-size", int, 512, "model width"),
    ("--num-attention-heads", int, 8, "attention heads"),
    ("--seq-length", int, 256, "tokens per sequence"),
    ("--vocab-size", int, 16384, "vocabulary (a multiple of 128 needs no padding)"),
    ("--global-batch-size", int, 4, "sequences per iteration over all ranks"),
)


def parse_systems(text: str) -> list[str]:
    systems = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in systems if s not in ALL_SYSTEMS]
    if unknown or not systems:
        raise argparse.ArgumentTypeError(
            f"unknown system(s) {', '.join(unknown) or '(none given)'}; "
            f"choose from {','.join(ALL_SYSTEMS)}")
    return systems


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.run_lab",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="unlimited",
                        help="inter-node link rate: 100mbit, 1gbit, ... or unlimited")
    parser.add_argument("--systems", type=parse_systems, default=list(ALL_SYSTEMS),
                        help=f"comma-separated, from {','.join(ALL_SYSTEMS)}")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per system")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    for flag, kind, default, help_text in SHAPE_FLAGS:
        parser.add_argument(flag, type=kind, default=default, help=help_text)
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--local", action="store_true",
                        help="localhost ranks, no namespaces and no shaping (no root needed)")
    parser.add_argument("--keep-cluster", action="store_true",
                        help="leave the simulated cluster up afterwards")
    parser.add_argument("--link-check-mib", type=int, default=8,
                        help="MiB sent once node 0 -> node 1 to measure the link (0: skip)")
    parser.add_argument("--system-timeout", type=float, default=900.0,
                        help="seconds allowed for one system's run")
    args = parser.parse_args(argv)
    check_rate(args.rate)
    if args.nodes < 1 or args.ranks_per_node < 1:
        parser.error("--nodes and --ranks-per-node must be at least 1")
    if args.iters < 1:
        parser.error("--iters must be at least 1")
    return args


def machine_description() -> dict:
    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu_model = None
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    return {
        "hostname": platform.node(),
        "cpu": cpu_model or platform.processor(),
        "cpu_count": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "deepspeed": version("deepspeed"),
    }


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def bench_command(args: argparse.Namespace, system: str) -> list[str]:
    command = [sys.executable, "-m", BENCH_STEP, "--system", system, "--iters", str(args.iters),
               "--warmup", str(args.warmup), "--ranks-per-node", str(args.ranks_per_node)]
    for flag, _, _, _ in SHAPE_FLAGS:
        command += [flag, str(getattr(args, flag.lstrip("-").replace("-", "_")))]
    return command


def result_from_outputs(outputs: list[RankOutput]) -> dict | None:
    """The LAB_RESULT record of the lowest rank that printed one (rank 0 on success)."""
    for output in outputs:
        for line in output.stdout.splitlines():
            if line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX):])
    return None


def run_system(args: argparse.Namespace, system: str, cluster: SimCluster | None) -> dict:
    """One system's record; failures become ``{"status": "error", "error": ...}``."""
    print(f"[lab] {system} at {'localhost' if cluster is None else args.rate} ...", flush=True)
    try:
        outputs = launch(bench_command(args, system), nodes=args.nodes,
                         ranks_per_node=args.ranks_per_node, cluster=cluster, cwd=ROOT,
                         timeout_s=args.system_timeout)
    except LaunchError as error:
        reported = result_from_outputs(error.outputs)
        if reported is not None and reported.get("status") == "error":
            message = reported["error"]
        else:
            message = describe_failure(error).splitlines()[-1].strip() or str(error)
        print(f"[lab] {system}: error: {message}", flush=True)
        return {"system": system, "status": "error", "error": message}
    result = result_from_outputs(outputs)
    if result is None:
        return {"system": system, "status": "error", "error": "rank 0 printed no LAB_RESULT"}
    print(f"[lab] {system}: {result['median_step_s']:.2f} s/iteration, "
          f"{result['tokens_per_sec']:.0f} tokens/s, "
          f"{result['inter_node_bytes_per_iter'] / 2**20:.1f} MiB inter-node per rank "
          f"({result['inter_node_bytes_source']})", flush=True)
    return result


def repo_relative(argument: str, root: Path = ROOT) -> str:
    """``argument`` with an absolute path under ``root`` written relative to it (also the
    value of ``--option=PATH``); anything else unchanged. Records and documents name files the
    way a user types them from the repository root, not where one machine kept its checkout."""
    option, equals, value = ("", "", argument)
    if argument.startswith("-"):
        option, equals, value = argument.partition("=")
    path = Path(value)
    if not path.is_absolute():
        return argument
    for base in dict.fromkeys((root, root.resolve())):
        try:
            relative = Path(os.path.normpath(path)).relative_to(base)
        except ValueError:
            continue
        return option + equals + (relative.as_posix() or ".")
    return argument


def command_line(module: str, argv: list[str] | None) -> str:
    """The command that repeats this run from the repository root: ``python -m module`` with
    the same arguments, paths under the repository relative to it (not this machine's
    interpreter and checkout)."""
    arguments = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", "-m", module, *(repo_relative(a) for a in arguments)])


def write_json(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(record, indent=2) + "\n")
    temporary.replace(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cluster = None
    if not args.local:
        reason = unavailable_reason()
        if reason is not None:
            print(f"error: {reason} (or run with --local)", file=sys.stderr)
            return 2
        cluster = SimCluster()
    record = {
        "kind": "throughput",
        "rate": "local" if args.local else args.rate,
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "iters": args.iters,
        "warmup": args.warmup,
        "machine": machine_description(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line("scripts.bench.run_lab", argv),
        "load_average_before": load_average(),
        "systems": {},
    }
    try:
        if cluster is not None:
            cluster.up(args.nodes, args.rate)
            record["shaping"] = cluster.shaping(0)
            if args.link_check_mib > 0 and args.nodes > 1:
                record["link"] = check_links.measure(cluster, 1, args.link_check_mib)
        for system in args.systems:
            record["systems"][system] = run_system(args, system, cluster)
            write_json(args.out, record)
    finally:
        if cluster is not None and not args.keep_cluster:
            cluster.down()
    record["load_average_after"] = load_average()
    write_json(args.out, record)
    print(f"[lab] wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
