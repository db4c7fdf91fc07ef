"""Export: a checkpoint written by 2 ranks becomes a Hugging Face GPT-2 that matches us."""

from __future__ import annotations

import sys

import torch

from tests.test_pretrain_cli import ENTRY_POINT, TINY_RUN, data_prefix, run

__all__ = ["data_prefix"]


def test_export_to_hf_matches_our_logits_and_generates(data_prefix, tmp_path):
    from transformers import GPT2LMHeadModel

    from megatron_lite.export import load_consolidated_model, main

    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc_per_node", "2", ENTRY_POINT, *TINY_RUN, "--data-path", data_prefix,
                  "--data-cache-dir", str(tmp_path / "cache"), "--save", str(ckpt)])
    assert result.returncode == 0, result.stderr
    assert main(["--load", str(ckpt), "--out", str(out),
                 "--fp32-state-dict", str(tmp_path / "fp32.safetensors")]) == 0

    ours = load_consolidated_model(str(ckpt)).eval()
    hf = GPT2LMHeadModel.from_pretrained(out, local_files_only=True).eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(ids)[..., : ours.config.vocab_size]
        got = hf(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    generated = hf.generate(ids[:1, :4], max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, 9)

    from safetensors.torch import load_file

    fp32 = load_file(str(tmp_path / "fp32.safetensors"))
    assert fp32["embedding.word_embeddings.weight"].dtype == torch.float32


def test_export_errors(tmp_path):
    from megatron_lite.export import main

    assert main(["--load", str(tmp_path), "--out", str(tmp_path / "hf")]) == 1
