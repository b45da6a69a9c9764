"""Scale-out on JAX's own SPMD engine: a device mesh, data-parallel and FSDP shardings, several processes.

Nothing here communicates by hand: the state and the batch are placed with `NamedSharding`s on a
`jax.sharding.Mesh`, the step is `jax.jit` with those shardings pinned, and XLA inserts the collectives (the gradient
all-reduce or reduce-scatter, the all-gathers of FSDP params). Because the loss is a mean over the *global* batch and
`all_finite` reduces over the *global* gradients, the finite check and the loss-scale update are global by
construction: one inf on one device skips the step on every device, and every device holds the same loss scale.

The mesh always has the two axes `("data", "fsdp")` (an axis left out of the spec has size 1):

- `data=N`: data parallel. The batch is split over the N devices; params and optimizer state are replicated.
- `data=N,fsdp=M`: params and optimizer state are also split along `fsdp` (each array along its largest dimension
  divisible by M; arrays with no such dimension, and scalars, stay replicated); the batch is split over both axes,
  so every one of the N*M devices holds `batch_size / (N*M)` rows.

Several processes (hosts): `initialize_distributed` wraps `jax.distributed.initialize` and must run before any other
JAX call. The mesh then spans every process's devices (`jax.devices()`, ordered by process), and `make_global_batch`
builds the global batch from each process's own rows only (no process materialises the others' rows).

Meshes are built with explicit `AxisType.Auto` axis types: under `jax.make_mesh`'s Explicit default, Flax's `Embed`
fails with a ShardingTypeError (jax 0.10).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "AXES",
    "parse_mesh_spec",
    "format_mesh_spec",
    "make_mesh",
    "leaf_sharding",
    "state_shardings",
    "batch_sharding",
    "replicated",
    "shard_state",
    "abstract_state",
    "ShardedJit",
    "jit_train_step",
    "jit_eval_step",
    "make_global_batch",
    "gather_to_host",
    "initialize_distributed",
    "distributed_args_from_env",
    "check_distributed_args",
    "is_main_process",
]

AXES = ("data", "fsdp")
_EXAMPLES = "e.g. --mesh data=8 or --mesh data=2,fsdp=4"

PyTree = Any


# ---------------------------------------------------------------------------------------------------------------
# The mesh.


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """Parses `"data=N"` or `"data=N,fsdp=M"` (either order, spaces allowed) into `{"data": N, "fsdp": M}`.

    Axes left out have size 1. The device count is not checked here (see `make_mesh`).

    Raises:
      ValueError: an empty spec, an entry without `=`, an unknown or repeated axis, or a size that is not an
        integer >= 1. The message quotes the spec and names the fix.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"--mesh must name at least one axis size, got {spec!r} ({_EXAMPLES})")
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not name:
            raise ValueError(f"--mesh {spec!r}: entry {part.strip()!r} is not AXIS=SIZE ({_EXAMPLES})")
        if name not in AXES:
            raise ValueError(f"--mesh {spec!r}: unknown axis {name!r}; the axes are {' and '.join(AXES)} "
                             f"({_EXAMPLES})")
        if name in sizes:
            raise ValueError(f"--mesh {spec!r}: axis {name!r} is given twice")
        value = value.strip()
        if not (value.isascii() and value.isdigit()):  # int() would also take "+4", "4_0" and non-ASCII digits
            raise ValueError(f"--mesh {spec!r}: the size of {name!r} must be an integer >= 1, got {value!r}")
        size = int(value)
        if size < 1:
            raise ValueError(f"--mesh {spec!r}: the size of {name!r} must be an integer >= 1, got {size}")
        sizes[name] = size
    return {axis: sizes.get(axis, 1) for axis in AXES}


def format_mesh_spec(mesh: Mesh) -> str:
    """`"data=N,fsdp=M"` for a mesh built by `make_mesh`."""
    return ",".join(f"{name}={size}" for name, size in mesh.shape.items())


def make_mesh(spec_or_shape: str | Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `("data", "fsdp")` mesh with `Auto` axis types over `devices` (default: every device of every process).

    Devices are ordered by (process index, id) before the reshape, so `fsdp` (the inner axis) stays within a host
    whenever it divides the local device count, and `data` spans hosts.

    Args:
      spec_or_shape: `"data=N,fsdp=M"` (see `parse_mesh_spec`) or a dict `{"data": N, "fsdp": M}`.
      devices: the devices to use; their number must equal the product of the axis sizes.

    Raises:
      ValueError: a bad spec, or the axis sizes multiply to a number other than the device count.
    """
    if isinstance(spec_or_shape, str):
        shape = parse_mesh_spec(spec_or_shape)
    else:
        shape = parse_mesh_spec(",".join(f"{k}={v}" for k, v in dict(spec_or_shape).items()))
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(shape.values())
    if need != len(devices):
        written = spec_or_shape if isinstance(spec_or_shape, str) else ",".join(f"{k}={v}" for k, v in shape.items())
        raise ValueError(
            f"--mesh {written} needs {need} devices but this run has {len(devices)} "
            f"({jax.process_count()} process(es) x {jax.local_device_count()} local device(s)); "
            f"the axis sizes must multiply to the device count")
    devices.sort(key=lambda d: (d.process_index, d.id))
    grid = np.array(devices, dtype=object).reshape(tuple(shape[a] for a in AXES))
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


# ---------------------------------------------------------------------------------------------------------------
# Shardings.


def replicated(mesh: Mesh) -> NamedSharding:
    """A full copy on every device of the mesh (scalars, the loss scale, the step, the RNG, metrics)."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The batch's leading (row) dimension split over `data` and `fsdp` together; other dimensions whole."""
    return NamedSharding(mesh, P(tuple(mesh.axis_names)))


def leaf_sharding(shape: Sequence[int], mesh: Mesh) -> NamedSharding:
    """The FSDP rule for one param or optimizer-state array of `shape`.

    Split along `fsdp` on the largest dimension divisible by the `fsdp` size (the first such on a tie); replicated
    when `fsdp` is 1, for scalars, and when no dimension divides. Never split along `data`.
    """
    fsdp = mesh.shape.get("fsdp", 1)
    candidates = [i for i, n in enumerate(shape) if n % fsdp == 0 and n >= fsdp]
    if fsdp == 1 or not candidates:
        return replicated(mesh)
    dim = max(candidates, key=lambda i: (shape[i], -i))
    spec = [None] * len(shape)
    spec[dim] = "fsdp"
    return NamedSharding(mesh, P(*spec))


def state_shardings(state: PyTree, mesh: Mesh) -> PyTree:
    """A pytree of `NamedSharding`s shaped like `state` (arrays or `ShapeDtypeStruct`s).

    For a `TrainState`: `params` and `opt_state` follow `leaf_sharding` (so Adam's moments are split like their
    params and its counts stay replicated); every other field (`step`, `loss_scale`, `rng`, ...) is replicated.
    Any other pytree: `leaf_sharding` for every leaf.
    """
    from jaxamp.state import TrainState  # pylint: disable=import-outside-toplevel

    by_shape = lambda tree: jax.tree.map(lambda x: leaf_sharding(np.shape(x), mesh), tree)
    if not isinstance(state, TrainState):
        return by_shape(state)
    repl = replicated(mesh)
    everywhere = jax.tree.map(lambda _: repl, state)
    return everywhere.replace(params=by_shape(state.params), opt_state=by_shape(state.opt_state))


def shard_state(state: PyTree, mesh: Mesh) -> PyTree:
    """`state` placed on the mesh by `state_shardings` (every leaf, scalars included, becomes a global array, as
    orbax needs in a multi-process run). In a multi-process run every process must pass the same values.

    Note: on one device the result may share buffers with `state`; do not use `state` after donating the result.
    """
    shardings = state_shardings(state, mesh)
    if jax.process_count() == 1:
        return jax.device_put(state, shardings)
    # jax.device_put cannot place host values on other processes' devices: each process fills its own shards.
    def put(x, sharding):
        host = np.asarray(jax.device_get(x)) if not isinstance(x, jax.Array) or x.is_fully_addressable else None
        if host is None:  # already a global array: let XLA move it
            return jax.jit(lambda y: y, out_shardings=sharding)(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.tree.map(put, state, shardings)


def abstract_state(state: PyTree, mesh: Mesh | None) -> PyTree:
    """`jax.ShapeDtypeStruct`s of `state` (arrays or structs) carrying `state_shardings(state, mesh)`: the restore
    target that puts a checkpoint onto this mesh, whatever mesh or device count saved it. `mesh=None`: one device
    (the default device), as the `Checkpointer` does by default."""
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=device), state)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
                        state, state_shardings(state, mesh))


class ShardedJit:
    """`jax.jit(fn)` for `fn(state, batch)` with the shardings pinned, compiled per state structure.

    In: the state by `state_shardings`, the batch by `batch_sharding`. Out: for a train step, `(state, metrics)`
    with the state's shardings and replicated metrics; for an eval function, everything replicated. Pinning the
    output shardings to the input ones means a step's output feeds the next step without resharding or
    recompiling, and a state restored into `abstract_state(..., mesh)` runs the same executable.

    The shardings are a pytree shaped like the state, static fields (`tx`, `policy`) included, so one `jax.jit` is
    made per state structure (as `jax.jit` itself compiles once per structure): a state with another `tx` object
    compiles anew instead of failing. `compiled_count()` counts the executables of every structure.
    """

    def __init__(self, fn: Callable, mesh: Mesh, *, returns_state: bool, donate: bool):
        self._fn, self._mesh, self._returns_state, self._donate = fn, mesh, returns_state, donate
        self._jitted: dict = {}

    def _for(self, state):
        key = jax.tree.structure(state)
        jitted = self._jitted.get(key)
        if jitted is None:
            shardings, repl = state_shardings(state, self._mesh), replicated(self._mesh)
            jitted = self._jitted[key] = jax.jit(
                self._fn, in_shardings=(shardings, batch_sharding(self._mesh)),
                out_shardings=(shardings, repl) if self._returns_state else repl,
                donate_argnums=0 if self._donate else ())
        return jitted

    def __call__(self, state, batch):
        return self._for(state)(state, batch)

    def lower(self, state, batch):
        return self._for(state).lower(state, batch)

    def compiled_count(self) -> int:
        """Executables compiled so far (all state structures together)."""
        return sum(f._cache_size() for f in self._jitted.values())  # pylint: disable=protected-access


def jit_train_step(step_fn: Callable, mesh: Mesh, *, donate: bool = True) -> ShardedJit:
    """`step_fn(state, batch) -> (state, metrics)` jitted on `mesh` with the state donated (see `ShardedJit`)."""
    return ShardedJit(step_fn, mesh, returns_state=True, donate=donate)


def jit_eval_step(eval_fn: Callable, mesh: Mesh) -> ShardedJit:
    """`eval_fn(state, batch) -> metrics` jitted on `mesh`, outputs replicated (see `ShardedJit`)."""
    return ShardedJit(eval_fn, mesh, returns_state=False, donate=False)


# ---------------------------------------------------------------------------------------------------------------
# Batches and host copies.


def make_global_batch(rows_fn: Callable[[int, int], PyTree], global_size: int, mesh: Mesh) -> PyTree:
    """The global batch as arrays sharded by `batch_sharding(mesh)`, built from this process's rows only.

    Args:
      rows_fn: `rows_fn(start, stop)` returns rows `[start, stop)` of the global batch: a pytree of host arrays whose
        leading dimension is `stop - start`. Called once per distinct row range this process's devices hold.
      global_size: the global batch size (rows), divisible by the mesh's device count.
      mesh: the mesh.

    Returns:
      The pytree `rows_fn` returns, each leaf a global `jax.Array` of leading dimension `global_size`. The batch is
      the same whatever the number of processes or devices, so a run matches the single-device one.

    Raises:
      ValueError: `global_size` is not divisible by the mesh size.
    """
    if global_size % mesh.size:
        raise ValueError(f"the global batch ({global_size} rows) must be divisible by the mesh's {mesh.size} devices")
    sharding = batch_sharding(mesh)
    ranges = sorted({index[0].indices(global_size)[:2]
                     for index in sharding.addressable_devices_indices_map((global_size,)).values()})
    parts = {r: rows_fn(*r) for r in ranges}
    flat = {r: jax.tree.flatten(tree) for r, tree in parts.items()}
    treedef = next(iter(flat.values()))[1]
    leaves = []
    for i in range(treedef.num_leaves):
        sample = np.asarray(next(iter(flat.values()))[0][i])
        shape = (global_size, *sample.shape[1:])

        def piece(index, i=i):
            start, stop = index[0].indices(global_size)[:2]
            return np.asarray(flat[(start, stop)][0][i])[(slice(None), *index[1:])]

        leaves.append(jax.make_array_from_callback(shape, sharding, piece))
    return jax.tree.unflatten(treedef, leaves)


def gather_to_host(tree: PyTree) -> PyTree:
    """Every leaf as a whole host (NumPy) array. A collective in a multi-process run: every process must call it."""
    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))
    return jax.tree.map(get, tree)


# ---------------------------------------------------------------------------------------------------------------
# Several processes.


def distributed_args_from_env(coordinator: str | None = None, num_processes: int | None = None,
                              process_id: int | None = None) -> tuple[str | None, int | None, int | None]:
    """Fills missing values from `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`.

    Raises:
      ValueError: an environment value is not an integer.
    """
    env = os.environ
    if coordinator is None:
        coordinator = env.get("JAX_COORDINATOR_ADDRESS") or None
    for name, value in (("JAX_NUM_PROCESSES", num_processes), ("JAX_PROCESS_ID", process_id)):
        if value is None and env.get(name):
            try:
                value = int(env[name])
            except ValueError:
                raise ValueError(f"{name}={env[name]!r} is not an integer") from None
            if name == "JAX_NUM_PROCESSES":
                num_processes = value
            else:
                process_id = value
    return coordinator, num_processes, process_id


def check_distributed_args(coordinator: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """True when the three describe a multi-process launch, False when none is given.

    Raises:
      ValueError: only some are given, the coordinator is not HOST:PORT, or the numbers are out of range.
    """
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if not any(given):
        return False
    if not all(given):
        raise ValueError("--coordinator, --num-processes and --process-id go together (or JAX_COORDINATOR_ADDRESS, "
                         "JAX_NUM_PROCESSES and JAX_PROCESS_ID); got "
                         f"coordinator={coordinator!r}, num_processes={num_processes!r}, process_id={process_id!r}")
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator must be HOST:PORT (the address of process 0), got {coordinator!r}")
    if num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"--process-id must lie in [0, {num_processes}), got {process_id}")
    return True


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> bool:
    """Calls `jax.distributed.initialize` when a multi-process launch is described; call it before any other JAX
    call. Missing arguments come from `JAX_COORDINATOR_ADDRESS`, `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`.

    Returns:
      True if JAX runs distributed (now or already), False when nothing describes a multi-process launch.

    Raises:
      ValueError: as `check_distributed_args`.
    """
    coordinator, num_processes, process_id = distributed_args_from_env(coordinator, num_processes, process_id)
    if not check_distributed_args(coordinator, num_processes, process_id):
        return False
    if jax.distributed.is_initialized():
        return True
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    return True


def is_main_process() -> bool:
    """True on process 0 (the one that prints and writes logs); always True in a single-process run."""
    return jax.process_index() == 0
