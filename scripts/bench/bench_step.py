"""Time training iterations of one data-parallel system on a GPT; run by every rank.

    sudo .venv/bin/python -m scripts.bench.launch_ranks --nodes 2 --ranks-per-node 2 -- \\
        .venv/bin/python -m scripts.bench.bench_step --system zeropp --iters 3

Systems (all fp32 compute, AdamW, gradient clipping 1.0, the same model and global batch):

    zero3                this project's engine, ZeRO-3
    qwz, hpz, qgz        this engine with one ZeRO++ optimization (hpZ group = ranks per node)
    zeropp               this engine with all three
    zeropp_deltas        zeropp with weight deltas (4-bit changes across nodes) instead of qwZ
    zeropp_deltas2       zeropp_deltas with 2-bit (ternary) deltas
    zeropp_deltas_grad2  zeropp_deltas with int2 gradients across nodes, with error feedback
    fsdp2                torch.distributed.fsdp.fully_shard on every block, then the root
    fsdp2_hybrid         fully_shard on a 2-D mesh (replicate across nodes, shard inside a
                         node): HSDP, PyTorch's nearest relative of hpZ
    ds_zero3             DeepSpeed ZeRO-3 (deepspeed.initialize on the existing gloo group)
    ds_zero3_hpz         DeepSpeed ZeRO-3 with zero_hpz_partition_size = ranks per node
    ds_zeropp            DeepSpeed ZeRO-3 with qwZ + hpZ + qgZ (its quantizers are CUDA ops)

After ``--warmup`` untimed iterations, each of ``--iters`` iterations is timed between two
barriers (so the slowest rank sets the time). Rank 0 prints one line ``LAB_RESULT {json}``.

Inter-node bytes, per rank and iteration, three ways:

- ``inter_node_bytes_per_iter``: the engine's accounting convention
  (``zeropp/comm/accounting.py``: bytes this rank hands to collectives whose group spans
  nodes). For this engine, its own counters (``engine.comm_bytes()``, source "engine"); for
  FSDP2 and DeepSpeed, the same convention applied to every torch.distributed collective they
  call (``collective_bytes.py``, source "collective calls"). The engine's runs carry that
  count too (``collective_inter_node_bytes_per_iter``) as a cross-check of the two. That
  counter wraps the process group's methods, which every caller reaches (this engine calls
  them directly).
- ``theory_inter_node_bytes_per_iter`` (FSDP2 only): its documented data path applied to
  the actual shard sizes.
- ``wire_inter_node_bytes_per_iter``: what really crossed the shaped links, the growth of
  every node's veth tx counter (TCP/IP headers included, about 4%) divided by iterations and
  ranks. A rank's traffic to peers of its own node goes over loopback and never shows here,
  so on 2 nodes x 2 it is about 2/3 of a world collective's accounted bytes.
"""

from __future__ import annotations

import abc
import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_lite.model import GPTConfig, GPTModel, lm_loss
from scripts.bench.collective_bytes import CollectiveByteCounter

if TYPE_CHECKING:  # imported for real only once the byte counter is installed
    from zeropp.topology import ClusterShape

RESULT_PREFIX = "LAB_RESULT "
FP32_BYTES = 4
LEARNING_RATE = 3e-4
WEIGHT_DECAY = 0.01
GRADIENT_CLIPPING = 1.0
# DeepSpeed's default: parameters below this many elements stay gathered (never re-fetched).
DS_PERSISTENCE_THRESHOLD = 100_000

OUR_SYSTEMS = {
    "zero3": {},
    "qwz": {"quantized_weights": True},
    "hpz": {"hpz": True},
    "qgz": {"quantized_gradients": True},
    "zeropp": {"quantized_weights": True, "hpz": True, "quantized_gradients": True},
    "zeropp_deltas": {"weight_deltas": True, "hpz": True, "quantized_gradients": True},
    "zeropp_deltas2": {"weight_deltas": True, "delta_bits": 2, "hpz": True,
                       "quantized_gradients": True},
    # int2 across nodes is refused without error feedback: plain feedback (beta 0, no reset)
    "zeropp_deltas_grad2": {"weight_deltas": True, "hpz": True, "quantized_gradients": True,
                            "gradient_inter_node_bits": 2, "error_feedback": (0.0, 0)},
}
FSDP_SYSTEMS = {"fsdp2": False, "fsdp2_hybrid": True}
DEEPSPEED_SYSTEMS = {
    "ds_zero3": {},
    "ds_zero3_hpz": {"hpz": True},
    "ds_zeropp": {"hpz": True, "zero_quantized_weights": True, "zero_quantized_gradients": True},
}
SYSTEMS = (*OUR_SYSTEMS, *FSDP_SYSTEMS, *DEEPSPEED_SYSTEMS)


@dataclass(frozen=True)
class BenchShape:
    """The benchmarked model and batch."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    global_batch_size: int

    def gpt_config(self) -> GPTConfig:
        # No dropout: a throughput benchmark needs no regularization, only the same work.
        return GPTConfig(
            num_layers=self.num_layers, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads, vocab_size=self.vocab_size,
            max_position_embeddings=self.seq_length, hidden_dropout=0.0,
            attention_dropout=0.0,
        )


class TrainingSystem(abc.ABC):
    """One system's training iteration; byte counts beyond the shared counter are optional."""

    @abc.abstractmethod
    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        """Forward, backward and optimizer step on this rank's micro-batch; returns the loss."""

    def engine_bytes(self) -> dict[str, int] | None:
        """Inter-node bytes by phase from the system's own counters since the last call."""
        return None

    def theory_bytes_per_iteration(self) -> dict[str, int] | None:
        """Inter-node bytes by phase per iteration from the system's documented data path."""
        return None


def _loss(model: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor,
          labels: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)  # (B, T, V)
    return lm_loss(logits, labels, torch.ones_like(labels))


# ---- this project's engine ------------------------------------------------------------------


class OurEngine(TrainingSystem):
    def __init__(self, shape: BenchShape, layout: ClusterShape, switches: dict[str, Any]) -> None:
        from zeropp import QuantizationOptions, build_engine

        with torch.device("meta"):
            model = GPTModel(shape.gpt_config())
        quantization = QuantizationOptions(
            quantized_weights=switches.get("quantized_weights", False),
            hpz_size=layout.ranks_per_node if switches.get("hpz") else 1,
            quantized_gradients=switches.get("quantized_gradients", False),
            weight_deltas=switches.get("weight_deltas", False),
            delta_bits=switches.get("delta_bits", 4),
            gradient_inter_node_bits=switches.get("gradient_inter_node_bits"),
            error_feedback=switches.get("error_feedback"),
        )
        self.engine = build_engine(
            model, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY,
            gradient_clipping=GRADIENT_CLIPPING, quantization=quantization,
            ranks_per_node=layout.ranks_per_node, param_init_fn=model.initial_value,
        )

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        loss = _loss(self.engine, inputs, labels)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def engine_bytes(self) -> dict[str, int]:
        return {phase: counts["inter_node"]
                for phase, counts in self.engine.comm_bytes(reset=True).items()}


# ---- PyTorch FSDP2 ---------------------------------------------------------------------------


def _padded_shard_numel(shape: torch.Size, shards: int) -> int:
    """FSDP2 shards every parameter on dim 0, padded to a multiple of the shard count."""
    rows = math.ceil(shape[0] / shards) if len(shape) else 1
    return rows * math.prod(shape[1:])


class Fsdp2(TrainingSystem):
    def __init__(self, shape: BenchShape, layout: ClusterShape, hybrid: bool) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.layout, self.hybrid = layout, hybrid
        model = GPTModel(shape.gpt_config())  # materialized and initialized on the CPU
        mesh = None
        if hybrid:
            mesh = init_device_mesh("cpu", (layout.num_nodes, layout.ranks_per_node),
                                    mesh_dim_names=("replicate", "shard"))
        self.shard_group_size = layout.ranks_per_node if hybrid else layout.world_size
        block_params = {id(p) for layer in model.layers for p in layer.parameters()}
        self.block_shard_numels = [
            sum(_padded_shard_numel(p.shape, self.shard_group_size) for p in layer.parameters())
            for layer in model.layers
        ]
        self.root_shard_numel = sum(
            _padded_shard_numel(p.shape, self.shard_group_size)
            for p in model.parameters() if id(p) not in block_params
        )
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE,
                                           weight_decay=WEIGHT_DECAY)

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        loss = _loss(self.model, inputs, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), GRADIENT_CLIPPING)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def theory_bytes_per_iteration(self) -> dict[str, int]:
        """FSDP2's data path: every block gathered in forward and again in backward (the
        root is not resharded after forward), gradients reduce-scattered; HSDP does both
        inside the node and all-reduces each gradient shard across nodes."""
        from zeropp.comm.accounting import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes

        units = [*self.block_shard_numels, self.root_shard_numel]
        if self.hybrid:
            nodes = self.layout.num_nodes
            reduce = sum(all_reduce_bytes(n * FP32_BYTES, nodes) for n in units)
            return {"forward_all_gather": 0, "backward_all_gather": 0, "gradient_reduce": reduce,
                    "optimizer": 0}
        group = self.shard_group_size
        forward = sum(all_gather_bytes(n * FP32_BYTES, group) for n in units)
        backward = sum(all_gather_bytes(n * FP32_BYTES, group) for n in self.block_shard_numels)
        reduce = sum(reduce_scatter_bytes(n * group * FP32_BYTES, group) for n in units)
        return {"forward_all_gather": forward, "backward_all_gather": backward,
                "gradient_reduce": reduce, "optimizer": 0}


# ---- DeepSpeed ZeRO-3 -------------------------------------------------------------------------


def _deepspeed_without_shm_build():
    """Import DeepSpeed with its shared-memory all-reduce op marked unavailable.

    DeepSpeed's CPU communication backend JIT-compiles that op when it starts, for inference
    all-reduces that ZeRO-3 training never issues; marking it incompatible (DeepSpeed's own
    switch) skips a C++ build, and keeps every byte on the gloo sockets we measure.
    """
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


class DeepSpeedZero3(TrainingSystem):
    def __init__(self, shape: BenchShape, layout: ClusterShape, extra: dict[str, bool]) -> None:
        deepspeed = _deepspeed_without_shm_build()
        zero = {
            "stage": 3,
            "overlap_comm": True,
            "stage3_param_persistence_threshold": DS_PERSISTENCE_THRESHOLD,
            # ZeRO-3 as it runs at the paper's sizes: every block re-gathered in backward.
            # With prefetching on, DeepSpeed 0.19 keeps a parameter gathered from forward to
            # backward when its prefetch scan meets the parameter's backward use while it is
            # still gathered; at 21M parameters that holds for every parameter (measured: all
            # of them still gathered after forward, even with a one-block prefetch bucket),
            # so it would run without re-gathers or ZeRO-3's memory saving. No prefetch and
            # no reuse window restore the release; the price is no gather/compute overlap.
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
            "zero_hpz_partition_size": layout.ranks_per_node if extra.get("hpz") else 1,
        }
        zero.update({k: v for k, v in extra.items() if k.startswith("zero_quantized")})
        config = {
            "train_micro_batch_size_per_gpu": shape.global_batch_size // layout.world_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": GRADIENT_CLIPPING,
            "zero_optimization": zero,
            # A torch AdamW: DeepSpeed's own Adam ops would be JIT-compiled C++ on CPU.
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1_000_000,
        }
        model = GPTModel(shape.gpt_config())
        # The tied head reads the embedding table outside the embedding module's forward;
        # ZeRO-3 must gather it around the root module too (DeepSpeed's documented API).
        deepspeed.zero.register_external_parameter(model, model.embedding.word_embeddings.weight)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE,
                                      weight_decay=WEIGHT_DECAY)
        # dist_init_required=False: DeepSpeed adopts the gloo group already set up here.
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False)

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> float:
        loss = _loss(self.engine, inputs, labels)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()


def build_system(name: str, shape: BenchShape, layout: ClusterShape) -> TrainingSystem:
    if name in OUR_SYSTEMS:
        return OurEngine(shape, layout, OUR_SYSTEMS[name])
    if name in FSDP_SYSTEMS:
        return Fsdp2(shape, layout, FSDP_SYSTEMS[name])
    if name in DEEPSPEED_SYSTEMS:
        return DeepSpeedZero3(shape, layout, DEEPSPEED_SYSTEMS[name])
    raise ValueError(f"unknown system {name!r}; expected one of {', '.join(SYSTEMS)}")


# ---- measurement --------------------------------------------------------------------------------


def node_tx_bytes(layout: ClusterShape) -> int:
    """Bytes all nodes have sent on their veths (each node's local rank 0 reads its own)."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    mine = 0
    if interface and dist.get_rank() % layout.ranks_per_node == 0:
        mine = int(Path(f"/sys/class/net/{interface}/statistics/tx_bytes").read_text())
    total = torch.tensor([mine], dtype=torch.int64)
    dist.all_reduce(total)
    return int(total.item())


def random_batches(shape: BenchShape, count: int, rank: int, world: int, seed: int):
    """This rank's slice of ``count`` global batches of random token ids (inputs, labels)."""
    generator = torch.Generator().manual_seed(seed)
    per_rank = shape.global_batch_size // world
    for _ in range(count):
        tokens = torch.randint(0, shape.vocab_size,
                               (shape.global_batch_size, shape.seq_length + 1),
                               generator=generator)
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]  # (b, T+1)
        yield mine[:, :-1], mine[:, 1:]


def _per_iteration(by_key: dict[str, int] | None, iters: int) -> dict[str, float] | None:
    return None if by_key is None else {k: v / iters for k, v in by_key.items()}


def measure(system: TrainingSystem, counter: CollectiveByteCounter, shape: BenchShape,
            layout: ClusterShape, iters: int, warmup: int, seed: int) -> dict:
    rank = dist.get_rank()
    batches = random_batches(shape, warmup + iters, rank, layout.world_size, seed)
    losses = [system.train_step(*next(batches)) for _ in range(warmup)]
    tx_before = node_tx_bytes(layout)
    system.engine_bytes()  # forget the warm-up's bytes
    counter.reset()
    step_seconds = []
    for _ in range(iters):
        inputs, labels = next(batches)
        dist.barrier()
        started = time.perf_counter()
        losses.append(system.train_step(inputs, labels))
        dist.barrier()
        step_seconds.append(time.perf_counter() - started)
    calls = _per_iteration({name: c["inter_node"] for name, c in counter.snapshot().items()},
                           iters)
    engine = _per_iteration(system.engine_bytes(), iters)
    theory = system.theory_bytes_per_iteration()
    wire_bytes = node_tx_bytes(layout) - tx_before
    median = statistics.median(step_seconds)
    has_veth = bool(os.environ.get("GLOO_SOCKET_IFNAME"))
    by_phase = engine if engine is not None else calls
    return {
        "status": "ok",
        "median_step_s": median,
        "step_times_s": step_seconds,
        "tokens_per_sec": shape.global_batch_size * shape.seq_length / median,
        "inter_node_bytes_per_iter": sum(by_phase.values()),
        "inter_node_bytes_by_phase": by_phase,
        "inter_node_bytes_source": "engine" if engine is not None else "collective calls",
        "collective_inter_node_bytes_per_iter": sum(calls.values()),
        "collective_inter_node_bytes_by_op": calls,
        "theory_inter_node_bytes_per_iter": None if theory is None else sum(theory.values()),
        "theory_inter_node_bytes_by_phase": theory,
        # Barriers and the counter read add a few hundred bytes, TCP/IP headers about 4%.
        "wire_inter_node_bytes_per_iter": (wire_bytes / iters / layout.world_size
                                           if has_veth else None),
        "losses": losses,
        "max_rss_mib_rank0": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.bench_step",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", required=True, choices=SYSTEMS)
    parser.add_argument("--iters", type=int, default=3, help="timed iterations")
    parser.add_argument("--warmup", type=int, default=1, help="untimed iterations first")
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=16384)
    parser.add_argument("--global-batch-size", type=int, default=4,
                        help="sequences per iteration over all ranks")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="default: LOCAL_WORLD_SIZE from the launcher")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args(argv)


def ranks_per_node(args: argparse.Namespace) -> int:
    return args.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def resolve_layout(args: argparse.Namespace) -> ClusterShape:
    from zeropp.topology import ClusterShape  # after the counter is installed (see main)

    world = dist.get_world_size()
    per_node = ranks_per_node(args)
    if per_node < 1 or world % per_node:
        raise ValueError(f"ranks per node {per_node} must divide the world size {world}")
    if args.global_batch_size % world:
        raise ValueError(f"--global-batch-size {args.global_batch_size} must be a multiple "
                         f"of the world size {world}")
    if args.iters < 1 or args.warmup < 0:
        raise ValueError(f"--iters {args.iters} must be >= 1 and --warmup {args.warmup} >= 0")
    return ClusterShape(world, per_node)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        # Before anything imports the engine or DeepSpeed: they keep references to the
        # torch.distributed functions they call, made when they are imported or start.
        counter = CollectiveByteCounter(ranks_per_node(args)).install()
        layout = resolve_layout(args)
        shape = BenchShape(args.num_layers, args.hidden_size, args.num_attention_heads,
                           args.seq_length, args.vocab_size, args.global_batch_size)
        started = time.perf_counter()
        system = build_system(args.system, shape, layout)
        setup_s = time.perf_counter() - started
        result = measure(system, counter, shape, layout, args.iters, args.warmup, args.seed)
    except Exception as error:  # the launcher ends the other ranks; say why on stdout
        traceback.print_exc()
        message = f"{type(error).__name__}: {error}".splitlines()[0]
        print(RESULT_PREFIX + json.dumps({"system": args.system, "status": "error",
                                          "error": message}), flush=True)
        return 1
    if rank == 0:
        result.update(
            system=args.system, setup_s=setup_s, iters=args.iters, warmup=args.warmup,
            world_size=layout.world_size, ranks_per_node=layout.ranks_per_node,
            model=asdict(shape) | {"parameters": shape.gpt_config().num_parameters()},
            torch_version=torch.__version__,
        )
        print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    status = main()
    # Every rank is past the last barrier and rank 0 has printed the result: leave without
    # the process group's and the interpreter's C++ teardown, which now and then aborted a
    # finished rank ("terminate called without an active exception", seen with every
    # system), and the launcher then counted the whole run as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
