"""The GPU check: kernels, engine, NCCL and CUDA graphs on a lent GPU (scripts/gpu_check.sh).

- ``run``: the check itself, sections a-g in one budget (``scripts/gpu_check.sh`` runs it);
  ``report``: the sections' outcomes, ``gpu_check.json``'s schema, writer and table.
- ``kernels``: the Triton kernels bit-exact against the reference and at HBM rate (a, b).
- ``engine``: the engine on NCCL against CPU/gloo, its streams' overlap, its host overhead
  (c, d, e); ``nccl``: the CUDA sanitizer and two ranks on two GPUs (f, g).
- ``graph_check``: the iteration as one CUDA graph against eager.
- ``side_by_side``: one GPU, this engine against FSDP2 and DeepSpeed.
- ``session.sh``: a whole GPU session (check, graph, train, side by side, profile);
  ``train_resume.sh``: torchrun training killed and resumed on NCCL.

Each module runs as ``python -m scripts.gpu_check.<name>``; the benchmarks are in
``scripts/bench/``.
"""
