"""``--dry-run``: will this model fit, and what will cross the nodes, on a cluster you name?

    python pretrain_zeropp_gpt.py --num-layers 40 --hidden-size 6144 --num-attention-heads 32 \\
        --seq-length 512 --batch-size 1 --fp16 --checkpoint-activations \\
        --deepspeed_config configs/ds_zeropp_config.json \\
        --dry-run --dry-run-nodes 4 --dry-run-gpus-per-node 16

One process, no GPU, no process group: the GPT is built on the meta device (an 18B model in
about a second), its units are counted the way the engine groups them, and
``zeropp.planning.planner`` replays the engine's layout, prefetch and collectives for the planned
cluster. Printed: the parameter count, each GPU's memory by kind (parameters, gradients,
optimizer state, hpZ secondary shards, activations) against the GPU's memory, and the bytes
each GPU sends per iteration by phase and locality, for the ZeRO-3 baseline and for the
configured ZeRO++ side by side.

[Note: activation memory]
Megatron's estimate (Korthikanti et al., 2022) for one layer without recomputation is
s*b*h*(34 + 5*a*s/h) bytes with 16-bit activations: 11sbh + 5as^2b in attention, 19sbh in the
MLP, 4sbh in the two norms. ``layer_activation_bytes`` keeps that accounting term by term
for any shape (grouped-query keys and values are narrower, SwiGLU keeps its gate, its up
projection and their product, the MLP's width is F rather than 4h), so for GPT-2 shapes it
is exactly Megatron's formula. Selective recomputation (``--recompute-granularity
selective``) drops the 5as^2b of scores, softmax and dropout mask. With full recomputation
(``--checkpoint-activations``) only
each checkpointed chunk's input (2*s*b*h bytes) stays for the whole backward, plus one
chunk's full activations while it is recomputed. The logits add s*b*V*d bytes, and the fp32
loss two fp32 chunks of them at a time (at most 2 x 2**26 values: [Note: chunked
cross-entropy] in megatron_lite/model/gpt.py). With fp32 compute the 16-bit terms are
doubled. The estimate counts no allocator fragmentation, no
CUDA context and no communication buffers, so leave a few GiB of margin.

The simulated GPU cluster measures what the program allocates on meta tensors, where attention
and RMSNorm take their unfused paths (no flash attention, no fused norm): for 4 layers of
width 2048 at 2048 tokens, bf16, it measured 2.76 GiB of activations where this estimate says
2.74 for the GPT-2 shape, 3.07 against 2.79 for the Llama shape (the unfused RMSNorm keeps
fp32 intermediates) and 1.96 against 1.54 with selective recomputation (a recomputed
layer's scores are transiently materialized). On GPUs, flash attention and the fused norm
keep less than either.

[Note: comparison with the ZeRO++ tutorial]
For the tutorial's 18B on 4 x 16 V100-32GB, DeepSpeed reports a peak of 8.28 GB (ZeRO-3) and
10.26 GB (ZeRO++), 1.98 GB apart; this planner prints 11.25 and 13.36 GiB, the simulated GPU
cluster measures 10.34 and 12.39 GiB. The hpZ cost agrees: the 2*Psi/alpha secondary shards
(here the blocks' only, the root never has one). The totals differ because this engine
accumulates gradient shards in fp32 (DeepSpeed keeps 16-bit gradient partitions), and the
planner adds up the peak of every transient as if they coincided: the root's gradients
through the whole backward, the gradient buffers in flight and the one filling, a block
gathered next to one still being reduced. The measurement is what the program allocates,
with the buffers as they actually overlap.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass

import torch

from megatron_lite.arguments import (
    ArgumentError,
    gpt_config_from_args,
    validate_args,
)
from megatron_lite.ds_config import read_ds_config
from megatron_lite.model import GPTConfig, GPTModel, describe_count
from megatron_lite.model.gpt import LOSS_CHUNK_ELEMENTS
from zeropp.config import ConfigError, EngineConfig, ZeroConfig
from zeropp.planning.planner import (
    SystemPlan,
    plan_zero3_and_zeropp,
    unit_parameter_counts,
    zero3_baseline,
)
from zeropp.topology import ClusterShape, TopologyError

GIB = 1024**3
# Megatron's per-layer activation constant and checkpoint size assume 16-bit activations.
ACTIVATION_REFERENCE_BYTES = 2
PHASE_LABELS = {
    "forward_all_gather": "forward all-gather",
    "backward_all_gather": "backward all-gather",
    "gradient_reduce": "gradient reduce",
    "optimizer": "optimizer (norm all-reduce)",
}


@dataclass(frozen=True, kw_only=True)
class PlannedCluster(ClusterShape):
    """The cluster the dry run plans for (not the one it runs on): a shape and each GPU's
    memory."""

    gpu_memory_gib: float

    @property
    def gpu_memory_bytes(self) -> int:
        return int(self.gpu_memory_gib * GIB)


@dataclass(frozen=True)
class ActivationPlan:
    """Activation bytes per GPU for one micro-batch (see [Note: activation memory])."""

    kept_for_backward: int  # every layer's activations, or only the chunk inputs
    recomputed_chunk: int  # one chunk's full activations during its recompute (0 without)
    logits: int

    @property
    def total(self) -> int:
        return self.kept_for_backward + self.recomputed_chunk + self.logits


@dataclass(frozen=True)
class DryRunReport:
    """Everything ``--dry-run`` prints, as numbers."""

    num_parameters: int
    cluster: PlannedCluster
    micro_batch_size: int
    gradient_accumulation_steps: int
    seq_length: int
    dtype_name: str
    activations: ActivationPlan
    plans: tuple[SystemPlan, SystemPlan]  # (ZeRO-3, configured ZeRO++)
    # The DeepSpeed JSON as parsed (once): the simulated ZeRO-3 baseline is derived from it.
    ds_config: EngineConfig = dataclasses.field(repr=False)

    def total_bytes(self, plan: SystemPlan) -> int:
        """Peak per GPU: the larger of the forward's and the backward's (see MemoryPlan)."""
        activations = self.activations
        return plan.memory.peak(
            forward_activations=activations.kept_for_backward + activations.logits,
            backward_activations=activations.kept_for_backward + activations.recomputed_chunk,
        )

    def reserved_bytes(self, plan: SystemPlan) -> int:
        """``total_bytes`` and the side streams' allocator pools ([Note: allocation lanes])."""
        return self.total_bytes(plan) + plan.memory.stream_buffers

    def fits(self, plan: SystemPlan) -> bool:
        return self.total_bytes(plan) <= self.cluster.gpu_memory_bytes

    @property
    def inter_node_ratio(self) -> float:
        """ZeRO-3's inter-node bytes over ZeRO++'s (inf when ZeRO++ sends none)."""
        zero3, zeropp = (plan.comm_total("inter_node") for plan in self.plans)
        return zero3 / zeropp if zeropp else math.inf


# ---- inputs -------------------------------------------------------------------------------


def planned_cluster(args: argparse.Namespace) -> PlannedCluster:
    # Checked here, not only by validate_args: the world size it validates against comes
    # from these values.
    for flag, value in (("--dry-run-nodes", args.dry_run_nodes),
                        ("--dry-run-gpus-per-node", args.dry_run_gpus_per_node),
                        ("--ranks-per-node", args.ranks_per_node),
                        ("--dry-run-gpu-memory-gb", args.dry_run_gpu_memory_gb)):
        if value is not None and not value > 0:
            raise ArgumentError(f"{flag} {value} must be positive")
    named = named_cluster(args)
    gpus_per_node = (args.dry_run_gpus_per_node or args.ranks_per_node
                     or (named.ranks_per_node if named else 1))
    if named and named.ranks_per_node != gpus_per_node:
        raise ArgumentError(f"--dry-run-cluster {named.name} has {named.ranks_per_node} GPUs "
                            f"per node, the plan {gpus_per_node}; give --dry-run-gpus-per-node "
                            f"{named.ranks_per_node}")
    return PlannedCluster(world_size=args.dry_run_nodes * gpus_per_node,
                          ranks_per_node=gpus_per_node, gpu_memory_gib=args.dry_run_gpu_memory_gb)


def named_cluster(args: argparse.Namespace):
    """The built-in cluster (zeropp.planning.step_time.CLUSTERS) ``--dry-run-cluster`` names, or
    None."""
    from zeropp.planning.step_time import CLUSTERS

    name = getattr(args, "dry_run_cluster", None)
    if name is not None and name not in CLUSTERS:
        raise ArgumentError(f"--dry-run-cluster {name!r} is not a built-in cluster; "
                            f"choose one of {', '.join(CLUSTERS)}")
    return None if name is None else CLUSTERS[name]


def predicted_clusters(args: argparse.Namespace, ranks_per_node: int,
                       kernel_rates=None) -> list:
    """The clusters to predict the step time on: the one ``--dry-run-cluster`` names, else
    every built-in one with ``ranks_per_node`` GPUs per node; with ``kernel_rates``
    (``zeropp.planning.kernel_rates.MeasuredKernelRates``) their kernels run at the measured rates."""
    from zeropp.planning.step_time import CLUSTERS, with_kernel_rates

    named = named_cluster(args)
    clusters = ([named] if named is not None
                else [c for c in CLUSTERS.values() if c.ranks_per_node == ranks_per_node])
    if kernel_rates is not None:
        clusters = [with_kernel_rates(c, kernel_rates) for c in clusters]
    if getattr(args, "cuda_graph", False):
        # One graph launch per iteration ([Note: iteration graphs] in
        # zeropp/acceleration/cuda_graph.py):
        # the host no longer issues each kernel and collective.
        clusters = [dataclasses.replace(c, host_seconds_per_op=0.0) for c in clusters]
    return clusters


def measured_kernel_rates(args: argparse.Namespace):
    """The GPU check's kernel rates ``--dry-run-kernel-rates`` names, or None (raises
    ``zeropp.planning.kernel_rates.KernelRatesError``, a ValueError, with one line)."""
    from zeropp.planning.kernel_rates import load_kernel_rates

    path = getattr(args, "dry_run_kernel_rates", None)
    return None if path is None else load_kernel_rates(path)


def kernel_rate_lines(kernel_rates, clusters: list) -> list[str]:
    """Where the measured rates come from, and a note for each cluster whose GPUs' memory
    differs from the measured device's by more than 15% (the rates are used as measured)."""
    peak = kernel_rates.peak_memory_bandwidth
    lines = [f"  quantization kernels at the rates measured on {kernel_rates.device}"
             + (f" (peak {peak / 1e12:.2f} TB/s)" if peak else "")
             + f", from {kernel_rates.path}:"]
    lines += [f"    {op:<44} {rate / 1e9:8.0f} GB/s"
              for op, rate in sorted(kernel_rates.rates.items())]
    if kernel_rates.host_seconds_per_op:
        lines.append(f"  host cost {kernel_rates.host_seconds_per_op * 1e6:.1f} us per kernel or "
                     "collective, as measured there")
    if peak:
        for cluster in clusters:
            if abs(cluster.memory_bandwidth / peak - 1) > 0.15:
                lines.append(f"  note: {cluster.name}'s GPUs have "
                             f"{cluster.memory_bandwidth / 1e12:.2f} TB/s of memory bandwidth, "
                             f"the measured device {peak / 1e12:.2f} TB/s: rates used as measured")
    return lines


def zero_config(args: argparse.Namespace, ds_config: EngineConfig) -> ZeroConfig:
    """The ``zero_optimization`` block the engine would run: the file's, stage from the CLI
    (which ``read_ds_config`` has reconciled with the file)."""
    return dataclasses.replace(ds_config.zero_optimization, stage=args.zero_stage)


model_config = gpt_config_from_args


def tokenizer_vocab_size(args: argparse.Namespace) -> int:
    # Imported here: only the dry run needs a tokenizer in this module.
    from data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(args.tokenizer_type, vocab_file=args.vocab_file,
                                merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                                vocab_size=args.vocab_size)
    return tokenizer.vocab_size


# ---- arithmetic ---------------------------------------------------------------------------


def layer_activation_bytes(config: GPTConfig, seq_length: int, micro_batch: int) -> int:
    """One layer's activations kept for backward, 16-bit, without full recomputation:
    Megatron's s*b*h*(34 + 5*a*s/h) for GPT-2 shapes (see [Note: activation memory])."""
    s, b, h, a = seq_length, micro_batch, config.hidden_size, config.num_attention_heads
    queries = a * config.head_dim  # channels of the queries, and of the attention's output
    keys = config.num_key_value_heads * config.head_dim  # of the keys, and of the values
    f = config.ffn_hidden_size
    assert f is not None  # filled in by GPTConfig.__post_init__
    norms = 2 * 2 * h  # each norm's input
    # QKV input, queries and keys (for the scores), values, the output projection's input,
    # the residual dropout mask (1 byte per element)
    attention = 2 * h + 2 * (queries + keys) + 2 * keys + 2 * queries + h
    if not config.recompute_attention:
        attention_scores = 5 * a * s  # softmax output, dropout mask, dropout output
    else:
        attention_scores = 0
    if config.swiglu:
        # input, gate and up (2F wide), silu(gate), their product (the down projection's input),
        # the residual dropout mask
        mlp = 2 * h + 2 * 2 * f + 2 * f + 2 * f + h
    else:
        mlp = 2 * h + 2 * f + 2 * f + h  # input, GELU input, GELU output, dropout mask
    return s * b * (norms + attention + mlp + attention_scores)


def plan_activations(config: GPTConfig, seq_length: int, micro_batch: int,
                     dtype_bytes: int) -> ActivationPlan:
    scale = dtype_bytes / ACTIVATION_REFERENCE_BYTES
    per_layer = layer_activation_bytes(config, seq_length, micro_batch)
    # The logits, and the loss's fp32 working set: two chunks of its tokens at a time
    # ([Note: chunked cross-entropy]), not fp32 copies of all of them.
    logit_count = seq_length * micro_batch * config.padded_vocab_size
    logits = logit_count * dtype_bytes + 4 * min(logit_count, 2 * LOSS_CHUNK_ELEMENTS)
    if not config.checkpoint_activations:
        return ActivationPlan(int(config.num_layers * per_layer * scale), 0, logits)
    layer_input = ACTIVATION_REFERENCE_BYTES * seq_length * micro_batch * config.hidden_size
    if config.recompute_method == "block":
        # the first N layers keep only their inputs, one at a time recomputed; the rest all
        recomputed_layers = min(config.checkpoint_num_layers, config.num_layers)
        kept = (recomputed_layers * layer_input
                + (config.num_layers - recomputed_layers) * per_layer)
        return ActivationPlan(int(kept * scale), int(per_layer * scale), logits)
    chunk = min(config.checkpoint_num_layers, config.num_layers)
    chunks = math.ceil(config.num_layers / chunk)
    return ActivationPlan(int(chunks * layer_input * scale), int(chunk * per_layer * scale),
                          logits)


def build_report(args: argparse.Namespace) -> DryRunReport:
    """Validate ``args`` for the planned cluster, build the meta model, plan both systems."""
    cluster = planned_cluster(args)
    ds_config = read_ds_config(args)
    zero = zero_config(args, ds_config)
    validate_args(args, cluster.world_size)
    if args.zero_stage != 3 and cluster.world_size > 1:
        raise ArgumentError(f"--zero-stage {args.zero_stage} with {cluster.world_size} GPUs: "
                            "--dry-run plans ZeRO-3 and ZeRO++; use --zero-stage 3")
    with torch.device("meta"):
        model = GPTModel(model_config(args, tokenizer_vocab_size(args)))
    dtype_bytes = 4 if args.params_dtype == torch.float32 else 2
    plans = plan_zero3_and_zeropp(
        unit_parameter_counts(model, zero=zero), cluster.world_size, cluster.ranks_per_node, zero,
        dtype_bytes, args.gradient_accumulation_steps)
    return DryRunReport(
        num_parameters=model.num_parameters(),
        cluster=cluster,
        micro_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        seq_length=args.seq_length,
        dtype_name=str(args.params_dtype).removeprefix("torch."),
        activations=plan_activations(model.config, args.seq_length, args.micro_batch_size,
                                     dtype_bytes),
        plans=plans,
        ds_config=ds_config,
    )


# ---- output -------------------------------------------------------------------------------


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def _row(label: str, values: list[str]) -> str:
    return f"  {label:<38}" + "".join(f"{value:>13}" for value in values)


def _system_options(plan: SystemPlan) -> str:
    zero = plan.zero
    parts = []
    deltas = zero.zero_quantized_weight_deltas
    if deltas:
        parts.append(f"weight deltas int{zero.zero_quantized_weight_deltas_bits}")
    elif zero.zero_quantized_weights:
        parts.append(f"qwZ int{zero.zero_quantized_weights_bits}")
    if zero.zero_hpz_partition_size > 1:
        int8 = zero.zero_quantized_weights and zero.zero_hpz_quantized_secondary
        kept = " (bases kept)" if deltas else (" (int8 secondary)" if int8 else "")
        parts.append(f"hpZ {zero.zero_hpz_partition_size}{kept}")
    if zero.zero_quantized_gradients:
        inter = zero.zero_quantized_gradients_inter_node_bits
        narrower = inter not in (None, zero.zero_quantized_gradients_bits)
        across = f" (int{inter} across nodes)" if narrower else ""
        parts.append(f"qgZ int{zero.zero_quantized_gradients_bits}{across}")
    return f"{plan.name}: " + (", ".join(parts) if parts else "no ZeRO++ option on")


def memory_lines(report: DryRunReport) -> list[str]:
    plans = report.plans
    memories = [plan.memory for plan in plans]
    activations = report.activations
    rows = [
        ("parameters: own shard", [m.working_shards for m in memories]),
        ("parameters: gathered units (peak)", [m.gathered_parameters for m in memories]),
        ("gradients: shards", [m.gradient_shards for m in memories]),
        ("gradients: unit buffers (transient)", [m.gradient_buffers for m in memories]),
        ("optimizer: fp32 master + Adam moments",
         [m.fp32_master_shards + m.optimizer_moments for m in memories]),
        ("hpZ secondary shards", [m.hpz_secondary_shards for m in memories]),
        ("qgZ error feedback (int4 errors)", [m.error_feedback for m in memories]),
        ("activations: kept for backward", [activations.kept_for_backward] * 2),
        ("activations: recomputed chunk", [activations.recomputed_chunk] * 2),
        ("activations: logits and loss", [activations.logits] * 2),
    ]
    offloaded = memories[1].host_model_states > 0
    if offloaded:  # [Note: offload]: these rows are in host memory, not in the peak
        rows.insert(0, ("in host memory (ZeRO-Offload): states", [m.host_model_states
                                                                  for m in memories]))
    lines = [_row("per-GPU memory (GiB)", [plan.name for plan in plans])]
    lines += [_row(label, [_gib(v) for v in values]) for label, values in rows]
    lines.append(_row("peak (larger of forward and backward)",
                      [_gib(report.total_bytes(plan)) for plan in plans]))
    lines.append(_row("reserved, with the stream pools",
                      [_gib(report.reserved_bytes(plan)) for plan in plans]))
    verdicts = ["fits" if report.fits(plan) else "does NOT fit" for plan in plans]
    lines.append(_row(f"vs GPU memory {report.cluster.gpu_memory_gib:g} GiB", verdicts))
    increase = report.total_bytes(plans[1]) - report.total_bytes(plans[0])
    lines.append(f"  ZeRO++ over ZeRO-3: {increase / GIB:+.2f} GiB per GPU, of which hpZ "
                 f"secondary shards {memories[1].hpz_secondary_shards / GIB:.2f} GiB")
    if offloaded:
        ranks = report.cluster.ranks_per_node
        host = [m.host_bytes for m in memories]
        lines.append(f"  host memory (ZeRO-Offload), ZeRO-3 / ZeRO++: {_gib(host[0])} / "
                     f"{_gib(host[1])} GiB per GPU, {_gib(host[0] * ranks)} / "
                     f"{_gib(host[1] * ranks)} GiB per node of {ranks}")
        pcie = [(plan.pcie["to_host"], plan.pcie["to_device"]) for plan in plans]
        lines.append("  PCIe per GPU per iteration, to host + to device, ZeRO-3 / ZeRO++: "
                     + " / ".join(f"{_gib(a)} + {_gib(b)} GiB" for a, b in pcie))
    # [Note: asynchronous checkpoint saves]: the staging buffers hold each rank's fp32 master
    # shards and moments, pinned host memory, never GPU memory (so not in the peak above).
    staging = memories[1].fp32_master_shards + memories[1].optimizer_moments
    lines.append(f"  --async-save stages {staging / GIB:.2f} GiB of host (pinned) memory per "
                 "rank: its fp32 master shards and Adam moments, kept for every save")
    return lines


def communication_lines(report: DryRunReport) -> list[str]:
    zero3, zeropp = report.plans
    lines = [_row("sent per GPU per iteration (GiB)", [zero3.name, "", zeropp.name, ""]),
             _row("", ["intra-node", "inter-node"] * 2)]
    for phase, label in PHASE_LABELS.items():
        values = [plan.comm[phase][locality] for plan in report.plans
                  for locality in ("intra_node", "inter_node")]
        lines.append(_row(label, [_gib(v) for v in values]))
    totals = [plan.comm_total(locality) for plan in report.plans
              for locality in ("intra_node", "inter_node")]
    lines.append(_row("total", [_gib(v) for v in totals]))
    ratio = report.inter_node_ratio
    shown = "ZeRO++ sends nothing across nodes" if math.isinf(ratio) else f"{ratio:.2f}x"
    if report.cluster.num_nodes == 1:
        shown = "one node: nothing crosses nodes"
    lines.append(f"  inter-node volume, ZeRO-3 / ZeRO++: {shown}")
    return lines


def render(report: DryRunReport) -> str:
    cluster = report.cluster
    tokens_per_gpu = report.micro_batch_size * report.seq_length
    lines = [
        f"number of parameters: {describe_count(report.num_parameters)}",
        f"planned cluster: {cluster.num_nodes} node(s) x {cluster.ranks_per_node} GPUs = "
        f"{cluster.world_size} GPUs of {cluster.gpu_memory_gib:g} GiB",
        f"per GPU: micro batch {report.micro_batch_size} x seq {report.seq_length} = "
        f"{tokens_per_gpu:,} tokens per micro-batch, {report.gradient_accumulation_steps} "
        f"micro-batch(es) per iteration, {report.dtype_name} compute",
        *(f"  {_system_options(plan)}" for plan in report.plans),
        "",
        *memory_lines(report),
        "",
        *communication_lines(report),
    ]
    return "\n".join(line.rstrip() for line in lines)


# ---- measured on the simulated GPU cluster --------------------------------------------------

MEASURED_ROWS = (
    ("model states", "model states (shards, fp32, Adam)"),
    ("gathered weights", "gathered units"),
    ("hpZ secondary shards", "hpZ secondary shards"),
    ("gradients in flight", "gradient buffers in flight"),
    ("quantization buffers", "quantization buffers"),
    ("activations", "activations and autograd's gradients"),
)


def baseline_ds_config(ds_config: EngineConfig) -> dict:
    """The user's DeepSpeed JSON (as ``read_ds_config`` parsed it) with qwZ, hpZ, qgZ and
    weight deltas off: the ZeRO-3 run to compare, as JSON for the simulated rank to read."""
    zero = dataclasses.replace(zero3_baseline(ds_config.zero_optimization),
                               stage=ds_config.zero_optimization.stage)
    return dataclasses.replace(ds_config, zero_optimization=zero).explicit_dict()


def simulate_plans(argv: list[str], report: DryRunReport) -> list:
    """Rank 0 of the planned cluster, run for real on meta tensors, for each planned system.

    Each run is the training program, given the DeepSpeed JSON as the dry run parsed it
    (``report.ds_config``, written for it to read; for the baseline with ZeRO++ off): the
    user's file is read once per dry run."""
    from megatron_lite.simulate import simulate_rank

    cluster = report.cluster
    zero3, configured = report.plans

    def measure(ds_config: dict, label: str):
        return simulate_rank(argv, 0, cluster.num_nodes, cluster.ranks_per_node, save_dir=None,
                             ds_config=ds_config, trace=True, label=label)

    baseline = measure(baseline_ds_config(report.ds_config), zero3.name)
    if dataclasses.replace(configured.zero, stage=3) == zero3.zero:
        return [baseline, baseline]
    return [baseline, measure(report.ds_config.explicit_dict(), configured.name)]


def predicted_lines(report: DryRunReport, measurements: list, clusters: list,
                    kernel_rates=None) -> list[str]:
    """Seconds per iteration and TFLOPs per GPU of each plan's traced iteration, replayed on
    each cluster by zeropp.planning.step_time.predict (datasheet rates, or the measured kernel rates
    where given; see its notes)."""
    from zeropp.planning.step_time import predict

    header = [label for plan in report.plans for label in (f"{plan.name} s", "TFLOPs")]
    lines = [_row("predicted per iteration, per GPU", header)]
    by_system: dict[str, list] = {plan.name: [] for plan in report.plans}
    for cluster in clusters:
        cells = []
        for plan, measurement in zip(report.plans, measurements, strict=True):
            p = predict(measurement.trace, cluster)
            cells += [f"{p.seconds:.3g}", f"{p.tflops_per_gpu:.1f}"]
            by_system[plan.name].append((cluster, p))
        lines.append(_row(f"  {cluster.name}", cells))
    host_lines = [host_line(system, predictions) for system, predictions in by_system.items()
                  if predictions]
    if not clusters:
        lines.append(f"  no built-in cluster has {report.cluster.ranks_per_node} GPUs per node; "
                     "name one with --dry-run-cluster")
    lines.append("  replay of rank 0's traced iteration (zeropp.planning.step_time) with datasheet "
                 "rates and assumed efficiencies: a comparison, not a promise")
    if host_lines:
        lines.append("  the host issuing the iteration ([Note: host in the step-time model]):")
        lines += host_lines
    if kernel_rates is not None:
        lines += kernel_rate_lines(kernel_rates, clusters)
    return lines


def host_line(system: str, predictions: list) -> str:
    """The host's work for one system (the same trace on every cluster) against the GPU's
    compute on each cluster, and where the host sets the pace."""
    cluster, p = predictions[0]
    costs = {c.host_seconds_per_op for c, _ in predictions}
    cost = (f"{cluster.host_seconds_per_op * 1e6:.1f} us each" if len(costs) == 1
            else "each cluster's host cost")
    bound = [c.name for c, q in predictions if q.host_bound]
    fastest = min(q.compute_busy_seconds for _, q in predictions)
    verdict = (f"HOST-BOUND on {', '.join(bound)}: the GPU waits for the host" if bound
               else f"the GPU sets the pace (its compute, {fastest:.3g} s or more, hides it)")
    return (f"    {system}: {p.host_ops:,} kernels and collectives per iteration, "
            f"{p.host_issue_seconds:.3g} s of host time at {cost}, {p.host_syncs} host "
            f"sync(s); {verdict}" + offload_note(predictions))


def offload_note(predictions: list) -> str:
    """The offloaded step's host work and PCIe copies on each cluster ([Note: offload in the
    step-time model]); empty without offload."""
    cells = [f"{c.name} {q.host_step_seconds:.3g} s on the host, "
             f"{q.pcie_seconds.get('to_host', 0):.3g} s to it, "
             f"{q.pcie_seconds.get('to_device', 0):.3g} s back"
             for c, q in predictions if q.host_step_seconds or q.pcie_seconds]
    return ("; ZeRO-Offload: " + "; ".join(cells)) if cells else ""


def measured_lines(report: DryRunReport, measurements: list) -> list[str]:
    lines = [_row("measured peak per GPU (GiB)", [plan.name for plan in report.plans])]
    for category, label in MEASURED_ROWS:
        values = [m.peak_by_category.get(category, 0) for m in measurements]
        if any(values):
            lines.append(_row(f"  {label}", [_gib(v) for v in values]))
    lines.append(_row("peak, measured", [_gib(m.peak_bytes) for m in measurements]))
    planned = [report.total_bytes(plan) for plan in report.plans]
    lines.append(_row("peak, planned (above)", [_gib(v) for v in planned]))
    lines.append(_row("planned vs measured",
                      [f"{p / m.peak_bytes - 1:+.1%}" for p, m in zip(planned, measurements,
                                                                       strict=True)]))
    # [Note: allocation lanes]: what CUDA's caching allocator holds with each stream's pool
    # at its own peak; it frees cached blocks before failing, so the fit is the allocated peak's.
    lines.append(_row("reserved, stream pools", [_gib(m.reserved_peak_bytes)
                                                 for m in measurements]))
    lines.append(_row("reserved, planned (above)", [_gib(report.reserved_bytes(plan))
                                                    for plan in report.plans]))
    verdicts = ["fits" if m.peak_bytes <= report.cluster.gpu_memory_bytes else "does NOT fit"
                for m in measurements]
    lines.append(_row(f"measured vs GPU memory {report.cluster.gpu_memory_gib:g} GiB", verdicts))
    seconds = sum({id(m): m.seconds for m in measurements}.values())
    lines.append(f"  rank 0 of {report.cluster.world_size} on the simulated GPU cluster "
                 f"(meta tensors, 3 iterations, {seconds:.0f} s); no allocator fragmentation, "
                 "CUDA context or NCCL buffers: leave a few GiB")
    return lines


def run_dry_run(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Print the plan for ``args`` and return the exit status (0, 2 for usage errors, else 1).

    Call it right after ``parse_args``, before any process group exists. With
    ``--dry-run-simulate`` (the default) ``argv``, the command line ``args`` came from, is
    also run as rank 0 of the planned cluster on the simulated GPU cluster.
    """
    try:
        if args.dry_run_cluster is not None and not args.dry_run_simulate:
            raise ArgumentError(f"--dry-run-cluster {args.dry_run_cluster} predicts from the "
                                "simulated rank's iteration; drop --no-dry-run-simulate")
        if getattr(args, "dry_run_kernel_rates", None) is not None and not args.dry_run_simulate:
            raise ArgumentError("--dry-run-kernel-rates predicts from the simulated rank's "
                                "iteration; drop --no-dry-run-simulate")
        # Read now: a bad file should fail before minutes of simulation, not after them.
        kernel_rates = measured_kernel_rates(args)
        report = build_report(args)
    except (ArgumentError, ConfigError, TopologyError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    print(render(report), flush=True)
    if args.dry_run_simulate:
        argv = list(sys.argv[1:] if argv is None else argv)
        print("", flush=True)
        measurements = simulate_plans(argv, report)
        print("\n".join(measured_lines(report, measurements)), flush=True)
        clusters = predicted_clusters(args, report.cluster.ranks_per_node, kernel_rates)
        print("", flush=True)
        print("\n".join(predicted_lines(report, measurements, clusters, kernel_rates)),
              flush=True)
        if getattr(args, "cuda_graph", False):
            print("  --cuda-graph: the iteration is replayed as one CUDA graph, so the host's "
                  "cost per kernel and collective is taken as 0", flush=True)
    return 0
