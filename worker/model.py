"""A small GPT-style decoder whose attention reads K/V from a paged block pool (PyTorch).

Architecture (Llama-like, pre-norm): token embedding -> ``num_layers`` x [RMSNorm -> grouped-query
attention with rotary position embeddings -> residual, RMSNorm -> SwiGLU MLP -> residual] ->
RMSNorm -> LM head (tied to the embedding unless ``tie_embeddings`` is false). Weights are random
(``torch.manual_seed``-style, from ``seed``) or loaded from a local safetensors file.

The K/V of every token lives in a :class:`KVPool`, a tensor of shape
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (2 = K, V; K is stored after
the rotary embedding). Block ``b`` of the pool is block id ``b`` of :class:`worker.kvcache.
PrefixCache`, so a request's ``Allocation.block_ids`` is its block table: token position ``p``
lives at ``pool[block_ids[p // block_size], :, :, p % block_size]``.

:meth:`Transformer.forward_chunk` runs the positions ``[start, start + len(tokens))`` of one
sequence: it computes Q/K/V for those positions only, writes K/V into the pool (positions
``>= write_from``; earlier ones are already there), then attends over all positions
``[0, start + len(tokens))`` read back from the pool. A prefix-cache hit therefore skips the whole
computation of the cached positions; decode is the same call with one token.

``--kv-dtype int8`` stores the pool as int8 with one float32 scale per (block, layer, K/V, head):
``scale = max|x| / 127`` over the block's filled slots, ``q = round(x / scale)``. Appending to a
partially filled block re-derives the scale from the dequantized old slots plus the new ones; the
scale only changes when the new values are larger, and re-quantizing with an unchanged scale is
lossless.
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker.engines.base import EngineUnavailableError
from worker.settings import KV_DTYPES

_TORCH_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
)


class ModelLoadError(EngineUnavailableError):
    """A model config or weights file cannot be used."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 50257
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 0
    """SwiGLU width; 0 means ``8/3 * hidden_size`` rounded up to a multiple of 64."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads"):
            if getattr(self, name) < 1:
                raise ModelLoadError(f"model config: {name} must be >= 1")
        if self.hidden_size % self.num_heads:
            raise ModelLoadError("model config: hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError("model config: num_heads must be a multiple of num_kv_heads")
        if self.head_dim % 2:
            raise ModelLoadError("model config: head_dim must be even (rotary embedding)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn_size(self) -> int:
        if self.intermediate_size:
            return self.intermediate_size
        return -(-(8 * self.hidden_size // 3) // 64) * 64

    def kv_bytes_per_token(self, kv_dtype: str, block_size: int = 16) -> float:
        """KV cache bytes one token takes (int8 includes its share of the per-block scales)."""
        elements = self.num_layers * 2 * self.num_kv_heads * self.head_dim
        if kv_dtype == "int8":
            return elements + self.num_layers * 2 * self.num_kv_heads * 4 / block_size
        return elements * (4 if kv_dtype in ("auto", "float32") else 2)

    @classmethod
    def from_mapping(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ModelLoadError(f"model config: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**data)

    @classmethod
    def load(cls, spec: str) -> ModelConfig:
        """A preset name (see :data:`PRESETS`) or the path of a JSON file with these fields."""
        if spec in PRESETS:
            return PRESETS[spec]
        path = Path(spec)
        if not path.is_file():
            raise ModelLoadError(
                f"model config {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a file"
            )
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot read model config {spec!r}: {exc}") from exc
        if not isinstance(data, dict):
            raise ModelLoadError(f"model config {spec!r} must be a JSON object")
        return cls.from_mapping(data)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


PRESETS: Mapping[str, ModelConfig] = MappingProxyType({
    # Unit tests: a few milliseconds per forward pass.
    "tiny": ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                        num_kv_heads=2),
    # Default of the worker: small enough for a laptop, big enough that prefill is real work.
    "small": ModelConfig(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4),
    # CPU benchmark: ~45M parameters (19M of them outside the embedding).
    "bench": ModelConfig(hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4),
    # GPU benchmark (bf16): ~0.9B parameters.
    "gpu": ModelConfig(hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=4),
})


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * scale * self.weight


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.attn_norm = RMSNorm(d, cfg.norm_eps)
        self.wq = nn.Linear(d, cfg.num_heads * hd, bias=False)
        self.wk = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.wv = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.mlp_norm = RMSNorm(d, cfg.norm_eps)
        self.w_gate = nn.Linear(d, cfg.ffn_size, bias=False)
        self.w_up = nn.Linear(d, cfg.ffn_size, bias=False)
        self.w_down = nn.Linear(cfg.ffn_size, d, bias=False)

    def mlp(self, x: Tensor) -> Tensor:
        h = self.mlp_norm(x)
        out: Tensor = self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))
        return out


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding (half-split convention) of ``x`` [T, heads, head_dim]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class KVPool:
    """The paged K/V store: ``data[num_blocks, layers, 2, block_size, kv_heads, head_dim]``.

    ``dtype`` is ``float32``/``bfloat16``/``float16`` (stored as is) or ``int8`` (with
    ``scales[num_blocks, layers, 2, kv_heads]``; see the module docstring). Not thread-safe: the
    engine runs one forward pass at a time.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        cfg: ModelConfig,
        *,
        dtype: str,
        compute_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if dtype not in KV_DTYPES or dtype == "auto":
            raise ValueError(f"kv dtype must be one of {KV_DTYPES[1:]}, got {dtype!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_dtype = dtype
        self.compute_dtype = compute_dtype
        self.device = device
        shape = (num_blocks, cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)
        storage = torch.int8 if dtype == "int8" else _TORCH_DTYPES[dtype]
        # empty, not zeros: pages are only touched when a block is first written.
        self.data = torch.empty(shape, dtype=storage, device=device)
        self.scales: Tensor | None = None
        if dtype == "int8":
            self.scales = torch.ones(
                (num_blocks, cfg.num_layers, 2, cfg.num_kv_heads), dtype=torch.float32,
                device=device,
            )

    @property
    def nbytes(self) -> int:
        extra = self.scales.numel() * 4 if self.scales is not None else 0
        return int(self.data.numel() * self.data.element_size() + extra)

    @property
    def bytes_per_token(self) -> float:
        return self.nbytes / (self.num_blocks * self.block_size)

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: str) -> float:
        return cfg.kv_bytes_per_token(dtype, block_size) * block_size

    def write(self, layer: int, table: Tensor, start: int, k: Tensor, v: Tensor) -> None:
        """Store K and V ([T, kv_heads, head_dim]) of positions ``start .. start + T - 1``."""
        n = k.shape[0]
        if n == 0:
            return
        bs = self.block_size
        if self.scales is None:
            pos = torch.arange(start, start + n, device=self.device)
            blocks = table[pos // bs]
            slots = pos % bs
            self.data[blocks, layer, 0, slots] = k.to(self.data.dtype)
            self.data[blocks, layer, 1, slots] = v.to(self.data.dtype)
            return
        first, last = start // bs, (start + n - 1) // bs
        blocks = table[first : last + 1]
        offset = start - first * bs
        for kind, x in ((0, k), (1, v)):
            buf = torch.zeros(
                (last - first + 1) * bs, *x.shape[1:], dtype=torch.float32, device=self.device
            )
            if offset:
                head = self.data[blocks[0], layer, kind, :offset].to(torch.float32)
                buf[:offset] = head * self.scales[blocks[0], layer, kind][None, :, None]
            buf[offset : offset + n] = x.to(torch.float32)
            grid = buf.view(last - first + 1, bs, *x.shape[1:])  # [blocks, slots, heads, dim]
            amax = grid.abs().amax(dim=(1, 3))  # [blocks, heads]
            scale = torch.clamp(amax / 127.0, min=1e-12)
            q = torch.round(grid / scale[:, None, :, None]).clamp_(-127, 127).to(torch.int8)
            self.data[blocks, layer, kind] = q
            self.scales[blocks, layer, kind] = scale

    def read(self, layer: int, table: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """K and V of positions ``0 .. length - 1``, each [length, kv_heads, head_dim]."""
        nb = -(-length // self.block_size)
        blocks = table[:nb]
        raw = self.data[blocks, layer]  # [nb, 2, bs, heads, dim]
        if self.scales is None:
            kv = raw.to(self.compute_dtype)
        else:
            scale = self.scales[blocks, layer]  # [nb, 2, heads]
            kv = (raw.to(torch.float32) * scale[:, :, None, :, None]).to(self.compute_dtype)
        k = kv[:, 0].reshape(nb * self.block_size, *kv.shape[-2:])[:length]
        v = kv[:, 1].reshape(nb * self.block_size, *kv.shape[-2:])[:length]
        return k, v


class Transformer(nn.Module):
    """The decoder (see module docstring). Inference only: call under ``torch.inference_mode``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head: nn.Linear | None = None
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim))
        self.inv_freq: Tensor
        self.register_buffer("inv_freq", inv, persistent=False)

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int) -> Transformer:
        """Deterministic random weights: normal(0, ``init_std``), norms at 1."""
        model = cls(cfg)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.fill_(1.0)
                else:
                    param.copy_(torch.randn(param.shape, generator=gen) * cfg.init_std)
        return model

    @classmethod
    def from_safetensors(cls, cfg: ModelConfig, path: str) -> Transformer:
        """Weights from a local safetensors file (needs the optional ``safetensors`` package).

        Tensor names are this module's ``state_dict`` keys (``embed.weight``,
        ``blocks.0.wq.weight``, ...); see :meth:`save_safetensors`.
        """
        st = _safetensors_torch(path)
        try:
            state: dict[str, Tensor] = st.load_file(path)
        except Exception as exc:  # the library raises its own exception types
            raise ModelLoadError(f"cannot read weights {path!r}: {exc}") from exc
        model = cls(cfg)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ModelLoadError(
                f"weights {path!r} do not match the config: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        return model

    def save_safetensors(self, path: str) -> None:
        st = _safetensors_torch(path)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        st.save_file(state, path)

    def num_params(self) -> int:
        return int(sum(p.numel() for p in self.parameters()))

    def logits(self, h: Tensor) -> Tensor:
        h = self.norm(h)
        weight = self.lm_head.weight if self.lm_head is not None else self.embed.weight
        return h @ weight.T

    def forward_chunk(
        self,
        tokens: Tensor,
        start: int,
        table: Tensor,
        pool: KVPool,
        *,
        write_from: int | None = None,
        all_logits: bool = False,
    ) -> Tensor:
        """Run positions ``[start, start + T)`` (``tokens``: [T] int64) against the pool.

        K/V of positions ``>= write_from`` (default ``start``) are written into the blocks of
        ``table`` first; positions before ``start`` must already be there. Returns the logits
        of the last position ([vocab], float32), or of every position when ``all_logits``.
        """
        n = tokens.shape[0]
        total = start + n
        write_from = start if write_from is None else write_from
        cfg = self.cfg
        hd = cfg.head_dim
        group = cfg.num_heads // cfg.num_kv_heads
        x = self.embed(tokens)
        pos = torch.arange(start, total, device=tokens.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        cos = freqs.cos()[:, None, :].to(x.dtype)
        sin = freqs.sin()[:, None, :].to(x.dtype)
        mask: Tensor | None = None
        causal = start == 0
        if not causal and n > 1:
            key_pos = torch.arange(total, device=tokens.device)
            mask = key_pos[None, :] <= (start + torch.arange(n, device=tokens.device))[:, None]
        scale = 1.0 / math.sqrt(hd)
        for layer, blk in enumerate(self.blocks):
            assert isinstance(blk, Block)
            h = blk.attn_norm(x)
            q = _rotate(blk.wq(h).view(n, cfg.num_heads, hd), cos, sin)
            k = _rotate(blk.wk(h).view(n, cfg.num_kv_heads, hd), cos, sin)
            v = blk.wv(h).view(n, cfg.num_kv_heads, hd)
            skip = write_from - start
            pool.write(layer, table, write_from, k[skip:], v[skip:])
            keys, values = pool.read(layer, table, total)  # [total, kv_heads, hd]
            keys = keys.transpose(0, 1).repeat_interleave(group, dim=0)
            values = values.transpose(0, 1).repeat_interleave(group, dim=0)
            # Batched (4-D) inputs: the fused kernels (flash, memory-efficient) take only
            # those; 3-D ones fall back to the math kernel, which materializes n x total.
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                is_causal=causal and n > 1, scale=scale,
            )[0]  # [heads, n, hd]
            x = x + blk.wo(attn.transpose(0, 1).reshape(n, cfg.num_heads * hd))
            x = x + blk.mlp(x)
        if all_logits:
            return self.logits(x).float()
        return self.logits(x[-1]).float()


def _safetensors_torch(path: str) -> Any:
    try:
        return importlib.import_module("safetensors.torch")
    except ImportError as exc:
        raise ModelLoadError(
            f"loading weights from {path!r} needs the optional 'safetensors' package "
            "(pip install safetensors); without weights the model is random-initialized "
            "from --model-seed"
        ) from exc


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


def pick_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
