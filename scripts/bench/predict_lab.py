"""The step-time model against the lab: predicted vs measured seconds per iteration.

    python -m scripts.bench.predict_lab [--measured cache/lab/DATE] [--out cache/lab/predicted.json]

The lab (docs/lab.md) trains a 21.1M-parameter GPT (4 layers x 512, sequence 256, vocabulary
16384, fp32, one sequence per rank) on 2 nodes x 2 CPU ranks joined by tbf-shaped links, and
measures the seconds per iteration of ZeRO-3, each ZeRO++ optimization alone and all three at
three link rates (MEASURED below, or run_lab's JSON with ``--measured``). Here:

1. each system's iteration is recorded as a trace on the simulated GPU cluster (the same
   engine and settings as scripts/bench/bench_step.py's ``OurEngine``);
2. the lab's cluster is described from rates measured on this machine, nothing else:
   - the links as run_lab's link check measured them, and gloo's algorithm ("direct": a
     world collective sends each rank's piece to every peer separately, see docs/lab.md);
   - gloo itself, 4 ranks on this machine's cores: a world all-gather plus reduce-scatter at
     two sizes gives the latency per collective and the bytes per second a rank's cores move
     (zeropp/planning/step_time.py [Note: host-driven transports]);
   - the CPU kernels, each in 4 concurrent single-thread processes (the lab's 4 ranks on 2
     cores): an fp32 add_ (the memory-bound ops) and each quantization kernel as the lab
     runs it (bytes counted as the trace counts them);
   - one compute rate: the same model unsharded in 4 concurrent processes, its FLOPs over its
     seconds less the time its memory-bound ops take at the measured rate;
3. the trace is replayed on that cluster (zeropp.planning.step_time.predict) for every cell.

Nothing is fitted, per cell or otherwise. The rates are measurements of this machine now, so
the unthrottled cells move with its load, as the lab's own figures do (10% between repeats);
compare with a lab run taken just before, on a quiet machine.

Where it stands (2026-11-24, lab run and rates minutes apart, quiet machine; docs/paper_setups.md,
"Will ZeRO++ help on my cluster?"): every one of the 15 cells within 25%, the largest errors qwZ
at 100mbit (-24%) and qgZ at 100mbit (+21%); ZeRO-3 within 6% at every rate.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megatron_lite.model import GPTConfig, GPTModel, lm_loss
from zeropp.planning.step_time import (
    lab_cluster,
    predict,
)
from zeropp.simulation.trace import ComputeOp

# Seconds per iteration (median) at the link rates unlimited, 1gbit, 100mbit, measured on
# 2026-11-24 on the quiet reference machine right before the rates below were measured:
#   python -m scripts.bench.run_lab --rate R --systems zero3,qwz,hpz,qgz,zeropp \
#       --iters 5 (3 at 100mbit) --out cache/lab/20261124/lab_R.json
# ``--measured DIR`` reads such files instead (and their measured link rates).
RATES = ("unlimited", "1gbit", "100mbit")
MEASURED = {
    "zero3": (1.35, 2.49, 20.24),
    "qwz": (1.40, 1.97, 13.80),
    "hpz": (1.38, 2.38, 17.48),
    "qgz": (1.46, 1.89, 10.25),
    "zeropp": (1.47, 1.57, 3.34),
}
# The same runs' link check (check_links: one TCP stream node 0 -> node 1, 8 MiB), Mbit/s.
MEASURED_LINK_MBIT = {"unlimited": 16270, "1gbit": 959, "100mbit": 95.7}
# The zero_optimization switches of each system (bench_step.OUR_SYSTEMS on 2 x 2).
SYSTEMS = {
    "zero3": {},
    "qwz": {"zero_quantized_weights": True},
    "hpz": {"zero_hpz_partition_size": 2},
    "qgz": {"zero_quantized_gradients": True},
    "zeropp": {"zero_quantized_weights": True, "zero_hpz_partition_size": 2,
               "zero_quantized_gradients": True},
}
SHAPE = dict(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=256,
             vocab_size=16384)
RANKS = 4  # 2 nodes x 2 ranks on the lab's 2 cores


def lab_argv(ds_config_path: str) -> list[str]:
    """The training flags of the lab's model, for the simulated cluster."""
    s = SHAPE
    return (f"--num-layers {s['num_layers']} --hidden-size {s['hidden_size']} "
            f"--num-attention-heads {s['num_attention_heads']} --seq-length {s['seq_length']} "
            f"--max-position-embeddings {s['seq_length']} --micro-batch-size 1 "
            f"--global-batch-size {RANKS} --lr 3e-4 --clip-grad 1.0 --hidden-dropout 0 "
            f"--attention-dropout 0 --tokenizer-type NullTokenizer --vocab-size "
            f"{s['vocab_size']} --ranks-per-node 2 --deepspeed_config {ds_config_path}").split()


def ds_config(switches: dict) -> dict:
    # build_engine's defaults (ShardingOptions), as the lab's OurEngine runs them.
    return {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8,
                                  "stage3_prefetch_bucket_size": 5e7,
                                  "stage3_max_live_parameters": 1e9,
                                  "stage3_param_persistence_threshold": 1e5,
                                  "stage3_max_reuse_distance": 0, **switches}}


def record_traces(workdir: Path) -> dict:
    from megatron_lite.simulate import simulate_rank

    traces = {}
    for name, switches in SYSTEMS.items():
        path = workdir / f"ds_{name}.json"
        path.write_text(json.dumps(ds_config(switches)))
        traces[name] = simulate_rank(lab_argv(str(path)), 0, 2, 2, save_dir=None,
                                     trace=True, label=name).trace
    return traces


def _lab_model(device: str = "cpu") -> GPTModel:
    s = SHAPE
    with torch.device(device):
        return GPTModel(GPTConfig(num_layers=s["num_layers"], hidden_size=s["hidden_size"],
                                  num_attention_heads=s["num_attention_heads"],
                                  vocab_size=s["vocab_size"],
                                  max_position_embeddings=s["seq_length"], hidden_dropout=0.0,
                                  attention_dropout=0.0))


def _unsharded_iteration(model: GPTModel, optimizer, tokens: torch.Tensor) -> None:
    logits = model(tokens[:, :-1])
    lm_loss(logits, tokens[:, 1:], torch.ones_like(tokens[:, 1:])).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


def unsharded_trace() -> list:
    """The compute ops of one unsharded iteration (what ``_time_unsharded`` runs), on meta."""
    from zeropp.simulation.tracing import TraceRecorder

    model = _lab_model("meta")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=False)
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, SHAPE["seq_length"] + 1), device="meta")
    _unsharded_iteration(model, optimizer, tokens)  # the optimizer's state exists from here
    with TraceRecorder() as recorder:
        _unsharded_iteration(model, optimizer, tokens)
    return [op for op in recorder.events if isinstance(op, ComputeOp)]


def _median_seconds(run, repeats: int) -> float:
    seconds = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])


def _time_unsharded(queue, rank: int, iterations: int) -> None:
    torch.set_num_threads(1)
    model = _lab_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=False)
    tokens = torch.randint(0, SHAPE["vocab_size"], (1, SHAPE["seq_length"] + 1))
    queue.put(_median_seconds(lambda: _unsharded_iteration(model, optimizer, tokens),
                              iterations))


# One layer's parameters (12 h^2), as the engine moves them: qwZ quantizes a rank's shard
# and dequantizes the gathered layer, qgZ quantizes the whole gradient (4 bits) and reduces
# the pieces it receives; every quantization block is 256 values (the engine's default).
_LAYER_NUMEL = 12 * SHAPE["hidden_size"] ** 2
_BLOCK = 256


def _kernel_calls() -> dict[str, tuple]:
    """Trace op name -> (a call of the CPU kernel as the lab runs it, its bytes as the
    trace counts them: the tensors it reads plus the tensors it writes)."""
    from zeropp import kernels

    shard = torch.randn(_LAYER_NUMEL // RANKS)
    full = torch.randn(_LAYER_NUMEL)
    q8 = kernels.quantize_blockwise(shard, 8, _BLOCK)
    gathered = q8.repeat(RANKS, 1)
    q4 = kernels.quantize_blockwise(full, 4, _BLOCK)
    per_node, nodes = 2, 2
    chunk = _LAYER_NUMEL // per_node
    chunk_q4 = kernels.quantize_blockwise(full[:chunk], 4, _BLOCK).repeat(per_node, 1)
    piece = chunk // nodes
    piece_q4 = kernels.quantize_blockwise(full[:piece], 4, _BLOCK).repeat(nodes, 1)

    def nbytes(*tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    return {
        "zeropp.quantize_blockwise.default": (
            lambda: (kernels.quantize_blockwise(shard, 8, _BLOCK),
                     kernels.quantize_blockwise(full, 4, _BLOCK)),
            nbytes(shard, q8, full, q4)),
        "zeropp.dequantize_blockwise_many.default": (
            lambda: kernels.dequantize_blockwise_many(gathered, shard.numel(), 8, _BLOCK,
                                                      torch.float32),
            nbytes(gathered, full)),
        "zeropp.dequantize_reduce_quantize.default": (
            lambda: kernels.dequantize_reduce_quantize(chunk_q4, chunk, 4, 4, _BLOCK),
            nbytes(chunk_q4, chunk_q4[0])),
        "zeropp.dequantize_reduce.default": (
            lambda: kernels.dequantize_reduce(piece_q4, piece, 4, _BLOCK),
            nbytes(piece_q4, full[:piece])),
    }


def _time_kernels(queue, rank: int, repeats: int) -> None:
    torch.set_num_threads(1)
    rates = {}
    for name, (call, nbytes) in _kernel_calls().items():
        rates[name] = nbytes / _median_seconds(call, repeats)
    a, b = torch.randn(_LAYER_NUMEL), torch.randn(_LAYER_NUMEL)
    # add_ reads a and b and writes a: 3 tensors of bytes, as the trace counts an add_.
    rates["elementwise"] = 3 * a.numel() * 4 / _median_seconds(lambda: a.add_(b), repeats)
    queue.put(rates)


# Two sizes of a world all-gather plus reduce-scatter (fp32 elements of the full buffer): a
# layer of the lab model and a quarter of one, enough apart to separate latency from rate.
_GLOO_SIZES = (_LAYER_NUMEL // 4, _LAYER_NUMEL)
_GLOO_PORT = 29517


def _time_gloo(queue, rank: int, repeats: int) -> None:
    """Seconds of a world all_gather + reduce_scatter per size in _GLOO_SIZES (4 ranks)."""
    import warnings

    import torch.distributed as dist

    warnings.simplefilter("ignore", FutureWarning)  # torch's rename notice for *_tensor
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_GLOO_PORT}", rank=rank,
                            world_size=RANKS)
    seconds = []
    for numel in _GLOO_SIZES:
        full, gathered = torch.randn(numel), torch.empty(numel)
        shard, reduced = torch.randn(numel // RANKS), torch.empty(numel // RANKS)

        def exchange(gathered=gathered, shard=shard, reduced=reduced, full=full):
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather_into_tensor(gathered, shard)
            dist.reduce_scatter_tensor(reduced, full)
            return time.perf_counter() - start

        seconds.append(statistics.median(exchange() for _ in range(repeats)))
    dist.destroy_process_group()
    queue.put(seconds)


def _concurrently(target, repeats: int) -> list:
    """Run ``target(queue, rank, repeats)`` in RANKS single-thread processes at once (the
    lab's 4 ranks on this machine's cores) and return what each put on the queue."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=target, args=(queue, rank, repeats))
                 for rank in range(RANKS)]
    for process in processes:
        process.start()
    results = [queue.get() for _ in processes]
    for process in processes:
        process.join()
    return results


def measure_gloo(repeats: int = 8) -> tuple[float, float]:
    """(latency per collective in seconds, bytes/s a rank sends plus receives) of gloo with
    the lab's 4 ranks on this machine's cores: the alpha-beta line through two sizes."""
    results = _concurrently(_time_gloo, repeats)
    small, large = (statistics.median(r[i] for r in results) for i in range(2))
    # A rank sends and receives 2 (n-1)/n of the full buffer in each of the two collectives.
    moved = [2 * 2 * (RANKS - 1) / RANKS * numel * 4 for numel in _GLOO_SIZES]
    # The line through the two points; on a quiet machine the small exchange can be cheaper
    # per byte than the large one (it stays in cache), and then the latency is taken as 0.
    latency = max(0.0, (small - moved[0] * (large - small) / (moved[1] - moved[0])) / 2)
    return latency, moved[1] / (large - 2 * latency)


def measure_compute_seconds(iterations: int = 5) -> float:
    """Median seconds of one unsharded iteration while 4 such processes share the cores."""
    return statistics.median(_concurrently(_time_unsharded, iterations))


def measure_kernel_rates(repeats: int = 10) -> dict[str, float]:
    """Bytes/s per kernel (and "elementwise": an fp32 add_) with 4 processes on the cores."""
    results = _concurrently(_time_kernels, repeats)
    return {name: statistics.median(r[name] for r in results) for name in results[0]}


def read_lab_runs(directory: Path) -> tuple[dict, dict]:
    """(seconds per system and rate, measured link Mbit/s per rate) from run_lab's JSON."""
    seconds: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    links = {}
    for rate_name in RATES:
        run = json.loads((directory / f"lab_{rate_name}.json").read_text())
        links[rate_name] = run["link"]["goodput_mbit_per_s"]
        for name in SYSTEMS:
            seconds[name].append(run["systems"][name]["median_step_s"])
    return {name: tuple(v) for name, v in seconds.items()}, links


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.predict_lab",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    parser.add_argument("--measured", type=Path, default=None, metavar="DIR",
                        help="compare with run_lab's lab_{unlimited,1gbit,100mbit}.json in DIR "
                        "instead of the figures in this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        traces = record_traces(Path(workdir))
    rates = measure_kernel_rates()
    latency, transport = measure_gloo()
    compute_seconds = measure_compute_seconds()
    # The compute rate: the unsharded iteration's FLOPs over the seconds left of it once its
    # memory-bound ops (no FLOPs) are charged at the measured elementwise rate.
    ops = unsharded_trace()
    flops = sum(op.flops for op in ops)
    memory_seconds = sum(op.bytes for op in ops if op.flops == 0) / rates["elementwise"]
    if memory_seconds >= compute_seconds:
        raise RuntimeError(f"the unsharded iteration took {compute_seconds:.3f} s, less than "
                           f"its memory-bound ops at the measured rate ({memory_seconds:.3f} s)")
    rate = flops / (compute_seconds - memory_seconds)
    kernel_rates = {name: r for name, r in rates.items() if name != "elementwise"}
    print(f"measured with {RANKS} processes on this machine: {compute_seconds:.3f} s per "
          f"unsharded iteration, {memory_seconds:.3f} s of it memory-bound at "
          f"{rates['elementwise'] / 1e9:.2f} GB/s -> {rate / 1e9:.2f} GFLOP/s per rank")
    for name, r in kernel_rates.items():
        print(f"  {name}: {r / 1e9:.2f} GB/s")
    print(f"  gloo, 4 ranks: {latency * 1e3:.1f} ms per collective, {transport / 1e6:.0f} MB/s "
          f"sent plus received per rank")
    measured_seconds, link_mbit = MEASURED, MEASURED_LINK_MBIT
    if args.measured is not None:
        measured_seconds, link_mbit = read_lab_runs(args.measured)
    links = {rate_name: mbit * 1e6 for rate_name, mbit in link_mbit.items()}
    rows = []
    print(f"{'system':<8}" + "".join(f"{rate_name:>26}" for rate_name in RATES))
    for name, trace in traces.items():
        cells = []
        for rate_name, measured in zip(RATES, measured_seconds[name], strict=True):
            cluster = lab_cluster(
                rate, rates["elementwise"], links[rate_name], algorithm="direct",
                host_transport_bandwidth=transport, intra_node_latency=latency,
                inter_node_latency=latency, kernel_bandwidth=kernel_rates)
            predicted = predict(trace, cluster).seconds
            cells.append({"rate": rate_name, "predicted": predicted, "measured": measured,
                          "error": predicted / measured - 1})
        rows.append({"system": name, "cells": cells})
        print(f"{name:<8}" + "".join(
            f"{c['predicted']:9.2f} vs {c['measured']:5.2f} ({c['error']:+5.0%})" for c in cells))
    worst = max(abs(c["error"]) for row in rows for c in row["cells"])
    print(f"largest error: {worst:.0%}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"gflops_per_rank": rate / 1e9,
                                              "compute_seconds": compute_seconds,
                                              "bytes_per_second": rates,
                                              "gloo_latency_s": latency,
                                              "gloo_bytes_per_second": transport,
                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
