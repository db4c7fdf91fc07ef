"""Test-wide settings, and the order the suite runs in."""

import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter. Triton reads the switch when
# it is first imported, and other test modules (transformers, deepspeed) may import it
# first, so it is set before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# [Note: the suite's order] scripts/test.sh runs the suite on two xdist workers, a file per
# worker at a time (--dist loadfile), handing out files in collection order. A file that
# starts last runs alone at the end while the other worker idles, so the files that take
# longest (measured: `bash scripts/test.sh --durations=0`, summed per file; every file of
# 14 s or more) are collected first and the quick ones fill the tail. The list is an
# ordering hint only: a file missing from it runs after these, in its usual order.
LONGEST_FIRST = (
    "test_supervise.py", "test_kernel_compile.py", "test_simulated_cluster.py",
    "test_pretrain_cli.py", "test_compiled_blocks.py", "test_kernels.py", "test_resilience.py",
    "test_deepspeed_example.py", "test_deepspeed_optimizers.py", "test_async_checkpoint.py",
    "test_gpu_side_by_side.py", "test_offload.py", "test_hf_llama.py",
    "test_deepspeed_param_face.py", "test_config_corpus.py", "test_export.py", "test_lab.py",
    "test_checkpoint_integrity.py", "test_zeropp_engine.py", "test_launch_scripts.py",
    "test_watchdog.py", "test_zero_stages.py", "test_host_ops.py", "test_deepspeed_convert.py",
    "test_zero3_parity.py", "test_deepspeed_chat.py", "test_quantized_collectives.py",
    "test_weight_deltas.py", "test_gpu_check.py", "test_gradient_reduction.py",
    "test_sample_corpus.py", "test_training_semantics.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: ties keep order
