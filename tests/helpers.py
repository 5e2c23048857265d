"""Helpers shared by several test modules (test modules never import each other).

* GPU: ``HAS_GPU``, ``sleep_stream`` (a spin kernel holding the compute stream), ``cuda_device``
  (the body of the cuda-only ``device`` fixtures of the tests/gpu files).
* Contexts: ``exit_from_another_thread`` (an entered co.offload context exited by a new thread).
* Child processes: ``run_python`` (a script in a fresh Python that imports the ckpt_offload these
  tests imported), ``run_child`` and ``outside_the_tree`` (the same for another command line).
* Autograd: ``Probe``, an autograd function checking that saved tensors come back exactly;
  ``Scribble``, one whose backward writes its saved input in place (a kernel using it as scratch);
  ``grads_of`` (a module's gradients by name) and ``step_grads`` (one step, its forward inside a context).
* Paths: ``TESTS_DIR`` (this folder, where the shared helper modules are; the test modules sit in
  its subfolders) and ``REPO_ROOT`` (the checkout: benchmarks/, docs/, scripts/).
* Hugging Face: tiny models (``gpt2``, ``llama``, ``bert``; no download), ``batch``, ``loss_of``,
  ``TokenDataset``, ``train`` (3 Trainer steps on CPU), ``QUIET_CPU_TRAINING`` (the Trainer arguments every
  test run shares), ``hf_cpu_options``, ``word_tokenizer``. transformers is
  imported inside the functions: the modules that use them skip without it.

Fixtures and the assertions every test uses (``pool``, ``stream``, ``device``, ``cpu_offload``,
``assert_bit_identical``, ...) are in conftest.py.
"""

from __future__ import annotations

import inspect
import os

import torch

import ckpt_offload as co


try:  # ckpt_offload's one test of "CUDA tensors can be offloaded here" (_runtime.gpu_usable)
    HAS_GPU = bool(co.build_info()["gpu_available"])
except Exception:  # a broken driver must skip, not error at collection
    HAS_GPU = False
GPU_REASON = "needs a CUDA GPU and a CUDA build of ckpt_offload (co.build_info()['gpu_available'])"

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)

# Spin-kernel length that holds the compute stream for a few milliseconds (~2 GHz clocks).
SLEEP_CYCLES = 10_000_000


def sleep_stream(cycles: int = SLEEP_CYCLES) -> None:
    """Holds the current stream busy, so that a copy that does not wait for it runs early."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(cycles)
    else:  # pragma: no cover - very old torch: a long matmul chain does the same job
        a = torch.randn(2048, 2048, device="cuda")
        for _ in range(8):
            a = a @ a.T / 2048.0


def cuda_device():
    """Generator body of a cuda ``device`` fixture: the current CUDA device, synchronized before
    and after the test (so one test's queued copies cannot leak into the next)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(dev)
    yield dev
    co.synchronize()
    torch.cuda.synchronize(dev)


# Contexts


def exit_from_another_thread(ctx) -> None:
    """Exits ``ctx`` (entered on this thread) from a new thread, which must warn that it is a
    different thread; returns once that thread has finished."""
    import threading

    import pytest

    def other():
        with pytest.warns(RuntimeWarning, match="different thread"):
            ctx.__exit__(None, None, None)

    t = threading.Thread(target=other)
    t.start()
    t.join()


# Child processes


def outside_the_tree() -> dict:
    """subprocess.run arguments for a `python -c` child that imports the ckpt_offload these tests
    imported: `python -c` puts its cwd first on sys.path, where a checkout's ckpt_offload/ (without
    a built _C) would shadow the installed package."""
    import tempfile

    return {
        "cwd": tempfile.gettempdir(),
        "env": dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                p for p in (os.path.dirname(os.path.dirname(co.__file__)), os.environ.get("PYTHONPATH")) if p
            ),
        ),
    }


def run_child(cmd: list, timeout: float = 120):
    """``subprocess.run(cmd)`` outside the tree (:func:`outside_the_tree`), its output captured as text."""
    import subprocess

    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **outside_the_tree())


def run_python(script: str, *args: str, timeout: float = 120):
    """Runs ``script`` in a fresh Python (``python -c script args...``) outside the tree; the
    completed process, its output captured as text."""
    import sys

    return run_child([sys.executable, "-c", script, *args], timeout=timeout)


# Autograd


def grads_of(module) -> dict:
    """The parameters' gradients of ``module`` (cloned), by name; those without one left out."""
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def train_step(model, x, ctx=None, retain=False) -> tuple:
    """One training step of ``model`` on ``x`` (loss ``(y * y).sum()``), its forward inside
    ``ctx`` when given (a co.offload context), the graph kept with ``retain``; returns the
    gradients (:func:`grads_of`) and the loss."""
    model.zero_grad(set_to_none=True)
    if ctx is None:
        y = model(x)
    else:
        with ctx:
            y = model(x)
    loss = (y * y).sum()
    loss.backward(retain_graph=retain)
    return grads_of(model), loss


def step_grads(model, x, ctx=None) -> dict:
    """The gradients of one :func:`train_step`."""
    return train_step(model, x, ctx)[0]


class Probe(torch.autograd.Function):
    """Saves the given tensors through autograd and checks in backward that each comes back
    with the same values, dtype, sizes, strides and storage offset."""

    seen = []

    @staticmethod
    def forward(ctx, x, *extras):
        ctx.save_for_backward(x, *extras)
        ctx.expected = [(e.clone(), e.size(), e.stride(), e.storage_offset(), e.dtype) for e in extras]
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        x, *extras = ctx.saved_tensors
        for got, (val, size, stride, offset, dtype) in zip(extras, ctx.expected):
            assert got.dtype == dtype and got.size() == size and got.stride() == stride
            assert got.storage_offset() == offset
            assert torch.equal(got, val)
            Probe.seen.append(got.dtype)
        return (grad * 2,) + (None,) * len(extras)


# Hugging Face tiny models and training

B, T, VOCAB = 2, 8, 100


class Scribble(torch.autograd.Function):
    """Saves a and b; backward uses them, then writes a in place (a kernel reusing its input as
    scratch) unless ``Scribble.writes`` is False (the run whose write goes nowhere)."""

    writes = True

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        ga, gb = g * b, (g * a).sum(0) if b.dim() < a.dim() else g * a
        if Scribble.writes:
            a.mul_(0)
        return ga, gb


def gpt2(**config):
    """A 4-layer GPT-2 of width 32 (``config``: GPT2Config fields to change, e.g. ``use_cache=False``)."""
    import transformers

    cfg = transformers.GPT2Config(
        **{
            "n_layer": 4,
            "n_embd": 32,
            "n_head": 2,
            "vocab_size": VOCAB,
            "n_positions": 64,
            "bos_token_id": 0,
            "eos_token_id": 0,
            **config,
        }
    )
    return transformers.GPT2LMHeadModel(cfg)


def llama():
    import transformers

    cfg = transformers.LlamaConfig(
        num_hidden_layers=4,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attention_dropout=0.1,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(cfg)


def bert():
    import transformers

    cfg = transformers.BertConfig(
        num_hidden_layers=4,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return transformers.BertForMaskedLM(cfg)


def batch():
    """A fixed batch for the tiny Hugging Face models, with padding (every layer gets a real mask)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T - 2 :] = 0  # padding, so every layer receives a real attention mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


def loss_of(model, seed=5):
    """The loss of a tiny Hugging Face model on `batch()`, from a fixed RNG state."""
    torch.manual_seed(seed)
    # Checkpointed layers run without a KV cache (Hugging Face turns use_cache off in them); the
    # reference must too: with a cache GPT-2 takes another attention path, rounding differently.
    extra = {"use_cache": False} if "use_cache" in inspect.signature(type(model).forward).parameters else {}
    return model(**batch(), **extra).loss


def word_tokenizer(vocab=VOCAB):
    """A word-level tokenizer built here, nothing downloaded (TRL's trainers want a processing class):
    the words ``w0`` .. ``w{vocab-1}`` are the ids 0 .. vocab-1; ``w0`` is end of sequence and padding."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w1"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="w0", pad_token="w0", unk_token="w1")


def hf_cpu_options(pool):
    """The options dict co.hf / co.checkpoint take to offload every CPU tensor into `pool`."""
    return {"devices": ["cpu"], "min_bytes": 0, "pool": pool}


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, n=12):
        g = torch.Generator().manual_seed(2)
        self.ids = torch.randint(1, VOCAB, (n, T), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# The TrainingArguments (and TRL configs) every test run shares: on CPU, logging each step, seeded, no
# checkpoint written, no report, no worker process, no progress bar.
QUIET_CPU_TRAINING = dict(
    report_to=[],
    use_cpu=True,
    logging_steps=1,
    save_strategy="no",
    seed=7,
    dataloader_num_workers=0,
    disable_tqdm=True,
)


def train(tmp_path, model, callbacks=(), **args):
    """Trains `model` 3 steps with the Trainer on CPU; returns the logged losses and the final parameters."""
    import transformers

    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, **{**QUIET_CPU_TRAINING, **args}
    )
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=TokenDataset(), callbacks=list(callbacks))
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == 3
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
