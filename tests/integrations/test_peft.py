"""PEFT LoRA on a frozen base: co.hf.enable, the Trainer callback, and co.offload.

A tiny Llama from a config (no download) wrapped by ``peft.get_peft_model``: the base weights are
frozen (``requires_grad=False``), only the LoRA adapters train. A frozen base weight saved for
backward (``nn.Linear`` saves ``weight.t()`` to compute the input's gradient) is a parameter's
storage: ckpt_offload must keep it -- counted as ``kept_by_reason["parameter"]``, never
offloaded as an activation -- and gradients must be bit-identical to the run without
ckpt_offload. "QLoRA-style": the same with the frozen base in bf16 (the adapters stay fp32, as
PEFT casts them).
"""

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import ckpt_offload as co  # noqa: E402
from conftest import assert_bit_identical, cpu_offload, grads_of  # noqa: E402
from helpers import hf_cpu_options as hf_options  # noqa: E402  (the options dict co.hf takes)
from helpers import llama, loss_of, train  # noqa: E402

TARGETS = ["q_proj", "v_proj", "up_proj"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices on a busy 2-core machine
    yield
    torch.set_num_threads(threads)


def lora(dtype=torch.float32):
    torch.manual_seed(0)
    base = llama().to(dtype)
    base.config.use_cache = False  # as inside checkpointed layers (see test_hf.loss_of)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=TARGETS, init_lora_weights=False)
    model = peft.get_peft_model(base, config)  # init_lora_weights=False: lora_B is not zero, so it matters
    model.train()
    return model


def check_frozen(model, grads):
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert set(grads) == trainable  # no gradient reached a frozen base weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("every_n_layers", [1, 2])
def test_lora_with_hf_enable_bit_identical(pool, dtype, every_n_layers):
    model = lora(dtype)
    loss_of(model).backward()
    base = grads_of(model)
    check_frozen(model, base)

    model = lora(dtype)
    handle = co.hf.enable(model, every_n_layers=every_n_layers, offload=hf_options(pool))
    loss_of(model).backward()
    got = grads_of(model)
    assert handle.function.calls == len(handle.names) == len(range(0, 4, every_n_layers))
    assert pool.stats()["num_allocs"] > 0 and pool.stats()["bytes_in_use"] == 0
    assert_bit_identical(base, got)
    if dtype == torch.bfloat16:
        assert {p.dtype for n, p in model.named_parameters() if "lora_" not in n} == {torch.bfloat16}


def saved_by_kind(model):
    """Runs forward under plain recording hooks: how many saved tensors share a storage with a
    frozen weight, with a trainable one, or with no parameter (activations)."""
    frozen = {p.untyped_storage().data_ptr() for p in model.parameters() if not p.requires_grad}
    trainable = {p.untyped_storage().data_ptr() for p in model.parameters() if p.requires_grad}
    kinds = {"frozen": 0, "trainable": 0, "activation": 0}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        kinds["frozen" if ptr in frozen else "trainable" if ptr in trainable else "activation"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return kinds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_frozen_base_weights_kept_as_parameters_not_offloaded(pool, dtype):
    model = lora(dtype)
    kinds = saved_by_kind(model)
    assert kinds["frozen"] > 0 and kinds["activation"] > 0, kinds
    loss_of(model).backward()
    base = grads_of(model)

    model = lora(dtype)
    ctx = cpu_offload(pool)
    with ctx:
        loss = loss_of(model)
    loss.backward()
    stats = ctx.stats()
    # Every saved view of a weight (frozen base or adapter) is kept as a parameter...
    assert stats["kept_by_reason"].get("parameter", 0) == kinds["frozen"] + kinds["trainable"], (kinds, stats)
    # ...and every other saved tensor is an activation: offloaded, or deduplicated against one
    # (min_bytes=0, nothing else is kept but buffers, e.g. the rotary inv_freq).
    offloaded = stats["tensors_offloaded"] + stats["tensors_deduplicated"]
    assert offloaded + stats["kept_by_reason"].get("buffer", 0) == kinds["activation"], (kinds, stats)
    assert pool.stats()["bytes_in_use"] == 0
    assert_bit_identical(base, grads_of(model))


def test_lora_trainer_callback_matches_without_ckpt_offload(tmp_path):
    base_losses, base_params = train(tmp_path / "base", lora())
    pool = co.HostPool(pinned=False)
    model = lora()
    cb = co.hf.OffloadCheckpointCallback(every_n_layers=2, offload=hf_options(pool))
    losses, params = train(tmp_path / "co", model, [cb])
    assert cb.handle.function.calls == 6  # 2 layers x 3 steps, through ckpt_offload's checkpoint
    assert pool.stats()["num_allocs"] > 0 and pool.stats()["bytes_in_use"] == 0
    assert losses == base_losses
    assert_bit_identical(base_params, params)
    # Only the adapters moved.
    fresh = dict(lora().named_parameters())
    moved = {n for n, p in params.items() if not torch.equal(p, fresh[n])}
    assert moved and all("lora_" in n for n in moved), moved
