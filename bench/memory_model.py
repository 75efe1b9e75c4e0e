"""Memory model of training a GPT (Llama shape) with the trainer, per token and per layer: the
activations kept for backward, the checkpoints (recompute inputs), the logits / loss, and the model
+ optimizer state, each term measured on the real model next to its formula, and which memory
feature removes which term.

Model (preset llama-1b): Llama-3.2-1B shape (see harness.py), bf16 on GPU (fp32 on CPU), micro
batch 1, SP=1, the trainer's build (`harness.Trainer("ours", ...)` from `harness.run_config`'s
Megatron-LM flags). Each variant is built once (for the longer sequence) and measured at s and 2s:

    none             no recompute
    selective        --recompute-granularity selective (megatron-core's default module: core_attn)
    full             full recompute (uniform, 1 layer per checkpoint)
    full-tiled-mlp   full recompute + TiledMLP
    tiled-mlp        TiledMLP alone
    tiled-loss       tiled loss alone
    full-all         full recompute + TiledMLP + tiled loss + activation offload

Method, per variant and sequence length: ONE forward of the model on `harness.random_batch`
(and the trainer's loss·mask sum) under `torch.autograd.graph.saved_tensors_hooks`, recording
every tensor saved for backward: its storage (a view counts its whole storage; a storage counts
once; parameters, main_grad buffers and module buffers are excluded), where it stays (device, or
host when the activation offload moved it) and whether it is a checkpoint (saved by the
`torch.autograd.Function` of a recompute: megatron-core's CheckpointFunction, the sequence-tiled
recompute of TiledMLP / tiled loss). A module stack (forward pre/post hooks) attributes each
saved tensor to a layer and a submodule (two levels below the layer), or to the embedding, the
final norm, the output layer, the loss (GPTModel._postprocess) or the loss·mask sum outside the
model; a storage saved by more than one of these is "shared" (RoPE frequencies). The activation
offload pushes its own hooks inside the decoder (the innermost hooks win), so the recorder wraps
them: it calls the offload's pack first and records what that leaves on the device. Then one
backward under the same hooks, whose new saved storages are the recompute working set (peak of
the live ones); everything saved must be released after it ("leaked" is 0). On GPU also
torch.cuda.memory_allocated() after minus before the forward (ground truth: it includes what TE
keeps in ctx attributes, which no hook sees, and the forward's outputs) and the backward's peak
over its start, after one unrecorded warm-up forward + backward per variant (workspaces, kernel
selection, Triton compiles).

Two lengths give the slope: bytes/token/layer = a + c*s, c being the s^2 term (materialized
attention scores: the local backend's [b, H, s, s] probabilities and its [s, s] causal mask;
flash / fused attention (te, sdpa) has none). The analytic model (`layer_terms`,
`outside_terms`, `apply_features`) derives each term from the shape (h hidden, ffn, H heads,
G kv heads, d head dim, e bytes per element) and what megatron-core's modules save; it is
checked exactly on CPU (tests/integration/test_memory_model.py) for the local and sdpa backends; for TE
(norms fused into the qkv / fc1 GEMMs, fused RoPE and SwiGLU, TE's fused cross entropy) it is
a prediction from their sources, which the GPU run confirms or not (ratio column).

Model / optimizer state after one `trainer.init_optimizer_state()`: weights, the DDP grad buffer
(main_grad, fp32), master weights (fp32 copies held by the optimizer) and the optimizer's state
tensors (Adam moments, step), against params x (e weights + 4 main grad + 4 master (bf16 only)
+ 8 moments).

Output: markdown tables (terms of one layer without recompute, analytic vs measured; each
variant's kept / checkpoint / host / loss / working-set bytes per token; which feature removes
which term; model state) and --json {versions, args, shape, profile, rows, fits, model_state}.

Command (H200; environment in bench/RESULTS.md, "Setup"; s = 8192 and 16384, ~1 min):
    python3 bench/memory_model.py --json $OUT/memory.json
CPU smoke test (tests/integration/test_memory_model.py; --offload-min-bytes 0 because the tiny model's layer
inputs are under the offload's 1 MiB threshold):
    python3 bench/memory_model.py --preset tiny --backend local --seq 64 --offload-min-bytes 0

--strategies builds nothing: it tabulates, per GPU, the model + optimizer state of DDP + the
distributed optimizer, Megatron-FSDP's optim / optim_grads / optim_grads_params and optimizer CPU
offload (`strategy_state`, read from megatron-core 0.19.2's code) for the Llama-3.1-8B and 70B
shapes at DP x SP layouts, and the longest sequence each leaves with the memory features on: the
activation bytes per token are the analytic terms above plus the backward's extra, fitted to
max_seq_len.py's measured peaks (`Calibration`). bench/RESULTS.md section 8:
    python bench/memory_model.py --strategies --json bench/results/memory_strategies.json
"""

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

import harness
from megatron_ulysses.sp.backends import resolve_backend
from megatron_ulysses.sp.loss import masked_sum
from megatron_ulysses.memory import activation_offload, tiling
from megatron_ulysses.training.fsdp import torch_optimizers
from megatron_ulysses.training.loop import initialize_distributed
from megatron_ulysses.training.schedule import per_token_loss

VARIANTS = {  # key: (label, flags)
    "none": ("no recompute", ()),
    "selective": ("selective recompute (core_attn)", harness.SELECTIVE_RECOMPUTE),
    "full": ("full recompute", harness.FULL_RECOMPUTE),
    "full-tiled-mlp": ("full recompute + TiledMLP", harness.FULL_RECOMPUTE + harness.TILED_MLP),
    "tiled-mlp": ("TiledMLP", harness.TILED_MLP),
    "tiled-loss": ("tiled loss", harness.TILED_LOSS),
    "full-all": ("full recompute + TiledMLP + tiled loss + offload",
                 harness.FULL_RECOMPUTE + harness.TILED_MLP + harness.TILED_LOSS
                 + harness.OFFLOAD),
}
OUTSIDE = ("embedding", "final_layernorm", "output_layer", "loss", "outside model", "decoder",
           "shared")
# The layer's submodules in forward order (those a spec lacks are left out of the tables).
LAYER_SUBS = ("(block)", "input_layernorm", "self_attention.linear_qkv", "self_attention",
              "self_attention.core_attention", "self_attention.linear_proj", "pre_mlp_layernorm",
              "mlp.linear_fc1", "mlp", "mlp.linear_fc2", "(layer)")


# ---------------------------------------------------------------------------------------------
# Measurement: what the forward saves for backward.
# ---------------------------------------------------------------------------------------------

def _storage(tensor: torch.Tensor) -> tuple:
    """(key, bytes) of the storage behind `tensor` (a view keeps its whole storage alive)."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without one
        return id(tensor), tensor.numel() * tensor.element_size()


@dataclass
class Saved:
    owner: str            # "layer" or one of OUTSIDE
    layer: Optional[int]
    sub: str              # the layer's submodule ("" outside a layer)
    kind: str             # "activation" or "checkpoint" (a recompute's input)
    where: str            # "device" or "host"
    nbytes: int
    shape: tuple
    dtype: str


class _Held:
    """What the pack hook returns: the packed object, and the key whose refcount it holds (so
    the recorder knows which saved storages are alive)."""

    __slots__ = ("recorder", "key", "inner")

    def __init__(self, recorder, key, inner):
        self.recorder, self.key, self.inner = recorder, key, inner

    def __del__(self):
        self.recorder._release(self.key)


class SavedTensorRecorder:
    """Records the tensors saved for backward while `recording(phase)` is active, attributed to
    the module (of `model`, a DDP-wrapped GPTModel) whose forward saved them."""

    def __init__(self, model):
        self.gpt = harness.unwrap(model)
        self.excluded = set()  # storages that are state, not activations
        for param in model.parameters():
            self.excluded.add(_storage(param)[0])
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None:
                self.excluded.add(_storage(main_grad)[0])
        for buffer in self.gpt.buffers():  # (DDP.buffers is its list of grad buffers)
            self.excluded.add(_storage(buffer)[0])
        self.on_cuda = torch.cuda.is_available()
        self.phase = None
        self.stack = []
        self.last_layer = None
        self.recompute_depth = 0
        self.saved = {}       # key -> Saved, first saver of each storage in forward
        self.savers = {}      # key -> {(owner, layer)}
        self.tensors = []     # every forward save, duplicates included (for the JSON detail)
        self.live = {}        # key -> [refcount, bytes, phase]
        self.backward_live = 0
        self.backward_peak = 0

    # -- module stack ---------------------------------------------------------------------
    def _labels(self):
        for name, module in self.gpt.named_modules():
            if name in ("embedding", "decoder", "decoder.final_layernorm", "output_layer"):
                yield name, module
            elif re.fullmatch(r"decoder\.layers\.\d+(\.[^.]+){0,2}", name):
                yield name, module

    def _owner(self) -> tuple:
        if not self.stack:
            return "outside model", None, ""
        label = self.stack[-1]
        if label == "decoder":
            if self.last_layer is None:
                return "decoder", None, ""
            return "layer", self.last_layer, "(block)"  # CheckpointFunction, around a layer
        match = re.fullmatch(r"decoder\.layers\.(\d+)(?:\.(.+))?", label)
        if match:
            return "layer", int(match.group(1)), match.group(2) or "(layer)"
        if label.startswith("decoder.final_layernorm"):
            return "final_layernorm", None, ""
        if label == "":
            return "loss", None, ""  # GPTModel outside its children: _postprocess's loss
        return label, None, ""

    @contextlib.contextmanager
    def _module_hooks(self):
        handles = []

        def enter(label, index):
            def hook(module, args):
                if label == "decoder":
                    self.last_layer = None
                if index is not None:
                    self.last_layer = index
                self.stack.append(label)
            return hook

        def leave(module, args, output):
            self.stack.pop()

        modules = [("", self.gpt)] + list(self._labels())
        for label, module in modules:
            match = re.fullmatch(r"decoder\.layers\.(\d+)", label)
            handles.append(module.register_forward_pre_hook(
                enter(label, int(match.group(1)) if match else None)))
            handles.append(module.register_forward_hook(leave, always_call=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    # -- recompute functions ------------------------------------------------------------
    @contextlib.contextmanager
    def _recompute_flags(self):
        """Count the saves made inside `apply` of the recompute functions as checkpoints."""
        from megatron.core.tensor_parallel.random import CheckpointFunction

        classes = [CheckpointFunction] + [
            obj for obj in vars(tiling).values()
            if isinstance(obj, type) and issubclass(obj, torch.autograd.Function)]
        patched = []
        for cls in classes:
            original = cls.apply

            def apply(*args, _original=original, **kwargs):
                self.recompute_depth += 1
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.recompute_depth -= 1
            patched.append((cls, cls.__dict__.get("apply")))
            cls.apply = staticmethod(apply)
        try:
            yield
        finally:
            for cls, own in reversed(patched):
                if own is None:
                    del cls.apply
                else:
                    cls.apply = own

    @contextlib.contextmanager
    def _offload_wrapped(self, min_bytes_override):
        """The decoder's offload context (looked up when the decoder's forward starts) with the
        recorder's hooks composed inside it."""
        original = activation_offload.offload_saved_activations

        @contextlib.contextmanager
        def recorded(min_bytes=activation_offload.DEFAULT_MIN_OFFLOAD_BYTES, stats=None):
            if min_bytes_override is not None:
                min_bytes = min_bytes_override
            with original(min_bytes, stats):
                top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
                if top is None:
                    raise RuntimeError("this torch cannot compose saved-tensor hooks "
                                       "(torch._C._autograd._top_saved_tensors_default_hooks)")
                pack, unpack = top(True)
                with self._hooks(pack, unpack):
                    yield

        activation_offload.offload_saved_activations = recorded
        try:
            yield
        finally:
            activation_offload.offload_saved_activations = original

    @contextlib.contextmanager
    def installed(self, offload_min_bytes=None):
        with self._module_hooks(), self._recompute_flags(), \
                self._offload_wrapped(offload_min_bytes):
            yield

    # -- the hooks ------------------------------------------------------------------------
    def _hooks(self, pack_inner=None, unpack_inner=None):
        def pack(tensor):
            inner = pack_inner(tensor) if pack_inner is not None else tensor
            return self._record(tensor, inner)

        def unpack(held):
            inner = held.inner if isinstance(held, _Held) else held
            return unpack_inner(inner) if unpack_inner is not None else inner

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    @contextlib.contextmanager
    def recording(self, phase: str):
        self.phase = phase
        try:
            with self._hooks():
                yield
        finally:
            self.phase = None

    def _record(self, tensor, inner):
        ptr, nbytes = _storage(tensor)
        if nbytes == 0 or ptr in self.excluded:
            return inner
        if isinstance(inner, activation_offload._Offloaded):
            where, key = "host", ("host", id(inner))
            nbytes = _storage(inner.cpu)[1]
        elif self.on_cuda and tensor.device.type == "cpu":
            where, key = "host", ("host", ptr)
        else:
            where, key = "device", ("device", ptr)
        if self.phase == "forward":
            owner, layer, sub = self._owner()
            kind = "checkpoint" if self.recompute_depth else "activation"
            new = key not in self.saved
            if new:
                self.saved[key] = Saved(owner, layer, sub, kind, where, nbytes,
                                        tuple(tensor.shape), str(tensor.dtype).split(".")[-1])
            self.savers.setdefault(key, set()).add((owner, layer))
            self.tensors.append({"owner": owner, "layer": layer, "sub": sub, "kind": kind,
                                 "where": where, "shape": list(tensor.shape),
                                 "dtype": str(tensor.dtype).split(".")[-1], "bytes": nbytes,
                                 "new_storage": new})
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [1, nbytes, self.phase]
            if self.phase == "backward":
                self.backward_live += nbytes
                self.backward_peak = max(self.backward_peak, self.backward_live)
        else:
            entry[0] += 1
        return _Held(self, key, inner)

    def _release(self, key):
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[key]
            if entry[2] == "backward":
                self.backward_live -= entry[1]

    # -- results ---------------------------------------------------------------------------
    def summary(self, num_layers: int) -> dict:
        """Bytes (not per token) by layer and submodule, outside buckets and totals."""
        def bucket():
            return {"device": 0, "host": 0, "checkpoint": 0}

        def add(target, saved):
            target[saved.where] += saved.nbytes
            if saved.kind == "checkpoint":
                target["checkpoint"] += saved.nbytes

        layers = [dict(bucket(), subs={}) for _ in range(num_layers)]
        outside = {name: bucket() for name in OUTSIDE}
        shared_tensors = []
        totals = bucket()
        for key, saved in self.saved.items():
            add(totals, saved)
            if len(self.savers[key]) > 1:
                add(outside["shared"], saved)
                shared_tensors.append({"shape": list(saved.shape), "dtype": saved.dtype,
                                       "bytes": saved.nbytes, "where": saved.where,
                                       "kind": saved.kind, "savers": sorted(
                                           f"{o}{'' if l is None else f' {l}'}"
                                           for o, l in self.savers[key])})
            elif saved.owner == "layer":
                layer = layers[saved.layer]
                add(layer, saved)
                add(layer["subs"].setdefault(saved.sub, bucket()), saved)
            else:
                add(outside[saved.owner], saved)
        return {"layers": layers, "outside": outside, "shared_tensors": shared_tensors,
                "totals": totals, "backward_working_set": self.backward_peak,
                "layer0_tensors": [t for t in self.tensors if t["layer"] == 0],
                "outside_tensors": [t for t in self.tensors if t["owner"] != "layer"]}


def warm_up(trainer, seq: int, shape) -> None:
    """One unrecorded forward + backward (GPU): kernel selection, cuBLAS / TE workspaces and
    Triton compiles happen here, not inside the measured forward's memory_allocated delta."""
    batch = harness.random_batch(shape.vocab, seq)
    loss_sum, _ = masked_sum(per_token_loss(trainer.model, batch), batch["loss_mask"])
    loss_sum.backward()
    del loss_sum, batch
    trainer.model.zero_grad_buffer()
    harness.reset_memory()


def measure(trainer, seq: int, shape, args) -> dict:
    """One forward + backward of `trainer.model` at `seq` tokens under the recorder."""
    model = trainer.model
    batch = harness.random_batch(shape.vocab, seq)
    recorder = SavedTensorRecorder(model)
    model.zero_grad_buffer()
    harness.reset_memory()
    cuda = torch.cuda.is_available()
    gpu = {}
    with recorder.installed(args.offload_min_bytes):
        harness.synchronize()
        before = torch.cuda.memory_allocated() if cuda else 0
        with recorder.recording("forward"):
            per_token = per_token_loss(model, batch)
            loss_sum, _ = masked_sum(per_token, batch["loss_mask"])
        harness.synchronize()
        if cuda:
            gpu["forward_allocated_delta"] = torch.cuda.memory_allocated() - before
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        with recorder.recording("backward"):
            loss_sum.backward()
        harness.synchronize()
        if cuda:
            gpu["backward_peak_delta"] = torch.cuda.max_memory_allocated() - start
        del per_token, loss_sum
    gc.collect()
    result = recorder.summary(len(harness.unwrap(model).decoder.layers))
    result["leaked"] = sum(entry[1] for entry in recorder.live.values())
    result["gpu"] = gpu
    model.zero_grad_buffer()
    del recorder, batch
    harness.reset_memory()
    return result


# ---------------------------------------------------------------------------------------------
# Analytic model.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Profile:
    """What the built model's modules are, as far as what they save depends on it."""
    e: int               # bytes per activation element: 2 (bf16) or 4 (fp32)
    spec: str            # "te": TE layers (norm fused into linear_qkv / linear_fc1); "local"
    attention: str       # the Ulysses backend: te, sdpa or local
    norm: str            # "te", "torch-cpu" (decomposed RMSNorm) or "torch-cuda" (fused kernel)
    rope_fused: bool     # TE's fused RoPE (saves the shared frequencies only)
    swiglu_fused: bool   # megatron-core's bias_swiglu (saves the fc1 output only)
    cross_entropy: str   # "te" (fused, grad in place in the logits) or "unfused"
    verified: bool       # terms checked: on CPU by tests/integration/test_memory_model.py (local, sdpa),
                         # te on the H200 (bench/results/memory_model.json, 2026-12-04)

    @classmethod
    def of(cls, config, gpt) -> "Profile":
        model, mcore = config.model, gpt.config
        cuda = torch.cuda.is_available()
        backend = model.ulysses_attention_backend
        spec = "te" if model.transformer_impl == "transformer_engine" else "local"
        norm = "te" if spec == "te" else ("torch-cuda" if cuda else "torch-cpu")
        fused_ce = bool(mcore.cross_entropy_loss_fusion) and mcore.cross_entropy_fusion_impl == "te"
        return cls(e=2 if (model.bf16 or model.fp16) else 4, spec=spec, attention=backend,
                   norm=norm, rope_fused=bool(mcore.apply_rope_fusion),
                   swiglu_fused=bool(mcore.bias_activation_fusion),
                   cross_entropy="te" if fused_ce else "unfused",
                   verified=(backend == "te") == cuda == (spec == "te"))


@dataclass(frozen=True)
class Term:
    owner: str           # "layer" (bytes per token per layer) or an OUTSIDE bucket (per token)
    sub: str             # the layer's submodule ("" outside)
    name: str
    formula: str
    per_token: float
    kind: str = "activation"
    where: str = "device"


def _norm_terms(owner, sub, p: Profile, h: int, fused_output: bool) -> list:
    e = p.e
    if p.norm == "torch-cpu":  # torch RMSNorm's CPU decomposition: x^2 mean, rsqrt, x*rstd*w
        return [Term(owner, sub, "norm input x", "h·e", h * e),
                Term(owner, sub, "rstd", "e", e),
                Term(owner, sub, "x·rstd (for the weight grad)", "h·e", h * e)]
    terms = [Term(owner, sub, "norm input x", "h·e", h * e),
             Term(owner, sub, "rstd (fp32)", "4", 4)]
    if fused_output:  # TE LayerNormLinear keeps the norm output, its GEMM input
        terms.append(Term(owner, sub, "norm output (GEMM input)", "h·e", h * e))
    return terms


def layer_terms(shape, s: int, p: Profile) -> list:
    """What one layer saves per token without recompute (b = 1)."""
    h, f, H, G, e = shape.hidden, shape.ffn, shape.heads, shape.kv_heads, p.e
    d = h // H
    L = "layer"
    terms = []
    if p.spec == "te":
        terms += _norm_terms(L, "self_attention.linear_qkv", p, h, fused_output=True)
    else:
        terms += _norm_terms(L, "input_layernorm", p, h, fused_output=False)
        terms.append(Term(L, "self_attention.linear_qkv", "GEMM input (norm output)", "h·e",
                          h * e))
    if not p.rope_fused:
        terms.append(Term(L, "self_attention", "RoPE cos, sin of q and of k [s,1,1,d]",
                          "4·d·e", 4 * d * e))
    A = "self_attention.core_attention"
    if p.attention == "local":  # megatron-core's DotProductAttention
        terms += [Term(L, A, "q", "H·d·e", H * d * e),
                  Term(L, A, "k repeated to H heads", "H·d·e", H * d * e),
                  Term(L, A, "v repeated to H heads", "H·d·e", H * d * e),
                  Term(L, A, "causal mask [s,s] bool (s^2)", "s", s)]
        if e == 4:
            terms.append(Term(L, A, "softmax probs [H,s,s] (s^2)", "H·s·e", H * s * e))
        else:
            terms += [Term(L, A, "softmax output fp32 [H,s,s] (s^2)", "4·H·s", 4 * H * s),
                      Term(L, A, "probs [H,s,s] (s^2)", "H·s·e", H * s * e)]
    else:  # flash / fused: q, k (rotated copies), v, output and the softmax statistics
        terms += [Term(L, A, "q (rotated)", "H·d·e", H * d * e),
                  Term(L, A, "k (rotated)", "G·d·e", G * d * e),
                  # sdpa: v is a view and keeps the whole qkv GEMM output alive; TE's fused
                  # attention saves its own contiguous v (measured on the H200, 2026-12-04).
                  Term(L, A, "v (own copy)", "G·d·e", G * d * e) if p.attention == "te" else
                  Term(L, A, "v: a view, keeps the whole qkv GEMM output", "(H+2G)·d·e",
                       (H + 2 * G) * d * e),
                  Term(L, A, "output", "H·d·e", H * d * e),
                  Term(L, A, "logsumexp (fp32)", "4·H", 4 * H)]
    if p.attention == "local":  # sdpa / te: linear_proj's input is the output's storage
        terms.append(Term(L, "self_attention.linear_proj", "GEMM input (attention output)",
                          "h·e", h * e))
    if p.spec == "te":
        terms += _norm_terms(L, "mlp.linear_fc1", p, h, fused_output=True)
    else:
        terms += _norm_terms(L, "pre_mlp_layernorm", p, h, fused_output=False)
        terms.append(Term(L, "mlp.linear_fc1", "GEMM input (norm output)", "h·e", h * e))
    terms.append(Term(L, "mlp", "fc1 output [2·ffn] (SwiGLU input)", "2·ffn·e", 2 * f * e))
    if not p.swiglu_fused:  # glu(): silu(gate) * (up + glu_linear_offset)
        terms += [Term(L, "mlp", "silu(gate)", "ffn·e", f * e),
                  Term(L, "mlp", "up + glu_linear_offset (a copy, offset 0)", "ffn·e", f * e)]
    terms.append(Term(L, "mlp.linear_fc2", "GEMM input (SwiGLU output)", "ffn·e", f * e))
    return terms


def outside_terms(shape, vocab: int, p: Profile) -> list:
    """What the model saves per token outside its layers (b = 1; `vocab`: the padded V)."""
    h, V, e = shape.hidden, vocab, p.e
    d = h // shape.heads
    terms = [Term("embedding", "", "token ids (int64)", "8", 8)]
    if p.norm == "te":
        terms += [Term("final_layernorm", "", "norm input x", "h·e", h * e),
                  Term("final_layernorm", "", "rstd (fp32)", "4", 4)]
    else:
        terms += _norm_terms("final_layernorm", "", p, h, fused_output=False)
    terms.append(Term("output_layer", "", "GEMM input (final norm output)", "h·e", h * e))
    if p.cross_entropy == "te":
        terms.append(Term("loss", "", "logits [V] (TE writes the grad into them)", "V·e", V * e))
    else:
        terms += [Term("loss", "", "softmax [V] fp32 (in the logits' storage in fp32)", "4·V",
                       4 * V),
                  Term("loss", "", "target mask (bool)", "1", 1),
                  Term("loss", "", "masked target (int64)", "8", 8)]
    terms.append(Term("outside model", "", "loss mask (fp32) of loss·mask", "4", 4))
    if p.rope_fused:
        terms.append(Term("shared", "", "RoPE frequencies [s,1,1,d] fp32, one for all layers",
                          "4·d", 4 * d))
    return terms


def features_of(config) -> set:
    model = config.model
    features = set()
    if model.recompute_granularity == "full":
        features.add("full")
    elif model.recompute_granularity == "selective":
        features.add("selective")
    if model.tiled_mlp_shards is not None:
        features.add("tiled_mlp")
    if model.tiled_loss_shards is not None:
        features.add("tiled_loss")
    if model.offload_activations:
        features.add("offload")
    return features


def apply_features(terms: list, shape, s: int, p: Profile, features: set,
                   offload_min_bytes: int) -> list:
    """The no-recompute terms as `features` change them: removed terms, added checkpoints,
    offloaded (host) ones."""
    h, H, G, e = shape.hidden, shape.heads, shape.kv_heads, p.e
    d = h // H
    ckpt = "checkpoint"
    out = list(terms)
    if "tiled_mlp" in features:
        out = [t for t in out if not (t.owner == "layer" and t.sub.startswith("mlp"))]
        out.append(Term("layer", "mlp", "MLP input (TiledMLP checkpoint)", "h·e", h * e, ckpt))
    if "selective" in features:
        out = [t for t in out if t.sub != "self_attention.core_attention"]
        out += [Term("layer", "self_attention", "q (core_attn checkpoint)", "H·d·e", H * d * e,
                     ckpt),
                Term("layer", "self_attention", "k (core_attn checkpoint)", "G·d·e", G * d * e,
                     ckpt),
                Term("layer", "self_attention", "v: view of the qkv GEMM output (checkpoint)",
                     "(H+2G)·d·e", (H + 2 * G) * d * e, ckpt),
                Term("layer", "self_attention", "attn_mask_type [1] int32 (checkpoint)", "4/s",
                     4 / s, ckpt)]
        if p.attention != "local":  # no longer the attention output's storage
            out.append(Term("layer", "self_attention.linear_proj",
                            "GEMM input (checkpoint output)", "h·e", h * e))
    if "full" in features:
        out = [t for t in out if t.owner != "layer" and t.owner != "shared"]
        out += [Term("layer", "(block)", "layer input [s,b,h] (checkpoint)", "h·e", h * e, ckpt),
                Term("shared", "", "RoPE frequencies [s,1,1,d] fp32 (checkpoint of every layer)",
                     "4·d", 4 * d, ckpt)]
    if "tiled_loss" in features:
        out = [t for t in out if t.owner not in ("output_layer", "loss")]
        out.append(Term("loss", "", "final norm output (tiled loss checkpoint)", "h·e", h * e,
                        ckpt))
    if "offload" in features:  # what the decoder saves, tensors of at least min bytes
        out = [dataclasses.replace(t, where="host")
               if t.owner in ("layer", "final_layernorm", "shared")
               and t.per_token * s >= offload_min_bytes else t for t in out]
    return out


def analytic(shape, vocab: int, s: int, p: Profile, features: set,
             offload_min_bytes: int) -> dict:
    """Bytes per token (per layer for the layer) by submodule / bucket, and the terms."""
    terms = apply_features(layer_terms(shape, s, p) + outside_terms(shape, vocab, p), shape, s,
                           p, features, offload_min_bytes)
    layer = {"device": 0.0, "host": 0.0, "checkpoint": 0.0, "subs": {}}
    outside = {name: {"device": 0.0, "host": 0.0, "checkpoint": 0.0} for name in OUTSIDE}
    for t in terms:
        targets = [layer, layer["subs"].setdefault(t.sub, {"device": 0.0, "host": 0.0,
                                                            "checkpoint": 0.0})] \
            if t.owner == "layer" else [outside[t.owner]]
        for target in targets:
            target[t.where] += t.per_token
            if t.kind == "checkpoint":
                target["checkpoint"] += t.per_token
    return {"layer": layer, "outside": outside,
            "terms": [dataclasses.asdict(t) for t in terms]}


# ---------------------------------------------------------------------------------------------
# Model and optimizer state.
# ---------------------------------------------------------------------------------------------

def model_state(trainer) -> dict:
    """Bytes of weights, grad buffer, master weights and optimizer state after one update,
    against params x bytes per param."""
    model = trainer.model
    trainer.init_optimizer_state()
    params = list(model.parameters())
    count = sum(p.numel() for p in params)
    weights, grads = {}, {}
    for param in params:
        key, nbytes = _storage(param)
        weights[key] = nbytes
        if getattr(param, "main_grad", None) is not None:
            key, nbytes = _storage(param.main_grad)
            grads[key] = nbytes
    master, state, step_tensors = {}, {}, 0
    for optimizer in torch_optimizers(trainer.optimizer):
        for group in optimizer.param_groups:
            for param in group["params"]:
                key, nbytes = _storage(param)
                if key not in weights:
                    master[key] = nbytes
        for param_state in optimizer.state.values():
            for name, value in param_state.items():
                if torch.is_tensor(value):
                    key, nbytes = _storage(value)
                    state.setdefault(name, {})[key] = nbytes
                    step_tensors += name == "step"
    e_w = params[0].element_size()
    master_e = 4 if e_w < 4 else 0
    measured = {"weights": sum(weights.values()), "main_grad": sum(grads.values()),
                "master_weights": sum(master.values())}
    measured.update({f"optimizer {name}": sum(v.values()) for name, v in state.items()})
    formula = {"weights": (f"P·{e_w}", count * e_w), "main_grad": ("P·4 (fp32 grad buffer)",
                                                                   count * 4),
               "master_weights": (f"P·{master_e}", count * master_e),
               "optimizer exp_avg": ("P·4", count * 4), "optimizer exp_avg_sq": ("P·4",
                                                                             count * 4)}
    if "step" in state:
        formula["optimizer step"] = ("4 per step tensor", 4 * step_tensors)
    result = {"params": count, "param_tensors": len(params), "measured": measured,
              "formula": {k: {"formula": f, "bytes": b} for k, (f, b) in formula.items()},
              "total_measured": sum(measured.values()),
              "total_formula": sum(b for _, b in formula.values()),
              "bytes_per_param_formula": e_w + 4 + master_e + 8}
    if torch.cuda.is_available():
        harness.reset_memory()
        result["gpu_allocated_after_init"] = torch.cuda.memory_allocated()
    return result


# ---------------------------------------------------------------------------------------------
# Tables.
# ---------------------------------------------------------------------------------------------

def fmt(value) -> str:
    if value is None:
        return ""
    if abs(value - round(value)) < 1e-9:
        return f"{int(round(value)):,}"
    text = f"{value:,.2f}"
    return "0.00" if text == "-0.00" else text


def ratio(measured, analytic_value) -> str:
    if not analytic_value:
        return "" if not measured else "inf"
    return f"{measured / analytic_value:.3f}"


def per_token_row(result: dict, tokens: int) -> dict:
    """Measured bytes per token (layers: the mean over layers, per layer)."""
    layers = result["layers"]
    n = len(layers)

    def mean(field):
        return sum(layer[field] for layer in layers) / n / tokens
    subs = {}
    for layer in layers:
        for sub, b in layer["subs"].items():
            target = subs.setdefault(sub, {"device": 0.0, "host": 0.0, "checkpoint": 0.0})
            for field in target:
                target[field] += b[field] / n / tokens
    return {"layer": {"device": mean("device"), "host": mean("host"),
                      "checkpoint": mean("checkpoint"), "subs": subs,
                      "uniform": len({(l["device"], l["host"]) for l in layers}) == 1},
            "outside": {k: {f: v / tokens for f, v in b.items()}
                        for k, b in result["outside"].items()},
            "backward_working_set": result["backward_working_set"] / tokens}


def _ordered_subs(subs) -> list:
    """Distinct submodule names, LAYER_SUBS order first, any others after."""
    subs = set(subs)
    return [sub for sub in LAYER_SUBS if sub in subs] + sorted(subs - set(LAYER_SUBS))


def print_tables(results) -> None:
    rows, shape = results["rows"], results["shape"]
    seqs = sorted({r["s"] for r in rows})
    by = {(r["key"], r["s"]): r for r in rows if "measured" in r}
    e = results["profile"]["e"]
    print(f"\nProfile: {results['profile']} (h={shape['hidden']}, ffn={shape['ffn']}, "
          f"H={shape['heads']}, G={shape['kv_heads']}, d={shape['hidden'] // shape['heads']}, "
          f"V={shape['padded_vocab']}, L={shape['layers']}, e={e}); bytes per token "
          "(per layer for layer terms), b = 1.")
    if all(("none", s) in by for s in seqs):
        print("\n### One layer, no recompute: analytic vs measured (mean over layers)")
        print("| submodule | terms (analytic) | " + " | ".join(
            f"analytic s={s} | measured s={s} | ratio" for s in seqs) + " |")
        print("|---|---|" + "---|---|---|" * len(seqs))
        terms = [t for t in by[("none", seqs[0])]["analytic"]["terms"] if t["owner"] == "layer"]
        subs = _ordered_subs([t["sub"] for t in terms] + [
            sub for s in seqs for sub in by[("none", s)]["per_token"]["layer"]["subs"]])
        for sub in subs:
            text = "; ".join(f"{t['name']} {t['formula']}" for t in terms if t["sub"] == sub)
            cells = []
            for s in seqs:
                a = by[("none", s)]["analytic"]["layer"]["subs"].get(sub, {}).get("device", 0)
                m = by[("none", s)]["per_token"]["layer"]["subs"].get(sub, {}).get("device", 0)
                cells += [fmt(a), fmt(m), ratio(m, a)]
            print(f"| {sub} | {text or '(none)'} | " + " | ".join(cells) + " |")
        cells = []
        for s in seqs:
            a = by[("none", s)]["analytic"]["layer"]["device"]
            m = by[("none", s)]["per_token"]["layer"]["device"]
            cells += [fmt(a), fmt(m), ratio(m, a)]
        print("| **layer total** | | " + " | ".join(cells) + " |")
        for name in OUTSIDE:
            text = "; ".join(f"{t['name']} {t['formula']}"
                             for t in by[("none", seqs[0])]["analytic"]["terms"]
                             if t["owner"] == name)
            cells = []
            for s in seqs:
                a = by[("none", s)]["analytic"]["outside"][name]["device"]
                m = by[("none", s)]["per_token"]["outside"][name]["device"]
                cells += [fmt(a), fmt(m), ratio(m, a)]
            if text or any(c not in ("0", "") for c in cells):
                print(f"| {name} (per token, not per layer) | {text or '(none)'} | "
                      + " | ".join(cells) + " |")

    print("\n### Variants: bytes per token (layer terms per layer, mean over layers)")
    print("| variant | s | kept on device / layer (analytic) | measured | ratio | "
          "checkpoints / layer | host / layer | logits + loss | outside layers, device | "
          "outside, host | fit a + c·s: a | c (s^2 term) | c analytic | backward working set | "
          "GPU fwd Δalloc / hooked |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    fits = {f["key"]: f for f in results["fits"]}
    for r in rows:
        if "measured" not in r:
            print(f"| {r['variant']} | {r['s']} | {r.get('error', '')[:60]} |" + " |" * 12)
            continue
        pt, an = r["per_token"], r["analytic"]
        out_dev = sum(b["device"] for b in pt["outside"].values())
        out_host = sum(b["host"] for b in pt["outside"].values())
        logits = sum(pt["outside"][k]["device"] + pt["outside"][k]["host"]
                     for k in ("output_layer", "loss"))
        fit = fits.get(r["key"], {})
        gpu = r["measured"]["gpu"]
        gpu_text = ""
        if gpu:
            hooked = r["measured"]["totals"]["device"]
            gpu_text = (f"{gpu['forward_allocated_delta'] / r['s']:,.0f} / "
                        f"{hooked / r['s']:,.0f}")
        first = r["s"] == seqs[0]
        kept, kept_analytic = pt["layer"]["device"], an["layer"]["device"]
        print(f"| {r['variant']} | {r['s']} | {fmt(kept_analytic)} | {fmt(kept)} | "
              f"{ratio(kept, kept_analytic)} | {fmt(pt['layer']['checkpoint'])} | "
              f"{fmt(pt['layer']['host'])} | "
              f"{fmt(logits)} | {fmt(out_dev)} | {fmt(out_host)} | "
              f"{fmt(fit.get('a')) if first else ''} | {fmt(fit.get('c')) if first else ''} | "
              f"{fmt(fit.get('analytic_c')) if first else ''} | "
              f"{fmt(pt['backward_working_set'])} | {gpu_text} |")

    s = seqs[0]
    keys = [k for k in VARIANTS if (k, s) in by]
    if keys:
        print(f"\n### Which feature removes which term (measured bytes per token at s={s}; "
              "h = on host)")
        print("| term | " + " | ".join(VARIANTS[k][0] for k in keys) + " |")
        print("|---|" + "---|" * len(keys))
        subs = _ordered_subs([sub for k in keys
                              for sub in by[(k, s)]["per_token"]["layer"]["subs"]])

        def cell(b):
            text = fmt(b["device"]) if b["device"] or not b["host"] else ""
            if b["host"]:
                text += (" + " if text else "") + f"{fmt(b['host'])} h"
            return text
        zero = {"device": 0, "host": 0}
        for sub in subs:
            print(f"| layer: {sub} | " + " | ".join(
                cell(by[(k, s)]["per_token"]["layer"]["subs"].get(sub, zero)) for k in keys)
                + " |")
        print("| **layer total** | " + " | ".join(
            cell(by[(k, s)]["per_token"]["layer"]) for k in keys) + " |")
        for name in OUTSIDE:
            cells = [cell(by[(k, s)]["per_token"]["outside"][name]) for k in keys]
            if any(c != "0" for c in cells):
                print(f"| {name} | " + " | ".join(cells) + " |")
        print("| backward working set | " + " | ".join(
            fmt(by[(k, s)]["per_token"]["backward_working_set"]) for k in keys) + " |")
        print("| removes (vs no recompute) | " + " | ".join(
            removed_text(by, k, s) for k in keys) + " |")

    state = results.get("model_state")
    if state:
        print(f"\n### Model and optimizer state (P = {state['params']:,} parameters, "
              f"{state['param_tensors']} tensors)")
        print("| item | formula | analytic bytes | measured bytes | ratio |")
        print("|---|---|---|---|---|")
        for name in sorted(set(state["formula"]) | set(state["measured"])):
            f = state["formula"].get(name, {"formula": "", "bytes": 0})
            m = state["measured"].get(name, 0)
            print(f"| {name} | {f['formula']} | {fmt(f['bytes'])} | {fmt(m)} | "
                  f"{ratio(m, f['bytes'])} |")
        print(f"| **total** | P·{state['bytes_per_param_formula']} (+ steps) | "
              f"{fmt(state['total_formula'])} | {fmt(state['total_measured'])} | "
              f"{ratio(state['total_measured'], state['total_formula'])} |")
        if "gpu_allocated_after_init" in state:
            print(f"| GPU memory_allocated after init | | | "
                  f"{fmt(state['gpu_allocated_after_init'])} | |")


def removed_text(by, key, s) -> str:
    """The terms (layer submodules, outside buckets) `key` lowers on the device against no
    recompute, by how much per token ("every layer term" when none of them is left)."""
    if key == "none" or ("none", s) not in by:
        return ""
    base, other = by[("none", s)]["per_token"], by[(key, s)]["per_token"]
    parts = []
    layer_parts = []
    for sub, b in base["layer"]["subs"].items():
        now = other["layer"]["subs"].get(sub, {"device": 0})["device"]
        if b["device"] - now > 0.5:
            layer_parts.append((sub, b["device"] - now, now))
    if len(layer_parts) == len(base["layer"]["subs"]) and not any(n for _, _, n in layer_parts):
        parts.append(f"every layer term -{fmt(sum(d for _, d, _ in layer_parts))}/layer")
    else:
        parts += [f"{sub} -{fmt(delta)}" for sub, delta, _ in layer_parts]
    for name, b in base["outside"].items():
        now = other["outside"][name]["device"]
        if b["device"] - now > 0.5:
            parts.append(f"{name} -{fmt(b['device'] - now)}")
    return "; ".join(parts)


def fit_rows(rows) -> list:
    """Per variant, bytes/token/layer (device + host) = a + c·s through the two lengths,
    measured and analytic; c is the s^2 term."""
    fits = []
    for key in VARIANTS:
        points = sorted(((r["s"], r["per_token"]["layer"], r["analytic"]["layer"])
                         for r in rows if r["key"] == key and "per_token" in r),
                        key=lambda point: point[0])
        if len(points) < 2:
            continue
        (s1, m1, a1), (s2, m2, a2) = points[0], points[-1]
        fit = {"key": key, "variant": VARIANTS[key][0], "s": [s1, s2]}
        for name, p1, p2 in (("", m1, m2), ("analytic_", a1, a2)):
            y1, y2 = p1["device"] + p1["host"], p2["device"] + p2["host"]
            c = (y2 - y1) / (s2 - s1)
            fit[name + "a"], fit[name + "c"] = y1 - c * s1, c
        fits.append(fit)
    return fits


# ---------------------------------------------------------------------------------------------
# Per-GPU state under each data-parallel strategy, and the longest sequence it leaves room for.
# ---------------------------------------------------------------------------------------------

SHAPES = {
    "llama-1b": harness.PRESETS["llama-1b"],
    "llama-3.1-8b": harness.Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336,
                                  vocab=128256),
    "llama-3.1-70b": harness.Shape(hidden=8192, layers=80, heads=64, kv_heads=8, ffn=28672,
                                   vocab=128256),
}
# Memory torch reports (total_memory, GiB): H100 80 GB HBM3 and H200 141 GB (bench/RESULTS.md).
CARDS = {"80 GB": 79.2, "141 GB": 139.8}
# Left free on every card: CUDA context, cuBLAS / cuDNN / TE workspaces and allocator slack, which
# max_memory_allocated (what the calibration measured) does not count. An assumption.
CARD_RESERVE_GIB = 2.5
# Host memory a training process uses besides the offloaded tensors (Python, torch, TE, CUDA's
# host side, the data loader): an assumption, to be checked against bench/offload_8b.sh's RSS.
HOST_OVERHEAD_GIB = 8.0
STRATEGIES = ("ddp", "optim", "optim_grads", "optim_grads_params", "offload")
STRATEGY_LABELS = {
    "ddp": "DDP + distributed optimizer",
    "optim": "Megatron-FSDP optim",
    "optim_grads": "Megatron-FSDP optim_grads",
    "optim_grads_params": "Megatron-FSDP optim_grads_params",
    "offload": "DDP + dist. opt. + optimizer offload",
}
# Megatron-FSDP's communication sizes (megatron_fsdp.py, megatron-core 0.19.2), in elements:
# reduce-scatter queue capacity max(1e9, 2 x unit) and all-gather prefetch half of it.
FSDP_MIN_COMM_UNIT = 1_000_000_000
MEASURED_PEAKS = str(Path(__file__).resolve().parent / "results" / "max_seq_len_ours.json")
DEFAULT_STRATEGIES = "ddp,optim,optim_grads,optim_grads_params,offload:1,offload:0.5"


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a Llama-shaped GPT (untied, no biases): `layer` per TransformerLayer (the
    FSDP unit of optim_grads_params), `outside` the embedding, output layer and final norm."""
    layer: int
    layers: int
    outside: int

    @property
    def total(self) -> int:
        return self.layer * self.layers + self.outside

    @classmethod
    def of(cls, shape, vocab: int) -> "ParamCounts":
        h, f, H, G = shape.hidden, shape.ffn, shape.heads, shape.kv_heads
        d = h // H
        layer = 2 * h + h * (H + 2 * G) * d + H * d * h + 3 * h * f  # norms, qkv, proj, SwiGLU
        return cls(layer=layer, layers=shape.layers, outside=2 * vocab * h + h)


@dataclass(frozen=True)
class StateTerms:
    """Bytes per GPU of weights, gradients, fp32 master weights and Adam's two fp32 moments;
    `transient` the largest unsharded buffers the strategy allocates during the step; `host_*`
    host memory: optimizer state (pageable), pinned fp32 grad copies and pinned bf16 staging."""
    weights: float
    grads: float
    master: float
    moments: float
    transient: float = 0.0
    host_optimizer: float = 0.0
    host_grads: float = 0.0
    host_staging: float = 0.0

    @property
    def device(self) -> float:
        return self.weights + self.grads + self.master + self.moments + self.transient

    @property
    def host(self) -> float:
        return self.host_optimizer + self.host_grads + self.host_staging


def fsdp_transient(counts: ParamCounts, grad_bytes: int) -> float:
    """optim_grads_params' unsharded buffers at the backward's peak (megatron-core 0.19.2): the
    bf16 params outside the layers (one bucket, kept gathered: PRESERVED) and of the running layer
    plus the ceil(max(5e8, unit) / unit) prefetched ones; the grads of that outside bucket (its
    output layer's arrive first, its embedding's last) and of the layers in the reduce-scatter
    queue (freed only when popped past max(1e9, 2 x unit) elements) plus the one accumulating."""
    unit, layers = counts.layer, counts.layers
    capacity = max(FSDP_MIN_COMM_UNIT, 2 * unit)
    gathered = min(layers, 1 + -(-(capacity // 2) // unit))
    reducing = min(layers, capacity // unit + 2)
    return 2 * (counts.outside + gathered * unit) + grad_bytes * (counts.outside + reducing * unit)


def strategy_state(counts: ParamCounts, strategy: str, shards: int, fsdp_grad_bytes: int = 2,
                   offload_fraction: float = 1.0, ddp_grad_bytes: int = 4) -> StateTerms:
    """Per-GPU state of `strategy` with bf16 weights, sharded over `shards` = DP x SP ranks (our
    SP ranks are in megatron-core's DP group).

    ddp: megatron-core DDP (fp32 grad buffer) + distributed optimizer (fp32 master + moments
    sharded; `ddp_grad_bytes` 2 with --grad-reduce-in-bf16, whose fp32 copies for the
    optimizer step are left out: the activations are gone by then). offload: the same with
    --use-precision-aware-optimizer --optimizer-cpu-offload: HybridDeviceOptimizer keeps fp32
    master + moments of `offload_fraction` of the shard on the host and a pinned fp32 copy of
    its grads; the first one megatron-core builds (on the whole model, before the distributed
    optimizer re-builds it on the shard) pins bf16 copies of f x P, left in torch's
    pinned-memory cache. Megatron-FSDP (`fsdp_grad_bytes`: 2 for
    Megatron-LM's default --megatron-fsdp-main-grads-dtype auto = the bf16 params', 4 for fp32):
    optim shards master + moments, optim_grads also the grads (but, with no FSDP unit and no
    --ddp-bucket-size, all of them form one bucket, whole during the backward), and
    optim_grads_params also the weights (see `fsdp_transient`). One shard: nothing is split."""
    P, N = counts.total, shards
    if strategy in ("ddp", "offload"):
        f = offload_fraction if strategy == "offload" else 0.0
        # HybridDeviceOptimizer casts a bf16 grad shard to an fp32 copy for the GPU share and
        # keeps it (the fp32 param's .grad) until the next step.
        copies = 4 * (1 - f) * P / N if strategy == "offload" and ddp_grad_bytes < 4 else 0.0
        return StateTerms(weights=2 * P, grads=ddp_grad_bytes * P + copies,
                          master=4 * (1 - f) * P / N,
                          moments=8 * (1 - f) * P / N, host_optimizer=12 * f * P / N,
                          host_grads=4 * f * P / N, host_staging=2 * f * P)
    g = fsdp_grad_bytes
    master, moments = 4 * P / N, 8 * P / N
    if strategy == "optim":
        return StateTerms(2 * P, g * P, master, moments)
    sharded = N > 1
    if strategy == "optim_grads":
        return StateTerms(2 * P, g * P / N, master, moments, g * P if sharded else 0.0)
    if strategy == "optim_grads_params":
        return StateTerms(2 * P / N, g * P / N, master, moments,
                          fsdp_transient(counts, g) if sharded else 0.0)
    raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


TE_PROFILE = Profile(e=2, spec="te", attention="te", norm="te", rope_fused=True,
                     swiglu_fused=True, cross_entropy="te", verified=True)
MEMORY_FEATURES = frozenset({"full", "tiled_mlp", "tiled_loss", "offload"})


def _pow2(nbytes: float) -> float:
    """torch's pinned-memory allocator rounds each block up to a power of two."""
    return float(1 << max(0, math.ceil(math.log2(nbytes)))) if nbytes > 0 else 0.0


def analytic_slope(shape, vocab: int, s_local: int) -> float:
    """Device bytes per token kept through the step with the memory features on (TE, bf16):
    what stays outside the layers plus one layer recomputed in backward (its no-recompute saves,
    TiledMLP's checkpoint for the MLP)."""
    kept = analytic(shape, vocab, s_local, TE_PROFILE, MEMORY_FEATURES, 0)
    layer = apply_features(layer_terms(shape, s_local, TE_PROFILE), shape, s_local, TE_PROFILE,
                           {"tiled_mlp"}, 0)
    return (sum(b["device"] for b in kept["outside"].values())
            + sum(t.per_token for t in layer if t.where == "device"))


def offloaded_host_bytes(shape, vocab: int, s_local: int, rounded: bool = True) -> float:
    """Pinned host bytes of the activation offload at `s_local` tokens per GPU: each offloaded
    tensor (every layer's input, the final norm's, the RoPE table), rounded up to a power of two
    as torch's pinned-memory cache does (`rounded`)."""
    kept = analytic(shape, vocab, s_local, TE_PROFILE, MEMORY_FEATURES,
                    activation_offload.DEFAULT_MIN_OFFLOAD_BYTES)
    size = _pow2 if rounded else float
    return sum((shape.layers if t["owner"] == "layer" else 1) * size(t["per_token"] * s_local)
               for t in kept["terms"] if t["where"] == "host")


@dataclass(frozen=True)
class Calibration:
    """The measured peak of `max_seq_len.py --model ours` (memory features on, SP 1) as
    intercept + slope x s; `extra` the slope's bytes per token beyond `analytic_slope` (grads and
    workspaces of the layer's backward), in units of h x e, assumed the same for other shapes."""
    slope: float
    intercept_gib: float
    static_gib: float
    extra: float
    source: str

    @classmethod
    def load(cls, path: str = MEASURED_PEAKS) -> "Calibration":
        with open(path) as f:
            data = json.load(f)
        points = [(r["s"], r["peak_alloc_gib"] * harness.GIB) for r in data["rows"]
                  if r.get("status") == "ok"]
        n = len(points)
        mean_s = sum(s for s, _ in points) / n
        mean_y = sum(y for _, y in points) / n
        slope = (sum((s - mean_s) * (y - mean_y) for s, y in points)
                 / sum((s - mean_s) ** 2 for s, _ in points))
        shape = SHAPES[data["args"]["preset"]]
        extra = (slope - analytic_slope(shape, shape.vocab, points[0][0])) / (shape.hidden * 2)
        return cls(slope=slope, intercept_gib=(mean_y - slope * mean_s) / harness.GIB,
                   static_gib=data["static_gib"], extra=extra,
                   source=f"{path} ({data['versions'].get('gpu')}, s = "
                          f"{', '.join(str(s) for s, _ in points)})")

    def slope_of(self, shape, vocab: int, s_local: int) -> float:
        return analytic_slope(shape, vocab, s_local) + self.extra * shape.hidden * 2


def longest_sequence(shape, vocab: int, state: StateTerms, sp: int, card_gib: float,
                     cal: Calibration, step: int = 4096, host_gib: Optional[float] = None,
                     rounded: bool = True) -> int:
    """The longest s (a multiple of `step` x sp) whose per-GPU peak, state + s/sp x slope, fits
    `card_gib` less CARD_RESERVE_GIB, and (with `host_gib`) whose host bytes fit too; 0 if none."""
    free = (card_gib - CARD_RESERVE_GIB) * harness.GIB - state.device
    if free <= 0:
        return 0
    s_local = int(free / cal.slope_of(shape, vocab, 1 << 20)) // step * step
    while s_local > 0 and (
            s_local * cal.slope_of(shape, vocab, s_local) > free
            or (host_gib is not None and host_bytes(shape, vocab, state, s_local, rounded)
                > (host_gib - HOST_OVERHEAD_GIB) * harness.GIB)):
        s_local -= step
    return max(s_local, 0) * sp


def host_bytes(shape, vocab: int, state: StateTerms, s_local: int, rounded: bool = True) -> float:
    """Host bytes per GPU beside the process itself: optimizer offload + activation offload."""
    return state.host + offloaded_host_bytes(shape, vocab, s_local, rounded)


def _strategy(key: str) -> tuple:
    """"offload:0.5" -> ("offload", 0.5); other keys take fraction 1."""
    name, _, fraction = key.partition(":")
    if name not in STRATEGIES or (fraction and name != "offload"):
        raise SystemExit(f"--strategies: unknown {key!r}; choose from {', '.join(STRATEGIES)} "
                         "(offload:F for an offload fraction F)")
    return name, float(fraction) if fraction else 1.0


def strategy_rows(models, layouts, keys, cal: Calibration, fsdp_grad_bytes: int,
                  host_gib_per_gpu: float) -> list:
    """One row per model x (DP, SP) x strategy: the state terms (GiB per GPU), the longest s on
    each card (GPU memory only), the host bytes per GPU at that s, and the longest s within
    `host_gib_per_gpu` of host memory too."""
    rows = []
    for model in models:
        shape = SHAPES[model]
        counts = ParamCounts.of(shape, shape.vocab)
        for dp, sp in layouts:
            for key in keys:
                name, fraction = _strategy(key)
                state = strategy_state(counts, name, dp * sp, fsdp_grad_bytes, fraction)
                row = {"model": model, "params": counts.total, "dp": dp, "sp": sp,
                       "strategy": key, "label": STRATEGY_LABELS[name]
                       + (f" (f = {fraction:g})" if name == "offload" else ""),
                       "state_gib": {k: v / harness.GIB
                                     for k, v in dataclasses.asdict(state).items()},
                       "device_gib": state.device / harness.GIB,
                       "host_state_gib": state.host / harness.GIB, "cards": {}}
                for card, gib in CARDS.items():
                    s = longest_sequence(shape, shape.vocab, state, sp, gib, cal)
                    capped = longest_sequence(shape, shape.vocab, state, sp, gib, cal,
                                              host_gib=host_gib_per_gpu)
                    row["cards"][card] = {"longest_s": s, "host_gib": host_bytes(
                        shape, shape.vocab, state, s // sp) / harness.GIB if s else None,
                        "longest_s_host_capped": capped}
                rows.append(row)
    return rows


ONE_GPU_VARIANTS = (  # (label, grad buffer bytes, pinned blocks rounded to powers of two)
    ("as is", 4, True),
    ("--grad-reduce-in-bf16", 2, True),
    ("exact-size pinned blocks", 4, False),
)


def one_gpu_plans(model: str, cal: Calibration, host_gib: float, step: float = 0.05) -> list:
    """For one GPU (DP = SP = 1) with optimizer offload, per card and ONE_GPU_VARIANTS: the
    offload fraction that leaves room for the longest sequence within the card and `host_gib`."""
    shape = SHAPES[model]
    counts = ParamCounts.of(shape, shape.vocab)
    plans = []
    for card, gib in CARDS.items():
        for label, grad_bytes, rounded in ONE_GPU_VARIANTS:
            best = {"card": card, "variant": label, "fraction": None, "longest_s": 0}
            for i in range(int(round(1 / step)) + 1):
                fraction = round(i * step, 6)
                state = strategy_state(counts, "offload", 1, offload_fraction=fraction,
                                       ddp_grad_bytes=grad_bytes)
                s = longest_sequence(shape, shape.vocab, state, 1, gib, cal, host_gib=host_gib,
                                     rounded=rounded)
                if s > best["longest_s"]:
                    best.update(fraction=fraction, longest_s=s, device_gib=(
                        state.device + s * cal.slope_of(shape, shape.vocab, s)) / harness.GIB,
                        host_gib=host_bytes(shape, shape.vocab, state, s, rounded)
                        / harness.GIB + HOST_OVERHEAD_GIB)
            plans.append(best)
    return plans


def _k(s: int) -> str:
    return f"{s // 1024:,}K" if s else "does not fit"


def print_strategy_tables(rows, plans, cal: Calibration, args) -> None:
    print(f"Calibration: {cal.source}: peak = {cal.intercept_gib:.2f} GiB + "
          f"{cal.slope:,.0f} B/token (static state measured {cal.static_gib:.2f} GiB); beyond the "
          f"analytic terms the backward keeps {cal.extra:.2f} x h x e bytes per token. Cards: "
          + ", ".join(f"{k} = {v} GiB" for k, v in CARDS.items())
          + f", less {CARD_RESERVE_GIB} GiB reserve. Megatron-FSDP grads: "
          f"{'fp32' if args.fsdp_grad_bytes == 4 else 'bf16'}.")
    print("\n### Per-GPU model + optimizer state (GiB)")
    print("| model | DP x SP | strategy | weights | grads | fp32 master | Adam moments | "
          "transient unsharded | **GPU total** | host |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        st = r["state_gib"]
        print(f"| {r['model']} ({r['params'] / 1e9:.2f}B) | {r['dp']} x {r['sp']} | {r['label']} "
              f"| {st['weights']:.1f} | {st['grads']:.1f} | {st['master']:.1f} | "
              f"{st['moments']:.1f} | {st['transient']:.1f} | **{r['device_gib']:.1f}** | "
              f"{r['host_state_gib']:.1f} |")
    print("\n### Longest sequence with full recompute + TiledMLP + tiled loss + activation "
          "offload: within GPU memory (host GiB per GPU it needs), and within "
          f"{args.host_gib_per_gpu:g} GiB of host memory per GPU too")
    print("| model | DP x SP | strategy | " + " | ".join(
        f"{card}: longest s | host GiB | host-capped" for card in CARDS) + " |")
    print("|---|---|---|" + "---|---|---|" * len(CARDS))
    for r in rows:
        cells = []
        for card in CARDS:
            c = r["cards"][card]
            cells += [_k(c["longest_s"]), f"{c['host_gib']:.0f}" if c["host_gib"] else "",
                      _k(c["longest_s_host_capped"])]
        print(f"| {r['model']} | {r['dp']} x {r['sp']} | {r['label']} | " + " | ".join(cells)
              + " |")
    print(f"\n### {args.one_gpu}, one GPU, optimizer offload: best fraction within "
          f"{args.host_gib:g} GiB of host memory ({HOST_OVERHEAD_GIB:g} GiB of it the process)")
    print("| card | variant | --optimizer-offload-fraction | longest s | GPU GiB | host GiB |")
    print("|---|---|---|---|---|---|")
    for p in plans:
        if not p["longest_s"]:
            print(f"| {p['card']} | {p['variant']} | | does not fit | | |")
            continue
        print(f"| {p['card']} | {p['variant']} | {p['fraction']:g} | {_k(p['longest_s'])} "
              f"({p['longest_s']:,}) | {p['device_gib']:.1f} | {p['host_gib']:.1f} |")


def strategies_main(args) -> None:
    """--strategies: the tables from the model alone (nothing is built or run)."""
    cal = Calibration.load(args.calibration)
    keys = args.strategies.split(",")
    layouts = [tuple(int(x) for x in layout.split("x")) for layout in args.layouts.split(",")]
    rows = strategy_rows(args.models.split(","), layouts, keys, cal, args.fsdp_grad_bytes,
                         args.host_gib_per_gpu)
    plans = one_gpu_plans(args.one_gpu, cal, args.host_gib)
    print_strategy_tables(rows, plans, cal, args)
    harness.write_json(args.json, {"calibration": dataclasses.asdict(cal), "cards": CARDS,
                                   "card_reserve_gib": CARD_RESERVE_GIB,
                                   "host_overhead_gib": HOST_OVERHEAD_GIB, "rows": rows,
                                   "one_gpu": plans})


# ---------------------------------------------------------------------------------------------

def add_strategy_args(parser) -> None:
    """The options of the --strategies mode."""
    parser.add_argument("--strategies", nargs="?", const=DEFAULT_STRATEGIES, default=None,
                        help="print the per-GPU state and longest-sequence tables of these "
                        f"strategies from the model instead of measuring (default "
                        f"{DEFAULT_STRATEGIES}; offload:F = offload fraction F)")
    parser.add_argument("--models", default="llama-3.1-8b,llama-3.1-70b",
                        help=f"--strategies: of {', '.join(SHAPES)}")
    parser.add_argument("--layouts", default="1x8,8x8", help="--strategies: DPxSP, ...")
    parser.add_argument("--fsdp-grad-bytes", type=int, choices=(2, 4), default=2,
                        help="--strategies: Megatron-FSDP main grads, 2 (bf16: Megatron-LM's "
                        "default 'auto') or 4 (--megatron-fsdp-main-grads-dtype fp32)")
    parser.add_argument("--one-gpu", default="llama-3.1-8b", choices=sorted(SHAPES),
                        help="--strategies: the model of the one-GPU offload plan")
    parser.add_argument("--host-gib", type=float, default=125.0,
                        help="--strategies: host memory of the one-GPU machine")
    parser.add_argument("--host-gib-per-gpu", type=float, default=256.0,
                        help="--strategies: host memory per GPU of the multi-GPU nodes (an "
                        "8-GPU DGX H100 / H200 node has 2 TiB)")
    parser.add_argument("--calibration", default=MEASURED_PEAKS,
                        help="--strategies: max_seq_len.py's JSON the slope is fitted to")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-1b", choices=sorted(harness.PRESETS))
    parser.add_argument("--backend", default="auto", help="te, sdpa, local or auto")
    parser.add_argument("--seq", type=int, default=None,
                        help="s: measured at s and 2s (default 8192 on GPU, 64 on CPU)")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--offload-min-bytes", type=int, default=None,
                        help="the offload's smallest tensor moved (default: the trainer's, "
                        f"{activation_offload.DEFAULT_MIN_OFFLOAD_BYTES})")
    parser.add_argument("--json", default=None)
    add_strategy_args(parser)
    args = parser.parse_args()
    if args.strategies:
        strategies_main(args)
        return
    keys = args.variants.split(",")
    unknown = [key for key in keys if key not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    args.backend = resolve_backend(args.backend)
    if args.seq is None:
        args.seq = 8192 if torch.cuda.is_available() else 64
    shape = harness.PRESETS[args.preset]
    if args.layers is not None:
        shape = dataclasses.replace(shape, layers=args.layers)
    seqs = [args.seq, 2 * args.seq]
    min_bytes = (activation_offload.DEFAULT_MIN_OFFLOAD_BYTES if args.offload_min_bytes is None
                 else args.offload_min_bytes)

    base_config = harness.run_config(shape, seqs[-1], args.backend)
    initialize_distributed(base_config)
    vocab = base_config.model.padded_vocab_size
    shape_info = dict(dataclasses.asdict(shape), padded_vocab=vocab)
    results = {"versions": harness.versions(), "args": vars(args), "shape": shape_info,
               "profile": None, "rows": [], "fits": [], "model_state": None}
    for key in keys:
        label, flags = VARIANTS[key]
        config = harness.run_config(shape, seqs[-1], args.backend, flags)
        try:
            trainer = harness.Trainer("ours", config)
        except Exception as exc:
            error = harness.describe_failure(exc)
            print(f"{label}: build failed: {error}", flush=True)
            results["rows"] += [{"key": key, "variant": label, "s": s, "error": error}
                                for s in seqs]
            continue
        profile = Profile.of(config, harness.unwrap(trainer.model))
        if results["profile"] is None:
            results["profile"] = dataclasses.asdict(profile)
        if results["model_state"] is None:
            results["model_state"] = model_state(trainer)
        for s in seqs:
            row = {"key": key, "variant": label, "flags": list(flags), "s": s, "tokens": s,
                   "profile": dataclasses.asdict(profile)}
            try:
                if torch.cuda.is_available() and s == seqs[0]:
                    warm_up(trainer, s, shape)
                row["measured"] = measure(trainer, s, shape, args)
                row["per_token"] = per_token_row(row["measured"], s)
                row["analytic"] = analytic(shape, vocab, s, profile, features_of(config), min_bytes)
                pt = row["per_token"]
                print(f"{label:50s} s={s:6d}: kept {pt['layer']['device']:12,.1f} B/token/layer"
                      f" (analytic {row['analytic']['layer']['device']:12,.1f}), host "
                      f"{pt['layer']['host']:10,.1f}, leaked {row['measured']['leaked']}",
                      flush=True)
            except Exception as exc:  # OOM, or a broken variant: report, go on
                row["error"] = harness.describe_failure(exc)
                print(f"{label} s={s}: {row['error']}", flush=True)
            results["rows"].append(row)
        del trainer
        harness.reset_memory()
        results["fits"] = fit_rows(results["rows"])
        harness.write_json(args.json, results)
    print_tables(results)
    harness.shutdown()


if __name__ == "__main__":
    main()
