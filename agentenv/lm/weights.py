"""What the sampler samples from: a plain copy of the trained policy in the sampling dtype.

Rollouts are on-policy only if the sampler draws from the weights being trained
(docs/design.md §4). :func:`sampling_copy` builds the copy and :func:`sync_weights` refreshes
it after an optimizer step:

* **LoRA stays unmerged** (:class:`_LoRALinear`): folded into bfloat16 weights, most of a
  small update rounds away (72% of an SFT adapter's update, by norm, on SmolLM2) and the
  sampler would draw from another policy than the one trained. Frozen weights already in
  the sampling dtype (a LoRA run's base) are shared with the trained model, not copied.
  The float32 update is added into a bfloat16 output by :func:`add_update` (by the matmul
  itself where that gives the same values: :func:`add_product`).
  In float32 on a CPU the update is folded into the *packed* copy of the weights only
  (below): float32 keeps it, and the decode step saves the low-rank matmuls.
* **FSDP2-sharded parameters** (``fully_shard``, accelerate's ``fsdp_version: 2``) are
  gathered whole into the copy, so every process samples from the full policy; FSDP1 and
  DeepSpeed ZeRO-3 are refused (:func:`check_sharding`).
* **Linear layers run from weights pre-packed for oneDNN** on a CPU (:class:`_PackedLinear`):
  a plain CPU linear layer lays its weight out again on every call, which in a decode step
  of a few rows costs about as much as the product. Bit-identical outputs in bfloat16;
  float32 equal to rounding. The packed copies cost one more copy of the linear weights
  (0.27 GB for SmolLM2 in bfloat16) and are packed again when a sync changes the weights
  (full fine-tuning; a LoRA run's base never changes). All of them are freed while the
  trainer learns and packed again at their next call (:func:`release_packed`). An
  attention layer's query, key and value projections are packed once more as one matrix
  (:class:`PackedConcat`, 33 MB for SmolLM2): the decode step's one call instead of
  three, used where it gives the three outputs bit for bit (:meth:`PackedConcat.exact`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from agentenv.errors import InvalidOptionError


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 shards ``model``'s parameters (they are ``DTensor`` s)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def check_sharding(model: torch.nn.Module) -> bool:
    """Whether FSDP2 shards ``model``'s parameters (they are ``DTensor`` s); raise for the
    shardings the sampler cannot gather (FSDP1's flat parameters, DeepSpeed ZeRO-3)."""
    if any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        raise InvalidOptionError(
            "FSDP1 (FullyShardedDataParallel) flattens the parameters, which the sampler "
            "cannot gather; use FSDP2 (accelerate config: fsdp_version: 2)"
        )
    params = list(model.parameters())
    if any(hasattr(p, "ds_id") for p in params):
        raise InvalidOptionError(
            "DeepSpeed ZeRO-3 partitions the parameters, which the sampler cannot gather "
            "yet; use ZeRO-2 (zero_stage: 2) or FSDP2 (fsdp_version: 2)"
        )
    return is_sharded(model)


def whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` gathered whole if FSDP2 shards it (a collective), else ``t`` itself."""
    full = getattr(t, "full_tensor", None)
    return full().detach() if full is not None else t


def _is_lora_layer(name: str, module: torch.nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer the sampler can compute unmerged."""
    if not (hasattr(module, "base_layer") and hasattr(module, "lora_A")):
        return False
    adapters = [a for a in module.active_adapters if a in module.lora_A]
    if any(module.use_dora.get(a, False) for a in adapters) or getattr(
        module, "lora_embedding_A", None
    ):
        raise InvalidOptionError(
            f"{name} is a DoRA or embedding LoRA layer, which the sampler does not "
            "implement; train plain LoRA on linear layers (use_dora=False)"
        )
    return bool(adapters)


def _unmerge_lora(
    model: torch.nn.Module,
    base: torch.nn.Module,
    frozen: Callable[[torch.nn.Module], torch.nn.Module],
) -> None:
    """Put a :class:`_LoRALinear` in ``model`` wherever ``base`` (the trained peft base
    model) has a LoRA layer; ``frozen`` picks the frozen linear layer out of ``model``'s
    module at that path."""
    for name, layer in base.named_modules():
        if _is_lora_layer(name, layer):
            parent, _, child = name.rpartition(".")
            linear = frozen(model.get_submodule(name))
            setattr(model.get_submodule(parent), child, _LoRALinear(linear, layer))


def trainable_version(params: Sequence[torch.Tensor]) -> int:
    """A number that changes whenever one of ``params`` is modified in place."""
    return sum(getattr(p, "_version", 0) for p in params)


def sampling_copy(
    trained: torch.nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    *,
    pack: bool = True,
    pack_qkv: bool = True,
    fold: bool = True,
) -> torch.nn.Module:
    """The model sampled from: ``trained`` as a plain model in ``dtype`` (see the module
    docstring), or ``trained`` itself when it already is one and packing does not pay.
    ``pack``, ``pack_qkv``, ``fold``: :func:`_pack_linears`'s steps, each where it applies
    (False: not at all)."""
    sharded = check_sharding(trained)
    pack = pack and packs_linears(device, dtype)
    param = next(trained.parameters())
    if not (sharded or is_peft(trained) or param.dtype != dtype or pack):
        return trained  # already what we sample from: share it
    if sharded:
        model = _gathered_copy(trained, dtype, device)
    else:
        base = trained.get_base_model() if is_peft(trained) else trained
        tensors = [*base.parameters(), *base.buffers()]
        # already in the sampling dtype: shared, not copied (trained ones too, e.g. a
        # float32 model sampled in float32: sync then has nothing to copy)
        shared = {id(t): t for t in tensors if t.dtype == dtype}
        # adapters: not copied either, their layers are replaced by _LoRALinear below
        shared |= {id(p): p for n, p in base.named_parameters() if ".lora_" in n}
        model = copy.deepcopy(base, memo=shared)
        if is_peft(trained):
            _unmerge_lora(model, base, lambda copied: copied.base_layer)
        model = model.to(dtype).eval()
        for p in model.parameters():  # the copy's own; shared ones keep their flag
            if id(p) not in shared:
                p.requires_grad_(False)
    if pack:
        _pack_linears(model, qkv=pack_qkv, fold=fold)
    return model


@torch.no_grad()
def _gathered_copy(
    trained: torch.nn.Module, dtype: torch.dtype, device: torch.device
) -> torch.nn.Module:
    """The sampling copy of a model whose parameters FSDP2 shards: a fresh model of
    the same config holding every parameter gathered whole (a collective: every
    process builds its copy at the same time), LoRA layers unmerged as above."""
    from transformers import AutoModelForCausalLM

    base = trained.get_base_model() if is_peft(trained) else trained
    with torch.device(device):  # initialised where it runs, then overwritten
        model = AutoModelForCausalLM.from_config(base.config, dtype=dtype)
    state = {
        name.replace(".base_layer.", "."): whole(p)
        for name, p in base.named_parameters()
        if ".lora_" not in name
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {n for n in missing if n in (getattr(model, "_tied_weights_keys", None) or ())}
    if unexpected or set(missing) - tied:
        raise InvalidOptionError(
            f"the sampler cannot rebuild this sharded model as a plain "
            f"{type(model).__name__}: missing {sorted(set(missing) - tied)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}; train it unsharded or with LoRA"
        )
    model.tie_weights()
    _unmerge_lora(model, base, lambda plain: plain)  # a plain rebuild: no base_layer
    return model.eval().requires_grad_(False)  # packed by sampling_copy where that pays


@torch.no_grad()
def sync_weights(model: torch.nn.Module, trained: torch.nn.Module) -> None:
    """Copy ``trained``'s current weights into its sampling copy ``model`` (a no-op when
    the copy is ``trained`` itself). With FSDP2-sharded weights this is a collective."""
    if model is trained:
        return
    trained = trained.get_base_model() if is_peft(trained) else trained
    target = dict(model.named_parameters())
    for name, module in model.named_modules():
        if isinstance(module, _LoRALinear):
            module.load(trained.get_submodule(name))
    changed = False
    for name, p in trained.named_parameters():
        if p.requires_grad and name in target:  # full fine-tuning, modules_to_save
            if target[name] is not p:  # (a shared tensor is up to date)
                target[name].copy_(whole(p))
            changed = True
    if changed:  # packed weights are copies: pack the new values
        for module in model.modules():
            if isinstance(module, _PackedLinear):
                module.pack()


class _LoRALinear(torch.nn.Module):
    """A frozen layer plus its LoRA updates, unmerged, for sampling.

    ``y = base(x) + x A^T B^T`` with ``A`` the active adapters' ``lora_A`` weights stacked
    ``(r, in)`` and ``B`` their ``scaling * lora_B`` side by side ``(out, r)``: peft's
    LoRA layer in eval mode (dropout off). The low-rank path runs in float32 whatever the
    base's dtype: its matmuls are tiny, and on a CPU float32 ones cost a third of bfloat16
    ones. (The learner's bf16 autocast runs them in bfloat16; the two differ by that
    rounding of the update only.)
    :meth:`load` copies the trained layer's current adapter weights.
    """

    def __init__(self, base_layer: torch.nn.Module, lora_layer: torch.nn.Module):
        super().__init__()
        self.base_layer = base_layer
        self.names = [a for a in lora_layer.active_adapters if a in lora_layer.lora_A]
        self.load(lora_layer)

    @property
    def folded(self) -> bool:
        """Whether the update runs folded into the base layer's packed weights."""
        return getattr(self.base_layer, "update", None) is not None

    @torch.no_grad()
    def load(self, lora_layer: torch.nn.Module) -> None:
        """Copy the adapter weights of ``lora_layer`` (the trained peft layer)."""
        pairs = [
            (lora_layer.lora_A[a], lora_layer.lora_B[a], lora_layer.scaling[a]) for a in self.names
        ]
        self.a = torch.cat([whole(lora_a.weight).float() for lora_a, _, _ in pairs])
        self.b = torch.cat([whole(lora_b.weight).float() * s for _, lora_b, s in pairs], dim=1)
        biases = [whole(b.bias).float() * s for _, b, s in pairs if b.bias is not None]
        self.bias = torch.stack(biases).sum(0) if biases else None
        if self.folded:
            self.fold()

    def fold(self) -> None:
        """Compute the update folded into the base layer's packed weights from now on (a
        float32 :class:`_PackedLinear`: float32 keeps the update that bfloat16 would round
        away); :meth:`load` folds each new update."""
        self.base_layer.update = (self.b, self.a, self.bias)
        self.base_layer.pack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.folded:
            return self.base_layer(x)
        return self.add_to(self.base_layer(x), x)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Add the unmerged update ``x A^T B^T (+ bias)``, computed in float32, into ``y``
        (the base layer's output for ``x``, or its columns of a packed output) in place:
        :func:`add_product` where it applies, else :func:`add_update`; the same values."""
        h = F.linear(x.float(), self.a)  # (..., r)
        if self.bias is None and adds_in_float32(y):
            return add_product(y, h, self.b)
        return add_update(y, F.linear(h, self.b, self.bias))


# add_update's size from which the float32 add pays (measured: equal at 32 x 1536,
# 14% faster at 160 x 1536, 4-5x at 32 x 139 x 1536)
ADD_IN_FLOAT32 = 1 << 16
HALF = (torch.bfloat16, torch.float16)


def adds_in_float32(y: torch.Tensor) -> bool:
    """Whether an update is added into ``y`` in float32 (rounded once into ``y``'s
    dtype): ``y`` is 16-bit with at least ``ADD_IN_FLOAT32`` elements."""
    return y.dtype in HALF and y.numel() >= ADD_IN_FLOAT32


def add_update(y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``y.add_(delta)`` for a float32 ``delta`` (a LoRA layer's update, in every
    prefill and decode step). For a large bfloat16 or float16 ``y`` (a view included),
    the same values (the float32 sum rounded once into ``y``'s dtype) computed as a
    float32 add and one conversion: PyTorch's in-place add of a float32 tensor into a
    16-bit one runs up to 5x slower on a CPU (SmolLM2's MLP output in a 32-row RAG
    prefill, ``(32, 139, 1536)`` in bfloat16: 21-23 ms against 4.3-5.8 ms, 2 cores),
    while below ``ADD_IN_FLOAT32`` elements (a decode step's few rows) the one call is
    as fast or faster (1 x 576: 5 against 9 us)."""
    if delta.dtype != torch.float32 or not adds_in_float32(y):
        return y.add_(delta)
    return y.copy_(y.float().add_(delta))


def add_product(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``add_update(y, h @ b.T)`` for a large 16-bit ``y`` and float32 ``h`` ``(..., r)``
    and ``b`` ``(out, r)``, bit for bit, without the ``(..., out)`` float32 update: the
    matmul adds its product into ``y``'s float32 copy (``addmm_``), the BLAS adding the
    finished product to it as the separate add does (tested against :func:`add_update`).
    A 32-row LoRA prefill of SmolLM2 in bfloat16 on a 2-core CPU (r 16, all 7
    projections): 4.96 s against 5.53 (medians of 12, alternating), the MLP's gate and
    up projections' updates costing most (4,608 x 1,536 floats each)."""
    total = y.to(torch.float32, memory_format=torch.contiguous_format)
    total.view(-1, total.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), b.t())
    return y.copy_(total)


@functools.cache
def _onednn_linear() -> bool:
    """Whether this torch has oneDNN's pre-packed linear ops (CPU builds with mkldnn)."""
    try:
        return torch.backends.mkldnn.is_available() and all(
            hasattr(torch.ops.mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise")
        )
    except (AttributeError, RuntimeError):
        return False


def _onednn_bf16() -> bool:
    """Whether oneDNN has a bfloat16 path on this CPU (avx512bw/vl/dq or avx_ne_convert;
    an AVX2-only CPU has none, and packing a bf16 weight there raises)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


PACKED_DTYPES = (torch.bfloat16, torch.float32)  # the dtypes packed weights exist for


def why_not_packed(device: str | torch.device, dtype: torch.dtype) -> str | None:
    """Why the sampler cannot run its linear layers from pre-packed weights
    (:class:`_PackedLinear`) on ``device`` in ``dtype``, or None where it can: on a CPU, in
    float32, or in bfloat16 where oneDNN has a bfloat16 path, with oneDNN present."""
    if torch.device(device).type != "cpu":
        return "a CPU path"
    if dtype not in PACKED_DTYPES:
        return f"bfloat16 or float32 only, not {str(dtype).removeprefix('torch.')}"
    if not _onednn_linear():
        return "this torch build has no oneDNN pre-packed linear ops"
    if dtype == torch.bfloat16 and not _onednn_bf16():
        return "oneDNN has no bfloat16 path on this CPU"
    return None


def packs_linears(device: str | torch.device, dtype: torch.dtype) -> bool:
    """Whether the sampler runs its linear layers from pre-packed weights
    (:func:`why_not_packed` has no reason against it)."""
    return why_not_packed(device, dtype) is None


class _PackedLinear(torch.nn.Module):
    """A frozen ``nn.Linear`` whose weight is pre-packed once for oneDNN (CPU sampling).

    A plain CPU linear layer re-lays out its weight for oneDNN's kernel on every call;
    in a decode step (a few rows) that costs as much as the product itself: 41 -> 30 us
    for SmolLM2's 576 x 576 at 8 rows, 4.1 -> 2.1 ms for its LM head, in bfloat16 on a
    2-core CPU. Packing once makes the same kernel skip it: in bfloat16 the outputs are
    bit-identical to ``F.linear`` (the same kernel and accumulation order); in float32
    oneDNN replaces MKL's sgemm, equal to float rounding. ``weight`` and ``bias`` stay
    the layer's own parameters (shared, so syncs copy into them); the packed copy is
    made again by :meth:`pack`. ``update``, when set (a float32 LoRA layer folded by
    :meth:`_LoRALinear.fold`), is ``(B, A, bias)``: the packed copy holds ``W + B A`` and
    the bias ``b + bias``, while ``weight`` stays the shared frozen ``W``.
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.update: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self.concats: list[PackedConcat] = []  # packed with others too: to pack again
        self.pack()

    @torch.no_grad()
    def pack(self) -> None:
        """Pack the current ``weight`` (after it changed), plus ``update`` if set."""
        weight, self.packed_bias = self.effective()
        self.packed = _reorder(weight)
        for concat in self.concats:
            concat.stale = True

    def effective(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weight and bias this layer computes with: ``W + B A`` and ``b + bias``
        when ``update`` is set, else its own."""
        weight, bias = self.weight.detach(), self.bias
        if self.update is not None:
            b, a, extra = self.update
            weight = torch.addmm(weight, b, a)  # W + B A: (out, r) @ (r, in)
            if extra is not None:
                bias = extra if bias is None else bias.detach() + extra
        return weight, bias

    def release(self) -> int:
        """Free the packed copy (its next call packs it again); return the bytes freed."""
        packed, self.packed = self.packed, None
        freed = 0 if packed is None else _nbytes(packed)
        return freed + sum(concat.release() for concat in self.concats)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:  # released (release_packed): pack the current weights
            self.pack()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.packed_bias, "none", [], "")


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a packed weight holds (an opaque oneDNN tensor reports no storage)."""
    try:
        return t.untyped_storage().nbytes()
    except (NotImplementedError, RuntimeError):
        return t.numel() * t.element_size()


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``(out, in)``) laid out for oneDNN's linear kernel."""
    # oneDNN's batch-size hint: in bfloat16 (avx512_bf16) no hint from 1 to 128 rows
    # changed the speed, and 1 keeps the outputs bit-identical to F.linear's; in float32
    # on an AVX2 CPU, hint 1 picks a layout 1.5-2x slower than none for the MLP and
    # the LM head at 8 rows (the whole decode step: 60-70 -> 80-90 tok/s at 8 rows)
    hint = 1 if weight.dtype == torch.bfloat16 else None
    return torch.ops.mkldnn._reorder_linear_weight(weight, hint)


# (PackedConcat.shapes, rows, threads) -> whether a packed concatenation of those shapes
# computes its layers' outputs bitwise (PackedConcat.exact)
_CONCAT_EXACT: dict[tuple, bool] = {}


class PackedConcat(torch.nn.Module):
    """Several :class:`_PackedLinear` layers that read the same input (an attention
    layer's query, key and value projections) packed as one matrix: their outputs side
    by side, ``(..., sum of out features)``, from one oneDNN call instead of one each.

    In a decode step of a few rows each call costs more than its product: SmolLM2's
    three projections at 8 rows take 76 us a layer as three calls, 46 us as one (bfloat16,
    2-core CPU). Each output column is the same dot product either way, but oneDNN does
    not promise to accumulate it in the same order for a wider matrix, so
    :meth:`exact` checks, per number of rows and threads, that the concatenation gives
    the separate layers' outputs bit for bit; callers use it only where it does. The
    layers stay the model's (prefill and every other path call them); when one of them
    is packed again (a sync), so is the concatenation, at its next call. Costs one more
    copy of the layers' weights (33 MB for SmolLM2 in bfloat16).
    """

    def __init__(self, layers: Sequence[_PackedLinear]):
        super().__init__()
        self.layers = tuple(layers)  # a tuple: not submodules (they stay where they are)
        for layer in self.layers:
            layer.concats.append(self)
        self.pack()

    @torch.no_grad()
    def pack(self) -> None:
        """Pack the layers' current weights (:meth:`_PackedLinear.effective`) as one."""
        weights, biases = zip(*(layer.effective() for layer in self.layers), strict=True)
        self.packed = _reorder(torch.cat(weights))
        self.packed_bias = None if biases[0] is None else torch.cat(biases)
        self.stale = False  # set when one of the layers is packed again
        # what oneDNN's kernel choice depends on, besides the rows and threads (exact)
        self.shapes = (
            weights[0].shape[1],
            tuple(w.shape[0] for w in weights),
            self.packed_bias is not None,
            weights[0].dtype,
        )

    def release(self) -> int:
        """Free the packed matrix (the next call packs the layers' weights again); return
        the bytes freed."""
        packed, self.packed, self.stale = self.packed, None, True
        return 0 if packed is None else _nbytes(packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stale:  # a layer was packed again since, or released
            self.pack()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.packed_bias, "none", [], "")

    def exact(self, rows: int) -> bool:
        """Whether, for an input of ``rows`` rows (``(rows, 1, in)``, a decode step; a
        step of ``q`` tokens per row is ``b * q`` rows to the matmul), this
        gives the layers' outputs bitwise. Checked once per shapes, dtype, number of rows
        and of threads (what oneDNN picks its kernel by, not the values): random inputs
        through both, 2^18 output values in all. Summed in another order, about one
        bfloat16 output in 8,000 differs (measured on SmolLM2's shapes; most float32
        outputs do), so a different order would show some 30 times."""
        key = (self.shapes, rows, torch.get_num_threads())
        verdict = _CONCAT_EXACT.get(key)
        if verdict is None:
            in_features, widths, _, dtype = self.shapes
            generator = torch.Generator().manual_seed(0)
            verdict = _CONCAT_EXACT[key] = all(
                torch.equal(self(x), torch.cat([layer(x) for layer in self.layers], -1))
                for x in (
                    torch.randn((rows, 1, in_features), generator=generator).to(dtype)
                    for _ in range(max(16, -(-(2**18) // (rows * sum(widths)))))
                )
            )
        return verdict


def _pack_linears(model: torch.nn.Module, *, qkv: bool = True, fold: bool = True) -> None:
    """Replace every plain ``nn.Linear`` of ``model`` (the sampling copy) with a
    :class:`_PackedLinear` of the same weights (a LoRA layer's base layer included), give
    each attention layer a :class:`PackedConcat` of its q, k, v projections (``packed_qkv``;
    a LoRA layer's base layer: its unmerged update is added by the caller) if ``qkv``, and
    fold float32 LoRA updates into the packed weights (:meth:`_LoRALinear.fold`) if
    ``fold``."""
    for name, module in list(model.named_modules()):
        if type(module) is torch.nn.Linear:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, _PackedLinear(module))
    for module in list(model.modules()) if qkv else []:  # attention layers: q, k, v as one
        layers = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        layers = [getattr(x, "base_layer", x) if type(x) is _LoRALinear else x for x in layers]
        if not all(type(layer) is _PackedLinear for layer in layers):
            continue  # not an attention layer, or projections that are not linear layers
        one_input = len({layer.in_features for layer in layers}) == 1
        if one_input and len({layer.bias is None for layer in layers}) == 1:
            module.packed_qkv = PackedConcat(layers)
    for module in model.modules() if fold else []:
        base = getattr(module, "base_layer", None)  # packed (not GPT-2's Conv1D), float32
        packed32 = isinstance(base, _PackedLinear) and base.weight.dtype == torch.float32
        if isinstance(module, _LoRALinear) and packed32:
            module.fold()


def release_packed(model: torch.nn.Module) -> int:
    """Free every packed weight of ``model`` (a sampling copy); return the bytes freed.

    The trainer frees them for its learn phase (:meth:`TransformersPolicy.release_weights`),
    whose activations then have that memory: 0.30 GB for SmolLM2 in bfloat16 (its LoRA
    base and the q, k, v concatenations), 0.60 GB with LoRA in float32. Each layer packs
    itself again at its next call, from its current weights (after a sync: the updated
    ones): the same packed copy as before for weights that did not change, so the same
    outputs bit for bit. Packing SmolLM2 again takes about 0.15 s on a 2-core CPU."""
    return sum(module.release() for module in model.modules() if isinstance(module, _PackedLinear))
