"""The `deepmesh` command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from deepmesh import __version__


def _observe(service: str) -> None:
    """JSON logs and tracing for a serving process, as DEEPMESH_LOG_* and DEEPMESH_TRACE_* say."""
    from common.logs import setup_logging
    from common.settings import Settings
    from common.tracing import setup_tracing

    settings = Settings()
    setup_logging(service, settings.log_level, settings.log_format)
    setup_tracing(service, settings.trace_exporter, settings.trace_file)


def set_engine_threads() -> None:
    """Torch's intra-op threads in a process that runs an engine, as DEEPMESH_TORCH_THREADS says
    (common/settings.py: by default one less than this process's cores, unless OMP_NUM_THREADS
    says otherwise)."""
    from common.settings import Settings

    threads = Settings().torch_threads or (None if "OMP_NUM_THREADS" in os.environ else engine_thread_default())
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def engine_thread_default() -> int:
    """One less than the cores this process may run on, at least one."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepmesh", description="DeepSeek-V4 serving stack")
    parser.add_argument("--version", action="version", version=f"deepmesh {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    make = commands.add_parser(
        "make-model", help="write a deterministic random-weight DeepSeek-V4 (or, with a -v41 preset, V4.1) checkpoint"
    )
    make.add_argument("outdir", type=Path)
    make.add_argument("--preset", choices=["tiny", "small", "tiny-v41", "tiny-v41-dspark", "small-v41"], default="tiny")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument(
        "--format",
        choices=["transformers", "deepseek"],
        default="transformers",
        help="tensor names: transformers' module names, or DeepSeek's as published (with MTP modules)",
    )
    make.add_argument(
        "--quant",
        choices=["none", "fp8", "fp8-fp4"],
        default="none",
        help="fp8: block-scaled FP8 projections and experts; fp8-fp4: FP4 routed experts (both: the rest bf16)",
    )
    make.add_argument("--scale-fmt", choices=["ue8m0", "float"], default="ue8m0", help="FP8/FP4 scale format")
    make.add_argument("--shards", type=int, default=1, help="safetensors files (more than 1: with an index)")
    make.add_argument(
        "--train-drafter",
        type=int,
        default=0,
        metavar="STEPS",
        help="train the MTP module (--format deepseek), or a V4.1 preset's DSpark stages, on the model's own "
        "greedy outputs for STEPS steps, so that speculative decoding accepts its drafts (the tiny preset's "
        "MTP: 100 steps took 669 s on 2 cores, its 129,280-token output projection most of it)",
    )
    make.set_defaults(run=_make_model)

    inspect = commands.add_parser("inspect", help="what a checkpoint holds and whether this engine can serve it")
    inspect.add_argument("path", type=Path)
    inspect.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the checkpoint's)")
    inspect.set_defaults(run=_inspect)

    gen = commands.add_parser("generate", help="generate text from a prompt with the engine")
    gen.add_argument("--model", type=Path, required=True, help="Hugging Face checkpoint directory")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: the checkpoint's)")
    _compile_flag(gen)
    gen.set_defaults(run=_generate)

    serve = commands.add_parser("serve", help="every service in one process: the embedded default")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model", type=Path, default=None, help="checkpoint (default: a tiny model made on first use)")
    serve.add_argument("--served-model-name", default="deepmesh-tiny")
    serve.add_argument(
        "--default-thinking",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reason before answering when a request does not say (default: no; DEEPMESH_DEFAULT_THINKING)",
    )
    _compile_flag(serve)
    _speculative_flags(serve)
    serve.set_defaults(run=_serve)

    # distributed mode: one service per process, configured from DEEPMESH_* (common/settings.py)
    for name, helptext in (
        ("gateway", "the HTTP gateway"),
        ("tokenizer", "the tokenizer worker"),
        ("encoder", "an image encoder worker (a V4.1 checkpoint with a vision tower)"),
        ("prefill", "a prefill worker"),
        ("decode", "a decode worker"),
        ("cache", "the cache service"),
    ):
        service = commands.add_parser(name, help=f"{helptext}, over Kafka (distributed mode)")
        service.add_argument("--model", type=Path, default=None, help="checkpoint (default: DEEPMESH_MODEL)")
        if name in ("gateway", "cache"):
            service.add_argument("--host", default="127.0.0.1")
            service.add_argument("--port", type=int, default=8000 if name == "gateway" else 8100)
        else:
            service.add_argument("--metrics-port", type=int, default=None, help="/metrics port (DEEPMESH_METRICS_PORT)")
        if name in ("prefill", "decode"):
            _compile_flag(service)
        if name == "decode":
            _speculative_flags(service)
        if name == "cache":
            service.add_argument(
                "action", nargs="?", choices=["serve", "stats"], default="serve", help="stats: print the cache's state"
            )
            service.add_argument("--dir", type=Path, default=None, help="T2 directory (default: DEEPMESH_CACHE_DIR)")
            service.add_argument(
                "--url", default=None, help="stats of this cache service (default: DEEPMESH_CACHE_URL)"
            )
        service.set_defaults(run=_service)

    replicas = commands.add_parser("replicas", help="the live table of prefill and decode replicas and their load")
    replicas.add_argument("--watch", action="store_true", help="print it again every second until interrupted")
    replicas.add_argument("--seconds", type=float, default=2.0, help="how long to listen for reports (default 2)")
    replicas.set_defaults(run=_replicas)

    keys = commands.add_parser("keys", help="API keys (in DEEPMESH_DATABASE_URL): create, list, revoke")
    key_actions = keys.add_subparsers(dest="action", required=True)
    create = key_actions.add_parser("create", help="a new key for a tenant; its secret is printed once")
    create.add_argument("--tenant", required=True)
    create.add_argument("--rpm", type=int, default=None, help="requests per minute (default: no limit)")
    create.add_argument("--tpm", type=int, default=None, help="tokens per minute, input + output (default: no limit)")
    key_actions.add_parser("list", help="every key: id, tenant, limits, created, revoked")
    revoke = key_actions.add_parser("revoke", help="revoke a key by its id (key_...)")
    revoke.add_argument("key_id")
    keys.set_defaults(run=_keys)

    usage = commands.add_parser("usage", help="usage of every tenant per model, day and priority (a table)")
    usage.add_argument("--start", default=None, help="first day, YYYY-MM-DD (default: today, UTC)")
    usage.add_argument("--end", default=None, help="last day, YYYY-MM-DD (default: today, UTC)")
    usage.set_defaults(run=_usage)

    show = commands.add_parser("trace", help="print a job's trace as a span tree, from the JSON-lines trace file")
    show.add_argument("job_id")
    show.add_argument("--file", type=Path, default=None, help="trace file (default: DEEPMESH_TRACE_FILE)")
    show.set_defaults(run=_trace)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("serve", "gateway", "tokenizer", "encoder", "prefill", "decode", "cache"):
        _observe(args.command)
    if args.command in ("serve", "encoder", "prefill", "decode"):
        set_engine_threads()
    try:
        code = args.run(args)
    except ValueError as err:  # EngineError and friends: a clear message, not a traceback
        print(f"deepmesh: error: {err}", file=sys.stderr)
        code = 2
    _exit_at_once_if_compiling(code)
    return code


def _exit_at_once_if_compiling(code: int) -> None:
    """The command is done (a server drained, the cache written down): a decode graph still compiling
    in the background has nothing left to serve. Left to the interpreter's exit, it would be waited
    for (engine/compiled_decode.py: the C++ runtime aborts a process that exits under the compiler),
    up to a minute; end the process now instead, once traces and logs are written."""
    compiled_decode = sys.modules.get("engine.compiled_decode")
    if compiled_decode is None or not compiled_decode.compiling_anywhere():
        return
    from opentelemetry import trace

    shutdown = getattr(trace.get_tracer_provider(), "shutdown", None)
    if shutdown is not None:
        shutdown()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _make_model(args: argparse.Namespace) -> int:
    from engine.checkpoint.make_model import make_model

    v41 = "-v41" in args.preset
    if args.train_drafter and (not (v41 or args.format == "deepseek") or args.quant != "none" or args.shards != 1):
        raise ValueError("--train-drafter needs --format deepseek (or a V4.1 preset), no --quant and one shard")
    path = make_model(
        args.outdir,
        args.preset,
        args.seed,
        layout=args.format,
        quant=args.quant,
        scale_fmt=args.scale_fmt,
        shards=args.shards,
    )
    if args.train_drafter and v41:
        from engine.checkpoint.train_dspark import train_checkpoint_dspark

        before, after = train_checkpoint_dspark(path, args.train_drafter, seed=args.seed)
        print(
            f"DSpark: first draft right {before[0]:.1%} before training, {after[0]:.1%} after; "
            f"drafts a block gets accepted {before[1]:.2f} -> {after[1]:.2f}",
            file=sys.stderr,
        )
    elif args.train_drafter:
        from engine.checkpoint.train_drafter import train_checkpoint_drafter

        before, after = train_checkpoint_drafter(path, args.train_drafter, seed=args.seed)
        print(f"drafter: first draft right {before:.1%} before training, {after:.1%} after", file=sys.stderr)
    print(path)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from engine.checkpoint.inspect_checkpoint import inspect_checkpoint, render

    report = inspect_checkpoint(args.path, dtype=args.dtype)
    print(render(report))
    return 0 if report.servable else 1


def _trace(args: argparse.Namespace) -> int:
    from common.settings import Settings
    from common.tracing import format_tree, job_trace, read_spans

    path = args.file or Path(Settings().trace_file)
    if not path.is_file():
        raise ValueError(f"no trace file at {path} (see DEEPMESH_TRACE_FILE and DEEPMESH_TRACE_EXPORTER=jsonl)")
    spans = job_trace(read_spans(path), args.job_id)
    if not spans:
        raise ValueError(f"no spans of job {args.job_id} in {path}")
    print(format_tree(spans))
    return 0


def _compile_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="decode steps as compiled graphs, and prefill steps as compiled pieces, warmed up at start "
        "(default: DEEPMESH_COMPILE_DECODE and DEEPMESH_COMPILE_PREFILL, on); --no-compile runs both eager",
    )


def _speculative_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative",
        choices=["auto", "off", "mtp", "dspark"],
        default=None,
        help="draft tokens and verify them in one decode step: mtp (V4's multi-token-prediction module), "
        "dspark (V4.1's draft model), auto (where the checkpoint has a drafter and its drafts pay), off "
        "(default: DEEPMESH_SPECULATIVE, auto)",
    )
    parser.add_argument(
        "--speculative-tokens", type=int, default=None, help="tokens drafted a step (DEEPMESH_SPECULATIVE_TOKENS, 3)"
    )


def _speculation(args: argparse.Namespace, settings) -> dict:
    """The decode engine's speculation options, from the flags or else the settings."""
    tokens = settings.speculative_tokens if args.speculative_tokens is None else args.speculative_tokens
    return {
        "speculative": args.speculative or settings.speculative,
        "speculative_tokens": tokens,
        "speculative_max_batch": settings.speculative_max_batch,
        "speculative_min_confidence": settings.speculative_min_confidence,
    }


def text_prompt_ids(model: Path, text: str) -> list[int]:
    """A text prompt's token ids as POST /v1/completions takes it (its checkpoint's tokenizer, a BOS
    token first where its tokenizer_config.json says add_bos_token)."""
    from tokenizer_svc.conversion import ProtocolError
    from tokenizer_svc.protocol import Codec

    codec = Codec.for_model(model, "deepmesh")
    try:
        return codec.completions.prompt_ids(codec.completions.request({"model": "deepmesh", "prompt": text}))
    except ProtocolError as err:  # an empty prompt: the endpoint's message, as a usage error
        raise ValueError(json.loads(err.body)["error"]["message"]) from None


def _compile_prefill(args: argparse.Namespace, settings) -> bool:
    """Whether prefill steps run as compiled pieces; they compile after the decode graphs."""
    compile_prefill = settings.compile_prefill if args.compile is None else args.compile
    if compile_prefill:
        logging.getLogger("engine.compiled_prefill").setLevel(logging.INFO)
        print(
            "compiling the prefill step's pieces in the background (after any decode graphs), "
            "one set per token bucket; prompts are prefilled eager until a step's buckets are ready",
            file=sys.stderr,
        )
    return compile_prefill


def _compile_decode(args: argparse.Namespace, settings) -> bool:
    """Whether decode steps run compiled; when they do, says on stderr what happens meanwhile and
    lets the compiler's one line per graph through whatever the log level."""
    compile_decode = settings.compile_decode if args.compile is None else args.compile
    if compile_decode:
        logging.getLogger("engine.compiled_decode").setLevel(logging.INFO)
        print(
            "compiling the decode step in the background, one graph per batch size (minutes the first time; "
            "later starts load them from .cache/torchinductor); "
            "requests are answered meanwhile, eager; --no-compile: no graphs",
            file=sys.stderr,
        )
    return compile_decode


def _serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    import uvicorn

    from cache_svc.store import StateStore
    from common.bus import MemoryBus
    from common.claims import ClaimStore
    from common.retention import Retention
    from common.settings import Settings
    from deepmesh.mesh import Mesh
    from engine.checkpoint.make_model import make_model
    from gateway.app import create_app
    from gateway.jobs import JobStore
    from tokenizer_svc.images import ImagePolicy

    model = args.model
    if model is None:
        model = Path(".cache/models/tiny")
        if not (model / "config.json").is_file():
            print(f"making a tiny random-weight model in {model}", file=sys.stderr)
            make_model(model, "tiny", seed=0)
    settings = Settings()
    bus = MemoryBus(claims=ClaimStore.from_settings(settings))  # the same claim checks as over Kafka
    mesh = Mesh(
        model,
        bus,
        StateStore.from_settings(settings),
        served_model=args.served_model_name,
        retention=Retention.from_settings(settings),
        anchor_interval=settings.cache_anchor_interval,
        maintenance_seconds=settings.cache_maintenance_seconds,
        resident_prefix_bytes=settings.resident_prefix_bytes,
        compile_decode=_compile_decode(args, settings),
        compile_prefill=_compile_prefill(args, settings),
        speculation=_speculation(args, settings),
        default_thinking=settings.default_thinking if args.default_thinking is None else args.default_thinking,
        image_policy=ImagePolicy.from_settings(settings),
    )
    mesh.start([mesh.tokenizer])
    app = create_app(
        bus,
        "deepmesh.",
        [args.served_model_name],
        JobStore(settings.database_url),
        max_model_len=_context_length(model),
        cache_stats=mesh.store.stats,
        replicas=mesh.replicas,
        admission_wait_seconds=settings.admission_wait_seconds,
        files_dir=settings.files_dir,
        batch_rounds=settings.batch_round_seconds,
        batch_in_flight=settings.batch_in_flight,
        require_keys=_keys_required(settings, args.host),
        responses_keep_seconds=settings.responses_keep_seconds,
    )
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=settings.drain_seconds
    )
    server = uvicorn.Server(config)
    http_done = threading.Event()

    def serve_http() -> None:
        try:
            server.run()
        finally:
            http_done.set()

    http = threading.Thread(target=serve_http, name="http", daemon=True)
    http.start()
    while not server.started:
        if not http.is_alive():
            raise ValueError(f"could not serve on {args.host}:{args.port}")
        time.sleep(0.05)
    print(f"deepmesh serving {args.served_model_name} on http://{args.host}:{args.port}/v1", file=sys.stderr)
    # SIGTERM drains: no new connections, the engines keep running for the answers in flight
    # (for up to drain_seconds), then the workers stop and write-behind reaches the disk.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: setattr(server, "should_exit", True))
    try:
        # on this thread, which loaded the model: the only one stepping the engines (the decode graphs
        # compile on a thread of their own)
        mesh.run_engines(until=http_done)
    finally:
        server.should_exit = True
        http.join(timeout=settings.drain_seconds + 5)
        mesh.stop()
    return 0


def _keys_required(settings, host: str) -> bool:
    """API keys are required when the gateway listens beyond this machine, or when set so."""
    import ipaddress

    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    return settings.require_keys or not loopback


# How long a stopping service may take beyond its drain. With the broker or the database away,
# closing waits out kafka-python's and the connection pool's own timeouts: a gateway stopped beside
# a frozen broker took 57 s to exit, prefill and decode beside a stopped stack 25 s, where an
# orchestrator sends SIGKILL after 10 (Docker) or 30 (Kubernetes). Nothing is lost by not waiting:
# what a process had not committed, the next owner of its partitions does again.
STOP_GRACE_SECONDS = 5.0


def _exit_if_stopping_takes(seconds: float, name: str) -> None:
    """From now on, exit after `seconds`, whatever the process is still waiting for, and say what
    that was: every thread's stack (a broker, a database or a cache service that does not answer
    shows in the frames that wait for it)."""
    import faulthandler
    import threading

    def exit_now() -> None:
        print(
            f"deepmesh {name}: still stopping after {seconds:g} s: exiting now; what it had not committed "
            "is done again by the next owner of its work. Where its threads were:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(1)

    timer = threading.Timer(seconds, exit_now)
    timer.daemon = True
    timer.start()


def _serve_http(app: Any, host: str, port: int, drain_seconds: float, name: str) -> None:
    """uvicorn, stopping within its drain and STOP_GRACE_SECONDS of the first SIGTERM or SIGINT."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            if not self.should_exit:
                _exit_if_stopping_takes(drain_seconds + STOP_GRACE_SECONDS, name)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=drain_seconds)
    Server(config).run()


def _service(args: argparse.Namespace) -> int:
    import signal
    import threading

    import uvicorn

    from common.bus import KafkaBus
    from common.claims import ClaimStore
    from common.settings import Settings
    from common.topics import create_all

    settings = Settings()
    model = args.model or Path(settings.model)
    if args.command == "cache" and args.action == "stats":
        return _cache_stats(args.url or settings.cache_url)
    if args.command == "cache":
        from cache_svc.app import create_app as create_cache_app
        from cache_svc.store import StateStore

        if args.dir is not None:
            settings.cache_dir = str(args.dir)
        store = StateStore.from_settings(settings)
        # not bounded by STOP_GRACE_SECONDS: stopping, it writes its memory tier's pending
        # write-behind to disk, which takes as long as that is large
        uvicorn.run(
            create_cache_app(store),
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=settings.drain_seconds,
        )
        return 0
    claims = ClaimStore.from_settings(settings)
    bus = KafkaBus(
        settings.kafka_bootstrap,
        client_id=f"deepmesh-{args.command}",
        claims=claims,
        session_timeout_ms=settings.kafka_session_timeout_ms,
    )
    create_all(bus, settings.topic_prefix, settings.topic_partitions)
    if args.command == "gateway":
        from gateway.app import create_app
        from gateway.jobs import JobStore
        from gateway.quotas import RedisQuotas

        app = create_app(
            bus,
            settings.topic_prefix,
            [settings.served_model_name],
            JobStore(settings.database_url),
            max_model_len=_context_length(args.model or Path(settings.model)),
            replicas=_replica_table(bus, settings.topic_prefix),
            admission_wait_seconds=settings.admission_wait_seconds,
            files_dir=settings.files_dir,
            require_keys=_keys_required(settings, args.host),
            quotas=RedisQuotas(settings.redis_url, settings.topic_prefix),
            responses_keep_seconds=settings.responses_keep_seconds,
        )
        print(f"deepmesh gateway on http://{args.host}:{args.port}/v1", file=sys.stderr)
        _serve_http(app, args.host, args.port, settings.drain_seconds, "gateway")
        return 0
    replicas = _replica_table(bus, settings.topic_prefix)
    compile_decode = _compile_decode(args, settings) if args.command == "decode" else False
    compile_prefill = _compile_prefill(args, settings) if args.command == "prefill" else False
    speculation = _speculation(args, settings) if args.command == "decode" else {}
    compiling = {"compile_decode": compile_decode, "compile_prefill": compile_prefill}
    worker = _make_worker(args.command, bus, settings, model, replicas, compiling, speculation)
    metrics_port = args.metrics_port if args.metrics_port is not None else settings.metrics_port
    if metrics_port:
        from prometheus_client import start_http_server

        start_http_server(metrics_port, addr=settings.metrics_host)
    stop = threading.Event()

    def stopping(*_: Any) -> None:
        if not stop.is_set():  # a worker does not drain: what it had not committed is done again
            _exit_if_stopping_takes(STOP_GRACE_SECONDS, args.command)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stopping)
    print(f"deepmesh {args.command} worker running", file=sys.stderr)
    worker.run(stop)
    bus.close()
    return 0


def _keys(args: argparse.Namespace) -> int:
    from common.api import TENANT_PATTERN
    from common.settings import Settings
    from gateway.jobs import JobStore
    from gateway.keys import KeyStore

    store = KeyStore(JobStore(Settings().database_url).session)
    if args.action == "create":
        if not TENANT_PATTERN.fullmatch(args.tenant):
            raise ValueError("the tenant is 1 to 64 letters, digits, '.', '_' or '-'")
        for name in ("rpm", "tpm"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise ValueError(f"--{name} must be at least 1")
        key, secret = store.create(args.tenant, args.rpm, args.tpm)
        print(f"created {key.id} for tenant {key.tenant}; the key (shown once, keep it):", file=sys.stderr)
        print(secret)
        return 0
    if args.action == "revoke":
        if store.revoke(args.key_id) is None:
            raise ValueError(f"no key {args.key_id}")
        print(f"revoked {args.key_id}")
        return 0
    print(f"{'id':<22} {'tenant':<24} {'rpm':>8} {'tpm':>10}  {'created (UTC)':<19}  revoked")
    for key in store.list():
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(key.created_at))
        revoked = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(key.revoked_at)) if key.revoked_at else ""
        rpm, tpm = key.rpm or "-", key.tpm or "-"
        print(f"{key.id:<22} {key.tenant:<24} {rpm:>8} {tpm:>10}  {created:<19}  {revoked}")
    return 0


def _usage(args: argparse.Namespace) -> int:
    from common.settings import Settings
    from gateway.jobs import JobStore
    from gateway.ledger import Ledger, day_of

    today = day_of(time.time())
    rows = Ledger(JobStore(Settings().database_url).session).report(args.start or today, args.end or today)
    header = f"{'tenant':<20} {'model':<20} {'day':<10} {'priority':<11} {'requests':>9} {'cached in':>11}"
    print(header + f" {'uncached in':>11} {'output':>11}")
    for r in rows:
        print(
            f"{r['tenant']:<20} {r['model']:<20} {r['day']:<10} {r['priority']:<11} {r['requests']:>9,} "
            f"{r['cached_input_tokens']:>11,} {r['uncached_input_tokens']:>11,} {r['output_tokens']:>11,}"
        )
    return 0


def _replicas(args: argparse.Namespace) -> int:
    """Listen to the replicas' load reports (DEEPMESH_KAFKA_BOOTSTRAP, DEEPMESH_TOPIC_PREFIX) and
    print one line per replica."""
    import threading

    from common.bus import KafkaBus
    from common.replicas import ReplicaTable, ReportListener
    from common.settings import Settings

    settings = Settings()
    bus = KafkaBus(settings.kafka_bootstrap, client_id="deepmesh-replicas")
    table, stop = ReplicaTable(), threading.Event()
    ReportListener(bus, settings.topic_prefix, table, stop, from_beginning=True).start()
    try:
        while True:
            stop.wait(args.seconds)
            print(format_replicas(table))
            if not args.watch:
                return 0
    except KeyboardInterrupt:
        return 0
    finally:
        stop.set()
        bus.close()


def format_replicas(table) -> str:
    """The table `deepmesh replicas` prints: a replica out of rotation says so."""
    live = {r.replica for stage in ("encoder", "prefill", "decode") for r in table.live(stage)}
    header = (
        f"{'replica':<36} {'stage':<8} {'parts':<8} {'queued':>6} {'running':>7} {'queued tok':>10} "
        f"{'free blocks':>12} {'free slots':>10} {'prefill tok/s':>13} {'step ms':>8} {'tier 0':>6}  state"
    )
    lines = [header]
    for r in table.all():
        lines.append(
            f"{r.replica:<36} {r.stage:<8} {','.join(map(str, r.partitions)) or '-':<8} {r.queued_jobs:>6} "
            f"{r.running_jobs:>7} {r.queued_tokens:>10,} {f'{r.free_blocks}/{r.total_blocks}':>12} "
            f"{f'{r.free_slots}/{r.max_slots}':>10} {r.tokens_per_second:>13,.0f} {r.step_seconds * 1000:>8.1f} "
            f"{len(r.resident):>6}  {'live' if r.replica in live else 'out of rotation'}"
        )
    if len(lines) == 1:
        lines.append("(no reports: no encoder, prefill or decode replica is running)")
    return "\n".join(lines)


def _cache_stats(url: str) -> int:
    """Tiers and entries from the cache service's /v1/stats (or an embedded gateway's
    /v1/cache/stats), then the cache's Prometheus series (hits, misses by reason, load latency,
    evictions, demotions)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    url = url.rstrip("/")
    try:
        response = httpx.get(f"{url}/v1/stats", timeout=10)
        if response.status_code == 404:  # `deepmesh serve`: the gateway serves the embedded cache's
            response = httpx.get(f"{url}/v1/cache/stats", timeout=10)
        stats = response.raise_for_status().json()
        exposition = httpx.get(f"{url}/metrics", timeout=10).raise_for_status().text
    except httpx.HTTPError as err:
        raise ValueError(f"cannot read the cache service at {url}: {err}") from err
    for kind, part in sorted(stats["catalog"].items()):
        print(f"{kind + 's':<10} {part['entries']:>10,} entries {part['bytes']:>16,} bytes")
    print(f"{'tier':<10} {'entries':>10} {'bytes':>16} {'capacity':>16} {'read MB/s':>10}")
    for tier in stats["tiers"]:
        capacity = f"{tier['capacity_bytes']:,}" if tier["capacity_bytes"] else "unbounded"
        speed = tier["read_bytes_per_second"] / 1e6
        print(f"{tier['name']:<10} {tier['entries']:>10,} {tier['bytes']:>16,} {capacity:>16} {speed:>10.0f}")
    print(f"waiting for write-behind: {stats['pending_write_behind']}")
    for family in text_string_to_metric_families(exposition):
        if not family.name.startswith(("deepmesh_cache", "deepmesh_prefix")) or family.type == "histogram":
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sample.labels.items())
            print(f"{sample.name}{{{labels}}} {sample.value:g}")
    return 0


def _replica_table(bus, topic_prefix: str):
    """The replicas' load reports, read on a thread for as long as the process runs: routers
    and the gateway's admission control go by them."""
    from common.replicas import ReplicaTable, ReportListener

    table = ReplicaTable()
    ReportListener(bus, topic_prefix, table).start()
    return table


def _context_length(model: Path) -> int | None:
    """The checkpoint's context length, for GET /v1/models (read from config.json: the gateway
    loads no engine). A V4.1 checkpoint keeps it in `text_config`, beside `vision_config`."""
    try:
        config = json.loads((model / "config.json").read_text())
        return int(config.get("max_position_embeddings") or config["text_config"]["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _make_worker(
    command: str, bus, settings, model: Path, replicas, compiling: dict | None = None, speculation: dict | None = None
):
    """The worker of a service; `compiling`: the engine's compile_decode and compile_prefill."""
    if command == "tokenizer":
        from tokenizer_svc.images import ImagePolicy
        from tokenizer_svc.protocol import Codec
        from tokenizer_svc.worker import TokenizerWorker

        codec = Codec.for_model(
            model, settings.served_model_name, settings.default_thinking, ImagePolicy.from_settings(settings)
        )
        return TokenizerWorker(bus, settings.topic_prefix, codec, replicas)
    from cache_svc.client import StateClient
    from common.retention import Retention
    from engine import LLMEngine

    if command == "encoder":
        from encoder_svc.worker import EncoderWorker
        from engine import load_vision_encoder
        from engine.checkpoint import weights_id

        vision = load_vision_encoder(model)
        if vision is None:
            raise ValueError(f"{model} has no vision tower (vision_config): it reads no images")
        store = StateClient(settings.cache_url)
        retention = Retention.from_settings(settings)
        return EncoderWorker(bus, settings.topic_prefix, vision, store, weights_id(model), retention, replicas)

    # decode never starts from a prefix, so it keeps none resident
    resident = settings.resident_prefix_bytes if command == "prefill" else 0
    engine = LLMEngine.from_pretrained(
        model, resident_prefix_bytes=resident, **(compiling or {}), **(speculation or {})
    )
    retention = Retention.from_settings(settings)
    if command == "prefill":
        from prefill_svc.worker import PrefillWorker

        return PrefillWorker(
            bus,
            settings.topic_prefix,
            engine,
            StateClient(settings.cache_url),
            retention=retention,
            anchor_interval=settings.cache_anchor_interval,
            replicas=replicas,
        )
    from decode_svc.worker import DecodeWorker

    store = StateClient(settings.cache_url)
    return DecodeWorker(bus, settings.topic_prefix, engine, store, retention=retention, replicas=replicas)


def _generate(args: argparse.Namespace) -> int:
    from tokenizers import Tokenizer
    from tqdm import tqdm

    from common.settings import Settings
    from engine import LLMEngine, SamplingParams

    tokenizer_file = args.model / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{args.model} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    prompt = text_prompt_ids(args.model, args.prompt)
    params = SamplingParams(  # checked before the model loads: a bad value is refused at once
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    compile_decode = _compile_decode(args, Settings())
    engine = LLMEngine.from_pretrained(
        args.model, device=args.device, dtype=args.dtype, max_num_seqs=1, compile_decode=compile_decode
    )
    engine.add_request("cli", prompt, params)
    tokens: list[int] = []
    printed = ""
    start = time.perf_counter()
    with tqdm(total=args.max_tokens, unit="tok", file=sys.stderr, leave=False) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
                bar.update(len(out.new_token_ids))
                bar.set_postfix(tok_per_s=f"{len(tokens) / (time.perf_counter() - start):.1f}")
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                if text.startswith(printed):  # print only the new, stable part of the text
                    sys.stdout.write(text[len(printed) :])
                    sys.stdout.flush()
                    printed = text
    elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    print(f"{len(prompt)} prompt tokens, {len(tokens)} generated, {len(tokens) / elapsed:.1f} tok/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
