"""Reading and writing a sharded model's weights: zeropp.zero.GatheredParameters, zero.Init,
state_dict outside a gather, full_state_dict's tied names (2 gloo ranks, DeepSpeed's meanings)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tests.distributed import run_ranks
from tests.toy_models import ToyLM, toy_batches, toy_loss, toy_model

LR = 3e-3
MICRO = 2  # rows per rank

# (name, zero_optimization block): units sharded and gathered on use, small units that stay
# gathered (persistent), the same holding qwZ's dequantized weights, and stage 2, where
# weights are whole on every rank.
CONFIGS = [
    ("stage3", {"stage": 3, "stage3_param_persistence_threshold": 0}),
    ("stage3_persistent", {"stage": 3}),
    ("stage3_qwZ", {"stage": 3, "zero_quantized_weights": True}),
    ("stage2", {"stage": 2}),
]


def _engine(model, zero: dict):
    import zeropp

    engine, *_ = zeropp.initialize(model, config={
        "train_micro_batch_size_per_gpu": MICRO, "zero_optimization": zero,
        "gradient_clipping": 0.0,  # the torch reference does not clip (DeepSpeed's default: 1.0)
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}})
    sharded = engine.sharded
    # The optimizer's fp32 masters follow shards written by GatheredParameters(modifier_rank).
    # build_engine does not register this yet (zeropp/deepspeed_api/initialize.py), so the test
    # does.
    if not sharded.shard_write_listeners:
        sharded.shard_write_listeners.append(
            lambda i: engine.optimizer.load_shard(i, sharded.units[i].shard))
    return engine


def _step(engine, rank):
    tokens = toy_batches(1, 1, MICRO * 2)[0, 0, rank * MICRO:(rank + 1) * MICRO]
    engine.backward(toy_loss(engine(tokens), tokens))
    assert engine.step()


def _modify(model, rank):
    """What rank 0 writes; rank 1 writes something else, which the broadcast must override."""
    with torch.no_grad():
        if rank == 0:
            model.layers[2].up.weight.mul_(0.5)
            model.embed.weight[3].fill_(0.25)
            model.norm.bias.add_(1.0)
        else:
            model.layers[2].up.weight.zero_()


def access_run(rank, world):
    import zeropp
    from zeropp.deepspeed_api.zero import GatheredParameters

    out = {}
    for name, zero in CONFIGS:
        model = toy_model()
        engine = _engine(model, zero)
        named = dict(model.named_parameters())
        with GatheredParameters(model.parameters()):
            read = {n: p.detach().clone() for n, p in named.items()}
            with torch.no_grad():  # the engine's releases leave held units whole
                engine(toy_batches(1, 1, 1)[0, 0])
            after_forward = {n: p.detach().clone() for n, p in named.items()}
            try:
                with GatheredParameters(named["layers.0.up.weight"]):
                    pass
                overlap = "no error"
            except RuntimeError as error:
                overlap = str(error)
            state_inside = sorted(model.state_dict())
        with GatheredParameters(named["layers.1.down.weight"]):
            one = named["layers.1.down.weight"].detach().clone()
        # Without modifier_rank, changes (different on each rank) are discarded.
        with GatheredParameters([named["layers.0.down.weight"], named["norm.weight"]]):
            with torch.no_grad():
                named["layers.0.down.weight"].add_(rank + 1.0)
                named["norm.weight"].zero_()
        discarded = engine.full_state_dict()
        with GatheredParameters([named["layers.2.up.weight"], named["embed.weight"],
                                 named["norm.bias"]], modifier_rank=0):
            _modify(model, rank)
        modified = engine.full_state_dict()
        _step(engine, rank)
        out[name] = {"read": read, "after_forward": after_forward, "overlap": overlap,
                     "state_inside": state_inside, "one": one, "discarded": discarded,
                     "modified": modified, "stepped": engine.full_state_dict()}
        if name == "stage2":  # whole weights: state_dict works without a gather
            out[name]["state_outside"] = sorted(model.state_dict())
        engine.close()
    assert zeropp.zero.GatheredParameters is GatheredParameters
    return out


def reference_step(modify: bool) -> dict[str, torch.Tensor]:
    model = toy_model()
    if modify:
        _modify(model, 0)
    tokens = toy_batches(1, 1, MICRO * 2)[0, 0]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    toy_loss(model(tokens), tokens).backward()
    opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_gathered_parameters_read_discard_and_modify():
    results = run_ranks(access_run, 2)
    initial = {n: p.detach() for n, p in toy_model().named_parameters()}
    modified_model = toy_model()
    _modify(modified_model, 0)
    modified = {n: p.detach() for n, p in modified_model.named_parameters()}
    stepped = reference_step(modify=True)
    for rank, out in enumerate(results):
        for config, got in out.items():
            where = f"rank {rank}, {config}"
            for name, value in initial.items():
                assert torch.equal(got["read"][name], value), (where, name)
                assert torch.equal(got["after_forward"][name], value), (where, name)
                assert torch.equal(got["discarded"][name], value), (where, name)
                assert torch.equal(got["modified"][name], modified[name]), (where, name)
                if config == "stage3_qwZ":  # its forward reads quantized weights
                    continue
                torch.testing.assert_close(got["stepped"][name], stepped[name], rtol=0,
                                           atol=1e-6, msg=f"{where}: {name}")
            assert torch.equal(got["one"], initial["layers.1.down.weight"]), where
            assert "cannot overlap" in got["overlap"], where
            assert got["state_inside"] == sorted(initial), where
        assert out["stage2"]["state_outside"] == sorted(initial)


def test_parameters_no_engine_manages_pass_through():
    from zeropp.deepspeed_api.zero import GatheredParameters

    linear = nn.Linear(3, 2)
    before = linear.weight.detach().clone()
    # No process group exists here: a context with nothing to gather issues no collective.
    with GatheredParameters(linear.parameters(), modifier_rank=0) as nothing:
        with torch.no_grad():
            linear.weight.add_(1.0)
    assert nothing is None
    assert torch.equal(linear.weight, before + 1.0)
    with GatheredParameters(linear.weight, enabled=False):
        pass


# ---- zero.Init -----------------------------------------------------------------------------

class ScaleOnly(nn.Module):
    """A parameter whose module has no reset_parameters(): its eager value is unknowable."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(5))

    def forward(self, x):
        return x * self.scale


def init_run(rank, world):
    import zeropp

    with zeropp.zero.Init():
        model = ToyLM()
    nothing_real = all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    engine = _engine(model, {"stage": 3, "stage3_param_persistence_threshold": 0})
    initial = engine.full_state_dict()
    _step(engine, rank)
    stepped = engine.full_state_dict()
    engine.close()

    with zeropp.zero.Init():
        bad = nn.Sequential(nn.ModuleList([ScaleOnly()]))
    try:
        _engine(bad, {"stage": 3})
        refused = "no error"
    except ValueError as error:
        refused = str(error)
    return nothing_real, initial, stepped, refused


def test_init_builds_on_meta_and_trains():
    results = run_ranks(init_run, 2)
    (nothing_real, initial, stepped, refused), other = results[0], results[1]
    assert nothing_real and other[0]
    for name, value in initial.items():  # the same initial values on every rank
        assert torch.equal(other[1][name], value), name
    # reset_parameters()'s values: LayerNorm ones and zeros, Linear within +-1/sqrt(fan_in).
    assert torch.equal(initial["layers.1.norm.weight"], torch.ones(17))
    assert torch.equal(initial["norm.bias"], torch.zeros(17))
    for layer in range(3):
        up = initial[f"layers.{layer}.up.weight"]
        assert 0.8 / 17**0.5 < up.abs().max() <= 1 / 17**0.5
    assert not torch.equal(initial["layers.0.up.weight"], initial["layers.1.up.weight"])
    assert initial["embed.weight"].std() == pytest.approx(1.0, rel=0.1)  # N(0, 1)

    reference = ToyLM()
    reference.load_state_dict(initial)
    tokens = toy_batches(1, 1, MICRO * 2)[0, 0]
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=0.0, foreach=False)
    toy_loss(reference(tokens), tokens).backward()
    opt.step()
    for name, value in reference.named_parameters():
        torch.testing.assert_close(stepped[name], value.detach(), rtol=0, atol=1e-6, msg=name)
    assert "'0.0.scale' is on the meta device" in refused and "reset_parameters()" in refused


def test_init_refuses_what_the_engine_lacks_and_can_be_disabled():
    import zeropp

    for kwargs, name in [({"remote_device": "cpu"}, "remote_device"),
                         ({"remote_device": "nvme"}, "remote_device"),
                         ({"mpu": object()}, "mpu"), ({"pin_memory": True}, "pin_memory")]:
        with pytest.raises(ValueError, match=name):
            zeropp.zero.Init(**kwargs)
    with zeropp.zero.Init(enabled=False):
        real = nn.Linear(2, 3)
    assert not real.weight.is_meta
    with zeropp.zero.Init(dtype=torch.bfloat16):
        half = nn.Linear(2, 3)
    assert half.weight.is_meta and half.weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32


# ---- Hugging Face: state_dict outside a gather, save_pretrained, tied names -----------------

def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=101, n_positions=16, n_embd=12, n_layer=2,
                                      n_head=3, bos_token_id=None, eos_token_id=None))


def hf_run(rank, world, out_dir):
    from zeropp.deepspeed_api.zero import GatheredParameters

    model = tiny_gpt2()
    engine = _engine(model, {"stage": 3, "stage3_param_persistence_threshold": 0})
    # Outside a gather: DeepSpeed's empty placeholders, and one warning per engine
    # ([Note: state_dict of sharded weights]).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outside = model.state_dict()
        model.transformer.h[0].state_dict()
    errors = [str(w.message) for w in caught]
    outside = {name: tuple(value.shape) for name, value in outside.items()}
    with GatheredParameters(model.parameters()):
        inside = model.state_dict()
        keys = sorted(inside)
        if rank == 0:
            model.save_pretrained(f"{out_dir}/inside")
    torch.distributed.barrier()
    full = engine.full_state_dict()
    return (errors, outside, keys, full,
            full["lm_head.weight"] is full["transformer.wte.weight"])


def test_hf_state_dict_outside_and_inside_a_gather_save_pretrained_and_tied_names(tmp_path):
    from transformers import GPT2LMHeadModel

    results = run_ranks(hf_run, 2, str(tmp_path))
    expected = tiny_gpt2().state_dict()
    assert "lm_head.weight" in expected
    for errors, outside, keys, full, shared in results:
        assert len(errors) == 1, errors  # once per engine, not once per module or call
        assert errors[0].startswith("state_dict(): the weights of GPT2LMHeadModel are sharded "
                                    "by ZeRO stage 3 and read as empty tensors, as in DeepSpeed")
        assert "zeropp.zero.GatheredParameters(...)" in errors[0]
        assert "engine.full_state_dict()" in errors[0]
        # Every parameter released (persistence threshold 0): all empty, buffers whole.
        params = dict(tiny_gpt2().named_parameters())
        assert sorted(outside) == sorted(expected)
        for name, shape in outside.items():
            assert shape == ((0,) if name in params or name == "lm_head.weight"
                             else tuple(expected[name].shape)), name
        assert keys == sorted(expected)
        assert sorted(full) == sorted(expected) and shared
        for name, value in expected.items():
            assert torch.equal(full[name], value), name
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "inside").state_dict()
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name
