"""co.hf: ckpt_offload's checkpoint inside Hugging Face models and Trainer (tiny models from configs)."""

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ckpt_offload as co  # noqa: E402
from conftest import assert_bit_identical, grads_of  # noqa: E402
from helpers import QUIET_CPU_TRAINING, B, T, TokenDataset, batch, bert, gpt2, llama, loss_of, train  # noqa: E402
from helpers import hf_cpu_options as cpu_offload  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matrices: on a busy 2-core machine intra-op threads only wait for each other (10-50x slower).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Each model keeps its default dropout (Llama's attention dropout is turned on): co.checkpoint restores
# the RNG state for the recompute, so even with dropout the gradients are bit-identical.
MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert}


def make(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    model.train()
    return model


def layers_of(model):
    base = getattr(model, model.base_model_prefix)
    for path in ("h", "layers", "encoder.layer"):
        obj = base
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return list(obj)
    raise AssertionError(f"no layers found in {type(model).__name__}")


def base_grads(model):
    loss_of(model).backward()
    grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    return grads


def input_grad_hooks(model):
    return len(model.get_input_embeddings()._forward_hooks)


def hf_input_grad_hooks(name):
    twin = make(name)
    getattr(twin, next(n for n in ENABLE_NAMES if hasattr(twin, n)))()
    return input_grad_hooks(twin)


ENABLE_NAMES = ("activation_checkpointing_enable", "gradient_checkpointing_enable")


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("every_n_layers, offload", [(1, True), (2, True), (1, False)])
def test_gradients_bit_identical(pool, name, every_n_layers, offload):
    model = make(name)
    base = base_grads(model)
    handle = co.hf.enable(model, every_n_layers=every_n_layers, offload=cpu_offload(pool) if offload else False)
    # Input gradients as Hugging Face's own enable sets them (>= 5.0: on for models fed input_ids).
    assert input_grad_hooks(model) == hf_input_grad_hooks(name)
    loss_of(model).backward()
    assert handle.function.calls == len(handle.names) == len(range(0, 4, every_n_layers))
    assert_bit_identical(base, grads_of(model))
    assert pool.stats()["bytes_in_use"] == 0
    assert (pool.stats()["num_allocs"] > 0) == offload


@pytest.mark.parametrize("name", list(MODELS))
def test_exactly_the_selected_layers_recompute(pool, name):
    model = make(name)
    handle = co.hf.enable(model, every_n_layers=2, offload=cpu_offload(pool))
    layers = layers_of(model)
    assert [m for n, m in model.named_modules() if n in handle.names] == layers[0::2]
    counts = {}
    for i, layer in enumerate(layers):
        first = next(iter(layer.children()))  # a submodule: its hook runs in forward and in each recompute
        first.register_forward_pre_hook(lambda m, a, i=i: counts.__setitem__(i, counts.get(i, 0) + 1))
    loss = loss_of(model)
    assert counts == {0: 1, 1: 1, 2: 1, 3: 1}
    loss.backward()
    assert counts == {0: 2, 1: 1, 2: 2, 3: 1}


def storage_bytes(t):
    return t.untyped_storage().nbytes()


@pytest.mark.parametrize("name", list(MODELS))
def test_pool_holds_layer_inputs_shared_ones_once(pool, name):
    model = make(name)
    handle = co.hf.enable(model, every_n_layers=2, offload=cpu_offload(pool))
    checkpointed = [m for n, m in model.named_modules() if n in handle.names]
    received = []  # every tensor each checkpointed layer receives, positional or by keyword

    def record(module, args, kwargs):
        flat, _ = torch.utils._pytree.tree_flatten((args, kwargs))
        received.append([t for t in flat if isinstance(t, torch.Tensor)])

    hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for m in checkpointed]
    loss = loss_of(model)
    for h in hooks:
        h.remove()
    received = received[: len(checkpointed)]  # the forward's calls (older releases recompute through __call__)
    unique = {t.untyped_storage().data_ptr(): t for ts in received for t in ts}
    hidden = [ts[0] for ts in received]
    shared = [t for p, t in unique.items() if all(p != h.untyped_storage().data_ptr() for h in hidden)]
    # What the layers receive: their own hidden states, plus tensors every layer shares (Llama: the
    # rotary cos/sin and position ids; GPT-2: position ids; all: the padding mask), stored once.
    assert all(h.shape == (B, T, 32) and h.dtype == torch.float32 for h in hidden)
    assert any(t.dim() == 4 and t.shape[0] == B for t in shared), "the padding mask reached the layers"
    if name == "llama":
        assert sum(t.shape[-1] == 16 and t.is_floating_point() for t in shared) == 2  # cos, sin (head_dim 16)
    expected = sum(storage_bytes(h) for h in hidden) + sum(storage_bytes(t) for t in shared)
    assert pool.stats()["bytes_requested"] == expected
    assert pool.stats()["num_blocks_in_use"] == len(hidden) + len(shared)
    loss.backward()
    assert pool.stats()["bytes_in_use"] == 0


def test_remove_restores_the_model_and_disable():
    model = make("llama")
    layers = layers_of(model)
    before = [dict(m.__dict__) for m in layers]
    handle = co.hf.enable(model, offload=False)
    assert all(layer._gradient_checkpointing_func is handle.function for layer in layers)
    with pytest.raises(RuntimeError, match="already applied"):
        co.hf.enable(model)
    with pytest.raises(RuntimeError, match="already applied"):
        co.apply(model)
    handle.remove()
    handle.remove()  # harmless
    assert [dict(m.__dict__) for m in layers] == before
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert "activation_checkpointing_enable" not in model.__dict__ and "_ckpt_offload_handle" not in model.__dict__
    assert input_grad_hooks(model) == 0
    co.hf.enable(model, offload=False)
    co.hf.disable(model)
    assert "_ckpt_offload_handle" not in model.__dict__


def test_enable_returns_the_handle_class_of_every_route():
    model = make("llama")
    handle = co.hf.enable(model, every_n_layers=2, offload=False)
    assert isinstance(handle, co.CheckpointHandle) and handle.names == ["model.layers.0", "model.layers.2"]
    assert handle.kinds == ["recompute", "recompute"]
    handle.function.options = co.OffloadOptions(devices=["cpu"])
    assert handle.kinds == ["recompute_offload", "recompute_offload"]
    with pytest.warns(DeprecationWarning, match=r"handle\.remove\(\)"):
        handle.disable()  # 0.1.0's name of remove()
    assert handle.removed and "_ckpt_offload_handle" not in model.__dict__
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def test_deepcopy_of_an_enabled_model(pool):
    import copy

    model = make("llama")
    handle = co.hf.enable(model, offload=cpu_offload(pool))
    twin = copy.deepcopy(model)  # the pool is shared, not copied
    twin_handle = twin._ckpt_offload_handle
    assert twin_handle is not handle and twin_handle.names == handle.names
    base = base_grads(make("llama"))
    loss_of(twin).backward()
    assert_bit_identical(base, grads_of(twin))
    twin_handle.remove()
    assert not any(getattr(m, "gradient_checkpointing", False) for m in twin.modules())
    assert all(layer.gradient_checkpointing for layer in layers_of(model))


def test_model_reenable_keeps_our_function_and_warns_on_ignored_settings():
    model = make("gpt2")
    handle = co.hf.enable(model, every_n_layers=2, offload=False)
    names = list(handle.names)
    enable_names = [n for n in ENABLE_NAMES if hasattr(model, n)]
    for n in enable_names:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # Trainer's default call: nothing ignored, nothing to warn
            getattr(model, n)(None, every_n_layers=1, offload=False)
        with pytest.warns(UserWarning, match=r"keeps ckpt_offload's checkpoint .* ignores every_n_layers=3"):
            getattr(model, n)(every_n_layers=3)
        assert handle.names == names
        assert all(
            m._gradient_checkpointing_func is handle.function
            for m in model.modules()
            if hasattr(m, "gradient_checkpointing")
        )
    assert input_grad_hooks(model) == hf_input_grad_hooks("gpt2")  # re-enabling did not stack hooks
    handle.remove()
    assert input_grad_hooks(model) == 0


def test_errors_name_the_fix():
    with pytest.raises(TypeError, match=r"co\.apply"):
        co.hf.enable(torch.nn.Linear(2, 2))
    no_gc = type("NoCheckpointGPT2", (transformers.GPT2LMHeadModel,), {"supports_gradient_checkpointing": False})
    torch.manual_seed(0)
    model = no_gc(gpt2().config)
    with pytest.raises(ValueError, match=r"does not support gradient checkpointing.*co\.apply"):
        co.hf.enable(model)

    def custom(self, *args, **kwargs):  # a model whose checkpointing does not use the hook
        pass

    custom_gc = type("CustomGPT2", (transformers.GPT2LMHeadModel,), {"_set_gradient_checkpointing": custom})
    model = custom_gc(gpt2().config)
    before = [dict(m.__dict__) for m in model.modules()]
    with pytest.raises(ValueError, match=r"turned no layer's checkpointing on.*co\.apply"):
        co.hf.enable(model)
    assert "_ckpt_offload_handle" not in model.__dict__  # and the failed enable was undone:
    assert input_grad_hooks(model) == 0
    assert all(
        m.__dict__.get("gradient_checkpointing") is keys_m.get("gradient_checkpointing")
        for m, keys_m in zip(model.modules(), before)
    )

    def old_format(self, module, value=False):  # transformers' pre-4.35 format
        if hasattr(module, "gradient_checkpointing"):
            module.gradient_checkpointing = value

    old_gc = type("OldFormatGPT2", (transformers.GPT2LMHeadModel,), {"_set_gradient_checkpointing": old_format})
    with pytest.raises(ValueError, match=r"old checkpointing format.*co\.apply"):
        co.hf.enable(old_gc(gpt2().config))

    model = make("gpt2")
    with pytest.raises(ValueError, match="every_n_layers must be >= 1"):
        co.hf.enable(model, every_n_layers=0)
    with pytest.raises(ValueError, match="offload needs use_reentrant=False"):
        co.hf.enable(model, offload=True, use_reentrant=True)
    with pytest.raises(TypeError, match="offload must be False, True"):
        co.hf.enable(model, offload="cpu")
    with pytest.raises(TypeError, match="unknown checkpoint keyword"):
        co.hf.enable(model, speed=2)
    with pytest.raises(ValueError, match="every_n_layers must be >= 1"):
        co.hf.OffloadCheckpointCallback(every_n_layers=0)
    assert "_ckpt_offload_handle" not in model.__dict__


def test_reentrant_without_offload_matches():
    model = make("gpt2")
    base = base_grads(model)
    co.hf.enable(model, offload=False, use_reentrant=True)
    loss_of(model).backward()
    assert_bit_identical(base, grads_of(model))


# --- a layer that writes an input Hugging Face passes by keyword ------------------------------


class _WriterConfig(transformers.PretrainedConfig):
    model_type = "ckpt_offload_keyword_writer"


class _WriterLayer(transformers.modeling_layers.GradientCheckpointingLayer):
    """Gets a tensor by keyword (as Hugging Face's layers get position_embeddings and masks); with
    ``write``, scales it in place first (valid without a checkpoint: nothing has saved it yet)."""

    def __init__(self, write: bool):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16, dtype=torch.float64)
        self.write = write

    def forward(self, hidden_states, *, scale):
        if self.write:
            scale.mul_(0.75)
        return torch.tanh(self.lin(hidden_states)) * scale


class _WriterModel(transformers.PreTrainedModel):
    config_class = _WriterConfig
    supports_gradient_checkpointing = True
    _input_embed_layer = "embed"  # transformers' enable warns for a model without input embeddings

    def __init__(self, config, write=True):
        super().__init__(config)
        self.embed = torch.nn.Identity()
        self.layers = torch.nn.ModuleList(_WriterLayer(write) for _ in range(3))
        self.post_init()

    def _init_weights(self, module):
        pass  # torch's own initialisation, from the seed

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, scale=h * 0.5 + 1.0)  # HF's wrapper binds it in a functools.partial
        return h.square().sum()


def _writer(write):
    torch.manual_seed(0)
    return _WriterModel(_WriterConfig(), write=write).train()


def _writer_grads(model):
    model.zero_grad(set_to_none=True)
    x = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    model(x).backward()
    return {**grads_of(model), "x": x.grad}


@pytest.mark.parametrize("offload", [False, True], ids=["recompute", "offload"])
def test_a_layer_writing_its_keyword_input_in_place_raises_torchs_error(offload, pool):
    # Hugging Face hands the layer's keyword arguments to the checkpoint function inside a
    # functools.partial; without offload they stayed there, out of torch's checkpoint's saved
    # inputs, and the recompute read the written value: wrong gradients, silently.
    model = _writer(write=True)
    _writer_grads(model)  # valid without a checkpoint
    co.hf.enable(model, offload=cpu_offload(pool) if offload else False)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _writer_grads(model)
    co.synchronize()
    assert pool.stats()["bytes_in_use"] == 0


@pytest.mark.parametrize("offload", [False, True], ids=["recompute", "offload"])
def test_keyword_inputs_of_a_layer_keep_exact_gradients(offload, pool):
    model = _writer(write=False)
    ref = _writer_grads(model)
    co.hf.enable(model, offload=cpu_offload(pool) if offload else False)
    assert_bit_identical(ref, _writer_grads(model))


# --- Trainer ------------------------------------------------------------------------------


def checkpointing_args(**kwargs):
    """TrainingArguments that turn Hugging Face's checkpointing on, under this release's names."""
    fields = transformers.TrainingArguments.__dataclass_fields__
    new = "activation_checkpointing" in fields
    flag, kw = (
        ("activation_checkpointing", "activation_checkpointing_kwargs")
        if new
        else ("gradient_checkpointing", "gradient_checkpointing_kwargs")
    )
    return {flag: True, kw: kwargs}


def trainer_model():
    torch.manual_seed(0)
    model = gpt2()
    model.config.use_cache = False  # as in the checkpointed layers (see loss_of)
    return model


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return train(tmp_path_factory.mktemp("base"), trainer_model())


@pytest.mark.parametrize("route", ["callback", "callback+args", "enable+args"])
def test_trainer_loss_matches_without_ckpt_offload(tmp_path, baseline, route):
    pool = co.HostPool(pinned=False)
    model = trainer_model()
    if route == "callback":
        cb = co.hf.OffloadCheckpointCallback(every_n_layers=2, offload=cpu_offload(pool))
        losses, params = train(tmp_path, model, [cb])
        handle = cb.handle
    elif route == "callback+args":
        # every_n_layers comes from TrainingArguments; Trainer's own re-enable at train() keeps ours.
        cb = co.hf.OffloadCheckpointCallback(offload=cpu_offload(pool))
        losses, params = train(tmp_path, model, [cb], **checkpointing_args(every_n_layers=2))
        handle = cb.handle
    else:
        handle = co.hf.enable(model, every_n_layers=2, offload=cpu_offload(pool))
        losses, params = train(tmp_path, model, **checkpointing_args(every_n_layers=2))
    assert handle is model._ckpt_offload_handle and not handle.removed
    assert handle.names == ["transformer.h.0", "transformer.h.2"]
    # Our function did the checkpointing, 2 layers x 3 steps, and offloaded into our pool:
    assert handle.function.calls == 6
    assert pool.stats()["num_allocs"] > 0 and pool.stats()["bytes_in_use"] == 0
    assert all(m._gradient_checkpointing_func is handle.function for m in layers_of(model))
    # Same seed, same data order, RNG restored for the recompute: bit-equal losses and weights.
    base_losses, base_params = baseline
    assert losses == base_losses
    assert_bit_identical(base_params, params)


def test_trainer_callback_with_reentrant_args_raises_clearly(tmp_path):
    args = checkpointing_args(use_reentrant=True)
    with pytest.raises(ValueError, match="offload needs use_reentrant=False"):
        train(tmp_path, trainer_model(), [co.hf.OffloadCheckpointCallback(offload=True)], **args)
    # Without offload the reentrant checkpoint is allowed, and the callback uses it.
    cb = co.hf.OffloadCheckpointCallback(offload=False)
    losses, _ = train(tmp_path, trainer_model(), [cb], **args)
    assert cb.handle.use_reentrant and cb.handle.function.calls == 12


# ---------------------------------------------------------------- the offload entry, disable, stats


def test_callback_honours_offload_entry_of_training_arguments_and_logs_stats(tmp_path):
    pool = co.HostPool(pinned=False)
    cb = co.hf.OffloadCheckpointCallback()
    model = gpt2()
    train(tmp_path, model, [cb], **checkpointing_args(offload={"devices": ["cpu"], "min_bytes": 0, "pool": pool}))
    s = cb.handle.stats()
    assert s["bytes_offloaded"] > 0 and s["tensors_offloaded"] > 0  # the dict was used, not ignored
    assert s["pool_peak_bytes"] > 0
    assert set(co.offload(devices=["cpu"]).stats()["kept_by_reason"]) <= set(s["kept_by_reason"])
    cb.handle.reset_stats()
    assert cb.handle.stats()["bytes_offloaded"] == 0 and cb.handle.stats()["device_saved_peak_bytes"] == 0


def test_callback_offload_false_in_training_arguments_turns_offload_off(tmp_path):
    cb = co.hf.OffloadCheckpointCallback()
    train(tmp_path, gpt2(), [cb], **checkpointing_args(offload=False))
    assert cb.handle.function.options is None


def _train_logged(tmp_path, cb, max_steps, logging_steps, model=None):
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=max_steps,
        per_device_train_batch_size=2,
        **{**QUIET_CPU_TRAINING, "logging_steps": logging_steps},
    )
    trainer = transformers.Trainer(model=model or gpt2(), args=targs, train_dataset=TokenDataset(), callbacks=[cb])
    trainer.train()
    return [e for e in trainer.state.log_history if "ckpt_offload/bytes_offloaded_per_step" in e]


def test_callback_logs_per_step_stats_not_running_totals(tmp_path):
    # A tiny GPT-2 built from a config, 3 steps, one log entry per step: each step offloads the
    # same tensors, so each entry reports the same per-step counts (not 1x, 2x, 3x of them).
    # A pool of its own: the checkpoint context of these options is then this run's alone (the
    # shared context of an option set counts every handle's use of it).
    cb = co.hf.OffloadCheckpointCallback(
        offload={"devices": ["cpu"], "min_bytes": 0, "pool": co.HostPool(pinned=False)}
    )
    logged = _train_logged(tmp_path, cb, max_steps=3, logging_steps=1)
    assert [e["step"] for e in logged] == [1, 2, 3]
    total = cb.handle.stats()
    for key in co.hf.PER_STEP_KEYS:
        values = [e[f"ckpt_offload/{key}_per_step"] for e in logged]
        assert values == [values[0]] * 3, (key, values)
        assert sum(values) == total[key]  # stats() keeps the total
        assert f"ckpt_offload/{key}" not in logged[0]  # no key without its unit
    assert logged[0]["ckpt_offload/tensors_offloaded_per_step"] > 0
    assert logged[0]["ckpt_offload/bytes_reloaded_per_step"] == logged[0]["ckpt_offload/bytes_offloaded_per_step"] > 0
    assert 0 < logged[-1]["ckpt_offload/device_saved_peak_bytes"] == total["device_saved_peak_bytes"]
    assert logged[-1]["ckpt_offload/pool_peak_bytes"] == total["pool_peak_bytes"] > 0


def test_offload_callback_logs_per_step_averages_over_the_logging_interval(tmp_path):
    cb = co.hf.OffloadCallback(devices=["cpu"], min_bytes=0)
    logged = _train_logged(tmp_path, cb, max_steps=4, logging_steps=2)
    assert [e["step"] for e in logged] == [2, 4]
    total = cb.stats()
    per_step = [e["ckpt_offload/tensors_offloaded_per_step"] for e in logged]
    assert per_step[0] == per_step[1] == total["tensors_offloaded"] / 4 > 0
    # The pool's peak, as the checkpoint callback logs it: at least the bytes one step offloads.
    assert logged[-1]["ckpt_offload/pool_peak_bytes"] == total["pool_peak_bytes"] >= total["bytes_offloaded"] / 4 > 0


def test_hf_disable_method_removes_the_handle_and_enable_works_again():
    model = gpt2()
    handle = co.hf.enable(model, offload={"devices": ["cpu"]})
    disable = (
        "activation_checkpointing_disable"
        if hasattr(model, "activation_checkpointing_disable")
        else "gradient_checkpointing_disable"
    )
    getattr(model, disable)()
    assert handle.removed
    assert "_ckpt_offload_handle" not in model.__dict__ and disable not in model.__dict__
    again = co.hf.enable(model, offload={"devices": ["cpu"]})
    assert not again.removed
    again.remove()


def test_model_disable_pauses_the_callbacks_handle_and_enable_resumes_it(tmp_path):
    # TRL's trainers call the model's disable and enable methods around every no-grad pass
    # (generation, reference log-probabilities): the callback's handle must outlive the pair, or
    # the enable call puts Hugging Face's function back for the rest of training.
    model, pool = gpt2(), co.HostPool(pinned=False)
    cb = co.hf.OffloadCheckpointCallback(offload=cpu_offload(pool))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    transformers.Trainer(model=model, args=args, train_dataset=TokenDataset(), callbacks=[cb])
    handle = cb.handle
    names = [n for n in ("activation_checkpointing", "gradient_checkpointing") if hasattr(model, f"{n}_disable")]
    for name in names:  # both names: TRL 1.16 calls the deprecated one
        getattr(model, f"{name}_disable")()
        assert not handle.removed and model._ckpt_offload_handle is handle
        assert (
            not model.is_activation_checkpointing
            if hasattr(model, "is_activation_checkpointing")
            else not model.is_gradient_checkpointing
        )
        allocs = pool.stats()["num_allocs"]
        with torch.no_grad():
            model(**batch())  # runs the layers as they are: nothing checkpointed, nothing offloaded
        assert handle.function.calls == 0 and pool.stats()["num_allocs"] == allocs
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            getattr(model, f"{name}_enable")()
        assert handle.names == [f"transformer.h.{i}" for i in range(4)]
        loss_of(model).backward()
        assert handle.function.calls == 4 and handle.stats()["tensors_offloaded"] > 0
        handle.function.calls = 0
        co.synchronize()
        assert pool.stats()["bytes_in_use"] == 0
    handle.remove()  # still ends it
    assert "_ckpt_offload_handle" not in model.__dict__
    assert not any(n in model.__dict__ for n in ("activation_checkpointing_disable", "gradient_checkpointing_disable"))


def test_offload_callback_offloads_without_recompute_and_matches(tmp_path, baseline):
    ref_losses, ref_params = baseline
    cb = co.hf.OffloadCallback(devices=["cpu"], min_bytes=0, pool=co.HostPool(pinned=False))
    model = trainer_model()
    losses, params = train(tmp_path, model, [cb])
    assert losses == ref_losses
    assert all(torch.equal(params[n], ref_params[n]) for n in ref_params)
    s = cb.stats()
    assert s["tensors_offloaded"] > 0
    # Its context's device peak (sampled at each pack and unpack): some of one step's saved
    # bytes, never the three steps' total.
    assert 0 < s["device_saved_peak_bytes"] < s["bytes_offloaded"]
    assert "forward" not in model.__dict__  # removed at the end of training


# ---------------------------------------------------------------- co.hf.enable + Trainer's offload entry


def test_enable_without_offload_follows_the_offload_entry_trainer_passes(tmp_path, baseline):
    # Trainer.train() re-enables checkpointing itself and passes TrainingArguments' offload entry
    # to the model's enable method (transformers 5.24 pops it out of the kwargs and passes
    # offload=...); a handle made with offload off uses it instead of ignoring it.
    pool = co.HostPool(pinned=False)
    model = trainer_model()
    handle = co.hf.enable(model, every_n_layers=2)
    assert handle.offload is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # honoured, so nothing to warn about
        losses, params = train(tmp_path, model, **checkpointing_args(every_n_layers=2, offload=cpu_offload(pool)))
    assert handle.offload is not None and handle.offload["pool"] is pool
    s = handle.stats()
    assert s["bytes_offloaded"] > 0 and s["tensors_offloaded"] > 0
    assert pool.stats()["num_allocs"] > 0 and pool.stats()["bytes_in_use"] == 0
    assert handle.function.calls == 6  # our function: 2 layers x 3 steps
    base_losses, base_params = baseline
    assert losses == base_losses
    assert_bit_identical(base_params, params)


def test_enable_follows_an_offload_entry_inside_the_kwargs_dict_and_offload_given_wins():
    model = gpt2()
    name = next(n for n in ENABLE_NAMES if hasattr(model, n))
    handle = co.hf.enable(model)

    def enable(*args, **kwargs):  # the model's enable method, as Trainer calls it (looked up now)
        return getattr(model, name)(*args, **kwargs)

    # A Trainer that passes the whole dict (the entry left inside it).
    enable({"use_reentrant": False, "offload": {"devices": ["cpu"], "min_bytes": 0}})
    assert handle.offload == {"devices": ("cpu",), "min_bytes": 0}
    loss_of(model).backward()
    assert handle.stats()["bytes_offloaded"] > 0
    enable(None, offload=False)  # the entry absent (Trainer passes False): off again
    assert handle.offload is None
    with pytest.raises(TypeError, match=r"offload.*must be False, True, or a dict"):
        enable(None, offload="cpu")
    handle.remove()
    # offload turned on in co.hf.enable: kept; a request for other options is named as ignored.
    ours = {"devices": ["cpu"], "min_bytes": 1024}
    handle = co.hf.enable(model, offload=ours)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        enable(None, offload=True)  # satisfied by ours
        enable(None, offload=False)  # Trainer's call when its arguments have no entry
    with pytest.warns(UserWarning, match=r"ignores offload=\{'devices': \['cpu'\]\}"):
        enable(None, offload={"devices": ["cpu"]})
    assert handle.offload == {"devices": ("cpu",), "min_bytes": 1024}
    handle.remove()


def test_callback_offload_false_wins_over_the_entry_trainer_passes(tmp_path):
    # The callback's own offload=False decides (TrainingArguments' entry only fills in a None);
    # Trainer's enable call at train() passes the entry, which is then named as ignored.
    cb = co.hf.OffloadCheckpointCallback(offload=False)
    with pytest.warns(UserWarning, match=r"ignores offload="):
        train(tmp_path, gpt2(), [cb], **checkpointing_args(offload={"devices": ["cpu"], "min_bytes": 0}))
    assert cb.handle.function.options is None
    assert cb.handle.stats()["bytes_offloaded"] == 0 and cb.handle.stats()["device_saved_peak_bytes"] == 0


def test_enable_handle_device_peak_is_the_profiles():
    # The co.hf.enable route: the handle's device peak of saved activations
    # is the one co.profile() measures for the same step, one layer's inputs (copies inline on
    # the compute stream: no prefetch, no copy finishing between two samples), not the step's.
    pool = co.HostPool(pinned=False)
    model = make("gpt2")
    handle = co.hf.enable(model, offload={**cpu_offload(pool), "stream": "compute"})
    base = co._C.device_bytes_saved()
    with co.profile(pools=[pool]) as prof:
        loss_of(model).backward()
    s = handle.stats()
    assert base < s["device_saved_peak_bytes"] == prof.totals()["device_saved_peak_bytes"]
    assert s["device_saved_peak_bytes"] - base < s["bytes_offloaded"]
    handle.reset_stats()
    assert handle.stats()["device_saved_peak_bytes"] == 0
    handle.remove()


@pytest.mark.parametrize("order", ["offload_first", "checkpoint_first"])
def test_offload_callback_and_checkpoint_callback_together_are_refused(tmp_path, order):
    targs = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to=[], max_steps=1, use_cpu=True, save_strategy="no", disable_tqdm=True
    )
    callbacks = [
        co.hf.OffloadCallback(devices=["cpu"], min_bytes=0),
        co.hf.OffloadCheckpointCallback(every_n_layers=1, offload={"devices": ["cpu"], "min_bytes": 0}),
    ]
    if order == "checkpoint_first":
        callbacks.reverse()
    with pytest.raises(
        RuntimeError, match="OffloadCallback and co.hf.OffloadCheckpointCallback on one model.*Keep one"
    ):
        transformers.Trainer(model=gpt2(), args=targs, train_dataset=TokenDataset(), callbacks=callbacks)
