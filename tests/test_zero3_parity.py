"""Every ZeRO stage against the plain unsharded loop it replaces (torch AdamW + clip_grad_norm_)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_model, train_data_parallel, train_unsharded

LR, WD, CLIP = 3e-3, 0.1, 0.5


def reference_run(steps, micro, global_batch, checkpoint=False):
    """Single process, unsharded: what every sharded run must reproduce."""
    return train_unsharded(toy_model(checkpoint=checkpoint),
                           toy_batches(steps, micro, global_batch), steps, micro, LR, WD, CLIP)


def sharded_run(rank, world, steps, micro, global_batch, checkpoint, meta, options,
                unit_modules=None):
    """``unit_modules``: a function of the model naming its units (None: the default)."""
    from zeropp.deepspeed_api.initialize import build_engine
    from zeropp.sharded_model import ShardingOptions

    reference = toy_model(checkpoint=checkpoint)
    if meta:
        with torch.device("meta"):
            model = type(reference)(checkpoint=checkpoint)
        values = {n: p.detach() for n, p in reference.named_parameters()}
        init_fn = values.__getitem__
    else:
        model, init_fn = reference, None
    engine = build_engine(
        model, lr=LR, weight_decay=WD, gradient_accumulation_steps=micro,
        gradient_clipping=CLIP, param_init_fn=init_fn, sharding=ShardingOptions(**options),
        unit_modules=unit_modules(model) if unit_modules else None,
    )
    norms = []
    losses = train_data_parallel(engine, rank, world, toy_batches(steps, micro, global_batch),
                                 steps, micro,
                                 after_step=lambda _: norms.append(engine.get_global_grad_norm()))
    return losses, norms, engine.full_state_dict()


@pytest.mark.parametrize(
    "world,micro,checkpoint,meta,options",
    [
        (1, 1, False, False, {}),
        (2, 2, False, True, {"persistence_threshold": 0}),
        (4, 1, True, True, {"prefetch_bucket_numel": 10_000, "persistence_threshold": 0}),
        (3, 2, True, False, {"max_live_numel": 1500, "persistence_threshold": 100}),
        (2, 2, False, True, {"stage": 0}),
        (2, 3, False, True, {"stage": 1}),
        (3, 2, True, False, {"stage": 1}),
        (4, 2, False, True, {"stage": 2}),
        (3, 1, True, False, {"stage": 2}),
        # Units below the block ([Note: units]): each 1486-element block splits into its
        # Linears (738 and 714 elements), its norm alone or with the block's own unit.
        (2, 2, False, True, {"max_unit_numel": 800, "persistence_threshold": 0}),
        (4, 1, True, True, {"max_unit_numel": 800, "persistence_threshold": 0,
                            "max_live_numel": 0}),
        (3, 2, "reentrant", False, {"max_unit_numel": 800, "persistence_threshold": 100,
                                    "max_live_numel": 0, "prefetch_bucket_numel": 0}),
        (2, 3, False, True, {"stage": 1, "max_unit_numel": 800, "persistence_threshold": 0}),
        (4, 2, True, False, {"stage": 2, "max_unit_numel": 800, "max_live_numel": 0}),
    ],
    ids=["n1", "n2-accum-buckets-meta", "n4-checkpoint-prefetch", "n3-live-cap-persistent",
         "n2-stage0-replicated", "n2-stage1-accum-buckets", "n3-stage1-checkpoint",
         "n4-stage2-accum-buckets", "n3-stage2-checkpoint", "n2-subblock-accum-buckets",
         "n4-subblock-checkpoint-release", "n3-subblock-reentrant-no-prefetch",
         "n2-subblock-stage1", "n4-subblock-stage2-checkpoint"],
)
def test_zero_stages_match_unsharded(world, micro, checkpoint, meta, options):
    steps, global_batch = 6, 12
    ref_losses, ref_norms, ref_params = reference_run(steps, micro, global_batch, checkpoint)
    results = run_ranks(sharded_run, world, steps, micro, global_batch, checkpoint, meta, options)
    for losses, norms, params in results:
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        # Adam is blind to a constant gradient factor, so the norms check the averaging.
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)
