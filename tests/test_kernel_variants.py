"""The kernels an engine compiles at build are the ones its iterations launch.

``ShardedModel.kernel_variants`` asks each collective what it launches for each unit's
buffers (``Collective.kernel_variants``) and the build compiles those ahead
(``zeropp.kernels.prepare_variants``), so no Triton compile lands inside the first
iterations. Here every ZeRO++ path runs two training steps with each kernel call taken
through the Triton backend's host side on the CPU (Triton's interpreter mode, where the
backend accepts CPU tensors), with a launcher that records each launch's key, grid and
argument specialization and runs nothing; the keys ``prepare`` would compile for the
engine's variants are recorded the same way: every launch must be among them.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_model, train_data_parallel

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed")

# (label, ranks per node, QuantizationOptions): every branch of the quantized collectives
PATHS = (
    ("qwZ+hpZ int8 secondary+qgZ, 2 x 2", 2,
     {"quantized_weights": True, "hpz_size": 2, "quantized_gradients": True}),
    ("qgZ int4 -> int2 with error feedback, 2 x 2", 2,
     {"quantized_gradients": True, "gradient_inter_node_bits": 2,
      "error_feedback": (0.8, 3)}),
    ("qgZ int4 -> int8 across nodes, 2 x 2", 2,
     {"quantized_gradients": True, "gradient_inter_node_bits": 8}),
    ("qgZ with error feedback, 4 nodes of 1", 1,
     {"quantized_gradients": True, "error_feedback": (0.0, 0)}),
    ("qwZ+qgZ, 4 nodes of 1", 1, {"quantized_weights": True, "quantized_gradients": True}),
    ("qwZ+qgZ, one node of 4", 4, {"quantized_weights": True, "quantized_gradients": True}),
    ("weight deltas+qgZ, 2 x 2", 2,
     {"weight_deltas": True, "hpz_size": 2, "quantized_gradients": True, "delta_block_size": 256}),
)


def record(rank, world):
    """Per path: (launched keys, prepared keys, variant count), as sorted reprs."""
    import zeropp.kernels
    from zeropp.comm.options import QuantizationOptions
    from zeropp.deepspeed_api.initialize import build_engine
    from zeropp.kernels import launcher, reference, triton_kernels
    from zeropp.sharded_model import ShardingOptions

    seen: dict[str, set] = {}

    class Recording:
        """Records what would be launched or compiled, and runs nothing."""

        def launch(self, kernel, key, constants, num_warps, grid, args):
            seen["launch"].add(repr((key, grid, launcher.argument_key(args))))

        def prepare(self, kernel, key, constants, num_warps, grid, args):
            seen["prepare"].add(repr((key, grid, launcher.argument_key(args))))
            return True

    class TritonShadow:
        """Every call goes through the Triton backend's host side as it would on a GPU (its
        launches recorded, none run) and returns the reference's result (bit-identical to
        the kernels', tests/test_kernels.py), so training goes on as on a GPU, at the
        reference's speed rather than the Triton interpreter's."""

        def __getattr__(self, name):
            def call(*args, **kwargs):
                getattr(triton_kernels, name)(*args, **kwargs)
                return getattr(reference, name)(*args, **kwargs)
            return call

    shadow = TritonShadow()
    triton_kernels.LAUNCHER = Recording()
    zeropp.kernels.backend_for = lambda tensor, block_size: shadow
    results = []
    for _label, per_node, quant in PATHS:
        seen.update(launch=set(), prepare=set())
        engine = build_engine(
            toy_model(width=32, hidden=64, layers=2), lr=1e-3, dtype=torch.bfloat16,
            ranks_per_node=per_node, quantization=QuantizationOptions(**quant),
            sharding=ShardingOptions(persistence_threshold=100))
        assert engine.sharded.prepared_kernels == 0  # CPU: the build prepares nothing
        variants = engine.sharded.kernel_variants()
        for v in variants:
            triton_kernels.prepare(torch.device("cpu"), v.numel, v.bits, v.block_size, v.dtype,
                                   v.payloads, v.parts, v.swizzles, v.bits_out)
        # two steps: the second reads qgZ's stored errors and sends weight deltas
        losses = train_data_parallel(engine, rank, world, toy_batches(2, 1, 2 * world), 2, 1)
        engine.close()
        assert all(map(math.isfinite, losses)), losses
        results.append((sorted(seen["launch"]), sorted(seen["prepare"]), len(variants)))
    return results


def test_an_iteration_launches_only_the_variants_the_build_prepares():
    per_rank = run_ranks(record, 4, env={"ZEROPP_KERNELS": "triton", "TRITON_INTERPRET": "1"})
    for rank, results in enumerate(per_rank):
        for (label, _, _), (launched, prepared, variants) in zip(PATHS, results, strict=True):
            assert launched, (rank, label)  # the Triton kernels ran
            missing = sorted(set(launched) - set(prepared))
            assert not missing, (rank, label, f"{len(missing)} of {len(launched)} launches "
                                 f"not prepared by {variants} variants", missing[:3])


def test_exact_collectives_name_no_kernels():
    from zeropp.comm.collectives import AllGather, CommGroup, ReduceScatter

    group = CommGroup(None, 4, 0, False)
    for collective in (AllGather(), ReduceScatter()):
        assert collective.kernel_variants(1024, torch.bfloat16, group) == ()
