"""`python -m engine serve --model smollm2 --dtype float32 --port 8100`.

The two bearer secrets come from the environment (ENGINE_SERVING_SECRET,
ENGINE_ADMIN_SECRET; see engine.config.EngineSecrets), never from the arguments, and so does
the name of the agent it serves for (ENGINE_AGENT_NAME), which GET /identity answers.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from types import FrameType

import torch
import uvicorn

from contracts.capacity import BUILTIN_KV_CACHE_MB
from contracts.logs import logging_configure
from contracts.tracing import tracing_configure
from engine.config import (
    ADMIN_SECRET_VARIABLE,
    AGENT_NAME_VARIABLE,
    ATTENTION_BACKENDS,
    DTYPES,
    MAX_SPECULATIVE_TOKENS,
    SERVING_SECRET_VARIABLE,
    SPECULATIVE_MODES,
    EngineConfig,
    EngineSecrets,
)
from engine.models import decode_attention
from engine.models.layers import cpu_has_native_bf16
from engine.server import EngineApp

logger = logging.getLogger("engine")


def default_dtype() -> str:
    # On CUDA and on CPUs with native bf16 dot products (avx512_bf16, AMX) bf16 GEMMs run
    # ~4x faster than fp32, and bf16 answers the reference prompts right (on an H200 only
    # with the logits kept in fp32: Linear.forward_fp32). On other x86
    # CPUs where the kernel library builds (AVX2), bf16 weights still win: batches compute
    # on an fp32 copy, as fast as float32, and decode steps of a few rows run in the step
    # kernel on the bf16 weights (SmolLM2, 2-core AVX2 VM: 60-74 tok/s against 14).
    if torch.cuda.is_available() or cpu_has_native_bf16():
        return "bfloat16"
    return "bfloat16" if decode_attention.has_decode_step() else "float32"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model over the OpenAI-compatible HTTP API")
    serve.add_argument(
        "--model",
        required=True,
        help="smollm2, minilm, a .gguf file or a HF folder (a BERT one serves embeddings only)",
    )
    serve.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="how weights are stored; default: bfloat16 where it is fastest (CUDA, CPUs with"
        " native bf16, x86 CPUs where the engine's kernels build), else float32",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8100)
    serve.add_argument("--served-model-name", default="")
    serve.add_argument("--threads", type=int, default=0, help="torch compute threads (0: default)")
    serve.add_argument("--max-model-len", type=int, default=0, help="0: min(4096, model's)")
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--num-blocks", type=int, default=0)
    serve.add_argument("--kv-cache-memory-mb", type=int, default=BUILTIN_KV_CACHE_MB)
    serve.add_argument("--max-num-seqs", type=int, default=64)
    serve.add_argument("--max-num-batched-tokens", type=int, default=512)
    serve.add_argument("--max-queue", type=int, default=256)
    serve.add_argument("--no-prefix-caching", action="store_true")
    serve.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run decode steps op by op instead of replaying CUDA graphs",
    )
    serve.add_argument(
        "--speculative",
        choices=SPECULATIVE_MODES,
        default="auto",
        help="n-gram speculative decoding for greedy requests: auto (default) drafts where the"
        " step costs and acceptance measured while serving say it is faster; off never",
    )
    serve.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=8,
        help=f"most drafts per request and step (1..{MAX_SPECULATIVE_TOKENS})",
    )
    serve.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        default="auto",
        help="auto (default): the Triton paged attention kernel on CUDA where Triton imports,"
        " else PyTorch ops; triton: that kernel (CUDA only); torch: PyTorch ops",
    )
    serve.add_argument("--fault-latency-ms", type=float, default=0.0)
    serve.add_argument("--fault-error-rate", type=float, default=0.0)
    serve.add_argument("--device", default="", help="cpu or cuda (default: cuda when present)")
    serve.add_argument(
        "--log-level",
        default=os.environ.get("LOG_LEVEL", "info").lower(),
        choices=["critical", "error", "warning", "info", "debug"],
        help="default: LOG_LEVEL, else info; LOG_FORMAT chooses json (default) or text lines",
    )
    return parser


class DrainingServer(uvicorn.Server):
    """SIGTERM drains (refuse new, finish in-flight, exit 0); a second signal exits at once."""

    def __init__(self, config: uvicorn.Config, app: EngineApp):
        super().__init__(config)
        self.engine_app = app
        app.on_drained = self._drained
        app.on_failed = self._drained

    def _drained(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.engine_app.state != "draining" and self.started:
            loop = self._loop
            if loop is not None:
                loop.call_soon_threadsafe(self.engine_app.drain)
                return
        super().handle_exit(sig, frame)

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        import asyncio

        self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        await super().serve(sockets)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        logging_configure(level=args.log_level)
    except ValueError as error:
        print(f"engine: error: {error}", file=sys.stderr)
        return 2
    from engine.loader import is_embedding_folder

    embedding_only = args.model == "minilm" or is_embedding_folder(args.model)
    try:
        if not 0 < args.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {args.port}")
        tracing_configure("engine")
        secrets = EngineSecrets.from_environment(os.environ)
        if args.device and args.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {args.device!r}")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device cuda requested but CUDA is not available")
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype or default_dtype(),
            served_model_name=args.served_model_name
            or ("all-MiniLM-L6-v2" if embedding_only else args.model),
            device=args.device,
            threads=args.threads,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_cache_memory_mb=args.kv_cache_memory_mb,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_queue=args.max_queue,
            enable_prefix_caching=not args.no_prefix_caching,
            enforce_eager=args.enforce_eager,
            speculative=args.speculative,
            num_speculative_tokens=args.num_speculative_tokens,
            attention_backend=args.attention_backend,
            fault_latency_ms=args.fault_latency_ms,
            fault_error_rate=args.fault_error_rate,
        )
        if not embedding_only:
            from engine.loader import resolve_model_path

            resolve_model_path(args.model)
    except (ValueError, FileNotFoundError) as error:
        logger.error("engine: error: %s", error)
        return 2
    # Read once; nothing this process starts needs them.
    os.environ.pop(SERVING_SECRET_VARIABLE, None)
    os.environ.pop(ADMIN_SECRET_VARIABLE, None)
    agent_name = os.environ.pop(AGENT_NAME_VARIABLE, "")
    if config.threads:
        torch.set_num_threads(config.threads)
        torch.set_num_interop_threads(1)
    app = EngineApp(config, secrets=secrets, embedding_only=embedding_only, agent_name=agent_name)
    uvicorn_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, lifespan="on",
        access_log=args.log_level == "debug", timeout_graceful_shutdown=5,
        log_config=None,  # uvicorn's lines go through logging_configure's handler
    )  # fmt: skip
    server = DrainingServer(uvicorn_config, app)
    try:
        server.run()
    except KeyboardInterrupt:
        return 130
    if app.state == "failed":
        logger.error("engine: error: %s", app.load_error)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
