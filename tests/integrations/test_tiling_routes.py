"""The routes to sequence-tiled recompute: co.apply(tile=...) and co.hf.enable(tile=...) on Hugging
Face models built from configs (Llama, Qwen2, GPT-2), the Trainer callback, and torch.compile
(default and fullgraph=True). Gradients against the untiled run within the documented tolerance."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import train

import ckpt_offload as co

transformers = pytest.importorskip("transformers")

CPU = {"devices": ["cpu"], "min_bytes": 0}
PARAM_RTOL = 1e-5


def tiny(kind: str, vocab: int = 96):
    torch.manual_seed(0)
    common = {"vocab_size": vocab, "bos_token_id": 0, "eos_token_id": 0}
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            n_positions=256,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            use_cache=False,
            **common,
        )
        return transformers.GPT2LMHeadModel(cfg).train()
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    cfg = cls[0](
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=88,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        pad_token_id=0,
        use_cache=False,
        **common,
    )
    return cls[1](cfg).train()


def batch(seq=96, vocab=96):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, vocab, (2, seq), generator=g)
    labels = ids.clone()
    labels[0, :9] = -100
    return {"input_ids": ids, "labels": labels}


def loss_and_grads(model, b):
    model.zero_grad(set_to_none=True)
    loss = model(**b).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close(got: dict, ref: dict):
    assert got.keys() == ref.keys()
    worst = max((float((got[n] - ref[n]).norm() / ref[n].norm()), n) for n in ref)
    assert worst[0] <= PARAM_RTOL, worst


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_hf_enable_tiles_every_mlp_and_fuses_the_head(kind):
    model = tiny(kind)
    b = batch()
    ref_loss, ref = loss_and_grads(copy.deepcopy(model), b)
    handle = co.hf.enable(model, offload=CPU, tile={"tile": 16, "head_tile": 40})
    layers = "transformer.h" if kind == "gpt2" else "model.layers"
    names = handle.tiles.names
    assert names[:2] == [f"{layers}.0.mlp", f"{layers}.1.mlp"] and names[-1] == "<head>"
    assert handle.tiles.kinds == ["mlp"] * 2 + ["norm"] * 4 + ["head"]  # two norms a layer (the default)
    out = model(**b)
    assert out.logits.shape == (2, 0, model.config.vocab_size)  # never the full logits
    assert torch.allclose(out.loss, ref_loss, rtol=1e-6)
    out.loss.backward()
    assert_close({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, ref)
    head = handle.tiles.tiled[-1].stats()
    assert head["tiles"] == 5 and head["tiles_recomputed"] == 5  # 192 tokens in tiles of 40
    model.eval()
    with torch.no_grad():  # outside training: the model's own forward, logits and all
        assert model(**b).logits.shape == (2, 96, model.config.vocab_size)
    handle.remove()
    assert "forward" not in model.__dict__ and not any("forward" in m.__dict__ for m in model.modules())


def test_hf_head_loss_divides_by_num_items_in_batch_as_hugging_face_does():
    model = tiny("llama")
    b = batch()
    ref = model(**b, num_items_in_batch=torch.tensor(150)).loss
    handle = co.hf.enable(model, tile=True)
    assert torch.allclose(model(**b, num_items_in_batch=torch.tensor(150)).loss, ref, rtol=1e-6)
    handle.remove()


@pytest.mark.parametrize("kind", ["qwen2", "gpt2"])
def test_co_apply_tile_on_hugging_face_models(kind):
    model = tiny(kind)
    b = batch()
    _, ref = loss_and_grads(copy.deepcopy(model), b)
    handle = co.apply(model, offload=CPU, tile=co.TileOptions(tile=32, norms=False))
    assert handle.tiles.kinds == ["mlp", "mlp", "head"]
    _, got = loss_and_grads(model, b)
    assert_close(got, ref)
    handle.remove()


def test_trainer_callback_with_tile(tmp_path):
    from helpers import VOCAB

    ref_losses, ref_params = train(tmp_path / "ref", tiny("llama", VOCAB))
    cb = co.hf.OffloadCheckpointCallback(offload=CPU, tile={"tile": 2, "head_tile": 4})  # 8-token rows
    losses, params = train(tmp_path / "tiled", tiny("llama", VOCAB), callbacks=[cb])
    assert cb.handle.tiles is not None and cb.handle.tiles.stats()["tiles_recomputed"] > 0
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for n, p in params.items():
        assert float((p - ref_params[n]).norm()) <= 1e-5 * float(ref_params[n].norm()) + 1e-7, n


def test_trainer_callback_refuses_a_bad_tile():
    with pytest.raises(TypeError, match="tile must be True/False/None"):
        co.hf.OffloadCheckpointCallback(tile=[1])


# --- torch.compile -------------------------------------------------------------------------------


class CountingBackend:
    """aot_eager that counts the graphs it is given."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        self.graphs += 1
        return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(gm, example_inputs)


def demo_model():
    from models_for_tests import TinyTransformer, lm_loss, make_batch, make_config

    cfg = make_config("tiny", layers=2, dim=32, heads=2, seq=32, vocab=61, batch=2)
    model = TinyTransformer(
        vocab=cfg.vocab, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, seq=cfg.seq, dropout=0.0, seed=0
    ).train()
    tokens = make_batch(cfg, seed=1)
    return model, lambda m: lm_loss(m, tokens)


def _grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss_fn(model).backward()
    return {n.replace("_orig_mod.", ""): p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.usefixtures("_fresh_dynamo")
@pytest.mark.parametrize("fullgraph", [False, True], ids=["default", "fullgraph"])
def test_compiled_model_with_tiled_mlps(fullgraph):
    from torch._dynamo.utils import counters

    model, loss_fn = demo_model()
    ref = _grads(model, loss_fn)
    handle = co.apply(model, offload=CPU, tile={"tile": 8, "norms": False})
    backend = CountingBackend()
    got = _grads(torch.compile(model, backend=backend, fullgraph=fullgraph), loss_fn)
    assert_close(got, ref)
    stats = handle.tiles.stats()
    if fullgraph:
        # One graph: each tile traced as a checkpoint, the blocks' inputs offloaded inside it.
        assert backend.graphs == 1 and not counters["graph_break"], dict(counters["graph_break"])
        assert stats["calls"] == 0
    else:
        # The graph breaks at each tiled call, whose tiles run the MLP compiled (its own graph).
        assert stats["calls"] == 2 and stats["tiles_recomputed"] == 2 * 4
        assert backend.graphs >= 3
    handle.remove()


@pytest.mark.usefixtures("_fresh_dynamo")
def test_fullgraph_with_the_fused_head():
    """torch.compile(model, fullgraph=True) of a causal LM with its head fused: the fused forward
    runs in eager code around the model's own forward, which compiles as one graph (tiled MLPs and
    offloaded checkpoints traced into it); the tiled loss runs eagerly."""
    from torch._dynamo.utils import counters

    model = tiny("gpt2")
    b = batch()
    _, ref = loss_and_grads(copy.deepcopy(model), b)
    handle = co.hf.enable(model, offload=CPU, tile={"tile": 16, "head_tile": 48})
    backend = CountingBackend()
    _, got = loss_and_grads(torch.compile(model, backend=backend, fullgraph=True), b)
    assert backend.graphs == 1 and not counters["graph_break"], dict(counters["graph_break"])
    assert_close({k.replace("_orig_mod.", ""): v for k, v in got.items()}, ref)
    assert handle.tiles.tiled[-1].stats()["tiles_recomputed"] > 0  # the head: eager, tiled
    handle.remove()
