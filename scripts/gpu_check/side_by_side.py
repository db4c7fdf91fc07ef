"""One GPU, side by side: this engine, FSDP2 and DeepSpeed ZeRO-3 on the same GPT, one run.

Systems, each in a subprocess of its own with a time limit (one OOM or failure does not stop
the others), one process per system on the one GPU (world size 1):

    zeropp_compiled   this engine, ZeRO-3 (zeropp.build_engine), with compiled
                      blocks (engine.compile(): [Note: compiled blocks])
    fsdp2_compiled    torch.distributed.fsdp.fully_shard on every block, then the root,
                      MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), each
                      block's forward compiled before sharding, as the engine compiles it
                      (hooks eager, the block's arithmetic compiled)
    deepspeed_zero3   DeepSpeed 0.19.8 ZeRO-3, bf16, with torch's AdamW as client optimizer
    zeropp_eager      this engine, eager blocks
    fsdp2_eager       FSDP2, eager blocks

The same for all: this project's GPT (megatron_lite.model.GPTModel) with GPT-3 XL's shape
(24 layers, hidden 2048, 16 heads, sequence 2048, GPT-2 vocabulary: 1.32B parameters,
learned positions, tied head, dropout 0), the same initial values (the model's init rules,
drawn on the device from one generator per parameter: ``initial_values``), bf16 compute with fp32 master
weights, AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1 on matrices only),
gradient clipping 1.0, no activation checkpointing, the same micro-batch (8 sequences:
16,384 tokens a step), and the same data: two batches of random token ids from a fixed
seed, alternated, so the loss falls fast (memorization) and a wrong system shows.

Reported per system: tokens/s over the steady steps, MFU (Megatron's FLOPs per token,
``megatron_lite.model.flops_per_token`` without recomputation, over the device's dense bf16
peak from ``PEAK_BF16_TFLOPS`` by device name: stated in the output), peak memory allocated
and reserved, the loss at every step (the last one is the check: the issue asks the three
to agree to 1% after 20 steps), the first step's time and, for compiled systems, the compile
time dynamo measured; which SDPA kernel the attention shape selects. One JSON (``--out``)
and a table printed last.

Budget (default run, one H100/H200): each system takes 20 steps (3 warm-up, 10 timed, the
rest only for the loss check). A step is 16K tokens, 0.146 PFLOP by Megatron's count
(8.9 GFLOP a token): on an H100 (989 TFLOP/s) 0.37 s at 40% MFU, 1.5 s at 10%, so 7-30 s
of steps. The rest is fixed cost: ~10 s for Python, torch and CUDA, ~2 s to draw the
initial values on the device, ~40-60 s for inductor to compile one block's forward and
backward (the run starts from an empty inductor cache; the second compiled system may reuse
kernels the first one built, which the JSON says, and ``--separate-compile-caches`` gives
each its own), ~20 s of DeepSpeed start-up. About 25-50 s per eager system and 80-100 s per
compiled one: 4-6 minutes for all five. Each system is stopped after ``--system-timeout``
(200 s); none starts once ``--budget`` (420 s) leaves it less than it needs (100 s for a
compiled system, 60 s for another), so with the wheels' install and the machine's start the
call stays within 8 minutes of device time; the systems run in the order above, the
targets' comparisons first. The JSON is rewritten after every system, and SIGTERM (a
caller's time limit) stops the running system's worker and writes what finished.

The GPU machine has no network and no DeepSpeed. Its wheels travel in ``.whl_ds/`` (ignored
by git; ``bash scripts/gpu_check/wheels.sh`` prepares it on a machine with a registry:
deepspeed 0.19.8 built with
``DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation deepspeed==0.19.8``, and hjson,
pydantic, pydantic-core (cp312 manylinux x86_64), annotated-types, typing-inspection and
typing-extensions downloaded with ``pip download --no-deps --only-binary=:all:``; the image
has numpy, packaging, psutil, py-cpuinfo, tqdm, msgpack, ninja, einops and torch). The
device call carries ``.whl_ds`` and runs, from the repository root:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl_ds/*.whl && \\
    export PYTHONPATH=/tmp/site && \\
    python3 -m scripts.gpu_check.side_by_side --out $OUT/side_by_side.json

Only the DeepSpeed subprocess imports deepspeed; without it that system reports the import
error and the others run.

``--cpu-smoke``: the same code on a tiny GPT on the CPU (gloo, world size 1), compiled
systems with dynamo's ``aot_eager`` backend (inductor's C++ compile takes minutes on two
cores), DeepSpeed with its CPU accelerator; a test of the suite runs it
(tests/test_gpu_side_by_side.py) so the script cannot rot between GPU sessions.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from scripts.gpu_check.report import sigterm_raises, write_json_atomically

# In the order they run: what the targets compare first (this engine compiled against
# FSDP2 compiled and DeepSpeed), so a run cut short by its budget still answers them.
SYSTEMS = ("zeropp_compiled", "fsdp2_compiled", "deepspeed_zero3", "zeropp_eager",
           "fsdp2_eager")
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets, matched
# by a substring of torch.cuda.get_device_name(); the first match wins.
PEAK_BF16_TFLOPS = (
    ("GH200", 989.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0),
    ("H100", 989.0), ("B200", 2250.0), ("A100", 312.0), ("L40S", 362.0), ("A10G", 70.0),
    ("L4", 121.0),
)
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0
DATA_SEED, DISTINCT_BATCHES = 1234, 2


@dataclass(frozen=True)
class RunShape:
    """What every system runs: model shape, batch and step counts."""

    num_layers: int = 24
    hidden_size: int = 2048
    num_attention_heads: int = 16
    seq_length: int = 2048
    vocab_size: int = 50257
    micro_batch: int = 8
    warmup_steps: int = 3
    timed_steps: int = 10
    loss_steps: int = 20
    compile_backend: str = "inductor"
    device: str = "cuda"

    @property
    def total_steps(self) -> int:
        return max(self.warmup_steps + self.timed_steps, self.loss_steps)

    def gpt_config(self):
        from megatron_lite.model import GPTConfig

        return GPTConfig(num_layers=self.num_layers, hidden_size=self.hidden_size,
                         num_attention_heads=self.num_attention_heads,
                         vocab_size=self.vocab_size, max_position_embeddings=self.seq_length,
                         hidden_dropout=0.0, attention_dropout=0.0, seed=DATA_SEED)


CPU_SMOKE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                 vocab_size=255, micro_batch=2, warmup_steps=1, timed_steps=2, loss_steps=4,
                 compile_backend="aot_eager", device="cpu")


# ---- the systems: build, then one training step returning the loss as a device tensor ----


def _batches(shape: RunShape, device):
    import torch

    generator = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.randint(0, shape.vocab_size, (DISTINCT_BATCHES, shape.micro_batch,
                                                 shape.seq_length + 1), generator=generator)
    return [(t[:, :-1].to(device), t[:, 1:].to(device)) for t in tokens]


def initial_values(model, device):
    """``name -> fp32 value`` drawn on ``device``: the same for every system. The model's
    rules (normal with its std, or a constant), one generator per parameter seeded by the
    model's seed and the name; the model's own ``initial_value`` draws the same rules on the
    host, 30 s for 1.3B values, per system."""
    import torch

    def value(name: str) -> torch.Tensor:
        rule = model._init_rules[name]
        if rule.std is None:
            return torch.full(rule.shape, rule.constant, dtype=torch.float32, device=device)
        generator = torch.Generator(device=device)
        generator.manual_seed(model.config.seed * 1_000_003 + zlib.crc32(name.encode()))
        drawn = torch.empty(rule.shape, dtype=torch.float32, device=device)
        return drawn.normal_(0.0, rule.std, generator=generator)

    return value


def _gpt(shape: RunShape, device=None):
    """The GPT on the meta device, or materialized on ``device`` with ``initial_values``."""
    import torch

    from megatron_lite.model import GPTModel

    with torch.device("meta"):
        model = GPTModel(shape.gpt_config())
    if device is not None:
        model.to_empty(device=device)
        value = initial_values(model, device)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(value(name))
    return model


def _loss(logits, labels):
    import torch

    from megatron_lite.model import lm_loss

    return lm_loss(logits, labels, torch.ones_like(labels))


def _parameter_groups(model) -> list[dict]:
    """Megatron's groups, as the engine builds them: decay on matrices, none on the rest."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}]


def _adamw_options(device) -> dict[str, Any]:
    # torch's fused AdamW on CUDA (as the engine steps its shards there); foreach on the CPU.
    fused = device.type == "cuda"
    return {"lr": LR, "betas": BETAS, "eps": EPS, "fused": fused, "foreach": not fused}


def _compile_forward(module, backend: str) -> None:
    """Compile ``module.forward`` (an instance attribute): its hooks stay eager."""
    import torch

    module.forward = torch.compile(module.forward, backend=backend)


class ZeroppSystem:
    def __init__(self, shape: RunShape, device, compiled: bool) -> None:
        import torch

        from zeropp.deepspeed_api.initialize import build_engine

        model = _gpt(shape)
        self.engine = build_engine(model, lr=LR, betas=BETAS, eps=EPS,
                                   weight_decay=WEIGHT_DECAY, dtype=torch.bfloat16,
                                   gradient_clipping=CLIP, device=device,
                                   param_init_fn=initial_values(model, device))
        if compiled:
            self.engine.compile(shape.compile_backend)

    def step(self, inputs, labels):
        loss = _loss(self.engine(inputs), labels)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def compile_seconds(self) -> float | None:
        blocks = self.engine.compiled_blocks
        return None if blocks is None else blocks.first_compile_seconds


class Fsdp2System:
    def __init__(self, shape: RunShape, device, compiled: bool) -> None:
        import torch
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = _gpt(shape, device)  # fp32
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            if compiled:
                _compile_forward(layer, shape.compile_backend)
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        self.model = model
        self.optimizer = torch.optim.AdamW(_parameter_groups(model), **_adamw_options(device))
        self._timers = _compile_timer_snapshot() if compiled else None

    def step(self, inputs, labels):
        import torch

        loss = _loss(self.model(inputs), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def compile_seconds(self) -> float | None:
        if self._timers is None:
            return None
        from zeropp.acceleration.compiled_blocks import compile_timers

        now = compile_timers()
        return sum(now.values()) - sum(self._timers.values())


class DeepSpeedSystem:
    NOTE = ("DeepSpeed 0.19.8's engine casts the fp32 model to bf16 "
            "(_cast_module_mixed_precision) before ZeRO-3 makes its fp32 masters, so its masters "
            "should start as the bf16-rounded initial values (the others: fp32); read in its "
            "source, not measured")

    def __init__(self, shape: RunShape, device, compiled: bool) -> None:
        import deepspeed  # only this subprocess imports it
        import deepspeed.ops
        import torch

        if device.type == "cpu":
            # DeepSpeed's CPU backend would JIT-build a shared-memory all-reduce it never
            # uses in training; its own switch skips that build. (Reading the switch probes
            # every op builder, seconds of compiler runs: on CUDA it is left alone, where
            # that op is not built anyway.)
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        model = _gpt(shape, device)  # fp32: DeepSpeed casts and partitions it
        # The tied head reads the embedding table outside the embedding's forward: ZeRO-3
        # must gather it around the root too (DeepSpeed's documented API).
        deepspeed.zero.register_external_parameter(model, model.embedding.word_embeddings.weight)
        config = {
            "train_micro_batch_size_per_gpu": shape.micro_batch,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "overlap_comm": True},
            "zero_allow_untested_optimizer": True,  # torch's AdamW as the client optimizer
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
        optimizer = torch.optim.AdamW(_parameter_groups(model), **_adamw_options(device))
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                    config=config, dist_init_required=False)

    def step(self, inputs, labels):
        loss = _loss(self.engine(inputs), labels)
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def compile_seconds(self) -> None:
        return None


def _compile_timer_snapshot() -> dict[str, float]:
    from zeropp.acceleration.compiled_blocks import compile_timers

    return compile_timers()


def build_system(name: str, shape: RunShape, device):
    compiled = name.endswith("_compiled")
    if name.startswith("zeropp"):
        return ZeroppSystem(shape, device, compiled)
    if name.startswith("fsdp2"):
        return Fsdp2System(shape, device, compiled)
    if name == "deepspeed_zero3":
        return DeepSpeedSystem(shape, device, compiled)
    raise ValueError(f"unknown system {name!r}; expected one of {', '.join(SYSTEMS)}")


# ---- one system in this process ------------------------------------------------------------


def _init_world_of_one(device_type: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if device_type == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sdpa_backend(shape: RunShape, device) -> str:
    """Which kernel scaled_dot_product_attention picks for the model's attention shape."""
    import torch

    if device.type != "cuda":
        return "math (CPU)"
    heads = shape.num_attention_heads
    head_dim = shape.hidden_size // heads
    # As the model calls it: q, k and v are transposed views of one QKV projection's output,
    # which require grad (the flash kernel's choice reads strides and the backward).
    qkv = torch.empty(shape.micro_batch, shape.seq_length, 3 * heads * head_dim,
                      dtype=torch.bfloat16, device=device, requires_grad=True)
    q, k, v = (part.view(shape.micro_batch, shape.seq_length, heads, head_dim).transpose(1, 2)
               for part in qkv.split(heads * head_dim, dim=2))
    try:
        choice = torch._fused_sdp_choice(q, k, v, is_causal=True)
        return torch.nn.attention.SDPBackend(choice).name
    except (AttributeError, RuntimeError, TypeError, ValueError) as error:  # private API
        return f"unknown ({type(error).__name__})"


def _compiled_graphs() -> int:
    """How many graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def run_one(name: str, shape: RunShape) -> dict[str, Any]:
    """Build ``name``, train ``shape.total_steps`` steps, measure (in this process)."""
    import torch

    device = torch.device(shape.device)
    _init_world_of_one(device.type)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    started = time.perf_counter()
    system = build_system(name, shape, device)
    built = time.perf_counter()
    batches = _batches(shape, device)
    if cuda:
        # FSDP2 and DeepSpeed build the fp32 model on the GPU first: its cached blocks
        # would count as reserved memory of the training.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    losses = []
    sync()
    first_start = time.perf_counter()
    timed_start = timed_end = None
    for step in range(shape.total_steps):
        if step == shape.warmup_steps:
            sync()
            graphs_before = _compiled_graphs()
            timed_start = time.perf_counter()
        inputs, labels = batches[step % len(batches)]
        losses.append(system.step(inputs, labels))
        if step == 0:
            sync()
            first_step = time.perf_counter() - first_start
        if step == shape.warmup_steps + shape.timed_steps - 1:
            sync()
            timed_end = time.perf_counter()
            graphs_after = _compiled_graphs()
    loss_values = [float(v) for v in torch.stack(losses).float().cpu()]
    step_seconds = (timed_end - timed_start) / shape.timed_steps
    tokens_per_step = shape.micro_batch * shape.seq_length
    result = {
        "system": name,
        "status": "ok",
        "build_seconds": built - started,
        "first_step_seconds": first_step,
        "compile_seconds": system.compile_seconds(),
        "step_seconds": step_seconds,
        "tokens_per_second": tokens_per_step / step_seconds,
        # dynamo graphs compiled during the timed steps (0 expected: a recompile there is
        # compile time counted as training)
        "graphs_compiled_in_timed_steps": graphs_after - graphs_before,
        "losses": loss_values,
        "final_loss": loss_values[-1],
        "sdpa_backend": _sdpa_backend(shape, device),
        "note": getattr(system, "NOTE", None),
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
    }
    if cuda:
        result["peak_memory_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_memory_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return result


# ---- the run: every system in a subprocess, then the JSON and the table -------------------


def peak_for(device_name: str) -> tuple[float | None, str]:
    """(dense bf16 peak TFLOP/s or None, where it came from) for a CUDA device name."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops, f"table: {key} dense bf16 {tflops:g} TFLOP/s"
    return None, f"{device_name} is not in the peak table: MFU not computed"


def _run_in_subprocess(name: str, shape: RunShape, timeout: float, smoke: bool,
                       inductor_cache: str | None) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        result_path = Path(scratch) / "result.json"
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   TORCHINDUCTOR_CACHE_DIR=inductor_cache or str(Path(scratch) / "inductor"))
        if smoke:
            env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        command = [sys.executable, "-m", "scripts.gpu_check.side_by_side", "--worker", name,
                   "--worker-shape", json.dumps(asdict(shape)), "--worker-out", str(result_path)]
        root = Path(__file__).resolve().parents[2]
        started = time.perf_counter()
        # A session of its own: on a timeout the worker and its compile workers all stop.
        worker = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            log, _ = worker.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(worker)
            log, _ = worker.communicate()
            return {"system": name, "status": f"timeout after {timeout:.0f} s",
                    "log_tail": log[-3000:]}
        except BaseException:  # Stopped (SIGTERM), Ctrl-C: the worker must not outlive us
            _stop(worker)
            try:
                worker.wait(timeout=30)  # gone, and reaped, before the report says so
            except subprocess.TimeoutExpired:
                pass
            raise
        wall = time.perf_counter() - started
        if result_path.exists():
            result = json.loads(result_path.read_text())
        else:
            result = {"system": name, "status": f"exited {worker.returncode} without a result"}
        result["wall_seconds"] = wall
        if result.get("status") != "ok":
            result["log_tail"] = log[-3000:]
        return result


def _stop(worker: subprocess.Popen) -> None:
    """Kill a worker and its compile workers (a session of their own)."""
    try:
        os.killpg(worker.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended by itself meanwhile
        pass


class Stopped(Exception):
    """SIGTERM reached the run (the device call's time limit, say)."""


def _minimum_seconds(name: str, smoke: bool) -> float:
    """The least time left to start a system: a compiled one spends 40-60 s compiling
    before its first step on a GPU, an eager one 20-40 s starting up and stepping."""
    if smoke:
        return 30.0
    return 100.0 if name.endswith("_compiled") else 60.0


def run_all(shape: RunShape, systems: list[str], system_timeout: float, budget: float,
            smoke: bool, separate_compile_caches: bool = False,
            on_update: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every system in turn, in a subprocess of its own; ``on_update`` gets the report after
    each (so a run stopped by SIGTERM, raising ``Stopped``, still leaves what finished)."""
    from megatron_lite.model import GPTModel, flops_per_token

    config = shape.gpt_config()
    import torch

    with torch.device("meta"):
        parameters = sum(p.numel() for p in GPTModel(config).parameters())
    flops = flops_per_token(config, shape.seq_length, checkpoint_activations=False)
    report: dict[str, Any] = {
        # the device as the workers saw it (this process leaves the GPU alone)
        "device": None, "peak_bf16_tflops": None, "peak_source": None,
        "shape": asdict(shape), "parameters": parameters, "flops_per_token": flops,
        "mfu_formula": "tokens/s x megatron_lite.model.flops_per_token (Megatron's, 3 passes) "
                       "/ dense bf16 peak",
        "torch": torch.__version__,
        "inductor_cache": "one per system, empty" if separate_compile_caches else
        "one for the run, empty at its start: a later compiled system may reuse the kernels "
        "an earlier one built (its compile time is then shorter)",
        "systems": {},
    }
    shared_cache = tempfile.TemporaryDirectory(prefix="side_by_side_inductor_")
    deadline = time.perf_counter() + budget
    try:
        for name in systems:
            left = deadline - time.perf_counter()
            if left < _minimum_seconds(name, smoke):
                report["systems"][name] = {
                    "system": name, "status": f"skipped: {max(left, 0):.0f} s of the budget left"}
                continue
            print(f"[side-by-side] {name} ...", flush=True)
            result = _run_in_subprocess(name, shape, min(system_timeout, left), smoke,
                                        None if separate_compile_caches else shared_cache.name)
            report["systems"][name] = result
            print(f"[side-by-side] {name}: {result.get('status')}", flush=True)
            _summarize(report, flops)
            if on_update is not None:
                on_update(report)
    except Stopped:  # the running system's worker is stopped already
        for name in systems:
            if name not in report["systems"]:
                report["systems"][name] = {"system": name,
                                           "status": "stopped: SIGTERM reached the run"}
    finally:
        shared_cache.cleanup()
    _summarize(report, flops)
    return report


def _summarize(report: dict[str, Any], flops: float) -> None:
    """The device, MFU and the losses' spread over the systems that finished."""
    ok = [r for r in report["systems"].values() if r.get("status") == "ok"]
    if ok:
        device = ok[0]["device_name"]
        peak, source = peak_for(device) if device != "cpu" else (None, "CPU: MFU not computed")
        report.update(device=device, peak_bf16_tflops=peak, peak_source=source)
        for result in ok:
            result["model_tflops_per_second"] = result["tokens_per_second"] * flops / 1e12
            if peak is not None:
                result["mfu"] = result["model_tflops_per_second"] / peak
        reference = ok[0]["final_loss"]
        report["final_loss_max_relative_spread"] = max(
            abs(r["final_loss"] - reference) / abs(reference) for r in ok)


def format_table(report: dict[str, Any]) -> str:
    header = (f"{'system':<17} {'status':<10} {'tokens/s':>10} {'MFU':>7} {'peak GiB':>9} "
              f"{'loss[-1]':>9} {'1st step s':>10} {'compile s':>9}")
    spread = report.get("final_loss_max_relative_spread")
    lines = [f"{report['device']}: {report['peak_source']}; {report['parameters'] / 1e6:,.1f}M "
             f"parameters, micro-batch {report['shape']['micro_batch']} x "
             f"{report['shape']['seq_length']}; final losses at most "
             f"{'-' if spread is None else format(spread, '.2%')} from the first system's",
             header]

    def number(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for name, r in report["systems"].items():
        ok = r.get("status") == "ok"
        status = "ok" if ok else str(r.get("status"))[:10]
        lines.append(
            f"{name:<17} {status:<10} {number(r.get('tokens_per_second'), ',.0f'):>10} "
            f"{number(r.get('mfu'), '.1%'):>7} "
            f"{number(r.get('peak_memory_allocated_gib'), '.1f'):>9} "
            f"{number(r.get('final_loss'), '.4f'):>9} "
            f"{number(r.get('first_step_seconds'), '.1f'):>10} "
            f"{number(r.get('compile_seconds'), '.1f'):>9}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="the JSON report (default: print only)")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--system-timeout", type=float, default=200.0)
    parser.add_argument("--budget", type=float, default=420.0,
                        help="no system starts after this many seconds of the run")
    parser.add_argument("--separate-compile-caches", action="store_true",
                        help="each compiled system compiles from an empty inductor cache")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="a tiny GPT on the CPU, world size 1, aot_eager compile")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker-shape", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    shape = RunShape(**CPU_SMOKE) if args.cpu_smoke else RunShape()
    if args.micro_batch is not None:
        shape = RunShape(**{**asdict(shape), "micro_batch": args.micro_batch})
    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown system(s) {', '.join(unknown)}; expected {', '.join(SYSTEMS)}")

    def write(report: dict[str, Any]) -> None:  # whole or not at all
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomically(args.out, report, indent=1)

    # The device call's time limit sends SIGTERM: the worker is stopped, the report kept.
    try:
        with sigterm_raises(lambda signum: Stopped()):
            report = run_all(shape, systems, args.system_timeout, args.budget,
                             args.cpu_smoke, args.separate_compile_caches, on_update=write)
    except Stopped:  # before the first system started
        report = {"systems": {name: {"system": name, "status": "stopped: SIGTERM reached the run"}
                              for name in systems}}
    write(report)
    if "device" in report:
        print(format_table(report), flush=True)
    stopped = any(r.get("status", "").startswith("stopped") for r in report["systems"].values())
    return 128 + signal.SIGTERM if stopped else 0


def _worker(args: argparse.Namespace) -> int:
    shape = RunShape(**json.loads(args.worker_shape))
    try:
        result = run_one(args.worker, shape)
    except BaseException as error:  # reported in the JSON: the parent runs the next system
        result = {"system": args.worker, "status": f"failed: {type(error).__name__}: {error}"[:300],
                  "traceback": traceback.format_exc()[-3000:]}
    args.worker_out.write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # no process-group teardown: the result is written


if __name__ == "__main__":
    sys.exit(main())
