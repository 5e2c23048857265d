"""TRL's RL trainers with ckpt_offload's Trainer callbacks: GRPOTrainer and DPOTrainer, one CPU process.

RL trainers interleave no-grad passes with the training steps: GRPO generates completions (a KV
cache, one new token per forward) and DPO runs the reference model, each step, and both turn the
policy's checkpointing off around those passes with the model's own disable method and back on
after (Note [Disable pauses a callback's handle]). Each test trains a tiny Llama built from a
config (a word-level tokenizer built here: nothing is downloaded) for 2 steps without ckpt_offload
and again with a callback, from the same seeds, and checks:

- the losses, the generated completions (GRPO samples them from the global RNG, seeded by the
  Trainer in both runs) and the final parameters are bit-identical;
- every training step offloaded (the callback's per-step log entries), and ckpt_offload's
  checkpoint ran in every step, not Hugging Face's after the first no-grad pass;
- no forward under no_grad (generation, the reference pass) allocated from the pool or ran a
  ckpt_offload checkpoint, and generation used its KV cache;
- the pool holds 0 bytes at the end of every step.
"""

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import ckpt_offload as co  # noqa: E402
from conftest import assert_same_params  # noqa: E402
from helpers import QUIET_CPU_TRAINING, hf_cpu_options, llama, word_tokenizer  # noqa: E402

STEPS = 2
LAYERS = 4  # llama(): 4 layers; every_n_layers=2 checkpoints 2 of them


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: intra-op threads only wait for each other
    yield
    torch.set_num_threads(threads)


def words(g, n):
    return " ".join(f"w{int(i)}" for i in torch.randint(2, 100, (n,), generator=g))


def model():
    torch.manual_seed(0)
    return llama()


class Watch(transformers.TrainerCallback):
    """Records, for one run: every forward of the policy model (grad mode, whether it ran inside
    ``generate``, its new tokens, the pool allocations and ckpt_offload checkpoints during it),
    what ``generate`` returned, and the pool's bytes at the end of each step."""

    def __init__(self, policy, pool, handle=lambda: None):
        self.pool, self.handle = pool, handle
        self.forwards, self.generated, self.step_end_bytes = [], [], []
        self.generating = False
        policy.register_forward_pre_hook(self.before, with_kwargs=True)
        policy.register_forward_hook(self.after)
        generate = policy.generate

        def watched_generate(*args, **kwargs):
            self.generating = True
            try:
                out = generate(*args, **kwargs)
            finally:
                self.generating = False
            self.generated.append(out.clone())
            return out

        policy.generate = watched_generate

    def counts(self):
        handle = self.handle()
        return self.pool.stats()["num_allocs"], (handle.function.calls if handle is not None else 0)

    def before(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._start = self.counts()
        self.forwards.append(
            {
                "grad": torch.is_grad_enabled(),
                "generate": self.generating,
                "tokens": None if ids is None else ids.shape[-1],
            }
        )

    def after(self, module, args, output):
        allocs, calls = self.counts()
        self.forwards[-1].update(allocs=allocs - self._start[0], calls=calls - self._start[1])

    def on_step_end(self, args, state, control, **kwargs):
        co.synchronize()
        self.step_end_bytes.append(self.pool.stats()["bytes_in_use"])


def grpo_run(tmp_path, tag, callback=None):
    """GRPO, 2 steps of 4 completions of one prompt each (num_generations=4), sampled by
    ``model.generate`` at temperature 1."""
    g = torch.Generator().manual_seed(3)
    data = datasets.Dataset.from_dict({"prompt": [words(g, 6) for _ in range(8)]})

    def reward(completions, **kwargs):  # longer completions score higher: the advantages differ
        return [float(len(c)) for c in completions]

    policy, pool = model(), co.HostPool(pinned=False)
    callbacks = [] if callback is None else [callback(pool)]
    watch = Watch(policy, pool, lambda: getattr(callbacks[0], "handle", None) if callbacks else None)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / tag),
        max_steps=STEPS,
        learning_rate=1e-3,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        **QUIET_CPU_TRAINING,
    )
    trainer = trl.GRPOTrainer(
        model=policy,
        args=args,
        train_dataset=data,
        processing_class=word_tokenizer(),
        reward_funcs=reward,
        callbacks=callbacks + [watch],
    )
    trainer.train()
    return trainer, watch, callbacks


def dpo_run(tmp_path, tag, callback=None):
    """DPO, 2 steps of 2 preference pairs, against a reference model of its own (a model built from a
    config has no path to load the default reference from)."""
    g = torch.Generator().manual_seed(4)
    data = datasets.Dataset.from_dict({k: [words(g, 5) for _ in range(4)] for k in ("prompt", "chosen", "rejected")})
    policy, pool = model(), co.HostPool(pinned=False)
    callbacks = [] if callback is None else [callback(pool)]
    watch = Watch(policy, pool, lambda: getattr(callbacks[0], "handle", None) if callbacks else None)
    args = trl.DPOConfig(
        output_dir=str(tmp_path / tag),
        max_steps=STEPS,
        learning_rate=1e-3,
        per_device_train_batch_size=2,
        **QUIET_CPU_TRAINING,
    )
    trainer = trl.DPOTrainer(
        model=policy,
        ref_model=model(),
        args=args,
        train_dataset=data,
        processing_class=word_tokenizer(),
        callbacks=callbacks + [watch],
    )
    trainer.train()
    return trainer, watch, callbacks


def checkpoint_callback(pool):
    return co.hf.OffloadCheckpointCallback(every_n_layers=2, offload=hf_cpu_options(pool))


def offload_callback(pool):
    return co.hf.OffloadCallback(hf_cpu_options(pool))


RUNS = {"grpo": grpo_run, "dpo": dpo_run}
CALLBACKS = {"checkpoint": checkpoint_callback, "offload": offload_callback}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Each trainer's run without ckpt_offload, made once."""
    out = {}

    def get(kind):
        if kind not in out:
            out[kind] = RUNS[kind](tmp_path_factory.mktemp(f"{kind}_plain"), "plain")
        return out[kind]

    return get


def losses(trainer):
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("kind, how", [(k, h) for k in RUNS for h in CALLBACKS])
def test_rl_trainer_matches_without_ckpt_offload_and_offloads_only_training(tmp_path, plain, kind, how):
    ref_trainer, ref_watch, _ = plain(kind)
    trainer, watch, (cb,) = RUNS[kind](tmp_path, how, CALLBACKS[how])

    # Same samples, same losses, same parameters: ckpt_offload changed no bit of any step.
    assert len(losses(trainer)) == STEPS and losses(trainer) == losses(ref_trainer)
    assert len(watch.generated) == len(ref_watch.generated)
    assert all(torch.equal(a, b) for a, b in zip(watch.generated, ref_watch.generated))
    assert any(not torch.equal(p, q) for p, q in zip(params(trainer).values(), params(model()).values()))
    assert_same_params(params(ref_trainer), params(trainer), f"{kind} with {how} callback vs without")

    # Every training step offloaded, and (checkpoint callback) through ckpt_offload's checkpoint.
    logged = [e for e in trainer.state.log_history if "ckpt_offload/tensors_offloaded_per_step" in e]
    assert [e["step"] for e in logged] == list(range(1, STEPS + 1)), trainer.state.log_history
    assert all(e["ckpt_offload/tensors_offloaded_per_step"] > 0 for e in logged), logged
    training = [f for f in watch.forwards if f["grad"]]
    assert len(training) >= STEPS and all(f["allocs"] > 0 for f in training), training
    if how == "checkpoint":
        assert not cb.handle.removed
        assert all(f["calls"] == LAYERS // 2 for f in training), training

    # The no-grad passes (generation, GRPO's; the reference forward, DPO's, runs on another model)
    # offloaded nothing and checkpointed nothing; generation fed one new token per forward after the
    # prompt: its KV cache was on.
    no_grad = [f for f in watch.forwards if not f["grad"]]
    assert all(f["allocs"] == 0 and f["calls"] == 0 for f in no_grad), no_grad
    if kind == "grpo":
        generating = [f for f in watch.forwards if f["generate"]]
        assert generating and all(not f["grad"] for f in generating)
        prompts = [f for f in generating if f["tokens"] > 1]  # each generate's first forward
        assert len(prompts) == len(watch.generated) and len(generating) > len(prompts), generating
        assert {f["tokens"] for f in generating if f not in prompts} == {1}, generating

    # Every offloaded tensor was released by the end of its step (reloaded, or freed with a graph
    # branch the loss does not reach).
    assert watch.step_end_bytes == [0] * STEPS
    stats = cb.stats() if how == "offload" else cb.handle.stats()
    assert stats["bytes_offloaded"] >= stats["bytes_reloaded"] > 0, stats
