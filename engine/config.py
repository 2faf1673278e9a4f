"""Configuration: the model's shape and the engine's limits, validated on construction."""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

from contracts.capacity import BUILTIN_KV_CACHE_MB

DTYPES = ("float32", "bfloat16", "int8")
SPECULATIVE_MODES = ("auto", "off")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
MAX_SPECULATIVE_TOKENS = 32

# The environment variables an engine reads its two secrets from (never argv: other users
# of the host can read a process's arguments).
SERVING_SECRET_VARIABLE = "ENGINE_SERVING_SECRET"  # noqa: S105 - a variable's name
ADMIN_SECRET_VARIABLE = "ENGINE_ADMIN_SECRET"  # noqa: S105 - a variable's name
SECRET_VARIABLES = (SERVING_SECRET_VARIABLE, ADMIN_SECRET_VARIABLE)
# The agent the engine serves for: it answers it, with a proof, on GET /identity.
AGENT_NAME_VARIABLE = "ENGINE_AGENT_NAME"
# Visible ASCII without spaces: it travels in an HTTP header. 32 characters at least.
SECRET_PATTERN = re.compile(r"^[!-~]{32,256}$")


@dataclass(slots=True)
class LlamaConfig:
    """Shape of a Llama-family decoder, read from GGUF metadata or a HF config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a positive multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be positive and even, got {self.head_dim}")


@dataclass(slots=True)
class EngineConfig:
    """Everything `python -m engine serve` can set; defaults suit one CPU socket."""

    model: str
    dtype: str = "float32"
    served_model_name: str = ""
    device: str = "cpu"
    threads: int = 0  # 0: leave torch's default
    max_model_len: int = 0  # 0: min(4096, the model's context length)
    block_size: int = 16
    num_blocks: int = 0  # 0: derive from kv_cache_memory_mb
    kv_cache_memory_mb: int = BUILTIN_KV_CACHE_MB  # the capacity model counts this pool
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_queue: int = 256
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # on CUDA: no decode graphs (engine/cuda_graphs.py)
    fault_latency_ms: float = 0.0
    fault_error_rate: float = 0.0
    embedding_batch_size: int = 32
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # n-gram speculative decoding (engine/speculative.py): "auto" drafts where it measures
    # faster, "off" never; at most this many drafts per request and step
    speculative: str = "auto"
    num_speculative_tokens: int = 8
    # attention: "triton" (engine/models/paged_attention.py, CUDA only), "torch" (PyTorch
    # ops and the CPU kernels), "auto": triton on CUDA where Triton imports, else torch
    attention_backend: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        positive = (
            "block_size",
            "kv_cache_memory_mb",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_queue",
            "embedding_batch_size",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.speculative not in SPECULATIVE_MODES:
            raise ValueError(
                f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, "
                f"got {self.speculative!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {self.num_blocks}")
        if self.block_size > 256:
            raise ValueError(f"block_size must be <= 256, got {self.block_size}")
        validate_faults(self.fault_latency_ms, self.fault_error_rate)
        if not self.served_model_name:
            self.served_model_name = self.model


def validate_faults(latency_ms_per_token: float, error_rate: float) -> None:
    """Shared by the flags and the admin endpoint so both refuse the same values."""
    if not latency_ms_per_token >= 0:
        raise ValueError(f"latency_ms_per_token must be >= 0, got {latency_ms_per_token}")
    if not 0 <= error_rate <= 1:
        raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")


@dataclass(slots=True, frozen=True)
class EngineSecrets:
    """The bearer secrets an engine requires: `serving` opens /v1/*, /health and /metrics
    (the gateway, the agent, evaluations), `admin` opens /admin/* (the agent only)."""

    serving: str
    admin: str

    def __post_init__(self) -> None:
        for name, variable in (
            ("serving", SERVING_SECRET_VARIABLE),
            ("admin", ADMIN_SECRET_VARIABLE),
        ):
            if not SECRET_PATTERN.fullmatch(getattr(self, name)):
                raise ValueError(
                    f"{variable} must be 32-256 visible ASCII characters without spaces"
                )
        if self.serving == self.admin:
            raise ValueError(f"{SERVING_SECRET_VARIABLE} and {ADMIN_SECRET_VARIABLE} must differ")

    def __repr__(self) -> str:  # never print a secret by accident
        return "EngineSecrets(serving=***, admin=***)"

    @classmethod
    def from_environment(cls, environment: Mapping[str, str]) -> EngineSecrets:
        missing = [
            name
            for name in (SERVING_SECRET_VARIABLE, ADMIN_SECRET_VARIABLE)
            if not environment.get(name)
        ]
        if missing:
            raise ValueError(
                f"{' and '.join(missing)} not set: the engine requires a serving and an admin "
                "secret in its environment (the agent sets both from its load command)"
            )
        return cls(
            serving=environment[SERVING_SECRET_VARIABLE], admin=environment[ADMIN_SECRET_VARIABLE]
        )

    @classmethod
    def generate(cls) -> EngineSecrets:
        """A fresh random pair, for an engine started by hand (benchmarks, tests)."""
        return cls(serving=secrets.token_hex(32), admin=secrets.token_hex(32))

    def environment(self) -> dict[str, str]:
        """The variables that pass these secrets to an engine process."""
        return {SERVING_SECRET_VARIABLE: self.serving, ADMIN_SECRET_VARIABLE: self.admin}
