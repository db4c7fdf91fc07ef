"""A model DeepSpeed's own zero.Init partitioned is adopted ([Note: adopting DeepSpeed's
partitions] in zeropp/deepspeed_params/deepspeed_adoption.py): a Hugging Face GPT-2 built under
``HfDeepSpeedConfig`` (so ``from_config`` runs inside DeepSpeed 0.19.8's ``zero.Init``, as
``from_pretrained`` does) is handed to ``zeropp.initialize`` and trains as the same model built
plainly with the same values (2 ranks, gloo, fp32). Before, its first forward failed with
"'weight' must be 2-D"."""

from __future__ import annotations

import torch

from tests.distributed import run_ranks

DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
             "zero_optimization": {"stage": 3}}


def _gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _losses(engine, batches) -> list[float]:
    losses = []
    for tokens in batches:
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def adopt_and_train(rank, world):
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import zeropp
    from zeropp.deepspeed_params.param_face import _DeepSpeedCall

    keep_alive = HfDeepSpeedConfig(DS_CONFIG)  # noqa: F841 (Hugging Face reads it globally)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_gpt2_config())
    partitioned = [name for name, p in model.named_parameters() if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    empty_before = all(p.numel() == 0 for p in model.parameters())
    del keep_alive

    gathers = []  # parameters per DeepSpeed gather while the engine adopts them
    original = deepspeed.zero.GatheredParameters

    def counting(params, *args, **kwargs):
        gathers.append(len(params))
        return original(params, *args, **kwargs)

    deepspeed.zero.GatheredParameters = counting
    try:
        engine, _, _, _ = zeropp.initialize(model=model, config=DS_CONFIG)
    finally:
        deepspeed.zero.GatheredParameters = original
    adopted = engine.full_state_dict()
    out = {
        "partitioned": len(partitioned), "params": len(reference), "empty_before": empty_before,
        "gathers": gathers,
        "same_values": all(torch.equal(adopted[name], value) for name, value in reference.items()),
        # The engine's parameters answer with DeepSpeed's ds_* names and all_gather of their
        # own ([Note: DeepSpeed's parameter attributes]); none holds a DeepSpeed partition.
        "deepspeed_left": [name for name, p in engine.module.named_parameters()
                           if hasattr(p, "ds_tensor")
                           or not isinstance(p.all_gather, _DeepSpeedCall)],
    }
    g = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 97, (2, 16), generator=g)] * 3  # one batch, learned
    out["adopted_losses"] = _losses(engine, batches)
    engine.close()

    # The same model built plainly, loaded with the same values, through the same engine.
    plain = AutoModelForCausalLM.from_config(_gpt2_config())
    plain.load_state_dict({**plain.state_dict(), **reference})
    twin, _, _, _ = zeropp.initialize(model=plain, config=DS_CONFIG)
    out["plain_losses"] = _losses(twin, batches)
    twin.close()
    return out


def test_a_model_partitioned_by_deepspeeds_zero_init_is_adopted_and_trains_the_same():
    for result in run_ranks(adopt_and_train, 2):
        assert result["partitioned"] == result["params"] > 0  # DeepSpeed partitioned them all
        assert result["empty_before"]
        assert result["same_values"]  # gathered exactly,
        gathers = result["gathers"]  # a unit at a time, never the whole model
        assert len(gathers) > 2 and max(gathers) < result["params"]
        assert sum(gathers) == result["params"]
        assert result["deepspeed_left"] == []  # nothing of DeepSpeed's stays on them
        assert result["adopted_losses"] == result["plain_losses"]
        assert result["adopted_losses"][-1] < result["adopted_losses"][0]
