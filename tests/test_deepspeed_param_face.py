"""Sharded parameters answer as DeepSpeed's ZeRO-3 parameters do ([Note: DeepSpeed's parameter
attributes] in zeropp/deepspeed_params/param_face.py), so a script written for DeepSpeed gathers
them before reading them (2 ranks, gloo, ZeRO-3).

The script protocol is DeepSpeed-Chat's ``save_zero_three_model`` and ``_z3_params_to_fetch``
(DeepSpeedExamples, applications/DeepSpeed-Chat/dschat/utils/utils.py): a parameter with a
``ds_id`` is read inside ``GatheredParameters`` of those whose ``ds_status`` is DeepSpeed's
``ZeroParamStatus.NOT_AVAILABLE``, any other is read directly. Before these attributes, every
sharded parameter took the direct path and the saved file held released storage. Outside a
gather a parameter's data is DeepSpeed's empty tensor ([Note: released parameters] in
zeropp/unit.py): a raw read finds nothing instead of freed memory."""

from __future__ import annotations

import torch

from tests.distributed import run_ranks
from tests.toy_models import toy_batches, toy_loss, toy_model


def save_as_deepspeed_chat_does(rank, world):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # DeepSpeed's own

    import zeropp

    model = toy_model()
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    config = {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 2000}}  # blocks persist, root not
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, _, _, _ = zeropp.initialize(model, optimizer=optimizer, config=config)
    for tokens in toy_batches(2, 1, 3 * world)[:, 0, rank * 3:(rank + 1) * 3]:
        engine.backward(toy_loss(engine(tokens), tokens))
        engine.step()

    params = dict(engine.module.named_parameters())
    out = {
        "ids_unique": len({p.ds_id for p in params.values()}) == len(params),
        "shapes": all(tuple(p.ds_shape) == shapes[name] and p.ds_numel == p.ds_shape.numel()
                      for name, p in params.items()),
        "released": sorted(name for name, p in params.items()
                           if p.ds_status == ZeroParamStatus.NOT_AVAILABLE),
        "available": sorted(name for name, p in params.items()
                            if ZeroParamStatus.AVAILABLE == p.ds_status),
    }
    saved, statuses_inside = {}, set()
    for name, v in engine.module.named_parameters():
        if hasattr(v, "ds_id"):
            fetch = [p for p in [v] if hasattr(p, "ds_id")
                     and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
            with zeropp.zero.GatheredParameters(fetch, enabled=True):
                statuses_inside.add(v.ds_status.name)
                saved[name] = v.data.cpu().clone()
        else:
            saved[name] = v.cpu().clone()
    # A raw read of a released parameter, as a script that forgot to gather would make it:
    # DeepSpeed's empty tensor ([Note: released parameters]), never the freed storage.
    embed = params["embed.weight"]
    out["raw_read"] = (tuple(embed.shape), float(embed.data.sum()), embed.detach().numel())
    try:
        embed @ torch.ones(embed.ds_shape[1])
        out["raw_use"] = "no error"
    except RuntimeError as error:
        out["raw_use"] = str(error).splitlines()[0]
    full = engine.full_state_dict()
    out["saved_equals_engine"] = all(torch.equal(saved[name], full[name]) for name in saved)
    out["statuses_inside"] = sorted(statuses_inside)
    out["released_after"] = sorted(name for name, p in params.items()
                                   if p.ds_status == ZeroParamStatus.NOT_AVAILABLE)
    engine.close()
    return out


def test_a_deepspeed_chat_style_save_gathers_sharded_parameters_and_reads_them_whole():
    for result in run_ranks(save_as_deepspeed_chat_does, 2):
        assert result["ids_unique"] and result["shapes"]
        # the root released after the step; the blocks, persistent, stay gathered
        assert result["released"] == ["embed.weight", "norm.bias", "norm.weight"]
        assert len(result["available"]) == 18 and all(
            name.startswith("layers.") for name in result["available"])
        assert result["statuses_inside"] == ["AVAILABLE"]
        assert result["saved_equals_engine"]
        assert result["released_after"] == result["released"]  # released again on exit
        assert result["raw_read"] == ((0,), 0.0, 0)
        assert result["raw_use"] != "no error"


def test_zero_param_status_equals_deepspeeds_member_of_the_same_name():
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as DeepSpeeds

    from zeropp.deepspeed_params.param_face import ZeroParamStatus

    for ours in ZeroParamStatus:
        theirs = DeepSpeeds[ours.name]
        assert ours == theirs and theirs == ours and not (ours != theirs)
        assert all(ours != other for other in DeepSpeeds if other is not theirs)


def deepspeeds_own_gathered_parameters(rank, world):
    """DeepSpeed-Chat's dschat package keeps ``import deepspeed``: its save gathers this
    engine's parameters with DeepSpeed's own ``GatheredParameters`` ([Note: DeepSpeed's
    GatheredParameters on this engine's parameters] in zeropp/deepspeed_api/zero.py)."""
    import deepspeed
    import deepspeed.comm
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    deepspeed.comm.init_distributed(dist_backend="gloo")  # wraps the group the test made
    engine, tokens = _stage3_engine(rank, world)
    full = engine.full_state_dict()
    params = dict(engine.module.named_parameters())
    out = {"saved": {}, "inside": set()}
    for name, v in params.items():  # save_zero_three_model, with DeepSpeed's context
        fetch = [p for p in [v] if hasattr(p, "ds_id")
                 and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]
        with deepspeed.zero.GatheredParameters(fetch, enabled=True):
            out["inside"].add(v.ds_status.name)
            out["saved"][name] = v.data.cpu().clone()
    out["released_after"] = all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE
                                for p in params.values())
    out["saved_equals_engine"] = all(torch.equal(out["saved"][n], full[n]) for n in full)
    embed = params["embed.weight"]
    with deepspeed.zero.GatheredParameters([embed]):  # no modifier: changes are discarded
        with torch.no_grad():
            embed.add_(rank + 1.0)
    out["discarded"] = torch.equal(engine.full_state_dict()["embed.weight"], full["embed.weight"])
    with deepspeed.zero.GatheredParameters([embed, params["norm.weight"]], modifier_rank=1):
        with torch.no_grad():
            embed.fill_(float(rank + 1))  # rank 1's 2.0 is broadcast by DeepSpeed
    written = engine.full_state_dict()
    written_embed = written["embed.weight"]
    out["written"] = (torch.equal(written_embed, torch.full_like(written_embed, 2.0)),
                      torch.equal(written["norm.weight"], full["norm.weight"]))
    # The optimizer's fp32 masters were told: the next step starts from the written values.
    engine.backward(toy_loss(engine(tokens), tokens))
    engine.step()
    moved = engine.full_state_dict()["embed.weight"] - 2.0
    out["stepped_from_written"] = 0 < float(moved.abs().max()) < 0.05
    engine.close()
    return out


def test_deepspeeds_own_gathered_parameters_reads_and_writes_this_engines_parameters():
    for result in run_ranks(deepspeeds_own_gathered_parameters, 2):
        assert result["inside"] == {"AVAILABLE"}
        assert result["saved_equals_engine"] and result["released_after"]
        assert result["discarded"]
        assert result["written"] == (True, True)
        assert result["stepped_from_written"]


# ---- [Note: storage lent to the user] in zeropp/deepspeed_api/zero.py ----------------------------
DSCHAT = __import__("pathlib").Path(__file__).parent / "material" / "deepspeed_chat"


def _stage3_engine(rank, world):
    import zeropp

    model = toy_model()
    config = {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, _, _, _ = zeropp.initialize(model, optimizer=torch.optim.AdamW(
        model.parameters(), lr=1e-2), config=config)
    tokens = toy_batches(1, 1, 3 * world)[0, 0, rank * 3:(rank + 1) * 3]
    engine.backward(toy_loss(engine(tokens), tokens))
    engine.step()
    return engine, tokens


def user_references_outlive_the_gather(rank, world):
    """Tensors taken inside ``GatheredParameters`` (``.data``, a view, ``.cpu()``: the same
    tensor on a CPU job) keep the gathered values after the context releases the unit, and
    the engine's own gathers in forward and backward still free their storage at once."""
    import zeropp

    engine, tokens = _stage3_engine(rank, world)
    full = engine.full_state_dict()
    params = dict(engine.module.named_parameters())
    kept = {}
    for name, v in params.items():
        with zeropp.zero.GatheredParameters([v]):
            data = v.data
            kept[name] = (data, v.data.cpu(), data.view(-1)[: data.numel() // 2])
    out = {"cpu_is_alias": all(c is d or c.data_ptr() == d.data_ptr() for d, c, _ in
                               kept.values()),
           "released": all(p.numel() == 0 for p in params.values()),
           "kept_whole": all(torch.equal(d, full[n]) and torch.equal(c, full[n]) and
                             torch.equal(view, full[n].view(-1)[: view.numel()])
                             for n, (d, c, view) in kept.items())}
    # A training iteration after the lending: the engine's own gathers are released by
    # resizing the same buffers to 0 bytes again (freed at once, not rebound).
    sharded = engine.sharded
    buffers = [u.full for u in sharded.units]
    engine.backward(toy_loss(engine(tokens), tokens))
    engine.step()
    out["same_buffers"] = all(u.full is b for u, b in zip(sharded.units, buffers, strict=True))
    out["freed_after_step"] = [u.full.untyped_storage().nbytes() for u in sharded.units]
    out["kept_after_training"] = all(torch.equal(d, full[n]) for n, (d, _, _) in kept.items())
    engine.close()
    return out


def test_tensors_taken_inside_gathered_parameters_outlive_its_release():
    for result in run_ranks(user_references_outlive_the_gather, 2):
        assert result["cpu_is_alias"] and result["released"]
        assert result["kept_whole"] and result["kept_after_training"]
        assert result["same_buffers"]
        assert result["freed_after_step"] == [0] * len(result["freed_after_step"])


def save_with_dschats_helper(rank, world, output_dir):
    """DeepSpeed-Chat's own ``save_zero_three_model`` (unmodified, from tests/material), which
    keeps ``v.data.cpu()`` of each parameter gathered by DeepSpeed's ``GatheredParameters``."""
    import sys

    import deepspeed.comm

    deepspeed.comm.init_distributed(dist_backend="gloo")
    sys.path.insert(0, str(DSCHAT))
    from dschat.utils.utils import save_zero_three_model

    engine, _ = _stage3_engine(rank, world)
    full = engine.full_state_dict()
    save_zero_three_model(engine, rank, output_dir, zero_stage=3)
    engine.close()
    return {name: tuple(value.shape) for name, value in full.items()}, full


def test_dschats_save_zero_three_model_writes_a_file_that_loads_at_full_shapes(tmp_path):
    (shapes, full), _ = run_ranks(save_with_dschats_helper, 2, str(tmp_path))
    saved = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert sorted(saved) == sorted(full)
    for name, value in saved.items():
        assert tuple(value.shape) == shapes[name] and value.numel() > 0, name
        assert torch.equal(value, full[name]), name
