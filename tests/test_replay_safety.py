"""[Note: replay safety] (zeropp/simulation/replay.py): on the simulated GPU cluster, steady
iterations 2 and 3 issue the same ops (shapes, dtypes, lanes, allocation sizes) and the same
collectives on the same communicators, with no host read, so a CUDA graph of one replays
the other. ZeRO-3 and ZeRO++ (qwZ, hpZ, qgZ), with and without activation checkpointing and
gradient accumulation.

A 3-layer GPT at hidden 64 as rank 0 of 2 nodes x 4 simulated GPUs, units split as the
18B's (``stage3_max_live_parameters`` 20 h^2: attention and the MLP's Linears; persistence
threshold 16 h: the layer norms), no block kept from forward to backward (reuse distance 0),
so every kind of gather, release and reduction runs; bf16, whose step is decided on the
device.
"""

from __future__ import annotations

import pytest
import torch

from megatron_lite.model import GPTConfig, GPTModel, lm_loss
from zeropp.simulation import HostSyncCounter, simulated_process_group
from zeropp.simulation.replay import OpSequence, first_difference

NODES, PER_NODE, HIDDEN, SEQ = 2, 4, 64, 32
ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": PER_NODE,
          "zero_quantized_gradients": True}


def _iterations(zero: dict, checkpoint: bool, micro_batches: int, iterations: int = 3,
                precision: dict | None = None,
                model_options: dict | None = None) -> list[tuple[list, dict, int]]:
    """(ops with their memory's sources, collectives by communicator, host reads) of each
    iteration; bf16 unless ``precision`` says otherwise, a GPT-2-style model unless
    ``model_options`` say otherwise."""
    import zeropp

    world = NODES * PER_NODE
    with simulated_process_group(0, world, "meta") as simulation:
        config = GPTConfig(num_layers=3, hidden_size=HIDDEN, num_attention_heads=4,
                           vocab_size=128, max_position_embeddings=SEQ, hidden_dropout=0.0,
                           attention_dropout=0.0, checkpoint_activations=checkpoint,
                           **(model_options or {}))
        with torch.device("meta"):
            model = GPTModel(config)
        engine, *_ = zeropp.initialize(
            model=model, ranks_per_node=PER_NODE,
            config={"train_micro_batch_size_per_gpu": 1,
                    "gradient_accumulation_steps": micro_batches,
                    "gradient_clipping": 1.0,
                    **(precision or {"bf16": {"enabled": True}}),
                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                    "zero_optimization": {"stage": 3,
                                          "stage3_max_live_parameters": 20 * HIDDEN**2,
                                          "stage3_param_persistence_threshold": 16 * HIDDEN,
                                          "stage3_max_reuse_distance": 0, **zero}})
        tokens = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
        mask = torch.ones(1, SEQ, device="meta")
        results = []
        try:
            with HostSyncCounter() as reads, OpSequence(storage_flow=True) as ops:
                for _ in range(iterations):
                    before = {key: len(issued) for key, issued in
                              simulation.order_signature().items()}
                    reads.reset()
                    ops.take()
                    for _ in range(micro_batches):
                        engine.backward(lm_loss(engine(tokens), tokens, mask))
                        engine.step()
                    collectives = {key: issued[before.get(key, 0):] for key, issued in
                                   simulation.order_signature().items()}
                    results.append((ops.take(), collectives, reads.total))
        finally:
            engine.close()
    return results


@pytest.mark.parametrize("micro_batches", [1, 2], ids=["one micro-batch", "accumulation"])
@pytest.mark.parametrize("checkpoint", [False, True], ids=["", "checkpointing"])
@pytest.mark.parametrize("system", ["zero3", "zeropp"])
def test_steady_iterations_issue_the_same_sequence(system, checkpoint, micro_batches):
    zero = ZEROPP if system == "zeropp" else {}
    _, second, third = _iterations(zero, checkpoint, micro_batches)
    ops2, collectives2, reads2 = second
    ops3, collectives3, reads3 = third
    assert len(ops2) > 100
    assert first_difference(ops2, ops3) is None, first_difference(ops2, ops3)
    assert collectives2 == collectives3
    assert sum(len(issued) for issued in collectives2.values()) > 0
    assert reads2 == reads3 == 0
    lanes = {op.lane for op in ops2}
    assert "reduce" in lanes  # what a reduction issues runs on the reduce lane
    if system == "zeropp":
        assert "gather" in lanes  # qwZ's quantize and payload buffers on the gather lane
        assert any("all_to_all" in str(record) for issued in collectives2.values()
                   for record in issued)  # qgZ's hops


LLAMA = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
         "num_query_groups": 2, "untie_embeddings_and_output_weights": True,
         "add_bias_linear": False}


@pytest.mark.parametrize("precision, model_options", [
    ({"fp16": {"enabled": True, "loss_scale": 128}}, None),
    (None, LLAMA),
], ids=["fp16 static loss scale", "llama-style"])
def test_other_capturable_runs_steady_iterations_issue_the_same_sequence(precision,
                                                                         model_options):
    """fp16 with a static loss scale is captured too (the dynamic scaler's window counts on
    the host, which ``capture_blockers`` refuses): its unscaling and skip flag stay on the
    device, in the same memory every iteration; so are Llama-style models (rotary tables,
    RMSNorm, SwiGLU, grouped-query attention, an untied head)."""
    _, second, third = _iterations(ZEROPP, False, 2, precision=precision,
                                   model_options=model_options)
    assert first_difference(second[0], third[0]) is None, first_difference(second[0], third[0])
    assert second[1] == third[1] and second[2] == third[2] == 0


def test_the_flow_sees_memory_an_iteration_leaves_to_the_next():
    """[Note: replay safety]'s memory check on a toy loop that keeps a running sum: kept in
    place, each iteration's flow is the same; left in memory the iteration made (a new
    tensor, or a storage freed and given memory again, as units free and regather), the next
    iteration reads other memory than this one did, which a replay would not."""
    def steady(how: str) -> tuple[list, list]:
        state = torch.zeros(4, device="meta")
        seen = []
        with OpSequence(storage_flow=True) as ops:
            for _ in range(3):
                total = torch.ones(4, device="meta") * 2 + state
                if how == "fresh":
                    state = total
                else:
                    if how == "regrow":
                        state.untyped_storage().resize_(0)
                        state.untyped_storage().resize_(16)
                    state.copy_(total)
                seen.append(ops.take())
        return seen[1], seen[2]

    second, third = steady("in place")
    assert first_difference(second, third) is None
    assert [source[0] for source in third[2].sources] == ["made", "held"]  # the add
    for how in ("fresh", "regrow"):
        second, third = steady(how)
        assert first_difference(second, third) is not None, how


def test_the_comparison_sees_a_changed_shape():
    """The recorder tells iterations apart when one differs (a different sequence length)."""
    with OpSequence() as ops:
        torch.ones(2, 3, device="meta").sum()
    first = ops.take()
    with OpSequence() as ops:
        torch.ones(2, 4, device="meta").sum()
    assert first_difference(first, ops.take()) is not None
