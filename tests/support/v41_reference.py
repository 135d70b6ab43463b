"""An independent fp32 forward pass of the DeepSeek-V4.1 text model (`deepseek_v41`): the oracle.

`reference_logits(model_dir, token_ids, keep_tokens=0)` runs one sequence, the whole prompt in one
pass, no cache, in fp32 throughout, and returns the logits [T, vocab]. It is assembled from other
people's code, never from deepmesh's engine: DeepInfer 0.1.0's plain-torch `*_ref` functions
(tests/support/deepinfer_reference.py) and SGLang 0.5.23's torch forms (tests/support/
sglang_reference.py). The code here is glue: reading weights, the layer loop, the shifted
hyper-connection wiring, masks and index bookkeeping. The study note the glue follows is
/tmp/cb/v41_study.md (sections B and C); "DI" is deepinfer-0.1.0/deepinfer/, "SG" sglang-0.5.23/sglang/.

Where each piece of math comes from:

- RMSNorm (attn_norm, ffn_norm, q_norm, kv_norm, compressor.norm, indexer.k_norm, final norm):
  DI model_executor/layers/tilelang_ops/norm.py `norm_ref` (fp32 in, so no bf16 rounding).
- mHC split of the mixes into pre / post / comb (sigmoids, Sinkhorn): SG test/kernels/mhc.py
  `hc_split_sinkhorn_torch`. Post `R'[i] = post[i] y + sum_j comb[j][i] R[j]`: SG
  kernels/ops/layernorm/mhc.py `_mhc_post_torch`.
- Initial streams: SG kernels/ops/layernorm/mhc.py `hc_broadcast` (its CPU branch).
- RoPE tables (YaRN on compressed layers): SG kernels/ops/attention/dsv4/rope.py
  `precompute_freqs_cis`; rotation of the trailing rope dims in interleaved pairs, and its inverse
  on the attention output: SG srt/layers/attention/dsv4/dsv41_sparse.py `rope_tail`.
- Ratio-2 pooling of compressed KV: DI tilelang_ops/compress.py
  `compress_and_update_state_prefill_ref`, run with its bf16 output cast retargeted to fp32 (see
  `_fp32_twin`; nothing else changes).
- Index scores `sum_h relu(q_h . k) w_h`: SG dsv41_sparse.py `DeepseekV41Indexer.scores`.
- Candidate blocks: DI tilelang_ops/candidate_blocks.py `candidate_block_max_ref` (fp32 twin, like
  the pooling: the per-block max, masked at the row's length, the last valid block forced to +inf),
  `get_candidate_compact_lens_ref` and `restore_candidate_indices_inplace_ref`.
- Attention core (softmax over SWA keys and the chosen compressed entries, plus the per-head sink as
  a virtual key with no value; K = V): SG test/kits/attention_unittest/attention_methods/
  dsv4_attention.py `_pure_torch_dsv4_combined_reference`, fed through a duck-typed fixture
  (`_attention`), its `DSV4_HEAD_DIM` set to the config's head_dim.
- Grouped output LoRA `o [T, G, D] @ wo_a [G, R, D]`: SG srt/models/deepseek_v4.py
  `_apply_wo_a_bf16_matmul` (its einsum path).
- Engram: compressed vocabulary DI v4_modules/engram_metadata.py `CompressedVocabulary`; primes
  DI `EngramLayout.from_cfg`; hash multipliers SG srt/layers/engram.py `compute_hash_multipliers`;
  hash ids SG `compute_engram_hash_ids`; gate SG `engram_gate` (its torch branch).
- MoE router (sqrtsoftplus, bias for selection only, renormalize, routed_scaling_factor): SG
  srt/layers/moe/topk.py `biased_topk_impl`; routed experts SG srt/layers/moe/fused_moe_native.py
  `moe_forward_native`, whose activation is SG srt/layers/quantization/expert_pack.py
  `_clamped_swiglu` (`silu(min(g, L)) * clamp(u, -L, L)`), also used for the shared expert.

Written here (no upstream torch function exists, or none callable on CPU):

- The mix GEMM `mixes = (x @ fn.T) * rsqrt(mean(x^2) + rms_norm_eps)` (study B.2): the CPU branch of
  SG srt/models/deepseek_v4_mhc.py `_mix_stats_impl` (lines 423-425), which itself imports SGLang
  kernels in its body and so cannot be called.
- The collapse `sum_j pre[j] R[j]` (SG kernels/ops/layernorm/mhc.py `_mhc_pre_torch`, its
  `layer_input` line) and the shifted wiring (study B.2; SG deepseek_v4_mhc.py module docstring and
  `_combine`): each sublayer collapses with the previous sublayer's `pre`, the first one takes
  stream 0, the final collapse uses the last FFN sublayer's `pre`, no HC head.
- Plain linears (`x @ W.T`), the head, the embedding lookup, the shared expert's two GEMMs.
- The Engram window (column s = the token s back, blocked before position 0): SG engram.py
  `_torch_hash_ids` (extend mode), and the table row offsets (exclusive cumsum of the primes, SG
  `EngramHasher.__init__`).
- Images (positions whose id is at or above the vocabulary's size, as DeepInfer's
  `_special_image_token_mask` reads them; `image_embeds` holds their rows in order): the rows
  replace the embeddings through DI tilelang_ops/image_embed_ops.py `replace_input_embeds_ref`;
  the Engram window is blocked from the first image position it reaches on (SG engram.py
  `EngramHasher.hash_windows`, its two lines of `cummax`, written here as it is a method) and
  reads such positions as `image_token_id`, as SGLang's scheduler does; `engram_gate` is SGLang's
  with its `input_ids` / `image_token_id` arguments (image rows keep their streams); the MoE
  selects with `gate.bias_vl` at image rows (SG srt/multimodal/dsv41/vl_routing.py
  `vision_topk`'s torch branch): `biased_topk_impl` runs once per kind of row with its bias.
- Top-k: a stable top-k (`_stable_topk`), ties toward the earlier entry. Upstream leaves ties
  unspecified (deep_select, torch.topk); it is used for the index top-k, the candidate-block top-k,
  the top-k among candidate blocks, and (passed into `biased_topk_impl` as its `torch.topk`) the
  MoE expert selection.
- The ratio-1 compressed KV is the projection itself (no pooling, study B.4.1).
- Cross-layer maps (DI hugging_face/config.py `_source_map`, `_n_prefill_layer`), visibility
  `klen = (p + 1) // r`, compressed positions `j * r`, SWA window `[p - W + 1, p]` with W the
  config's `sliding_window` (DI reads it; SGLang hard-codes 128), and the YOCO bookkeeping below.

YOCO (study B.4.3, B.5; DI models/decoder_layer.py, v4_modules/attn.py `_resolve_shared_hidden`,
`_store_yoco_full_kv`, v4_modules/yoco.py): layers from the first ratio-1 layer on are consumer
layers; a KV-source consumer layer projects its compressed KV (and index keys) from the shared
hidden, the boundary layer's attention-norm output, for every row. `keep_tokens > 0` is DeepInfer's
compact prefill truncation (DEEPINFER_YOCO_PREFILL_KEEP_TOKENS): rows at positions below
`T - keep_tokens` skip the consumer layers and come back as NaN rows, and the consumer layers'
sliding window of the kept rows never reaches below `T - keep_tokens`.

Index head weights are `weights_proj(x)` unscaled, as DeepInfer has them (SGLang scales them by
`index_head_dim^-0.5 * index_n_heads^-0.5`, which ranks the same; study F.3).
"""

from __future__ import annotations

import functools
import json
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open

from tests.support.deepinfer_reference import engram_metadata, tilelang_op
from tests.support.sglang_reference import sglang_functions

# ---------------------------------------------------------------------------------------------
# The upstream functions
# ---------------------------------------------------------------------------------------------


def _stable_topk(
    input: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True
) -> torch.return_types.topk:
    """torch.topk with ties broken toward the earlier entry (a stable sort); always sorted."""
    assert largest, "only the largest entries are asked for"
    values, indices = torch.sort(input, dim=dim, descending=True, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def _torch_with(**overrides: Any) -> types.ModuleType:
    """torch as one upstream function sees it: every attribute torch's, except `overrides`."""

    class _Torch(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    module = _Torch("torch")
    for name, value in overrides.items():
        setattr(module, name, value)
    return module


def _fp32_twin(module: types.ModuleType, name: str, *helpers: str) -> Any:
    """`module.name` re-bound to globals in which `torch.bfloat16` is torch.float32, so a DeepInfer
    reference that rounds its result (or its scratch) to bf16 keeps fp32; `helpers` are module
    functions it calls, re-bound the same way. The code objects are DeepInfer's, unchanged."""
    namespace = dict(vars(module))
    namespace["torch"] = _torch_with(bfloat16=torch.float32)
    for fn_name in (*helpers, name):
        fn = getattr(module, fn_name)
        namespace[fn_name] = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    return namespace[name]


@functools.cache
def _upstream() -> types.SimpleNamespace:
    norm = tilelang_op("norm")
    compress = tilelang_op("compress")
    candidate = tilelang_op("candidate_blocks")
    engram_meta = engram_metadata()

    sg_pack = sglang_functions("srt/layers/quantization/expert_pack.py", "_clamped_swiglu")
    sg_topk = sglang_functions(
        "srt/layers/moe/topk.py",
        "_RENORMALIZE_SUM_EPSILON",
        "biased_topk_impl",
        overrides={"torch": _torch_with(topk=_stable_topk)},
        undecorated={"biased_topk_impl"},  # @torch.compile only
    )
    return types.SimpleNamespace(
        norm_ref=norm.norm_ref,
        replace_input_embeds_ref=tilelang_op("image_embed_ops").replace_input_embeds_ref,
        compress_prefill_ref=_fp32_twin(compress, "compress_and_update_state_prefill_ref"),
        candidate_block_max_ref=_fp32_twin(candidate, "candidate_block_max_ref", "_check_inputs"),
        get_candidate_compact_lens_ref=candidate.get_candidate_compact_lens_ref,
        restore_candidate_indices_inplace_ref=candidate.restore_candidate_indices_inplace_ref,
        CompressedVocabulary=engram_meta.CompressedVocabulary,
        EngramLayout=engram_meta.EngramLayout,
        mhc_test=sglang_functions("test/kernels/mhc.py", "hc_split_sinkhorn_torch"),
        mhc=sglang_functions("kernels/ops/layernorm/mhc.py", "hc_broadcast", "_mhc_post_torch", "_mhc_pre_torch"),
        rope=sglang_functions("kernels/ops/attention/dsv4/rope.py", "precompute_freqs_cis"),
        sparse=sglang_functions("srt/layers/attention/dsv4/dsv41_sparse.py", "rope_tail", "DeepseekV41Indexer"),
        wo_a=sglang_functions("srt/models/deepseek_v4.py", "_apply_wo_a_bf16_matmul"),
        engram=sglang_functions(
            "srt/layers/engram.py",
            "_cuda_kernels",
            "compute_hash_multipliers",
            "compute_engram_hash_ids",
            "engram_gate",
        ),
        biased_topk_impl=sg_topk.biased_topk_impl,
        clamped_swiglu=sg_pack._clamped_swiglu,
    )


class _ClampedSiluAndMul:
    """The activation `moe_forward_native` builds (`SiluAndMul()`), given SG's clamped SwiGLU."""

    def __init__(self, limit: float | None) -> None:
        self.limit = limit

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return _upstream().clamped_swiglu(gate, up, self.limit)


@functools.cache
def _moe_forward_native(swiglu_limit: float | None) -> Any:
    """SG's per-expert torch MoE, its `SiluAndMul()` the SwiGLU clamped at `swiglu_limit`."""
    return sglang_functions(
        "srt/layers/moe/fused_moe_native.py",
        "moe_forward_native",
        overrides={"SiluAndMul": functools.partial(_ClampedSiluAndMul, swiglu_limit)},
    ).moe_forward_native


@functools.cache
def _attention_reference(head_dim: int) -> Any:
    """SG's pure-torch SWA + compressed-entries attention with sinks, for this head size."""
    return sglang_functions(
        "test/kits/attention_unittest/attention_methods/dsv4_attention.py",
        "_seed_c4_if_needed",
        "_extra_metadata_indices",
        "_pure_torch_dsv4_combined_reference",
        overrides={"DSV4_HEAD_DIM": head_dim},
    )._pure_torch_dsv4_combined_reference


# ---------------------------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------------------------

_FP4_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


class _Weights:
    """The checkpoint's tensors by HF name (a `model.` prefix is accepted), read as fp32. An FP8
    `X.weight` with `X.scale` (UE8M0) is dequantized by 32x32 blocks (Engram tables: 1x32, one scale
    per 32 columns of a row); an int8/uint8 `X.weight` with `X.scale` is FP4 e2m1, two per byte,
    the low nibble first [assumed, as V4], one scale per 32 inputs (study C)."""

    def __init__(self, model_dir: Path) -> None:
        index = model_dir / "model.safetensors.index.json"
        if index.exists():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = [path.name for path in sorted(model_dir.glob("*.safetensors"))]
        self._where: dict[str, tuple[Any, str]] = {}
        self._handles = []
        for file in files:
            handle = safe_open(str(model_dir / file), framework="pt")
            self._handles.append(handle)
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
                self._where[key] = (handle, key)
                if key.startswith("model."):
                    self._where.setdefault(key[len("model.") :], (handle, key))

    def has(self, name: str) -> bool:
        return name in self._where

    def raw(self, name: str) -> torch.Tensor:
        handle, key = self._where[name]
        return handle.get_tensor(key)

    def get(self, name: str) -> torch.Tensor:
        tensor = self.raw(name)
        scale_name = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else None
        if scale_name is None or not self.has(scale_name):
            return tensor.float()
        scale = self.raw(scale_name).float()
        if tensor.dtype in (torch.int8, torch.uint8):  # FP4 e2m1, two values a byte
            packed = tensor.view(torch.uint8).to(torch.int64)
            values = _FP4_E2M1[torch.stack([packed & 0xF, packed >> 4], dim=-1)].flatten(-2)
            return (values.unflatten(-1, (-1, 32)) * scale.unsqueeze(-1)).flatten(-2)
        values = tensor.float()
        block_rows = 1 if name.endswith("engram.embed.weight") else 32
        rows, cols = values.shape
        expanded = scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(32, 1)[:, :cols]
        return values * expanded


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------


def _source(ids: list[int], layer: int) -> int:
    """DI hugging_face/config.py `_source_map`: the nearest source not later than `layer`; a layer
    before the first source is its own."""
    earlier = [s for s in ids if s <= layer]
    return max(earlier) if earlier else layer


@dataclass
class _Config:
    text: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.text[name]
        except KeyError:
            raise AttributeError(name) from None

    @property
    def n_layers(self) -> int:
        return self.text["num_hidden_layers"]

    @property
    def ratios(self) -> list[int]:
        return list(self.text["compress_ratios"][: self.n_layers])

    @property
    def n_prefill_layer(self) -> int:
        """DI `_n_prefill_layer`: the first ratio-1 layer (the number of layers if none)."""
        return next((i for i, r in enumerate(self.ratios) if r == 1), self.n_layers)

    def kv_source(self, layer: int) -> int:
        return _source(self.text["kv_source_layer_ids"], layer)

    def index_source(self, layer: int) -> int:
        return _source(self.text["index_source_layer_ids"], layer)

    def index_k_source(self, layer: int) -> int:
        return _source(self.text.get("index_k_source_layer_ids", self.text["kv_source_layer_ids"]), layer)

    @property
    def candidate_source(self) -> int | None:
        source = self.text.get("candidate_source_layer_id")
        return None if source is None or source < 0 else source


def _read_config(model_dir: Path) -> _Config:
    raw = json.loads((model_dir / "config.json").read_text())
    text = {**raw.get("text_config", raw), "image_token_id": raw.get("image_token_id")}
    assert text.get("model_type", raw.get("model_type")) == "deepseek_v41", "not a deepseek_v41 config"
    for key in ("hc_shifted", "hc_pre_from_prev_sublayer"):
        assert text.get(key, True), f"{key}=false: only shifted hyper-connections are implemented"
    assert not text.get("q_head_norm", False), "q_head_norm: V4.1 has no per-head q norm"
    return _Config(text)


# ---------------------------------------------------------------------------------------------
# The forward pass
# ---------------------------------------------------------------------------------------------


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.T


class _Forward:
    def __init__(
        self, model_dir: Path, token_ids: list[int], keep_tokens: int, image_embeds: torch.Tensor | None = None
    ) -> None:
        self.up = _upstream()
        self.model_dir = model_dir
        self.cfg = _read_config(model_dir)
        self.w = _Weights(model_dir)
        self.ids = torch.tensor(token_ids, dtype=torch.int64)
        self.image = self.ids >= int(self.cfg.text["vocab_size"])
        self.image_embeds = image_embeds
        assert int(self.image.sum()) == (0 if image_embeds is None else image_embeds.shape[0])
        # SGLang's reading of an image position: the image token's id
        self.image_token_id = int(self.cfg.text.get("image_token_id") or 0)
        self.model_ids = self.ids.masked_fill(self.image, self.image_token_id)
        self.T = len(token_ids)
        assert self.T > 0 and keep_tokens >= 0
        self.eps = float(self.cfg.rms_norm_eps)
        # DeepInfer's compact truncation: rows below rect_lo skip the consumer layers
        self.rect_lo = max(0, self.T - keep_tokens) if keep_tokens > 0 else 0
        self.attention = _attention_reference(int(self.cfg.head_dim))
        self._freqs: dict[bool, torch.Tensor] = {}

    # -- small pieces ------------------------------------------------------------------------

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return self.up.norm_ref(x, self.w.get(name), self.eps)

    def freqs(self, ratio: int) -> torch.Tensor:
        """Complex RoPE table [T, rope_dim / 2]: rope_theta for ratio 0, compress_rope_theta with
        YaRN (if rope_scaling) for compressed layers (SG deepseek_v4.py:1169-1198)."""
        cfg = self.cfg
        scaling = cfg.text.get("rope_scaling") or {}
        compressed = ratio > 0
        if compressed in self._freqs:
            return self._freqs[compressed]
        self._freqs[compressed] = self.up.rope.precompute_freqs_cis(
            int(cfg.qk_rope_head_dim),
            self.T,
            int(scaling["original_max_position_embeddings"]) if compressed and scaling else 0,
            float(cfg.compress_rope_theta if compressed else cfg.rope_theta),
            float(scaling.get("factor", 1.0)),
            scaling.get("beta_fast", 32),
            scaling.get("beta_slow", 1),
        )
        return self._freqs[compressed]

    def rope(self, x: torch.Tensor, positions: torch.Tensor, ratio: int, inverse: bool = False) -> torch.Tensor:
        return self.up.sparse.rope_tail(
            x, self.freqs(ratio)[positions], int(self.cfg.qk_rope_head_dim), inverse=inverse
        )

    def mix(self, residual: torch.Tensor, prefix: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre, post, comb) of one hyper-connection from its input residual."""
        fn = self.w.get(f"{prefix}_fn")
        # written here: SG deepseek_v4_mhc.py `_mix_stats_impl`, CPU branch
        x_flat = residual.flatten(1).float()
        rsqrt = torch.rsqrt(x_flat.square().mean(-1, keepdim=True) + self.eps)
        mixes = (F.linear(x_flat, fn) * rsqrt).unsqueeze(1)
        pre, post, comb = self.up.mhc_test.hc_split_sinkhorn_torch(
            mixes,
            self.w.get(f"{prefix}_scale"),
            self.w.get(f"{prefix}_base"),
            int(self.cfg.hc_mult),
            int(self.cfg.hc_sinkhorn_iters),
            float(self.cfg.hc_eps),
        )
        return pre.squeeze(1), post.squeeze(1), comb.squeeze(1)

    @staticmethod
    def collapse(residual: torch.Tensor, pre: torch.Tensor | None) -> torch.Tensor:
        """The previous sublayer's `pre` applied to this residual; stream 0 for the first one."""
        if pre is None:
            return residual[:, 0, :]
        return (pre.unsqueeze(-1) * residual.float()).sum(dim=1)

    # -- Engram ------------------------------------------------------------------------------

    def engram_hash_ids(self) -> torch.Tensor | None:
        """[T, n_engram_layers, (N - 1) * heads] table rows, or None without Engram."""
        cfg = self.cfg
        layer_ids = list(cfg.text.get("engram_layer_ids") or [])
        if not layer_ids:
            return None
        n = int(cfg.engram_max_ngram_size)
        heads = int(cfg.engram_n_heads)
        vocab = _compressed_vocabulary(self.up.CompressedVocabulary, str(self.model_dir / "tokenizer.json"))
        expected = cfg.text.get("engram_compressed_vocab_size")
        assert not expected or expected == len(vocab), f"compressed vocabulary {len(vocab)} != config {expected}"
        layout = self.up.EngramLayout.from_cfg(
            types.SimpleNamespace(
                engram_max_ngram_size=n,
                engram_layer_ids=layer_ids,
                vocab_size=[int(cfg.engram_vocab_size)] * (n - 1),
                n_head_per_ngram=[heads] * (n - 1),
                n_embed_per_ngram=[heads * int(cfg.engram_head_dim)] * (n - 1),
            )
        )
        primes = torch.tensor([layout.layer_vocab_sizes[lid] for lid in layer_ids], dtype=torch.int64)
        flat = primes.flatten(1)
        offsets = torch.cumsum(flat, dim=1) - flat  # exclusive cumsum (SG EngramHasher.__init__)
        multipliers = self.up.engram.compute_hash_multipliers(tuple(layer_ids), n, len(vocab))
        token_map = torch.tensor(vocab.old2new, dtype=torch.int64)
        # written here: the extend-mode window of SG `_torch_hash_ids` (column s = token s back)
        t = torch.arange(self.T)
        shifts = torch.arange(n)
        window = (t.unsqueeze(-1) - shifts).clamp_min(0)
        tokens = self.model_ids[window]
        blocked = t.unsqueeze(-1) < shifts
        # SG `hash_windows`: once a look-back hits an image, every older predecessor is PAD
        blocked = (blocked | (tokens == self.image_token_id)).to(torch.int32).cummax(-1).values.bool()
        pad = int(token_map[int(cfg.text.get("engram_pad_token_id", 2))])
        self.engram_rows = {lid: int(primes[i].sum()) for i, lid in enumerate(layer_ids)}
        self.engram_index = {lid: i for i, lid in enumerate(layer_ids)}
        return self.up.engram.compute_engram_hash_ids(tokens, blocked, pad, token_map, multipliers, primes, offsets)

    def engram(self, layer: int, residual: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        p = f"layers.{layer}.engram."
        table = self.w.get(p + "embed.weight")
        assert table.shape[0] >= self.engram_rows[layer], "Engram table has fewer rows than its primes add up to"
        hash_rows = self.hash_ids[rows, self.engram_index[layer]]  # [n, (N-1)*heads]
        emb = table[hash_rows]  # [n, (N-1)*heads, De]
        kv = _linear(emb.flatten(-2), self.w.get(p + "wkv.weight"))
        return self.up.engram.engram_gate(
            residual,
            kv,
            self.w.get(p + "q_weight"),
            self.w.get(p + "k_weight"),
            self.eps,
            1e-6,
            input_ids=self.model_ids[rows],
            image_token_id=self.image_token_id,
        )

    # -- attention ---------------------------------------------------------------------------

    def compressed_kv(self, layer: int, hidden: torch.Tensor, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pre-RoPE entries, RoPE'd entries) [T // r, D] of a KV-source layer, from all T rows."""
        a = f"layers.{layer}.attn.compressor."
        latent = _linear(hidden, self.w.get(a + "wkv.weight"))
        n_c = self.T // ratio
        if ratio == 1:
            pooled = latent
        else:
            score = _linear(hidden, self.w.get(a + "wgate.weight"))
            dim = latent.shape[1]
            state = torch.zeros(1, ratio, 2, dim)  # one sequence, no earlier chunk
            i32 = functools.partial(torch.tensor, dtype=torch.int32)
            pooled = self.up.compress_prefill_ref(
                score,
                latent,
                state,
                i32([0]),
                torch.zeros(n_c, dtype=torch.int32),
                i32([0, self.T]),
                i32([0, self.T]),
                i32([0, n_c]),
                ratio,
            )
        pre_rope = self.norm(pooled, a + "norm.weight")
        positions = torch.arange(n_c) * ratio
        return pre_rope, self.rope(pre_rope, positions, ratio)

    def index_keys(self, layer: int, pre_rope: torch.Tensor, ratio: int) -> torch.Tensor:
        a = f"layers.{layer}.attn.indexer."
        k = self.norm(_linear(pre_rope, self.w.get(a + "wk.weight")), a + "k_norm.weight")
        return self.rope(k, torch.arange(pre_rope.shape[0]) * ratio, ratio)

    def index_scores(
        self, layer: int, x: torch.Tensor, q_lora: torch.Tensor, keys: torch.Tensor, pos: torch.Tensor, ratio: int
    ) -> torch.Tensor:
        """[n, T // r] index logits, -inf at entries the row cannot see yet."""
        cfg = self.cfg
        a = f"layers.{layer}.attn.indexer."
        q = _linear(q_lora, self.w.get(a + "wq_b.weight")).view(
            x.shape[0], int(cfg.index_n_heads), int(cfg.index_head_dim)
        )
        q = self.rope(q, pos, ratio)
        weights = _linear(x, self.w.get(a + "weights_proj.weight"))  # unscaled, as DeepInfer
        scores = self.up.sparse.DeepseekV41Indexer.scores(None, q, keys, weights)
        klen = (pos + 1) // ratio
        return scores.masked_fill(torch.arange(keys.shape[0]) >= klen.unsqueeze(1), -torch.inf)

    @staticmethod
    def dense_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
        top = _stable_topk(scores, min(k, scores.shape[1]))
        picked = top.indices.masked_fill(top.values == -torch.inf, -1)
        return F.pad(picked, (0, k - picked.shape[1]), value=-1)

    def candidate_blocks(self, scores: torch.Tensor, klen: torch.Tensor) -> torch.Tensor:
        """[n, topk_blocks] int32 block ids of the candidate source, ascending, -1 padded (DI
        `_topk_candidate_block`: top-k of the block maxima within the valid blocks, sorted ids)."""
        cfg = self.cfg
        topk_blocks = int(cfg.candidate_topk_blocks)
        block_size = int(cfg.candidate_block_size)
        if scores.shape[1] == 0:  # no compressed entry yet (T < ratio)
            return torch.full((scores.shape[0], topk_blocks), -1, dtype=torch.int32)
        block_scores, valid_blocks = self.up.candidate_block_max_ref(
            scores.contiguous(), klen.to(torch.int32), block_size
        )
        n_blocks = block_scores.shape[1]
        block_scores = block_scores.masked_fill(torch.arange(n_blocks) >= valid_blocks.unsqueeze(1), -torch.inf)
        top = _stable_topk(block_scores, min(topk_blocks, n_blocks))
        ids = top.indices.masked_fill(top.values == -torch.inf, n_blocks)  # invalid sort last
        ids = ids.sort(dim=1).values
        ids = ids.masked_fill(ids == n_blocks, -1).to(torch.int32)
        return F.pad(ids, (0, topk_blocks - ids.shape[1]), value=-1)

    def topk_among_candidates(
        self, scores: torch.Tensor, klen: torch.Tensor, blocks: torch.Tensor, block_size: int, k: int
    ) -> torch.Tensor:
        """Top-k of a consumer index layer inside the source's candidate blocks: compact logits
        (slot c = block blocks[c // bs], offset c % bs), DI compact lengths, DI restore."""
        compact_lens = self.up.get_candidate_compact_lens_ref(blocks, klen.to(torch.int32), block_size)
        width = blocks.shape[1] * block_size
        slots = torch.arange(width)
        positions = (
            blocks.to(torch.int64).gather(1, (slots // block_size).expand(blocks.shape[0], -1)) * block_size
            + slots % block_size
        )
        compact = scores.gather(1, positions.clamp(0, scores.shape[1] - 1))
        compact = compact.masked_fill(slots >= compact_lens.unsqueeze(1), -torch.inf)
        picked = self.dense_topk(compact, k).to(torch.int32).contiguous()
        self.up.restore_candidate_indices_inplace_ref(picked, blocks, block_size)
        return picked.to(torch.int64)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        pos: torch.Tensor,
        swa_kv: torch.Tensor,
        floor: int,
        extra_kv: torch.Tensor | None,
        extra_idx: torch.Tensor | None,
    ) -> torch.Tensor:
        """SG's combined reference over SWA keys [max(p - W + 1, floor), p] and the chosen compressed
        entries, through a duck-typed fixture (single request, token location = 1 + position)."""
        window = int(self.cfg.sliding_window)
        n = q.shape[0]
        offsets = torch.arange(window)
        key_pos = pos.unsqueeze(1) - window + 1 + offsets  # ascending window
        lo = torch.clamp(pos - window + 1, min=floor)
        valid = (key_pos >= lo.unsqueeze(1)) & (key_pos <= pos.unsqueeze(1))
        swa_locs = torch.where(valid, 1 + key_pos, -1)
        # valid keys first, so the first `length` columns hold them
        order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
        swa_locs = swa_locs.gather(1, order)
        swa_lens = valid.sum(1)
        if extra_kv is not None:
            extra = extra_idx
            extra_lens = torch.full((n,), extra.shape[1])
        else:
            extra, extra_lens = None, None

        metadata = types.SimpleNamespace(
            swa_page_indices=swa_locs,
            swa_topk_lengths=swa_lens,
            sparse_page_indices=lambda ratio: extra,
            sparse_topk_lengths=lambda ratio: extra_lens,
        )
        fixture = types.SimpleNamespace(
            # 128: a ratio the reference reads extra keys for, without seeding C4 indices
            case=types.SimpleNamespace(compress_ratio=128 if extra_kv is not None else 0),
            _current_batch=None,
            forward_batch=None,
            backend=types.SimpleNamespace(
                init_forward_metadata=lambda batch: None,
                forward_metadata=types.SimpleNamespace(core_metadata=metadata),
            ),
            runner=types.SimpleNamespace(
                req_to_token_pool=types.SimpleNamespace(req_to_token=torch.empty(1, self.T + 1))
            ),
            _swa_bf16_k_per_req=[swa_kv],
            _extra_bf16_k=extra_kv,
            actual_module=types.SimpleNamespace(attn_sink=self.w.get(f"layers.{layer}.attn.attn_sink")),
        )
        return self.attention(fixture, q)

    def attention_layer(self, layer: int, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        ratio = self.cfg.ratios[layer]
        a = f"layers.{layer}.attn."
        n = x.shape[0]
        n_heads, head_dim = int(cfg.num_attention_heads), int(cfg.head_dim)
        q_lora = self.norm(_linear(x, self.w.get(a + "wq_a.weight")), a + "q_norm.weight")
        q = _linear(q_lora, self.w.get(a + "wq_b.weight")).view(n, n_heads, head_dim)
        q = self.rope(q, pos, ratio)
        kv = self.rope(self.norm(_linear(x, self.w.get(a + "wkv.weight")), a + "kv_norm.weight"), pos, ratio)
        swa_kv = torch.zeros(self.T, head_dim)
        swa_kv[pos] = kv
        consumer = layer >= cfg.n_prefill_layer
        floor = self.rect_lo if consumer else 0

        extra_kv = extra_idx = None
        if ratio > 0:
            kv_source = cfg.kv_source(layer)
            assert not consumer or kv_source >= cfg.n_prefill_layer, "share-KV must not cross the YOCO boundary"
            if kv_source == layer:
                # YOCO consumer KV sources project from the shared hidden, for every row
                hidden = self.shared_hidden if consumer else x
                assert hidden.shape[0] == self.T
                self.pre_rope[layer], self.ckv[layer] = self.compressed_kv(layer, hidden, ratio)
            assert cfg.ratios[kv_source] == ratio, "a share-KV consumer must have its source's ratio"
            extra_kv = self.ckv[kv_source]
            index_k_source = cfg.index_k_source(layer)
            if index_k_source == layer and self.w.has(a + "indexer.wk.weight"):
                # index keys from the pre-RoPE entries of this layer's KV source
                self.index_k[layer] = self.index_keys(layer, self.pre_rope[kv_source], ratio)
            if cfg.index_source(layer) == layer:
                scores = self.index_scores(layer, x, q_lora, self.index_k[index_k_source], pos, ratio)
                klen = (pos + 1) // ratio
                k = int(cfg.index_topk)
                source = cfg.candidate_source
                if source is not None and source < layer:
                    assert cfg.ratios[source] == ratio, "candidate consumers must have the source's ratio"
                    block_size = int(cfg.candidate_block_size) * cfg.ratios[source] // ratio
                    self.topk = self.topk_among_candidates(scores, klen, self.blocks, block_size, k)
                else:
                    self.topk = self.dense_topk(scores, k)
                if source == layer:
                    self.blocks = self.candidate_blocks(scores, klen)
            extra_idx = self.topk
            assert extra_idx is not None and extra_idx.shape[0] == n

        o = self.attend(layer, q, pos, swa_kv, floor, extra_kv, extra_idx)
        o = self.rope(o, pos, ratio, inverse=True)
        groups = int(cfg.o_groups)
        wo_a = self.w.get(a + "wo_a.weight")
        z = self.up.wo_a._apply_wo_a_bf16_matmul(
            o.reshape(n, groups, -1), wo_a.view(groups, int(cfg.o_lora_rank), -1), False
        )
        return _linear(z.flatten(1), self.w.get(a + "wo_b.weight"))

    # -- MoE ---------------------------------------------------------------------------------

    def moe(self, layer: int, x: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        f = f"layers.{layer}.ffn."
        limit = float(cfg.text["swiglu_limit"]) if cfg.text.get("swiglu_limit") else None
        logits = _linear(x, self.w.get(f + "gate.weight"))
        k = int(cfg.num_experts_per_tok)
        weights = torch.empty(x.shape[0], k)
        ids = torch.empty(x.shape[0], k, dtype=torch.int32)
        for kind, bias in ((~image, "gate.bias"), (image, "gate.bias_vl")):
            if kind.any():
                weights[kind], ids[kind] = self.up.biased_topk_impl(
                    x[kind],
                    logits[kind],
                    self.w.get(f + bias),
                    k,
                    bool(cfg.text.get("norm_topk_prob", True)),
                    scoring_func=cfg.text.get("scoring_func", "sqrtsoftplus"),
                    routed_scaling_factor=float(cfg.routed_scaling_factor),
                    apply_routed_scaling_factor_on_output=True,
                )
        w = self.w

        class _Experts:
            def __init__(self, parts: tuple[str, ...]) -> None:
                self.parts = parts

            def __getitem__(self, e: int) -> torch.Tensor:
                return torch.cat([w.get(f"{f}experts.{int(e)}.{part}.weight") for part in self.parts], dim=0)

        moe_layer = types.SimpleNamespace(
            num_experts=int(cfg.n_routed_experts), w13_weight=_Experts(("w1", "w3")), w2_weight=_Experts(("w2",))
        )
        runner = types.SimpleNamespace(
            apply_router_weight_on_input=False, activation="silu", gemm1_alpha=None, gemm1_clamp_limit=None
        )
        routed = _moe_forward_native(limit)(moe_layer, x, (weights, ids, None), runner)
        shared = x.new_zeros(x.shape)
        for s in range(int(cfg.text.get("n_shared_experts", 1) or 0)):
            # one HF module holds the shared expert(s): `shared_experts.w1/w2/w3`
            assert s == 0
            g = _linear(x, w.get(f + "shared_experts.w1.weight"))
            u = _linear(x, w.get(f + "shared_experts.w3.weight"))
            shared = _linear(self.up.clamped_swiglu(g, u, limit), w.get(f + "shared_experts.w2.weight"))
        return routed + shared

    # -- the model ---------------------------------------------------------------------------

    def run(self) -> torch.Tensor:
        cfg = self.cfg
        self.hash_ids = self.engram_hash_ids()
        self.pre_rope: dict[int, torch.Tensor] = {}
        self.ckv: dict[int, torch.Tensor] = {}
        self.index_k: dict[int, torch.Tensor] = {}
        self.topk: torch.Tensor | None = None
        self.blocks: torch.Tensor | None = None
        self.shared_hidden: torch.Tensor | None = None

        rows = torch.arange(self.T)  # the query rows still running, by position
        embed = self.w.get("embed.weight")[self.ids.masked_fill(self.image, 0)]
        if self.image_embeds is not None:  # DI's reference, the image positions marked -1
            marked = self.ids.masked_fill(self.image, -1).to(torch.int32)
            none = torch.zeros(0, dtype=torch.int32)
            self.up.replace_input_embeds_ref(embed, marked, self.image_embeds.float(), -1, none, embed[:0])
        residual = self.up.mhc.hc_broadcast(embed, int(cfg.hc_mult))
        pre: torch.Tensor | None = None
        for layer in range(cfg.n_layers):
            p = f"layers.{layer}."
            if self.hash_ids is not None and layer in self.engram_index:
                assert layer < cfg.n_prefill_layer, "Engram layers must precede the YOCO consumers"
                residual = self.engram(layer, residual, rows)
            pre_a, post_a, comb_a = self.mix(residual, p + "hc_attn")
            x = self.norm(self.collapse(residual, pre), p + "attn_norm.weight")
            if layer == cfg.n_prefill_layer:
                self.shared_hidden = x  # every row: no row is dropped before this layer
                if self.rect_lo > 0:
                    keep = rows >= self.rect_lo
                    rows, residual, x = rows[keep], residual[keep], x[keep]
                    pre_a, post_a, comb_a = pre_a[keep], post_a[keep], comb_a[keep]
                    if self.topk is not None:
                        self.topk = self.topk[keep]
                    if self.blocks is not None:
                        self.blocks = self.blocks[keep]
            y = self.attention_layer(layer, x, rows)
            residual = self.up.mhc._mhc_post_torch(y, residual, post_a.unsqueeze(-1), comb_a)
            pre_f, post_f, comb_f = self.mix(residual, p + "hc_ffn")
            x = self.norm(self.collapse(residual, pre_a), p + "ffn_norm.weight")
            y = self.moe(layer, x, self.image[rows])
            residual = self.up.mhc._mhc_post_torch(y, residual, post_f.unsqueeze(-1), comb_f)
            pre = pre_f
        h = self.norm(self.collapse(residual, pre), "norm.weight")
        head = self.w.get("head.weight")
        logits = torch.full((self.T, head.shape[0]), torch.nan)
        logits[rows] = _linear(h, head)
        return logits


@torch.no_grad()
@functools.cache
def _compressed_vocabulary(build: Any, tokenizer_file: str) -> Any:
    """DeepInfer's compressed vocabulary of a tokenizer, built once (it decodes every token id)."""
    return build(tokenizer_file)


def reference_logits(
    model_dir: Path, token_ids: list[int], keep_tokens: int = 0, image_embeds: torch.Tensor | None = None
) -> torch.Tensor:
    """Logits [T, vocab] (fp32) of DeepSeek-V4.1 at `model_dir` for one prompt, run whole, no cache.
    `keep_tokens` > 0: DeepInfer's compact YOCO prefill truncation keeping the last `keep_tokens`
    rows through the consumer layers; the other rows are NaN. `image_embeds`: the rows of the
    prompt's image positions (ids at or above the vocabulary's size), in order."""
    return _Forward(Path(model_dir), list(token_ids), keep_tokens, image_embeds).run()
