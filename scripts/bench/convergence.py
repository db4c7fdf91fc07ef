"""Loss parity: ZeRO-3 vs ZeRO++ (int4 and int8 gradients) pretraining a small GPT.

    .venv/bin/python -m scripts.bench.convergence --train-iters 300 --out results/convergence.json

Each variant is one ``pretrain_zeropp_gpt.py`` run on the sample corpus with 4 ranks laid out
as 2 nodes x 2 (``--ranks-per-node 2``, on localhost: the link rate changes no arithmetic),
the same seed, data order, model and schedule; only the ZeRO config differs:

    zero3                configs/ds_zero3_config.json
    zeropp               configs/ds_zeropp_cpu2x2.json (qwZ int8, hpZ 2, qgZ int4)
    zeropp_grad8         the same with zero_quantized_gradients_bits = 8
    zeropp_loco          zeropp with LoCo error feedback (DeepSpeed's zeropp_loco_param defaults)
    zeropp_deltas        zeropp with weight deltas (zero_quantized_weight_deltas) instead of qwZ
    zeropp_deltas2       zeropp_deltas with 2-bit (ternary) deltas
                         (zero_quantized_weight_deltas_bits = 2)
    zeropp_deltas_grad2  zeropp_deltas with int2 gradients across nodes and error feedback
                         (zero_quantized_gradients_inter_node_bits = 2)

The runs' ``--metrics-file`` records give the training-loss curves and the validation loss
every ``--eval-interval`` iterations and at the end. The JSON reports each final validation
loss and its relative gap to ZeRO-3; the PNG shows all curves. When the tokenized corpus is
missing it is built first (``data.sample_corpus`` and ``data.preprocess``, as quickstart does).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from scripts.bench import plots
from scripts.bench.launch_ranks import LaunchError, describe_failure, launch
from scripts.bench.run_lab import (
    command_line,
    load_average,
    machine_description,
    repo_relative,
    write_json,
)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_PREFIX = ROOT / "cache" / "data" / "pile_sample_text_document"
ZERO3_CONFIG = ROOT / "configs" / "ds_zero3_config.json"
ZEROPP_CONFIG = ROOT / "configs" / "ds_zeropp_cpu2x2.json"
VARIANTS = ("zero3", "zeropp", "zeropp_grad8", "zeropp_loco", "zeropp_deltas", "zeropp_deltas2",
            "zeropp_deltas_grad2")
# The variants that run when --variants is not given.
DEFAULT_VARIANTS = ("zero3", "zeropp", "zeropp_grad8")
# What each derived variant changes in zero_optimization of the ZeRO++ config.
ZEROPP_CHANGES = {
    "zeropp_grad8": {"zero_quantized_gradients_bits": 8},
    "zeropp_loco": {"zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}},
    "zeropp_deltas": {"zero_quantized_weight_deltas": True},
    "zeropp_deltas2": {"zero_quantized_weight_deltas": True,
                       "zero_quantized_weight_deltas_bits": 2},
    "zeropp_deltas_grad2": {"zero_quantized_weight_deltas": True,
                            "zero_quantized_gradients_inter_node_bits": 2,
                            "zero_quantized_gradients_error_feedback": True},
}


def variant_config(name: str, run_dir: Path) -> Path:
    """The DeepSpeed JSON of one variant (derived ones: written next to its run)."""
    if name == "zero3":
        return ZERO3_CONFIG
    if name == "zeropp":
        return ZEROPP_CONFIG
    if name in ZEROPP_CHANGES:
        config = json.loads(ZEROPP_CONFIG.read_text())
        config["zero_optimization"].update(ZEROPP_CHANGES[name])
        path = run_dir / f"ds_{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(config, indent=2) + "\n")
        return path
    raise ValueError(f"unknown variant {name!r}; expected one of {', '.join(VARIANTS)}")


def ensure_dataset(prefix: Path) -> None:
    """Build the tokenized sample corpus at ``prefix`` unless its .bin/.idx exist."""
    if prefix.with_suffix(".bin").exists() and prefix.with_suffix(".idx").exists():
        return
    suffix = "_text_document"
    if not prefix.name.endswith(suffix):
        raise FileNotFoundError(f"{prefix}.bin/.idx: missing, and the name does not end in "
                                f"{suffix} as data.preprocess output does; build it first")
    corpus = ROOT / "cache" / "corpus"
    print(f"[convergence] building the sample corpus into {corpus}", flush=True)
    subprocess.run([sys.executable, "-m", "data.sample_corpus", "--output", str(corpus)],
                   cwd=ROOT, check=True)
    output_prefix = str(prefix)[: -len(suffix)]
    prefix.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "data.preprocess", "--input", str(corpus),
                    "--output-prefix", output_prefix, "--tokenizer-type", "GPT2BPETokenizer",
                    "--append-eod", "--workers", "2"], cwd=ROOT, check=True)


def pretrain_command(args: argparse.Namespace, config: Path, metrics: Path) -> list[str]:
    return [
        sys.executable, str(ROOT / "pretrain_zeropp_gpt.py"),
        "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--seq-length", str(args.seq_length), "--max-position-embeddings", str(args.seq_length),
        "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.global_batch_size),
        "--train-iters", str(args.train_iters), "--lr", str(args.lr),
        "--min-lr", str(args.lr / 10), "--lr-decay-style", "cosine",
        "--lr-warmup-iters", str(max(1, args.train_iters // 10)),
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--seed", str(args.seed),
        "--log-interval", str(args.log_interval), "--eval-interval", str(args.eval_interval),
        "--eval-iters", str(args.eval_iters),
        "--data-path", str(args.data_path), "--split", "969,30,1", "--num-workers", "0",
        "--ranks-per-node", str(args.ranks_per_node), "--zero-stage", "3",
        "--deepspeed", "--deepspeed_config", str(config), "--metrics-file", str(metrics),
    ]


def read_curves(metrics: Path) -> dict:
    """Training-loss and validation-loss curves of one run's metrics file."""
    train, valid = [], []
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "lm_loss" in record:
            train.append([record["iteration"], record["lm_loss"]])
        if "val_loss" in record:
            valid.append([record["iteration"], record["val_loss"]])
    if not valid:
        raise ValueError(f"{metrics}: no validation loss recorded")
    return {"train_curve": train, "valid_curve": valid, "final_valid_loss": valid[-1][1],
            "final_iteration": valid[-1][0]}


def run_variant(args: argparse.Namespace, name: str) -> dict:
    run_dir = args.out.parent / f"{args.out.stem}_runs" / name
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    config = variant_config(name, run_dir)
    command = pretrain_command(args, config, metrics)
    print(f"[convergence] {name}: {args.train_iters} iterations ...", flush=True)
    started = time.perf_counter()
    try:
        launch(command, nodes=args.nodes, ranks_per_node=args.ranks_per_node, cluster=None,
               timeout_s=args.timeout)
    except LaunchError as error:
        message = describe_failure(error)
        print(f"[convergence] {name}: failed: {message}", flush=True)
        return {"status": "error", "error": message.splitlines()[-1], "config": str(config)}
    seconds = time.perf_counter() - started
    result = {"status": "ok", "config": str(config), "seconds": seconds,
              "command": shlex.join(command), **read_curves(metrics)}
    print(f"[convergence] {name}: final validation loss {result['final_valid_loss']:.4f} "
          f"({seconds:.0f} s)", flush=True)
    return result


def relative_gaps(variants: dict, reference: str = "zero3") -> dict[str, float]:
    """(final validation loss - reference's) / reference's, for every other finished run."""
    base = variants.get(reference, {})
    if base.get("status") != "ok":
        return {}
    return {name: (v["final_valid_loss"] - base["final_valid_loss"]) / base["final_valid_loss"]
            for name, v in variants.items() if name != reference and v.get("status") == "ok"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.convergence",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma-separated, from {','.join(VARIANTS)}")
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--eval-iters", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--data-path", type=Path, default=DEFAULT_DATA_PREFIX)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant")
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--plot", type=Path, default=None,
                        help="loss-curve PNG (default: next to --out)")
    args = parser.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or not args.variants:
        parser.error(f"--variants: unknown {', '.join(unknown) or '(none)'}; "
                     f"choose from {','.join(VARIANTS)}")
    if args.train_iters < 1:
        parser.error("--train-iters must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_dataset(args.data_path)
    record = {
        "kind": "convergence",
        "machine": machine_description(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line("scripts.bench.convergence", argv),
        "load_average_before": load_average(),
        "setup": {"ranks": args.nodes * args.ranks_per_node,
                  "ranks_per_node": args.ranks_per_node, "train_iters": args.train_iters,
                  "num_layers": args.num_layers, "hidden_size": args.hidden_size,
                  "seq_length": args.seq_length, "global_batch_size": args.global_batch_size,
                  "data_path": repo_relative(str(args.data_path))},
        "variants": {},
    }
    for name in args.variants:
        record["variants"][name] = run_variant(args, name)
        record["final_valid_loss_gap_vs_zero3"] = relative_gaps(record["variants"])
        write_json(args.out, record)
    record["load_average_after"] = load_average()
    plot = args.plot or args.out.with_suffix(".png")
    record["plot"] = str(plots.loss_curves(record, plot))
    write_json(args.out, record)
    for name, gap in record["final_valid_loss_gap_vs_zero3"].items():
        print(f"[convergence] {name}: final validation loss {gap:+.2%} vs zero3")
    print(f"[convergence] wrote {args.out} and {plot}")
    return 0 if all(v["status"] == "ok" for v in record["variants"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
