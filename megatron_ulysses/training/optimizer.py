"""The optimizer: megatron-core's (`get_megatron_optimizer`: fp32, bf16/fp16 mixed precision, the
distributed optimizer sharded over DP x SP) on GPU; on CPU, where megatron-core's optimizers
allocate CUDA tensors, `CpuAdamW` with the same interface and math (AdamW over DDP's `main_grad`,
no weight decay on biases and norms, global-norm clipping over TP x PP, the same sharded
checkpoint layout)."""

import dataclasses
import math
from itertools import chain

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    optim_state_to_sharding_state,
)
from megatron.core.utils import to_local_if_dtensor
from torch.distributed.tensor import DTensor

from .chunks import model_chunks
from .config.performance import PerformanceConfig, optimizer_kwargs
from .fsdp import local_grad, sum_over_shards, torch_optimizers


def mcore_optimizer_config(config, model_config):
    """megatron-core's `OptimizerConfig` of our `OptimizerConfig` (+ the model's precision)."""
    from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig

    return McoreOptimizerConfig(
        optimizer=config.optimizer, lr=config.lr, min_lr=config.min_lr,
        decoupled_lr=config.decoupled_lr, decoupled_min_lr=config.decoupled_min_lr,
        apply_wd_to_qk_layernorm=config.apply_wd_to_qk_layernorm,
        weight_decay=config.weight_decay, adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2, adam_eps=config.adam_eps, clip_grad=config.clip_grad,
        bf16=model_config.bf16, fp16=model_config.fp16, params_dtype=model_config.params_dtype,
        loss_scale=config.loss_scale, initial_loss_scale=config.initial_loss_scale,
        min_loss_scale=config.min_loss_scale, loss_scale_window=config.loss_scale_window,
        hysteresis=config.hysteresis, use_distributed_optimizer=config.use_distributed_optimizer,
    )


def param_groups(model, mcore_config):
    """megatron-core's param groups (`_get_param_groups`, its standard overrides): no weight
    decay on biases and 1-D params (but q/k layernorms with --apply-wd-to-qk-layernorm), the
    embedding and output layer at their own max/min LR with --decoupled-lr. Each group carries
    the `max_lr` / `min_lr` / `wd_mult` the scheduler reads."""
    from megatron.core.optimizer import _get_param_groups

    return _get_param_groups(model_chunks(model), mcore_config, None)


class CpuAdamW:
    """AdamW over `param.main_grad` (DDP) or FSDP2's sharded `param.grad`, with megatron-core's
    `step() -> (ok, grad_norm, zeros)`."""

    def __init__(self, model, config, groups, log_num_zeros_in_grad: bool = False):
        """`config`: an `OptimizerConfig`; `groups`: `param_groups`; `log_num_zeros_in_grad`:
        `step` counts the zero gradient entries (megatron-core's OptimizerConfig option)."""
        self.optimizer = torch.optim.AdamW(
            groups, lr=config.lr, weight_decay=config.weight_decay,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
        )
        self.clip_grad = config.clip_grad
        self.log_num_zeros_in_grad = log_num_zeros_in_grad

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def get_parameters(self):
        return list(chain.from_iterable(g["params"] for g in self.optimizer.param_groups))

    def get_loss_scale(self) -> torch.Tensor:
        return torch.tensor(1.0)

    def zero_grad(self) -> None:
        for param in self.get_parameters():
            param.grad = None

    def _over_grads(self, per_grad) -> torch.Tensor:
        """Σ `per_grad(local gradient)` over all gradients, each counted once."""
        params = self.get_parameters()
        total = sum_over_shards([(p, local_grad(p)) for p in params], per_grad)
        dist.all_reduce(total, group=mpu.get_model_parallel_group())
        return total

    def grad_norm(self) -> float:
        """L2 norm of all gradients."""
        return math.sqrt(self._over_grads(lambda g: g.double().pow(2).sum()).item())

    def count_zeros(self) -> int:
        """Zero entries of all gradients (megatron-core's `count_zeros_fp32`, which allocates
        on CUDA)."""
        return int(self._over_grads(lambda g: g.numel() - torch.count_nonzero(g)).item())

    @torch.no_grad()
    def step(self):
        for param in self.get_parameters():
            if hasattr(param, "main_grad"):  # DDP's buffer; FSDP2 reduces into `grad`
                param.grad = param.main_grad.to(param.dtype)
        norm = self.grad_norm()
        if self.clip_grad > 0 and norm > self.clip_grad:
            coefficient = self.clip_grad / (norm + 1e-6)
            for param in self.get_parameters():
                param.grad.mul_(coefficient)
        zeros = self.count_zeros() if self.log_num_zeros_in_grad else None
        self.optimizer.step()
        return True, norm, zeros

    def _init_state(self) -> None:
        for param in self.get_parameters():
            state = self.optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        """Adam moments as ShardedTensors shaped like their params (any DP x SP layout can load
        them); the step and hyper-parameters as common state."""
        if is_loading:
            self._init_state()
        state_dict = self.optimizer.state_dict()
        # FSDP2: the local shards (new dicts: state_dict() shares the live ones)
        state_dict["state"] = {index: {k: to_local_if_dtensor(v) for k, v in state.items()}
                               for index, state in state_dict["state"].items()}
        # megatron-core's sharded state dict holds FSDP2's local shards, not the DTensors
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, [
            p._local_tensor if isinstance(p, DTensor) else p for p in self.get_parameters()])
        steps = {float(s["step"]) for s in state_dict["state"].values() if "step" in s}
        assert len(steps) <= 1, f"parameters at different Adam steps: {steps}"
        optim_state_to_sharding_state(state_dict, id_map, exclude_keys="step")
        if steps:
            state_dict["state"]["common_step"] = steps.pop()
        return state_dict

    def load_state_dict(self, state_dict) -> None:
        step = state_dict["state"].pop("common_step", None)
        if step is not None:
            for param_state in state_dict["state"].values():
                param_state["step"] = torch.tensor(float(step))
        self.optimizer.load_state_dict(state_dict)


def count_on_after_load(optimizer) -> None:
    """After a load: megatron-core's HybridDeviceOptimizer (--optimizer-cpu-offload) copies its
    param groups into its sub-optimizers before every step, and a loaded checkpoint leaves the
    saved Adam step in those groups, so TE's FusedAdam (the GPU share) restarted from it at
    every step: its bias correction stuck at the resumed iteration (the resumed run logged the
    uninterrupted digits for two iterations, then drifted; H100). The sub-optimizers already
    hold the loaded step (megatron-core's post-load hook): dropping it from the HDO's groups
    lets FusedAdam count on, as in a run never stopped."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    for inner in torch_optimizers(optimizer):
        if isinstance(inner, HybridDeviceOptimizer):
            for group in inner.param_groups:
                group.pop("step", None)


def build_optimizer(config, model_config, model, performance=PerformanceConfig(),
                    log_num_zeros_in_grad: bool = False):
    """megatron-core's optimizer on GPU, `CpuAdamW` over megatron-core's param groups on CPU.
    `config`: an `OptimizerConfig`; `model_config`: the `ModelConfig` (its precision);
    `performance`: the speed features (overlapped param gather, precision-aware optimizer, CPU
    offload; GPU only); `log_num_zeros_in_grad`: `step()` returns the number of zero gradient
    entries (--log-num-zeros-in-grad)."""
    mcore_config = mcore_optimizer_config(config, model_config)
    if not torch.cuda.is_available():
        return CpuAdamW(model, config, param_groups(model, mcore_config), log_num_zeros_in_grad)
    from megatron.core.optimizer import get_megatron_optimizer

    mcore_config = dataclasses.replace(mcore_config, log_num_zeros_in_grad=log_num_zeros_in_grad,
                                       **optimizer_kwargs(performance))
    return get_megatron_optimizer(mcore_config, model_chunks(model))
