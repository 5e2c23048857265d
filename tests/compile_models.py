"""The models the torch.compile tests build (the demo model, GPT-2 and Llama from tiny configs),
their gradients, and the forward's peak read from torch.profiler's memory events."""

import json
import os
import tempfile

import pytest
import torch
from models_for_tests import TinyTransformer, lm_loss, make_batch, make_config
from torch.profiler import ProfilerActivity, profile

# Each builder returns (model, loss_fn, blocks): `part="block"` lists the transformer blocks,
# `part="mlp"` the MLP inside each block.


def demo(part="block"):
    cfg = make_config("tiny", layers=2, dim=32, heads=2, seq=8, vocab=61, batch=2)
    model = TinyTransformer(
        vocab=cfg.vocab, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, seq=cfg.seq, seed=0
    ).train()
    batch = make_batch(cfg, seed=1)
    blocks = list(model.blocks)
    if part == "mlp":
        blocks = [b.mlp if hasattr(b, "mlp") else b for b in blocks]
    return model, (lambda m: lm_loss(m, batch)), blocks


def gpt2(part="block"):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=64,
            n_positions=16,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="eager",
            use_cache=False,
        )
    ).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    blocks = list(model.transformer.h)
    return model, (lambda m: m(input_ids=ids, labels=ids).loss), [b.mlp for b in blocks] if part == "mlp" else blocks


def llama(part="block"):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=64,
            max_position_embeddings=16,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
            use_cache=False,
        )
    ).train()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3))
    blocks = list(model.model.layers)
    return model, (lambda m: m(input_ids=ids, labels=ids).loss), [b.mlp for b in blocks] if part == "mlp" else blocks


def sequential(part="block"):
    """Blocks that are torch's own modules: an nn.Sequential of nn.Sequential(Linear, GELU, Linear)
    (their forward is in torch/nn, a file Dynamo never starts compiling on). `part="mlp"`: each
    block's first Linear."""
    model = mlp_blocks(4, 16)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    blocks = list(model)
    return model, (lambda m: m(x).sum()), [b[0] for b in blocks] if part == "mlp" else blocks


MODELS = {"demo": demo, "gpt2": gpt2, "llama": llama, "sequential": sequential}


def wrap(route, model, loss_fn, pool, **kwargs):
    """Wraps ``model``'s blocks by ``route`` ("co.apply", "co.apply segments", "co.hf.enable",
    "plan offload", "plan recompute_offload"), offloading into ``pool``; returns the handle.
    ``kwargs`` go to co.apply (checkpoint keywords) or into the offload options (``store_dtype``)."""
    import math

    import ckpt_offload as co

    opts = {"devices": ["cpu"], "min_bytes": 0, "pool": pool}
    if "store_dtype" in kwargs:
        opts["store_dtype"] = kwargs.pop("store_dtype")
    if route == "co.apply":
        return co.apply(model, offload=opts, **kwargs)
    if route == "co.apply segments":
        return co.apply(model, offload=opts, segments=1)  # one checkpoint around all the blocks
    if route == "co.hf.enable":
        return co.hf.enable(model, offload=opts, **kwargs)
    kinds = {"plan offload": ("offload",), "plan recompute_offload": ("recompute_offload",)}[route]
    plan = co.plan(
        model,
        lambda: loss_fn(model).backward(),
        budget=2**40,
        bandwidth=math.inf,
        kinds=kinds,
        segments=False,
        offload=opts,
    )
    model.zero_grad(set_to_none=True)
    return plan.apply()


def grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)  # dropout
    loss_fn(model).backward()
    # torch.compile(module) puts the original under "_orig_mod."; the parameters are the same.
    return {k.replace("_orig_mod.", ""): p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def reference(name):
    """The gradients of the same model compiled whole, without ckpt_offload."""
    model, loss_fn, _ = MODELS[name]()
    got = grads(torch.compile(model, backend="aot_eager"), loss_fn)
    torch._dynamo.reset()
    return got


def forward_peak(forward) -> int:
    """The most bytes torch's CPU allocator held during ``forward()`` above its start (profiler
    memory events; the host pool allocates its own memory and is not counted)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = forward()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    os.remove(path)
    del out
    start = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    return max(e["args"]["Total Allocated"] for e in events) - start


def mlp_blocks(n=6, dim=128):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[
            torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
            for _ in range(n)
        ]
    ).train()


class EagerProbe:
    """Counts the calls of the probed modules that run eagerly: under compile the hook is traced
    into the graph and its branch folds away, so a compiled call counts nothing."""

    def __init__(self, modules):
        self.calls = 0
        for m in modules:
            m.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if not torch.compiler.is_compiling():
            self.calls += 1


class CountingBackend:
    """An aot_eager backend that counts the graphs it compiles, the ckpt_offload ops in them, and
    how often the compiled graphs run (forward graphs: a recompute in backward is a forward run)."""

    def __init__(self):
        from torch._dynamo.backends.debugging import aot_eager

        self.aot_eager = aot_eager
        self.graphs = 0
        self.runs = 0
        self.ops = []

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        self.ops += [str(n.target) for n in gm.graph.nodes if "ckpt_offload" in str(n.target)]
        compiled = self.aot_eager(gm, example_inputs)

        def run(*args):
            self.runs += 1
            return compiled(*args)

        return run
