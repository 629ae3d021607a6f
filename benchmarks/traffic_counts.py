"""What the emulated network carries for one dispatch and one combine, counted by its host
proxies: flat and hierarchical normal mode, flat low-latency mode. Writes the ``--counts`` file
of benchmarks/traffic.py, which turns it into ``"source": "counted"`` records.

    JAX_EP_DEVICE_TRANSPORT=emulated python -m jax_ep.launch -n 16 --processes-per-gpu 16 \\
        --fake-hosts 2 -- python benchmarks/traffic_counts.py --hosts 2 --out counts-2x8.json
    python benchmarks/traffic.py --counts counts-2x8.json --out DIR

Every process is one rank of an EP group of ``--hosts`` fake hosts (the launcher's
``--fake-hosts``, which group consecutive processes), at docs/scaling_numbers.py's shapes (H, E,
top-K; T = 4096 normal, 128 low latency; ``--hidden`` for another H, e.g. where 32 low-latency
workspaces of H = 7168 do not fit one GPU) under its two routings (uniform top-K, and DeepSeek-V3's
node-limited one: ``jax_ep.testing.make_node_limited_routing``, seed ``--seed``). Over
``JAX_EP_DEVICE_TRANSPORT=emulated`` every row and signal between ranks, same host or not, is a
command of the emulated transport, whose proxies count what they deliver per (source,
destination) rank (``jax_ep._C_testing.transport_traffic``); the counts of each op pair are the
difference of a reading before and after it. The hierarchical mode's legs are Buffers of their own
(``across``: the ranks of one local index; ``within``: one host's): their ranks are mapped to the
flat group's (host h, GPU g -> h * G + g). The rows' contents do not change the counts: the
tokens are zeros.

Process 0 writes ``{"runs": [{"mode", "scheme", "hosts", "ranks_per_host", "routing", "tokens",
"hidden", "experts", "topk", "traffic": [{"src", "dst", "puts", "bytes", "signals"}, ...]}],
"commit", "command"}`` and prints each run's bytes per rank to its own host and to the others.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

from jax_ep import launch

launch.initialize_from_env()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from traffic import load_formula  # noqa: E402  (docs/scaling_numbers.py: the shapes)

import jax_ep  # noqa: E402
from jax_ep import hierarchical, settings, testing  # noqa: E402
from jax_ep.peers import ipc  # noqa: E402

# Names of the key-value store's barriers and keys: every process makes the same calls in order.
_barriers, _gathers = itertools.count(), itertools.count()


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, required=True, help="the launcher's --fake-hosts")
    p.add_argument("--out", required=True, help="the counts file (JSON) process 0 writes")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampled routings")
    p.add_argument("--modes", default="normal,low_latency",
                   help="comma-separated: normal (flat and hierarchical), low_latency (flat)")
    p.add_argument("--routings", default="uniform,node_limited",
                   help="comma-separated: uniform, node_limited")
    p.add_argument("--hidden", type=int,
                   help="channels a row (default the formula's H, 7168): the low-latency "
                        "workspace grows with it, about 1.9 GB a rank at 7168")
    return p.parse_args(argv)


def traffic(buf):
    """This process's ranks' counts of ``buf`` so far: ``{(src, dst): [puts, bytes, signals]}``."""
    from jax_ep import _C_testing  # noqa: PLC0415

    return {(row["src"], row["dst"]): np.array([row["puts"], row["bytes"], row["signals"]],
                                               np.int64)
            for row in _C_testing.transport_traffic(buf.buffer_id)}


def counted(bufs, run, read=traffic):
    """Runs ``run()`` (one op pair, finished when it returns) and returns what it sent: rows
    ``{"src", "dst", "puts", "bytes", "signals"}`` of this process's ranks, in the flat group's
    numbers (``bufs``: ``[(buffer, rank of the flat group of each of its ranks)]``; ``read``:
    a buffer's counts so far, as ``traffic``)."""
    before = [read(buf) for buf, _ in bufs]
    run()
    rows = {}
    for (buf, flat_rank), earlier in zip(bufs, before, strict=True):
        for (src, dst), count in read(buf).items():
            key = (flat_rank[src], flat_rank[dst])
            rows[key] = rows.get(key, 0) + count - earlier.get((src, dst), 0)
    return [dict(src=s, dst=d, puts=int(c[0]), bytes=int(c[1]), signals=int(c[2]))
            for (s, d), c in sorted(rows.items())]


def counted_runs(routings, scheme, bufs, run):
    """``(routing name, scheme, rows)``: ``run`` (as ``compiled`` returns it) on each routing
    of ``routings``, counted (``bufs``: as ``counted``'s)."""
    for name, routing in routings.items():
        yield name, scheme, counted(bufs, functools.partial(run, routing))


def compiled(mesh, axes, fn, topk_idx):
    """``fn(topk_idx of a rank)`` on every rank of ``mesh`` (ranks along ``axes``), compiled in
    every process before any runs (a kernel's wait for a peer still compiling would count
    against its bound): returns ``run(topk_idx)``, which runs it to completion on a ``[R, T,
    K]`` routing, the same in every process (``topk_idx``: one such, for its shape)."""
    spec = P(axes)
    sharding = NamedSharding(mesh, spec)

    def place(routing):
        return jax.make_array_from_callback(routing.shape, sharding, lambda index: routing[index])

    program = jax.jit(jax.shard_map(lambda i: fn(i[0])[None], mesh=mesh, in_specs=spec,
                                    out_specs=spec)).lower(place(topk_idx)).compile()
    ipc.kv_client().wait_at_barrier(f"traffic_counts/compiled{next(_barriers)}", 600_000)
    return lambda routing: jax.block_until_ready(program(place(routing)))


def normal_runs(sn, mesh, hosts, hidden, routings):
    """``(routing, scheme, rows)``: one dispatch and one combine of each routing (``{name: [R,
    T, K]}``) with rows of ``hidden`` channels, flat then hierarchical, each scheme's Buffers and
    program made once."""
    gpus = mesh.shape["ep"] // hosts
    kw = dict(num_experts=sn.E, hidden=hidden, max_tokens_per_rank=sn.T_NORMAL, num_topk=sn.K,
              dtype=jnp.bfloat16, backend="cuda")
    some = next(iter(routings.values()))

    def tokens():  # made inside each program: a closed-over array would be a constant of it
        return (jnp.zeros((sn.T_NORMAL, hidden), jnp.bfloat16),
                jnp.full((sn.T_NORMAL, sn.K), 1.0 / sn.K, jnp.float32))

    # Half of every row a rank could receive: top-8 of 256 sends a rank ~39% (16 ranks) of them.
    flat = jax_ep.Buffer(mesh, "ep", capacity=mesh.shape["ep"] * sn.T_NORMAL // 2, **kw)

    def flat_pair(idx):
        x, weights = tokens()
        d = jax_ep.dispatch(flat, x, idx, weights)
        return jax_ep.combine(flat, d.recv_x, d.handle)[0].sum(dtype=jnp.float32)

    run = compiled(mesh, "ep", flat_pair, some)
    ranks = list(range(mesh.shape["ep"]))
    yield from counted_runs(routings, "flat", [(flat, ranks)], run)
    flat.check()  # no row dropped, no fault the proxies found
    flat.close()

    grid = Mesh(mesh.devices.reshape(hosts, gpus), ("host", "gpu"))
    hbuf = hierarchical.HierarchicalBuffer(grid, "host", "gpu", **kw)
    mine = np.vectorize(lambda d: d.process_index == jax.process_index())(grid.devices)
    host, gpu = (int(v) for v in np.argwhere(mine)[0])  # this process's rank (one per process)
    across = [h * gpus + gpu for h in range(hosts)]    # the across leg's rank h: host h
    within = [host * gpus + g for g in range(gpus)]    # the within leg's rank g: GPU g

    def hierarchical_pair(idx):
        x, weights = tokens()
        d = hierarchical.dispatch(hbuf, x, idx, weights)
        return hierarchical.combine(hbuf, d.recv_x, d.handle)[0].sum(dtype=jnp.float32)

    run = compiled(grid, ("host", "gpu"), hierarchical_pair, some)
    yield from counted_runs(routings, "hierarchical",
                            [(hbuf.across, across), (hbuf.within, within)], run)
    hbuf.across.check()
    hbuf.within.check()
    hbuf.close()


def low_latency_runs(sn, mesh, hosts, hidden, routings):
    """``(routing, "flat", rows)`` (the low-latency kernels put every selection to its rank):
    one fp8 dispatch and one combine of each routing with rows of ``hidden`` channels, the Buffer
    and program made once."""
    del hosts
    buf = jax_ep.Buffer(mesh, "ep", num_experts=sn.E, hidden=hidden, max_tokens_per_rank=sn.T_LL,
                        num_topk=sn.K, low_latency=True, backend="cuda")

    def pair(idx):
        x = jnp.zeros((sn.T_LL, hidden), jnp.bfloat16)
        weights = jnp.full((sn.T_LL, sn.K), 1.0 / sn.K, jnp.float32)
        d = jax_ep.low_latency_dispatch(buf, x, idx, use_fp8=True)
        y = jnp.zeros(d.recv_x.shape, jnp.bfloat16)
        return jax_ep.low_latency_combine(buf, y, idx, weights, d.handle).sum(dtype=jnp.float32)

    run = compiled(mesh, "ep", pair, next(iter(routings.values())))
    ranks = list(range(mesh.shape["ep"]))
    yield from counted_runs(routings, "flat", [(buf, ranks)], run)
    buf.check()
    buf.close()


def gather(rows):
    """Every process's rows, at process 0 (through jax.distributed's key-value store: XLA's
    collectives cannot run between processes sharing a GPU)."""
    client = ipc.kv_client()
    key = f"traffic_counts/rows{next(_gathers)}"
    client.key_value_set(f"{key}/p{jax.process_index()}", json.dumps(rows))
    if jax.process_index() != 0:
        return None
    return [row for p in range(jax.process_count())
            for row in json.loads(client.blocking_key_value_get(f"{key}/p{p}", 600_000))]


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if settings.value("JAX_EP_DEVICE_TRANSPORT") != "emulated":
        raise SystemExit("traffic_counts.py counts the emulated transport's deliveries: run it "
                         "with JAX_EP_DEVICE_TRANSPORT=emulated")
    from jax_ep import _C_testing  # noqa: PLC0415

    _C_testing.register_emulated_transport()
    sn = load_formula()
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    num_ranks = mesh.shape["ep"]
    if num_ranks % args.hosts:
        raise SystemExit(f"--hosts {args.hosts} does not divide the {num_ranks} ranks")
    gpus = num_ranks // args.hosts
    hidden = sn.H if args.hidden is None else args.hidden
    runs = []
    for mode in args.modes.split(","):
        tokens = sn.traffic_tokens(mode)
        make_runs = normal_runs if mode == "normal" else low_latency_runs
        routings = {}
        for routing_name in args.routings.split(","):
            max_hosts = sn.NODE_LIMITED_MAX_HOSTS if routing_name == "node_limited" else args.hosts
            routings[routing_name] = testing.make_node_limited_routing(
                np.random.default_rng(args.seed), num_ranks, tokens, sn.E, sn.K, args.hosts,
                max_hosts, sn.NODE_LIMITED_GROUP_TOP)
        for routing_name, scheme, rows in make_runs(sn, mesh, args.hosts, hidden, routings):
            every = gather(rows)
            if every is None:
                continue
            runs.append(dict(mode=mode, scheme=scheme, hosts=args.hosts, ranks_per_host=gpus,
                             routing=routing_name, tokens=tokens, hidden=hidden, experts=sn.E,
                             topk=sn.K, seed=args.seed, traffic=every))
            same, cross = testing.fold_traffic(every, num_ranks, gpus)
            print(f"{mode} {scheme} {routing_name} {args.hosts} x {gpus}: per rank "
                  f"{cross.mean() / 1e9:.4f} GB cross-host, {same.mean() / 1e9:.4f} GB "
                  f"same-host", flush=True)
    if jax.process_index() == 0:
        with open(args.out, "w") as f:
            json.dump({"runs": runs, "commit": os.environ.get("JAX_EP_COMMIT", "unknown"),
                       "command": " ".join(sys.argv)}, f)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
