"""Sequence-tiled recompute: run a token-wise function over sequence tiles.

Glossary: ``s`` sequence, ``b`` micro batch, ``h`` hidden.

Forward runs ``fn`` tile by tile under ``torch.no_grad()`` and keeps only the
input ``x`` ``[s, ...]``; backward recomputes each tile with grad enabled and
differentiates it (``torch.autograd.grad``). Only one tile's intermediates (e.g.
``[s/n, b, ffn]`` or ``[s/n, b, V]``) ever exist at a time.

The parameters are inputs of the autograd function, and each one's tile gradients reach
autograd as one gradient (``_TileGradients``), so its ``AccumulateGrad`` -- and with it every
data-parallel wrapper's gradient hook -- runs once per backward, as without tiling:
Megatron-FSDP's hook copies the gradient it sees into its buffer (with a call per tile the last
tile's won) and megatron-core DDP counts hook calls per bucket.

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
        sums = _TileGradients(params)
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


def _ddp_main_grad(param: torch.Tensor):
    """megatron-core DDP's gradient-buffer view of ``param`` (its hook adds ``param.grad`` to it),
    or None: no wrapper, FSDP2, or Megatron-FSDP (``__fsdp_param__``, whose ``main_grad`` is a
    transient bucket)."""
    main_grad = getattr(param, "main_grad", None)
    if isinstance(main_grad, torch.Tensor) and not hasattr(param, "__fsdp_param__"):
        return main_grad
    return None


class _TileGradients:
    """Each parameter's gradients over the tiles, handed to autograd as one:

    - Transformer Engine's gradient-accumulation fusion added each tile's to ``main_grad``
      (``grad_added_to_main_grad``): its placeholder is handed on;
    - megatron-core DDP: each tile's is added to its ``main_grad`` (in that buffer's precision, as
      that fusion does) and autograd gets zeros, which DDP's hook adds with whatever else the
      parameter's gradient holds (a tied embedding's lookup);
    - otherwise (Megatron-FSDP, FSDP2, no wrapper): summed in float32, handed on in the
      parameter's dtype (4 bytes per parameter during the backward).
    """

    IN_MAIN_GRAD = object()

    def __init__(self, params):
        self.params, self.out = params, [None] * len(params)
        self.main_grads = [_ddp_main_grad(param) for param in params]

    def add(self, grads) -> None:
        for i, (param, main_grad, grad) in enumerate(zip(self.params, self.main_grads, grads)):
            if grad is None:
                continue
            if getattr(param, "grad_added_to_main_grad", False):
                self.out[i] = grad  # TE's placeholder; the tile is already in main_grad
            elif main_grad is not None:
                main_grad.add_(grad)
                self.out[i] = self.IN_MAIN_GRAD
            elif self.out[i] is None:
                self.out[i] = grad.to(torch.float32, copy=True)
            else:
                self.out[i].add_(grad)

    def result(self) -> list:
        return [self._handed_on(param, out) for param, out in zip(self.params, self.out)]

    def _handed_on(self, param, out):
        if out is None or getattr(param, "grad_added_to_main_grad", False):
            return out
        if out is self.IN_MAIN_GRAD:
            return param.new_zeros(()).expand_as(param)
        return out.to(param.dtype)


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
