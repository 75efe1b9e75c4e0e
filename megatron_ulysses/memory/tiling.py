"""Sequence-tiled recompute: run a token-wise function over sequence tiles.

Glossary: ``s`` sequence, ``b`` micro batch, ``h`` hidden.

Forward runs ``fn`` tile by tile under ``torch.no_grad()`` and keeps only the
input ``x`` ``[s, ...]``; backward recomputes each tile with grad enabled and
differentiates it (``torch.autograd.grad``). Only one tile's intermediates (e.g.
``[s/n, b, ffn]`` or ``[s/n, b, V]``) ever exist at a time.

The parameters are inputs of the autograd function: their tile gradients are summed here
(float32) and handed to autograd once, so each parameter's ``AccumulateGrad`` -- and with it
every data-parallel wrapper's gradient hook -- runs once per backward, as without tiling.
Megatron-FSDP's hook copies a gradient into its buffer (the last tile would win) and
megatron-core DDP counts hook calls per bucket. Where Transformer Engine's gradient-accumulation
fusion already added a tile's weight gradient to ``param.main_grad`` (``grad_added_to_main_grad``),
its placeholder gradient is handed on instead of a sum. The sums cost 4 bytes per parameter of
``fn`` during its backward (under tiled loss the output layer's ``V/tp x h``: 2.1 GB for
Llama-3.1-8B's vocabulary) where no such fusion takes the gradient.

Under activation recompute the forward runs a second time, inside the backward pass, only so
that backward can differentiate it. A caller whose output is then differentiated but never read
(the last sublayer of a checkpointed chunk: TiledMLP under full recompute) passes
``skip_in_recompute``: that second forward runs no tile and returns zeros, and backward
recomputes the tiles from ``x`` as always, so ``fn`` runs twice per step, not three times.

One noun: the flags `--tiled-mlp-shards N` / `--tiled-loss-shards N` (ALST's name) set the
number of tiles N, a positive int or "auto".
"""

from typing import Callable, Iterable, List, Union

import torch

TileFn = Callable[[torch.Tensor, slice], torch.Tensor]
NumTiles = Union[int, str]  # a positive count or "auto"


def check_num_tiles(num_tiles: NumTiles, flag: str) -> None:
    """A positive int or "auto", as the flag `flag` takes it."""
    if num_tiles == "auto":
        return
    if not isinstance(num_tiles, int) or isinstance(num_tiles, bool) or num_tiles < 1:
        raise ValueError(f"{flag} must be a positive integer or 'auto', got {num_tiles!r}")


def tile_slices(seq_len: int, num_tiles: int) -> List[slice]:
    """Split ``range(seq_len)`` into ``min(num_tiles, seq_len)`` near-equal slices."""
    num_tiles = max(1, min(num_tiles, seq_len))
    base, extra = divmod(seq_len, num_tiles)
    slices, start = [], 0
    for i in range(num_tiles):
        stop = start + base + (1 if i < extra else 0)
        slices.append(slice(start, stop))
        start = stop
    return slices


class _SequenceTiledRecompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, slices, out_dim, skip_in_recompute, x, *params):
        ctx.fn, ctx.slices, ctx.out_dim, ctx.params = fn, slices, out_dim, params
        ctx.save_for_backward(x)
        if skip_in_recompute and torch._C._current_graph_task_id() != -1:
            # A forward inside a backward pass is a checkpoint's recompute (see the module
            # docstring): the caller differentiates this output and never reads it.
            return torch.zeros_like(x)
        out = None
        with torch.no_grad():
            for tile in slices:
                y = fn(x[tile], tile)
                if out is None:
                    # Preallocate instead of torch.cat so tile outputs and the
                    # full output never coexist.
                    shape = list(y.shape)
                    shape[out_dim] = x.shape[0]
                    out = y.new_empty(shape)
                out.narrow(out_dim, tile.start, tile.stop - tile.start).copy_(y)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[4]
        grad_x = torch.empty_like(x) if need_x else None
        params = [p for p, need in zip(ctx.params, ctx.needs_input_grad[5:]) if need]
        sums = _ParamGradSums(params)
        for tile in ctx.slices:
            x_tile = x[tile].detach().requires_grad_(need_x)
            with torch.enable_grad():
                y = ctx.fn(x_tile, tile)
            grad_y = grad_out.narrow(ctx.out_dim, tile.start, tile.stop - tile.start)
            grads = torch.autograd.grad(y, [x_tile] * need_x + params, grad_y,
                                        allow_unused=True)
            if need_x:
                grad_x[tile] = grads[0]
            sums.add(grads[need_x:])
        delivered = iter(sums.result())
        return (None, None, None, None, grad_x,
                *(next(delivered) if need else None for need in ctx.needs_input_grad[5:]))


class _ParamGradSums:
    """The parameters' gradients summed over tiles, in float32, delivered in their dtype; a
    parameter whose gradient Transformer Engine accumulates into ``main_grad`` itself gets the
    placeholder gradient it returned."""

    def __init__(self, params):
        self.params, self.sums = params, [None] * len(params)

    def add(self, grads) -> None:
        for i, (param, grad) in enumerate(zip(self.params, grads)):
            if grad is None:
                continue
            if getattr(param, "grad_added_to_main_grad", False):
                self.sums[i] = grad  # TE's placeholder; the tile is already in main_grad
            elif self.sums[i] is None:
                self.sums[i] = grad.float() if grad.dtype != torch.float32 else grad.clone()
            else:
                self.sums[i].add_(grad)

    def result(self) -> list:
        return [total if total is None or getattr(param, "grad_added_to_main_grad", False)
                else total.to(param.dtype) for param, total in zip(self.params, self.sums)]


def sequence_tiled_recompute(
    fn: TileFn,
    x: torch.Tensor,
    num_tiles: int,
    params: Iterable[torch.Tensor],
    out_dim: int = 0,
    skip_in_recompute: bool = False,
) -> torch.Tensor:
    """Apply ``fn`` to sequence tiles of ``x`` ``[s, ...]``, recomputing in backward.

    ``fn(x_tile, tile)`` gets ``x[tile]`` and the ``slice`` (to cut matching
    side inputs such as labels) and returns that tile's output; outputs are
    joined along ``out_dim`` (0 for ``[s, b, h]``, 1 for ``[b, s]``). ``fn``
    must be token-wise and deterministic (no dropout): it runs again in
    backward. ``params`` are the leaf tensors ``fn`` closes over (module
    parameters), exactly those ``fn`` uses: autograd accumulates each one's gradient once
    (a parameter that ``fn`` does not use would get an empty extra accumulation).
    ``skip_in_recompute``: ``fn`` keeps ``x``'s shape and dtype, and where this runs inside a
    backward pass (an activation checkpoint's recompute) the caller only differentiates the
    output: it is then zeros, and no tile runs until backward.
    """
    if num_tiles < 1:
        raise ValueError(f"num_tiles must be >= 1, got {num_tiles}")
    slices = tile_slices(x.shape[0], num_tiles)
    return _SequenceTiledRecompute.apply(fn, slices, out_dim, skip_in_recompute, x, *params)
