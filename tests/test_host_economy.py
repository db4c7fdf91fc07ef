"""What the host issues per iteration grows with the model's own work only: one reduction per
unit whatever ``reduce_bucket_size`` says ([Note: one reduction per unit]), joint collectives
for the persistent units ([Note: persistent units]), and an optimizer step whose kernels do
not depend on the number of units ([Note: flat optimizer step]).

Collectives are counted on tiny GPTs as rank 0 of 4 x 16 simulated GPUs (``host_ops``'s
counting); the optimizer's kernels on gloo, 2 ranks, with the toy model at two depths.
"""

from __future__ import annotations

import json

import torch

from megatron_lite.arguments import parse_args
from megatron_lite.dry_run import build_report
from scripts.bench import host_ops
from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model
from zeropp.simulation import OpCounter

NODES, GPUS = host_ops.NODES, host_ops.GPUS_PER_NODE


def tiny_argv(tmp_path, layers: int, vocab: list[str] = (), hidden: int = 64,
              **zero) -> list[str]:
    config = json.loads(host_ops.ZEROPP_CONFIG.read_text())
    config["zero_optimization"].update({"stage3_max_live_parameters": 0,
                                        "stage3_max_reuse_distance": 0, **zero})
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    return host_ops.program_argv(["--num-layers", str(layers), "--hidden-size", str(hidden),
                                  "--num-attention-heads", "4", "--seq-length", "64",
                                  *vocab, "--deepspeed_config", str(path)])


def planned_units(argv: list[str]):
    report = build_report(parse_args(argv + ["--dry-run", "--dry-run-nodes", str(NODES),
                                              "--dry-run-gpus-per-node", str(GPUS)]))
    return report.plans[0].units


def test_one_reduction_per_unit_whatever_the_reduce_bucket_size(tmp_path):
    """A bucket of 64 elements would cut every unit's 4 x 16-rank reduction into pieces."""
    argv = tiny_argv(tmp_path, layers=2, reduce_bucket_size=64,
                     stage3_param_persistence_threshold=0)
    units = len(planned_units(argv))
    counted = host_ops.count_engine(argv, "zero3").collectives
    assert counted["reduce_scatter_single"] == units
    zeropp = host_ops.count_engine(argv, "zeropp").collectives
    assert zeropp["all_to_all_single"] == 2 * units  # qgZ: one intra- and one inter-node hop


def test_persistent_units_share_one_gather_and_one_reduction(tmp_path):
    """Blocks split below themselves (hidden 256: 787K-element blocks, a 500K cap, a quarter
    of a 2M live budget): each block keeps a unit of its two layer norms (1,024 elements),
    below the persistence threshold of 2,000. Those are gathered once after the step, all
    together, and reduced once after backward, all together; every other unit is gathered
    in forward, again for its recomputation (the root stays gathered), and reduced once.
    The budget holds a recomputed block's three units as ZeRO++ pads them (to whole
    quantization blocks on each of 64 ranks: 393K elements each) and a 64-token vocabulary
    keeps the root small, so no recomputed unit is released early."""
    argv = tiny_argv(tmp_path, layers=3, hidden=256, stage3_param_persistence_threshold=2_000,
                     stage3_max_live_parameters=2_000_000,
                     vocab=["--tokenizer-type", "NullTokenizer", "--vocab-size", "64"])
    units = planned_units(argv)
    persistent = sum(u.persistent for u in units)
    assert persistent == 3  # one per block
    released = len(units) - persistent
    for system, reduction in (("zero3", "reduce_scatter_single"), ("zeropp", "all_to_all_single")):
        counted = host_ops.count_engine(argv, system).collectives
        hops = 2 if system == "zeropp" else 1
        assert counted["all_gather_single"] == released + (released - 1) + 1, system
        assert counted[reduction] == hops * (released + 1), system


def _step_kernels(rank: int, world: int, layers: int) -> dict[str, int]:
    """Ops the optimizer step dispatches for a toy model of ``layers`` blocks, each split into
    units ([Note: units]), with Megatron-style groups (decay and no-decay)."""
    import zeropp

    model = toy_model(layers=layers)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    engine, *_ = zeropp.initialize(
        model=model,
        model_parameters=[{"params": decay, "weight_decay": 0.1},
                          {"params": no_decay, "weight_decay": 0.0}],
        config={"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 2000,
                                      "stage3_param_persistence_threshold": 0}})
    tokens = toy_batches(2, 1, 2 * world)[:, 0, rank * 2:(rank + 1) * 2]
    units = len(engine.sharded.units)
    for step in range(2):  # the first step creates the optimizer state; count the second
        engine.backward(toy_loss(engine(tokens[step]), tokens[step]))
        with OpCounter() as ops:
            engine.step()
    engine.close()
    return {"units": units, "ops": ops.by_name()}


def test_optimizer_step_kernels_do_not_grow_with_the_number_of_units():
    shallow = run_ranks(_step_kernels, 2, 2)
    deep = run_ranks(_step_kernels, 2, 6)
    # torch's multi-tensor Adam off CUDA reads each tensor's step counter, a host scalar
    # (the fused CUDA update keeps them on the device): not a kernel, left out here.
    host_reads = "aten._local_scalar_dense.default"
    for few, many in zip(shallow, deep, strict=True):
        assert many["units"] >= few["units"] + 8  # several units per block
        assert many["ops"].pop(host_reads) > few["ops"].pop(host_reads)
        assert many["ops"] == few["ops"]
        # the update is multi-tensor: one launch per group and operation
        assert any(name.startswith("aten._foreach_") for name in many["ops"])


def _persistent_weights_after_steps(rank: int, world: int) -> list[tuple[str, bool]]:
    """ZeRO++ with qwZ: after two steps, whether each persistent unit's gathered weights
    are exactly its ranks' shards (an exact gather of them, compared bit for bit)."""
    import zeropp
    from zeropp.comm import CommStats

    engine, *_ = zeropp.initialize(
        model=toy_model(layers=2),
        config={"train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                "zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                      "stage3_max_live_parameters": 2000,
                                      "stage3_param_persistence_threshold": 100}})
    tokens = toy_batches(2, 1, 2 * world)[:, 0, rank * 2:(rank + 1) * 2]
    for step in range(2):
        engine.backward(toy_loss(engine(tokens[step]), tokens[step]))
        engine.step()
    results = []
    for unit in engine.sharded.persistent_units.units:
        used = unit.full.clone()
        unit.gather_exact(CommStats(), refresh=True)
        results.append((unit.name, torch.equal(used, unit.full)))
    engine.close()
    return results


def test_persistent_units_are_gathered_exactly_under_qwz():
    """The layer norms below the persistence threshold are few elements used in every
    forward: DeepSpeed keeps them whole and exact. With qwZ they were gathered as int8 after
    every step, so forward saw gains near 1.0 in steps of about 0.8%."""
    for results in run_ranks(_persistent_weights_after_steps, 2):
        assert results, "the toy model's layer norms should be persistent units"
        assert all(exact for _, exact in results), results
