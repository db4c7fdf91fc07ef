"""Run DeepSpeed-Chat's step-1 supervised fine-tuning script (main.py, unmodified on disk) on 2
gloo ranks, under DeepSpeed or, with its one import line changed, under zeropp.

``prepare(root)`` builds what the script would download: a tiny OPT causal LM with a byte-level
BPE tokenizer trained here (``root/model``), and dschat's ``local/jsonfile`` data set
(``root/chat/data/{train,eval}.json``, next to a copy of the ``dschat`` package, because
dschat looks for the data three directories above its own ``data_utils.py``).

What this runner adds around the script is observation and launching only:

* with ``--system zeropp`` it replaces the line ``import deepspeed`` by
  ``import zeropp as deepspeed`` in main.py's source text it executes (the file is not
  changed); dschat's own ``import deepspeed`` lines stay (SOURCES.md says why), and the one
  line of ``DSCHAT_PORT`` is changed in prepare()'s copy for both systems;
* it records each training micro-step's loss and the lr in force (a wrapper on the engine's
  ``backward``), each evaluation's loss (a wrapper on dschat's ``get_all_reduce_mean``, which
  the script's evaluation calls once per evaluation), what the engine ran (ZeRO stage,
  dtype, optimizer, optimizer steps, epochs counted by ``tput_timer``) and, in ``seconds``,
  when each phase of the script began.

Each rank writes its record as JSON to the path in ``CHAT_EXAMPLE_RESULT``. By hand, from the
repository root:

    .venv/bin/python tests/material/deepspeed_chat/run_chat.py --launch --system zeropp
"""

from __future__ import annotations

import argparse
import builtins
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "main.py"
RESULT_ENV = "CHAT_EXAMPLE_RESULT"

_spec = importlib.util.spec_from_file_location(
    "cifar_run_example", HERE.parent / "deepspeed_examples" / "run_example.py")
run_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_example)

# The data: 64 training and 16 evaluation samples, in the "Human: ... Assistant: ..." form of
# DeepSpeed-Chat's data sets, from a few templates (so that 8 steps lower the eval loss).
TRAIN_SAMPLES, EVAL_SAMPLES = 64, 16
MAX_SEQ_LEN = 32
VOCAB_SIZE = 304
# One epoch: 64 samples / (2 ranks x micro-batch 2 x accumulation 2) = 8 optimizer steps.
MICRO_BATCH, ACCUMULATION = 2, 2


def script_args(root: Path, workdir: Path, rank: int) -> list[str]:
    """The script's own flags (those of its training_scripts/opt/*.sh, small), and
    ``--local_rank=N`` as the ``deepspeed`` launcher passes it."""
    return [
        f"--local_rank={rank}",
        "--data_path", "local/jsonfile", "--data_split", "10,0,0",
        "--data_output_path", str(workdir / "data_files"),
        "--model_name_or_path", str(root / "model"),
        "--per_device_train_batch_size", str(MICRO_BATCH),
        "--per_device_eval_batch_size", "4",
        "--max_seq_len", str(MAX_SEQ_LEN),
        "--learning_rate", "3e-3", "--weight_decay", "0.1",
        "--num_train_epochs", "1",
        "--gradient_accumulation_steps", str(ACCUMULATION),
        "--lr_scheduler_type", "cosine", "--num_warmup_steps", "2",
        "--seed", "1234", "--dropout", "0.0",
        "--zero_stage", "3", "--dtype", "bf16",
        "--print_loss",
        "--output_dir", str(workdir / "output"),
    ]


# ---- the material the script would download -------------------------------------------
_SUBJECTS = ["the sky", "the sea", "grass", "snow", "the sun", "a lemon", "coal", "milk"]
_COLOURS = ["blue", "green", "green", "white", "yellow", "yellow", "black", "white"]
_ANIMALS = ["cat", "dog", "cow", "duck", "horse", "sheep", "pig", "owl"]
_SOUNDS = ["meow", "woof", "moo", "quack", "neigh", "baa", "oink", "hoot"]


# Lines of the dschat copy that prepare() changes, the same for both systems (SOURCES.md says
# why): {file: [(upstream line, line run here)]}.
DSCHAT_PORT = {
    # transformers 5 moved no_init_weights (the examples were written against transformers 4).
    "dschat/utils/model/model_utils.py": [
        ("from transformers.modeling_utils import no_init_weights",
         "from transformers.initialization import no_init_weights"),
    ],
}


def copy_dschat(target: Path) -> None:
    """``dschat`` into ``target``, with ``DSCHAT_PORT``'s lines replaced (each once)."""
    shutil.copytree(HERE / "dschat", target)
    for relative, replacements in DSCHAT_PORT.items():
        path = target.parent / relative
        text = path.read_text()
        for old, new in replacements:
            if text.count(old) != 1:
                raise RuntimeError(f"expected one {old!r} in {HERE / relative}")
            text = text.replace(old, new)
        path.write_text(text)


def _samples(count: int, rng: random.Random) -> list[dict]:
    out = []
    for _ in range(count):
        if rng.random() < 0.5:
            i = rng.randrange(len(_SUBJECTS))
            prompt = f"Human: What colour is {_SUBJECTS[i]}? Assistant:"
            chosen = f"{_SUBJECTS[i].capitalize()} is {_COLOURS[i]}."
            rejected = f"{_SUBJECTS[i].capitalize()} is {_COLOURS[i - 1]}."
        else:
            i = rng.randrange(len(_ANIMALS))
            prompt = f"Human: What does a {_ANIMALS[i]} say? Assistant:"
            chosen = f"A {_ANIMALS[i]} says {_SOUNDS[i]}."
            rejected = f"A {_ANIMALS[i]} says {_SOUNDS[i - 1]}."
        out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def prepare(root: Path) -> Path:
    """Write the tiny model, its tokenizer, a copy of dschat and the data under ``root``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import OPTConfig, OPTForCausalLM

    root = Path(root)
    rng = random.Random(0)
    train, evaluation = _samples(TRAIN_SAMPLES, rng), _samples(EVAL_SAMPLES, rng)
    chat = root / "chat"
    copy_dschat(chat / "dschat")
    (chat / "data").mkdir(parents=True)
    for name, rows in (("train", train), ("eval", evaluation)):
        (chat / "data" / f"{name}.json").write_text(
            "".join(json.dumps(row) + "\n" for row in rows))

    # A byte-level BPE like OPT's (GPT-2's), trained on the samples' text and written as the
    # hub's OPT checkpoints hold their tokenizer: vocab.json, merges.txt and a
    # tokenizer_config.json naming GPT2Tokenizer (dschat's save_hf_format calls
    # save_vocabulary, which copies vocab.json). 304 entries, a multiple of 8, so the
    # script's resize_token_embeddings keeps the embedding as it is.
    special = ["<pad>", "</s>", "<unk>"]  # ids 0, 1, 2
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = [" " + r["prompt"] + " " + r[k] for r in train + evaluation
             for k in ("chosen", "rejected")]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bpe.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"the BPE has {bpe.get_vocab_size()} entries, not {VOCAB_SIZE}")
    model_dir = root / "model"
    model_dir.mkdir(parents=True)
    bpe.model.save(str(model_dir))  # vocab.json, merges.txt
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "GPT2Tokenizer", "pad_token": "<pad>", "eos_token": "</s>",
        "bos_token": "</s>", "unk_token": "<unk>"}, indent=2))

    # No linear biases: the key projection's bias has no gradient (softmax ignores a
    # constant added to every key's score), so Adam would move it by normalized rounding
    # noise, which differs between any two implementations and says nothing of training.
    config = OPTConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, word_embed_proj_dim=64, num_hidden_layers=2,
        num_attention_heads=4, ffn_dim=128, max_position_embeddings=MAX_SEQ_LEN,
        enable_bias=False, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    torch.manual_seed(0)
    OPTForCausalLM(config).save_pretrained(model_dir)
    # dschat's load_hf_tokenizer loads the tokenizer named by config.json's _name_or_path.
    config_path = model_dir / "config.json"
    saved = json.loads(config_path.read_text())
    saved["_name_or_path"] = str(model_dir)
    config_path.write_text(json.dumps(saved, indent=2))
    return root


# ---- one rank ----------------------------------------------------------------------------
def script_source(system: str) -> str:
    """main.py's text as it is executed: unchanged for DeepSpeed, one line for zeropp."""
    return run_example.script_source(system, SCRIPT)


def run_rank(system: str, args: list[str]) -> int:
    rank = int(os.environ["RANK"])
    record: dict = {"system": system, "rank": rank, "losses": [], "lrs": [], "eval_losses": [],
                    "status": "started", "seconds": {}}
    began = time.perf_counter()

    def mark(event: str) -> None:  # where a rank's time goes, seconds since it started
        record["seconds"].setdefault(event, round(time.perf_counter() - began, 2))
    result_path = os.environ[RESULT_ENV].format(rank=rank)
    code = 1
    # Python put this file's directory first on sys.path; its dschat is the pristine copy, and
    # the one to import is prepare()'s (on PYTHONPATH), next to the data.
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    try:
        import torch

        torch.set_num_threads(1)
        run_example.import_deepspeed()  # without its shm op; dschat imports deepspeed too
        module = __import__(system)  # what ``import deepspeed`` binds in main.py
        import dschat.utils.utils as dschat_utils

        engines = []
        original_initialize = module.initialize

        def initialize(*a, **kw):
            mark("initialize")
            result = original_initialize(*a, **kw)
            mark("initialized")
            engine = result[0]
            engines.append(engine)
            original_backward = engine.backward

            def backward(loss, *ba, **bkw):
                mark("first_backward")
                record["losses"].append(loss.item())
                record["lrs"].append(engine.get_lr()[0])
                return original_backward(loss, *ba, **bkw)

            engine.backward = backward
            return result

        module.initialize = initialize
        original_mean = dschat_utils.get_all_reduce_mean

        def get_all_reduce_mean(tensor):
            mark("first_evaluation" if not record["eval_losses"] else "last_evaluation")
            mean = original_mean(tensor)
            record["eval_losses"].append(mean.item())
            return mean

        dschat_utils.get_all_reduce_mean = get_all_reduce_mean

        import dschat.utils.data.data_utils as dschat_data
        import dschat.utils.model.model_utils as dschat_model

        def timed(owner, name: str) -> None:
            original = getattr(owner, name)

            def call(*a, **kw):
                mark(name)
                try:
                    return original(*a, **kw)
                finally:
                    mark(f"{name} done")

            setattr(owner, name, call)

        timed(module, "init_distributed")
        timed(dschat_utils, "load_hf_tokenizer")
        timed(dschat_model, "create_hf_model")
        timed(dschat_data, "create_prompt_dataset")
        mark("imported")
        saved_argv = sys.argv
        sys.argv = [str(SCRIPT)] + args
        namespace = {"__name__": "__main__", "__file__": str(SCRIPT), "__builtins__": builtins}
        start = time.perf_counter()
        try:
            exec(compile(script_source(system), str(SCRIPT), "exec"), namespace)
        finally:
            sys.argv = saved_argv
        record["script_seconds"] = time.perf_counter() - start
        mark("script_done")
        if not engines:
            raise RuntimeError("the script never called initialize")
        engine = engines[-1]
        record.update(run_example.what_ran(engine))
        record["epoch_count"] = engine.tput_timer.epoch_count
        torch.distributed.barrier()
        record["status"] = "ok"
        code = 0
    except BaseException:  # the parent reads the traceback from the record and the log
        record["status"] = "error"
        record["error"] = traceback.format_exc()
        traceback.print_exc()
    with open(result_path, "w") as f:
        json.dump(record, f, indent=1)
    return code


def launch(system: str, root: Path, workdir: Path, timeout: float = 600) -> list[dict]:
    """Start 2 ranks of main.py under ``system`` on ``prepare``'s material in ``root``; the
    script's output directory is ``workdir/output``."""
    root, workdir = Path(root), Path(workdir)

    def argv_for(rank: int) -> list[str]:
        return ([sys.executable, str(Path(__file__).resolve()), "--system", system, "--"]
                + script_args(root, workdir, rank))

    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HOME": str(root / "hf_home"), "TOKENIZERS_PARALLELISM": "false"}
    return run_example.start_ranks(system, argv_for, workdir, result_env=RESULT_ENV,
                                   pythonpath=[root / "chat"], extra_env=offline,
                                   timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args_for_script = []
    if "--" in argv:
        at = argv.index("--")
        argv, args_for_script = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", choices=["deepspeed", "zeropp"], required=True)
    parser.add_argument("--root", help="with --launch: prepare()'s directory (made if absent)")
    parser.add_argument("--launch", action="store_true",
                        help="prepare, start 2 ranks and print their records (else: be one rank)")
    args = parser.parse_args(argv)
    if args.launch:
        start = time.perf_counter()
        root = Path(args.root or tempfile.mkdtemp(prefix="chat_material_"))
        if not (root / "model").exists():
            prepare(root)
        records = launch(args.system, root, root / f"run_{args.system}")
        for record in records:
            print(json.dumps(record))
        print(f"wall time {time.perf_counter() - start:.1f} s", flush=True)
        return 0
    code = run_rank(args.system, args_for_script)
    # The record is on disk: leave without interpreter/C++ teardown (gloo), which can hang or
    # abort after the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
