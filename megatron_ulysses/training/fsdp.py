"""Sharded data parallelism: the GPTModel in megatron-core's FSDP wrappers, sharded over
megatron-core's data-parallel group, which here is DP x SP (the Ulysses SP groups are carved out
of it), so an SP rank holds 1/(DP x SP) of what the strategy shards.

    --use-torch-fsdp2   megatron-core's TorchFullyShardedDataParallel (PyTorch's fully_shard):
                        parameters, gradients and Adam moments sharded (ZeRO-3); CPU and GPU
    --use-megatron-fsdp megatron-core's FullyShardedDataParallel with its distributed optimizer;
                        --data-parallel-sharding-strategy picks what is sharded; GPU only (its
                        buffers live on CUDA streams)

Both reduce gradients as DDP does here: summed over DP x SP, then divided by the global batch's
token count (`finalize_model_grads` calls `scale_gradients`), so the losses equal DDP's.
"""

import inspect
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.distributed import TorchFullyShardedDataParallel
from megatron.core.utils import to_local_if_dtensor

from ..sp import parallel_state as ps
from ..errors import ConfigError

# What each --data-parallel-sharding-strategy shards over DP x SP (Megatron-LM's meaning).
SHARDED_TERMS = {
    "no_shard": (),
    "optim": ("optimizer state",),
    "optim_grads": ("optimizer state", "gradients"),
    "optim_grads_params": ("optimizer state", "gradients", "parameters"),
}


def sharding_strategy(performance):
    """What the run shards over DP x SP, as a --data-parallel-sharding-strategy (None: DDP)."""
    if performance.use_torch_fsdp2:
        return "optim_grads_params"
    if performance.use_megatron_fsdp:
        return performance.data_parallel_sharding_strategy
    return None


class UlyssesTorchFSDP2(TorchFullyShardedDataParallel):
    """megatron-core's FSDP2 wrapper with the per-token loss: each reduce-scatter sums over
    DP x SP (FSDP2 averages by default) and `scale_gradients` (a no-op in megatron-core's
    wrapper) divides the sharded gradients by the token count."""

    def __init__(self, config, ddp_config, module):
        _check_even_rows(module)
        super().__init__(config=config, ddp_config=ddp_config, module=module,
                         sub_modules_to_wrap=unit_modules(module))
        from torch.distributed.fsdp import FSDPModule

        for sub in self.module.modules():
            if isinstance(sub, FSDPModule):
                sub.set_gradient_divide_factor(1.0)
                sub.set_force_sum_reduction_for_comms(True)  # SUM, not PREMUL_SUM (gloo)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Nothing to wait for: FSDP2 reduce-scatters in its post-backward hooks (megatron-core
        0.16's wrapper lacks the `force_all_reduce` argument its finalize_model_grads passes)."""

    def scale_gradients(self, scaling_factor: float) -> None:
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.mul_(scaling_factor)


def unit_modules(module) -> set:
    """The module classes FSDP2 makes units of: megatron-core's (its TE spec's output layer
    too), but under tiled loss the output layer stays in the root unit. The tiled loss calls it
    once per tile in the forward and again per tile inside its backward, which an FSDP2 unit's
    hooks do not follow: the tiles' weight gradients are lost (tests/integration/test_fsdp.py; on an H100
    the losses drifted 4% from DDP's). The root unit stays unsharded through the backward and
    reduce-scatters once, at its end."""
    units = set(inspect.signature(TorchFullyShardedDataParallel.__init__)
                .parameters["sub_modules_to_wrap"].default)
    if any(getattr(sub, "tiled_loss_shards", None) is not None for sub in module.modules()):
        units.discard(tensor_parallel.ColumnParallelLinear)
    return units


def _check_even_rows(module) -> None:
    """FSDP2 splits each parameter's rows (dim 0) over DP x SP; megatron-core's checkpoint
    layout of a shard assumes equal blocks (FSDP2 pads the last one): the same ConfigError on
    every rank, before the first collective of the wrap."""
    shards = mpu.get_data_parallel_world_size(with_context_parallel=True)
    for name, param in module.named_parameters():
        if param.dim() and param.shape[0] % shards:
            raise ConfigError(
                f"--use-torch-fsdp2: {name} has {param.shape[0]} rows on this TP rank, not a "
                f"multiple of data parallel x --ulysses-sp-size = {shards}, which FSDP2 splits "
                "them over (its checkpoint shards would be uneven); choose sizes that divide")


def check_shard_group(model) -> int:
    """The size of the group `model`'s parameters are sharded over; raises unless it is
    megatron-core's DP group, of DP x SP ranks."""
    from torch.distributed.tensor import DTensor

    dims = ps.get_parallel_dims()
    group = mpu.get_data_parallel_group(with_context_parallel=True)
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):  # Megatron-FSDP's meshes are (dp_cp, tp)
            mesh = param.device_mesh
            dim = "dp_cp" if "dp_cp" in (mesh.mesh_dim_names or ()) else None
            if dim is None and mesh.ndim > 1:
                continue
            mesh_ranks = dist.get_process_group_ranks(mesh.get_group(dim))
            if mesh_ranks != dist.get_process_group_ranks(group):
                raise RuntimeError(f"{name} is sharded over ranks {mesh_ranks}, not over the "
                                   f"DP x SP group {dist.get_process_group_ranks(group)}")
    size = dist.get_world_size(group)
    if size != dims.dp * dims.sp:
        raise RuntimeError(f"megatron-core's DP group has {size} ranks, not DP x SP = "
                           f"{dims.dp} x {dims.sp}")
    return size


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in map(to_local_if_dtensor, tensors))


def gradient_bytes(model) -> int:
    """This rank's bytes of gradients (its shards of sharded ones). Read after the backward:
    megatron-core's mixed-precision optimizer frees the model's gradients in its step."""
    if hasattr(model, "megatron_fsdp_dist_index"):  # Megatron-FSDP: its buffers hold them
        return _bytes(_megatron_fsdp_buffers(model, "main_grad_buffer")[0])
    return _bytes([local_grad(p) for p in model.parameters()
                   if p.grad is not None or hasattr(p, "main_grad")])


def rank_bytes(model, optimizer, gradients: int) -> dict:
    """This rank's bytes of parameters and Adam moments (the local shards of sharded tensors),
    read after a step, with its `gradient_bytes`: what the strategy divides by DP x SP."""
    moments = [value for state in optimizer_states(optimizer)
               for key, value in state.items() if key in ("exp_avg", "exp_avg_sq")]
    params = list(model.parameters())
    if hasattr(model, "megatron_fsdp_dist_index"):
        # no_shard keeps its weights outside its weight buffer (H100 log)
        params = _megatron_fsdp_buffers(model, "model_weight_buffer")[0] or params
    return {"parameters": _bytes(params), "gradients": gradients,
            "optimizer state": _bytes(moments)}


def _megatron_fsdp_buffers(model, *names):
    """For each buffer name, the tensors Megatron-FSDP's parameter groups keep in it (a shard
    when the strategy shards it)."""
    groups = model.param_and_grad_buffer.parameter_groups
    return [[buffer.data for buffer in (getattr(group, name, None) for group in groups)
             if buffer is not None and getattr(buffer, "data", None) is not None]
            for name in names]


def torch_optimizers(optimizer):
    """The torch optimizer(s) in `optimizer`: itself, or inside megatron-core's (chained, mixed
    precision) wrapper(s)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        yield optimizer
    elif hasattr(optimizer, "chained_optimizers"):
        for inner in optimizer.chained_optimizers:
            yield from torch_optimizers(inner)
    elif hasattr(optimizer, "optimizer"):
        yield from torch_optimizers(optimizer.optimizer)


def optimizer_states(optimizer):
    """The per-parameter states of a torch optimizer, or of megatron-core's wrapper(s) of one."""
    for torch_optimizer in torch_optimizers(optimizer):
        yield from torch_optimizer.state.values()


def main_params_as_dtensors(optimizer, state) -> None:
    """Before megatron-core's mixed-precision optimizer loads `state`: its fp32 main params of
    FSDP2 parameters are DTensors, into which it copies the checkpoint's (this rank's shards):
    those made DTensors like them (GPU only: on CPU `CpuAdamW` keeps no main params)."""
    from torch.distributed.tensor import DTensor

    chained = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    states = [state] if len(chained) == 1 else (
        [value for _, value in sorted(state.items())] if isinstance(state, dict) else state)
    for each, each_state in zip(chained, states):
        groups, key = getattr(each, "fp32_from_float16_groups", None), "fp32_from_fp16_params"
        if groups is None or not isinstance(each_state, dict) or key not in each_state:
            continue
        each_state[key] = [
            [DTensor.from_local(saved, main.device_mesh, main.placements)
             if isinstance(main, DTensor) and not isinstance(saved, DTensor) else saved
             for main, saved in zip(main_group, saved_group)]
            for main_group, saved_group in zip(groups, each_state[key])]


def shard_loaded_states(optimizer) -> None:
    """After a load: each state tensor of an FSDP2 parameter, which a checkpoint gives as this
    rank's shard, made the DTensor the step computes with (as a fresh run's states are)."""
    from torch.distributed.tensor import DTensor

    for torch_optimizer in torch_optimizers(optimizer):
        for param, state in torch_optimizer.state.items():
            if not isinstance(param, DTensor):
                continue
            for key, value in state.items():
                if torch.is_tensor(value) and not isinstance(value, DTensor) \
                        and value.shape == param._local_tensor.shape:
                    state[key] = DTensor.from_local(value, param.device_mesh, param.placements)


class RankBytesLog:
    """One line per rank, once: its measured bytes and what `strategy` (`sharding_strategy`)
    shards; nothing under DDP (None). The loop calls `after_backward()` (gradients) and
    `after_step()` (the line) in each step."""

    def __init__(self, model, optimizer, strategy: Optional[str]):
        self.model, self.optimizer, self.strategy = model, optimizer, strategy
        self.gradients, self.logged = None, strategy is None

    def after_backward(self) -> None:
        if self.gradients is None and not self.logged:
            self.gradients = gradient_bytes(self.model)

    def after_step(self) -> None:
        if self.logged:
            return
        self.logged = True
        measured = rank_bytes(self.model, self.optimizer, self.gradients)
        terms = ", ".join(SHARDED_TERMS[self.strategy]) or "nothing"
        line = " | ".join(f"{name} {value}" for name, value in measured.items())
        print(f" > rank {dist.get_rank()} bytes ({self.strategy}: {terms} sharded over DP x SP "
              f"= {check_shard_group(self.model)}): {line}", flush=True)


def local_grad(param) -> Optional[torch.Tensor]:
    """This rank's gradient of `param`: DDP's `main_grad`, or FSDP's local shard of `grad`
    (None where Megatron-FSDP keeps it in its buffers only)."""
    grad = getattr(param, "main_grad", None)
    return to_local_if_dtensor(param.grad if grad is None else grad)


def sum_over_shards(pairs, per_tensor) -> torch.Tensor:
    """Σ `per_tensor(this rank's shard of t)` over the (param, t) `pairs` whose param counts once
    over TP x PP (not shared, not a TP duplicate), with FSDP's shards summed over DP x SP: `[1]`,
    on the tensors' device, still to be all-reduced over the model-parallel group."""
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared
    from torch.distributed.tensor import DTensor

    parts = {False: [], True: []}  # by "is an FSDP shard"
    for param, tensor in pairs:
        if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
            parts[isinstance(param, DTensor)].append(per_tensor(to_local_if_dtensor(tensor)))
    totals = [torch.stack(part).sum().reshape(1) if part else None for part in parts.values()]
    if totals[1] is None:
        return totals[0]
    dist.all_reduce(totals[1], group=mpu.get_data_parallel_group(with_context_parallel=True))
    return totals[1] if totals[0] is None else totals[0] + totals[1]


def local_shards_as_dtensors(module, state: dict) -> dict:
    """`state` (a loaded model state: FSDP2's local shards, as megatron-core's sharded state dict
    names them) with each shard of a sharded parameter of `module` made its DTensor again, so
    `module.load_state_dict` copies it; the other entries as they are."""
    from torch.distributed.tensor import DTensor

    targets = module.state_dict(keep_vars=True)
    return {key: DTensor.from_local(value, targets[key].device_mesh, targets[key].placements)
            if isinstance(targets.get(key), DTensor) else value for key, value in state.items()}


def model_sharded_state_dict(model) -> dict:
    """megatron-core's sharded state dict of the GPTModel in `model`; under FSDP2 with SwiGLU,
    each fused fc1 `[gate; up]` shard described by its place in the checkpoint's layout.

    megatron-core's SwiGLU factory splits a TP rank's `[gate_t; up_t]` rows in two halves; an
    FSDP2 shard is instead the d-th of D = DP x SP row blocks of them: at TP 1 chunk d of D of
    the layout DDP writes; at TP t of T with D even, within one half, chunk
    (half x T + t) x D/2 + d mod D/2 of T x D. So the checkpoint loads at any DP x SP, with or
    without FSDP."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

    state = model.module.sharded_state_dict()
    group = mpu.get_data_parallel_group(with_context_parallel=True)
    shards, shard = dist.get_world_size(group), dist.get_rank(group)
    if not isinstance(model, UlyssesTorchFSDP2) or shards == 1:  # the factory's halves hold
        return state
    tp, tp_rank = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()

    def place(value):
        if not (isinstance(value, ShardedTensorFactory)
                and value.key.endswith((".linear_fc1.weight", ".linear_fc1.bias"))):
            return value
        half, within = divmod(shard, shards // 2)
        chunk = shard if tp == 1 else (half * tp + tp_rank) * (shards // 2) + within
        gate = value.build_fn(value.key, value.data, value.replica_id, None)[0]
        axes = gate.prepend_axis_num  # the layer axis megatron-core prepends
        prepended = [(i, gate.global_offset[i], gate.axis_fragmentations[i]) for i in range(axes)]
        return ShardedTensor.from_rank_offsets(
            value.key, value.data, *prepended, (axes, chunk, tp * shards),
            replica_id=value.replica_id, prepend_axis_num=axes)

    return dict_list_map_inplace(place, state)
