"""FSDP2: the optimizer state as a distributed checkpoint, with the per-rank state beside it.

::

    hf_onebit.attach(model, opt)                          # model sharded with fully_shard
    ...
    hf_onebit.save_sharded(opt, "ckpt/optimizer")         # every rank
    dcp.save(get_model_state_dict(model), checkpoint_id="ckpt/model")   # the model, as usual

    # resume: the same model, fully_shard, a new optimizer, attach, then
    dcp.load(sd := get_model_state_dict(model), checkpoint_id="ckpt/model"); set_model_state_dict(model, sd)
    hf_onebit.load_sharded(opt, "ckpt/optimizer")         # every rank

What is where. ``directory`` is a ``torch.distributed.checkpoint`` (DCP) checkpoint, in the
layout of torch's ``get_optimizer_state_dict``::

    optimizer.state.<parameter name>.<key>    DTensor for every tensor of the shard's shape
                                              (moments, masks), sharded like the parameter;
                                              a plain value otherwise (1-bit LAMB's scalars)
    hf_onebit                                 the parameter groups (by name) and the counters
                                              of ``state_dict()["onebit"]``

Each shard is written once (by one replica), and DCP can read it back into another mesh or
world size. Beside it, every rank writes its per-rank file (:mod:`hf_onebit.checkpoint`): error
buffers and, for 0/1 Adam's local steps and BinSGDM, the values that differ between replicas.
The file also carries the *shard-only* entries: a key that some shards of a parameter hold and
others do not (a compression mask exists only where something is masked, and 0/1 Adam drops a
shard's mask once nothing in it stays masked). DCP needs every shard of an entry, so those go
per rank (one small exchange of key names per save finds them).

:func:`load_sharded` applies the per-rank file after the shared state, so a resume on the same
layout is bitwise; on another layout the shared state is resharded and the per-rank file is
refused (``on_mismatch="error"``) or started afresh with a warning (``"reset"``), the policy of a
world-size change; the shard-only entries are then dropped, and the warning names them.

Why not torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``: they map the
optimizer's parameters to the model's by identity, and an attached hf_onebit optimizer steps on
the local shards (:mod:`hf_onebit.hook.fsdp`); and they take the structure of the state to load
from the optimizer being loaded, which has none yet (its keys appear over the phases: the mask
at the freeze, 0/1 Adam's accumulators in its local phase). :func:`load_sharded` reads the
structure from the checkpoint's metadata instead.
"""

from __future__ import annotations

import io
import json
from typing import Literal

import torch

from hf_onebit.checkpoint import EXTRA, file_rank, read_rank_state, save_rank_state, shard_size
from hf_onebit.comm.compat import all_gather_bytes
from hf_onebit.hook.fsdp import FSDPHookState
from hf_onebit.optim.base import OneBitOptimizer, logger

FORMAT_VERSION = 1
_STATE = "optimizer.state."
_META = "hf_onebit"


def _shards(optimizer: OneBitOptimizer, what: str) -> list[tuple[str, torch.Tensor, object]]:
    """``(parameter name, local shard, DTensor parameter)`` for each of the optimizer's
    parameters, in its order (from what :func:`~hf_onebit.hook.fsdp.attach_fsdp` recorded)."""
    hook_state = optimizer.hook_state
    if not isinstance(hook_state, FSDPHookState):
        raise ValueError(f"hf_onebit.{what}: the optimizer is not attached to an FSDP2 model (hf_onebit.attach(model,"
                         " optimizer) after fully_shard); on the DDP path save optimizer.state_dict() on rank 0 and"
                         " hf_onebit.save_rank_state on every rank.")
    param_of = {id(local): param for local, param in hook_state.owners}
    params = optimizer.params_in_order()
    missing = [i for i, p in enumerate(params) if id(p) not in hook_state.names]
    if missing:
        raise ValueError(f"hf_onebit: optimizer parameters {missing[:8]} are not parameters of the attached FSDP2 model")
    return [(hook_state.names[id(p)], p, param_of[id(p)]) for p in params]


def _sharded(value, local: torch.Tensor, param):
    """``value`` as a DTensor sharded like ``param`` if it has the local shard's shape."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
    return value


def save_sharded(optimizer: OneBitOptimizer, directory: str) -> None:
    """Write ``optimizer``'s state into ``directory``: a DCP checkpoint and every rank's file
    (see the module docstring). Every rank calls it."""
    import torch.distributed.checkpoint as dcp

    shards = _shards(optimizer, "save_sharded")
    names = [name for name, _, _ in shards]
    sd = optimizer.state_dict()
    # Through the parameters' device, not all_gather_object: with NCCL that stages through
    # torch.cuda.current_device(), GPU 0 on every rank of a script that never calls set_device.
    # JSON (keys become strings): the key names and nothing a peer could make this rank execute.
    mine = json.dumps({str(i): sorted(entry) for i, entry in sd["state"].items()}).encode()
    device = optimizer.params_in_order()[0].device
    everyone = [{int(i): keys for i, keys in json.loads(b).items()} for b in all_gather_bytes(mine, device, None)]
    shard_only = {}  # index -> the keys not every rank holds for that parameter
    for i in {i for keys in everyone for i in keys}:
        held = [set(keys.get(i, ())) for keys in everyone]
        if set.union(*held) != set.intersection(*held):
            shard_only[i] = sorted(set.union(*held) - set.intersection(*held))
    state, own = {}, {}
    for i, entry in sd["state"].items():
        name, local, param = shards[i]
        state[name] = {k: _sharded(v, local, param) for k, v in entry.items() if k not in shard_only.get(i, ())}
        mine = {k: v for k, v in entry.items() if k in shard_only.get(i, ())}
        if mine:
            own[i] = mine
    meta = {
        "format": FORMAT_VERSION,
        "optimizer": type(optimizer).__name__,
        "world_size": file_rank(optimizer)[1],
        "shard_size": shard_size(optimizer),
        "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]],
        "onebit": sd["onebit"],
        "shard_only": {names[i]: keys for i, keys in shard_only.items()},
    }
    buf = io.BytesIO()
    torch.save(meta, buf)
    # bytes: one leaf for DCP (it would split a dict into one entry per key), read with weights_only
    dcp.save({"optimizer": {"state": state}, _META: buf.getvalue()}, checkpoint_id=directory)
    save_rank_state(optimizer, directory, extra={"shard_only_state": own})


def _template(metadata: dict, by_name: dict) -> dict:
    """What to load, from the checkpoint's metadata: a tensor (DTensor for a parameter-shaped
    one, sharded like this run's parameter) for each tensor entry, ``None`` for a plain value."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import DTensor

    template: dict = {}
    for key, item in metadata.items():
        if key == _META:
            template[key] = None
            continue
        if not key.startswith(_STATE):
            continue
        name = key[len(_STATE):].rsplit(".", 1)[0]
        if name not in by_name:
            raise ValueError(f"hf_onebit.load_sharded: the checkpoint has state for parameter {name!r}, which this"
                             " optimizer does not hold: it was saved for another model or optimizer.")
        if not isinstance(item, TensorStorageMetadata):
            template[key] = None
            continue
        local, param = by_name[name]
        dtype = item.properties.dtype
        if len(item.size) > 0 and tuple(item.size) == tuple(param.shape):
            empty = torch.empty(local.shape, dtype=dtype, device=local.device)
            template[key] = DTensor.from_local(empty, param.device_mesh, param.placements, run_check=False,
                                               shape=param.shape, stride=param.stride())
        else:
            template[key] = torch.empty(tuple(item.size), dtype=dtype, device=local.device)
    if template.get(_META, 0) is not None:
        raise ValueError("hf_onebit.load_sharded: the checkpoint has no hf_onebit entry: it was not written by"
                         " hf_onebit.save_sharded.")
    return template


def load_sharded(
    optimizer: OneBitOptimizer,
    directory: str,
    on_mismatch: Literal["error", "reset"] = "error",
) -> bool:
    """Restore what :func:`save_sharded` wrote into an optimizer attached to an FSDP2 model.

    Every rank calls it, after ``hf_onebit.attach`` and after the model's parameters are loaded.
    Returns whether this rank's per-rank state was loaded (``False``: reset, see the module
    docstring).
    """
    import torch.distributed.checkpoint as dcp

    if on_mismatch not in ("error", "reset"):
        raise ValueError(f"on_mismatch must be 'error' or 'reset', got {on_mismatch!r}")
    shards = _shards(optimizer, "load_sharded")
    names = [name for name, _, _ in shards]
    by_name = {name: (local, param) for name, local, param in shards}
    # Everything that can refuse the checkpoint runs before the optimizer changes.
    metadata = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    flat = _template(metadata, by_name)
    head = {_META: None}
    dcp.load(head, checkpoint_id=directory)
    meta = torch.load(io.BytesIO(head[_META]), weights_only=True)
    if meta.get("format") != FORMAT_VERSION or meta.get("optimizer") != type(optimizer).__name__:
        raise ValueError(f"hf_onebit.load_sharded: {directory} holds {meta.get('optimizer')} state (format"
                         f" {meta.get('format')}), this optimizer is {type(optimizer).__name__}.")
    saved, now = (meta["world_size"], meta["shard_size"]), (file_rank(optimizer)[1], shard_size(optimizer))
    if saved != now and on_mismatch == "error":
        raise ValueError(
            f"hf_onebit.load_sharded: {directory} was saved by world_size={saved[0]}, shard_size={saved[1]}, this run"
            f" has world_size={now[0]}, shard_size={now[1]}: the moments would be resharded, but the per-rank state"
            " (error buffers) belongs to other shards. To start the per-rank state afresh, pass on_mismatch='reset'.")
    flat.pop(_META)
    dcp.load(flat, checkpoint_id=directory)
    index = {name: i for i, name in enumerate(names)}
    state: dict = {}
    for key, value in flat.items():
        name, entry = key[len(_STATE):].rsplit(".", 1)
        state.setdefault(index[name], {})[entry] = value.to_local() if hasattr(value, "to_local") else value
    groups = []
    for g in meta["param_groups"]:
        unknown = [n for n in g["params"] if n not in index]
        if unknown:
            raise ValueError(f"hf_onebit.load_sharded: parameters {unknown[:4]} of the checkpoint are not in this"
                             " optimizer.")
        groups.append({**g, "params": [index[n] for n in g["params"]]})
    optimizer.load_state_dict({"state": state, "param_groups": groups, "onebit": meta["onebit"]})
    payload = read_rank_state(optimizer, directory, on_mismatch)
    if payload is None:
        if meta["shard_only"] and file_rank(optimizer)[0] == 0:
            logger.warning("hf_onebit: the per-rank state was started afresh, and with it these entries that only some"
                           " shards held: %s", ", ".join(f"{n}: {'/'.join(k)}" for n, k in meta["shard_only"].items()))
        return False
    for i, entry in payload.pop(EXTRA)["shard_only_state"].items():
        p = shards[i][1]
        for key, value in entry.items():
            optimizer.state[p][key] = value.to(p.device) if isinstance(value, torch.Tensor) else value
    optimizer.load_rank_state_dict(payload)
    return True


__all__ = ["load_sharded", "save_sharded"]
