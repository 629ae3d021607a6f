"""Trains the expert-parallel MoE transformer of model.py on the synthetic language of data.py.

    python examples/flax_moe/train.py --steps 400 --plot loss.png

On a CPU-only machine this runs on 8 host devices (XLA_FLAGS is set below before jax is
imported) with jax_ep's reference backend; on GPUs the same command uses every GPU and, with
`--backend auto`, the CUDA kernels. The mesh has axes ("data", "ep"): `--data-parallel D` puts
D replicas of the experts along "data" and spreads the experts over the remaining devices.
"""

from __future__ import annotations

import os

_HOST_DEVICES_FLAG = "--xla_force_host_platform_device_count"
if _HOST_DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    # Only affects the CPU platform: on GPUs jax still picks the GPUs.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_HOST_DEVICES_FLAG}=8".strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    import jax_ep  # noqa: E402
except ImportError:  # running from a source checkout without installing
    sys.path.insert(1, str(Path(__file__).resolve().parents[2]))
    import jax_ep  # noqa: E402

from data import TASKS, SyntheticLanguage  # noqa: E402
from model import MoETransformer, shard_model  # noqa: E402
from plot import plot_runs  # noqa: E402

from jax_ep import moe  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Config:
    steps: int = 400
    batch: int = 32
    seq: int = 32
    experts: int = 8
    topk: int = 2
    hidden: int = 128
    ffn: int = 256
    layers: int = 2
    heads: int = 4
    symbols: int = 16
    lr: float = 5e-3
    weight_decay: float = 0.01
    aux_coef: float = 0.01
    data_parallel: int = 1
    dtype: str = "float32"
    backend: str = "auto"
    micro_batches: int = 1
    seed: int = 0
    log_every: int = 25
    plot: str = "loss.png"
    save_losses: str = ""
    progress: bool = True


def make_mesh(data_parallel: int) -> Mesh:
    """A ("data", "ep") mesh over every device; "ep" gets `num_devices // data_parallel`."""
    devices = jax.devices()
    if len(devices) % data_parallel:
        raise ValueError(f"--data-parallel {data_parallel} must divide {len(devices)} devices")
    grid = np.array(devices).reshape(data_parallel, len(devices) // data_parallel)
    return Mesh(grid, ("data", "ep"))


class Setup(NamedTuple):
    """What the training loop runs: `train_step(model, optimizer, inputs, targets, mask)` ->
    `(ce, aux_loss)` and `eval_step(model, inputs, targets, mask)` -> per-sequence metrics, both
    `nnx.jit`-ed; `put(batch)` places a `SyntheticLanguage` batch on the mesh, batch axis split
    over ("data", "ep")."""

    mesh: Mesh
    buf: jax_ep.Buffer
    lang: SyntheticLanguage
    model: MoETransformer
    optimizer: nnx.Optimizer
    train_step: Callable
    eval_step: Callable
    put: Callable


def setup(cfg: Config) -> Setup:
    """The mesh, Buffer, data, sharded model and optimizer, and the jitted steps of `cfg`
    (`benchmarks/compile_time.py` compiles the same train step)."""
    mesh = make_mesh(cfg.data_parallel)
    num_devices = mesh.devices.size
    if cfg.batch % num_devices:
        raise ValueError(f"--batch {cfg.batch} must be a multiple of the {num_devices} devices")
    batch_axes = ("data", "ep")
    lang = SyntheticLanguage(cfg.seq, cfg.symbols, seed=cfg.seed)
    buf = jax_ep.Buffer(
        mesh, "ep",
        num_experts=cfg.experts, hidden=cfg.hidden,
        max_tokens_per_rank=cfg.batch // num_devices * cfg.seq,
        num_topk=cfg.topk, dtype=jnp.dtype(cfg.dtype), backend=cfg.backend,
        overlap=cfg.micro_batches == 2,
    )
    model = MoETransformer(
        buf, vocab_size=lang.vocab_size, max_seq_len=cfg.seq, num_layers=cfg.layers,
        num_heads=cfg.heads, ffn=cfg.ffn, batch_axes=batch_axes, rngs=nnx.Rngs(cfg.seed),
        micro_batches=cfg.micro_batches,
    )
    shard_model(model, mesh)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, warmup_steps=max(1, cfg.steps // 20), decay_steps=cfg.steps,
        end_value=cfg.lr * 0.1,
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(schedule, weight_decay=cfg.weight_decay))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    shard_model(optimizer, mesh)  # moments like their parameters, the step count replicated
    data_sharding = NamedSharding(mesh, P(batch_axes))

    def loss_fn(model, inputs, targets, mask):
        logits, aux_loss = model(inputs)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets) * mask
        correct = (jnp.argmax(logits, -1) == targets) * mask
        metrics = {"ce_per_seq": ce.sum(1), "correct_per_seq": correct.sum(1)}
        loss = jnp.sum(ce) / jnp.sum(mask)
        return loss + cfg.aux_coef * aux_loss, (loss, aux_loss, metrics)

    @nnx.jit
    def train_step(model, optimizer, inputs, targets, mask):
        grads, (ce, aux_loss, _) = nnx.grad(loss_fn, has_aux=True)(model, inputs, targets, mask)
        optimizer.update(model, grads)
        return ce, aux_loss

    @nnx.jit
    def eval_step(model, inputs, targets, mask):
        return loss_fn(model, inputs, targets, mask)[1][2]

    def put(batch):
        return [jax.device_put(a, data_sharding) for a in (batch.inputs, batch.targets,
                                                            batch.mask)]

    return Setup(mesh, buf, lang, model, optimizer, train_step, eval_step, put)


def train(cfg: Config) -> dict:
    """Runs the training loop; returns {"losses": per-step CE losses, "eval_loss", ...}."""
    mesh, buf, lang, model, optimizer, train_step, eval_step, put = setup(cfg)
    num_devices = mesh.devices.size
    rng = np.random.default_rng(cfg.seed + 1)
    devices = f"{num_devices} x {jax.devices()[0].device_kind}"
    # What the MoE layer's swiglu_experts(matmul="auto") runs for these widths and dtype.
    matmul = moe.expert_matmul("auto", jnp.dtype(cfg.dtype), (cfg.hidden, 2 * cfg.ffn),
                               (cfg.ffn, cfg.hidden))
    print(f"devices: {devices}, mesh {dict(mesh.shape)}, jax_ep backend {buf.backend}, "
          f"{cfg.experts // mesh.shape['ep']} experts per device, expert matmuls {matmul}; "
          f"the rules' expected loss {lang.expected_rule_loss():.3f}")
    ce_hist, aux_hist = [], []
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), disable=not cfg.progress, desc="train", dynamic_ncols=True)
    for step in bar:
        ce, aux_loss = train_step(model, optimizer, *put(lang.batch(cfg.batch, rng)))
        ce_hist.append(ce)
        aux_hist.append(aux_loss)
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            recent = float(np.mean(jax.device_get(ce_hist[-cfg.log_every:])))
            bar.set_postfix(loss=f"{recent:.3f}")
            tqdm.write(f"step {step + 1:5d}  loss {recent:.4f}  aux {float(aux_loss):.3f}")
    losses = np.asarray(jax.device_get(ce_hist), np.float32)
    seconds = time.perf_counter() - start

    (eval_loss, eval_acc, eval_rules), per_task = evaluate(
        lambda b: eval_step(model, *put(b)), lang, cfg.batch,
        np.random.default_rng(cfg.seed + 12345))
    # The rules' loss on the same sequences, and its expectation (data.py): a model that has
    # learned a rule scores around the first; a finite sample may put both below the second.
    print(f"done: {cfg.steps} steps in {seconds:.1f} s; eval loss {eval_loss:.4f} (the rules "
          f"on these sequences {eval_rules:.4f}, expected {lang.expected_rule_loss():.4f}), "
          f"next-token accuracy {eval_acc:.3f}")
    for name, (loss, acc, rules) in per_task.items():
        print(f"  {name:12s} loss {loss:.4f} (the rules {rules:.4f}, expected "
              f"{lang.expected_rule_loss(name):.4f}), accuracy {acc:.3f}")
    run = {"config": dataclasses.asdict(cfg), "backend": buf.backend, "matmul": matmul,
           "devices": devices, "expected_rule_loss": lang.expected_rule_loss(),
           "eval_rule_loss": float(eval_rules), "losses": losses.tolist(),
           "eval_loss": float(eval_loss), "eval_accuracy": float(eval_acc), "seconds": seconds}
    if cfg.save_losses:
        Path(cfg.save_losses).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.save_losses).write_text(json.dumps(run))
        print(f"losses written to {cfg.save_losses}")
    if cfg.plot:
        plot_runs([run], cfg.plot)
        print(f"loss plot written to {cfg.plot}")
    return {"losses": losses, "aux": np.asarray(jax.device_get(aux_hist)),
            "eval_loss": eval_loss, "eval_accuracy": eval_acc, "per_task": per_task,
            "seconds": seconds, "matmul": matmul}


def evaluate(eval_fn, lang: SyntheticLanguage, batch_size: int, rng, num_batches: int = 4):
    """On fresh batches, per masked position: ``(loss, accuracy, the rules' loss)`` overall and
    a dict of the same per task."""
    sums = np.zeros((len(TASKS), 4))  # per task: ce, correct, the rules' nats, positions
    for _ in range(num_batches):
        batch = lang.batch(batch_size, rng)
        metrics = jax.device_get(eval_fn(batch))
        for column, values in enumerate((metrics["ce_per_seq"], metrics["correct_per_seq"],
                                         batch.rule_nats, batch.mask.sum(1))):
            np.add.at(sums[:, column], batch.tasks, values)
    total = sums.sum(0)
    per_task = {name: tuple(sums[i, :3] / sums[i, 3]) for i, name in enumerate(TASKS)
                if sums[i, 3]}
    return tuple(total[:3] / total[3]), per_task


def parse_args(argv=None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(description="Train a Flax NNX MoE transformer with jax_ep.")
    p.add_argument("--steps", type=int, default=d.steps, help="training steps")
    p.add_argument("--batch", type=int, default=d.batch,
                   help="global batch (sequences), a multiple of the device count")
    p.add_argument("--seq", type=int, default=d.seq, help="sequence length")
    p.add_argument("--experts", type=int, default=d.experts,
                   help="experts per MoE layer, a multiple of the 'ep' axis size")
    p.add_argument("--topk", type=int, default=d.topk, help="experts per token")
    p.add_argument("--hidden", type=int, default=d.hidden,
                   help="model width (a multiple of 128, as jax_ep requires)")
    p.add_argument("--ffn", type=int, default=d.ffn, help="hidden width of each expert")
    p.add_argument("--layers", type=int, default=d.layers, help="transformer blocks")
    p.add_argument("--heads", type=int, default=d.heads, help="attention heads")
    p.add_argument("--symbols", type=int, default=d.symbols,
                   help="alphabet size of the synthetic language")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--aux-coef", type=float, default=d.aux_coef,
                   help="weight of the load-balancing loss")
    p.add_argument("--data-parallel", type=int, default=d.data_parallel,
                   help="size of the 'data' mesh axis (expert replicas)")
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"],
                   help="dtype of the tokens jax_ep moves and of the expert matmuls")
    p.add_argument("--backend", default=d.backend, choices=["auto", "cuda", "reference"],
                   help="jax_ep backend")
    p.add_argument("--micro-batches", type=int, default=d.micro_batches, choices=[1, 2],
                   help="2: each MoE layer in two micro-batches whose communication overlaps "
                        "the other's experts (jax_ep.moe.moe_ffn; Buffer(overlap=True))")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--log-every", type=int, default=d.log_every, help="steps per loss line")
    p.add_argument("--plot", default=d.plot,
                   help="write the PNG loss plot here ('' for none)")
    p.add_argument("--save-losses", default=d.save_losses,
                   help="write the run (config, expert matmul, per-step losses, eval) as JSON "
                        "here, for plot.py to compare runs ('' for none)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="hide the tqdm progress bar")
    return Config(**vars(p.parse_args(argv)))


if __name__ == "__main__":
    train(parse_args())
