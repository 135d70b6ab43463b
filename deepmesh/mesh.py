"""Every worker of the mesh in one process, over one bus.

The embedded default (`deepmesh serve`) and the end-to-end tests use this; in distributed
mode each worker runs in its own process (and any number of replicas) over Kafka. The
engine workers (prefill and decode) take turns on one thread, the thread that loaded the
model at best (see common.worker.run_workers); the tokenizer has a thread of its own.
"""

from __future__ import annotations

import threading
from pathlib import Path

from cache_svc.maintenance import MaintenanceThread
from cache_svc.store import StateStore
from common.bus import Bus
from common.replicas import ReplicaTable, ReportListener
from common.retention import Retention
from common.topics import create_all
from common.worker import Worker, run_workers
from decode_svc.worker import DecodeWorker
from encoder_svc.worker import EncoderWorker
from engine import LLMEngine, load_vision_encoder
from prefill_svc.worker import PrefillWorker
from tokenizer_svc.images import ImagePolicy
from tokenizer_svc.protocol import Codec
from tokenizer_svc.worker import TokenizerWorker


class Mesh:
    def __init__(
        self,
        model_path: str | Path,
        bus: Bus,
        store: StateStore,
        served_model: str = "deepmesh-tiny",
        topic_prefix: str = "deepmesh.",
        partitions: int = 4,
        retention: Retention | None = None,
        anchor_interval: int = 1024,
        maintenance_seconds: float = 2.0,
        compile_decode: bool = False,
        compile_prefill: bool = False,
        default_thinking: bool = False,
        speculation: dict | None = None,
        image_policy: ImagePolicy | None = None,
        **engine_options,
    ):
        model_path = Path(model_path)
        self.bus = bus
        create_all(bus, topic_prefix, partitions)
        # one copy of the weights, loaded by the decode engine first so that its graphs compile
        # before the prefill engine's pieces (engine/compiled_prefill.py); decode never starts from a
        # prefix, so it keeps none resident; only the decode engine runs decode steps (prefill
        # samples one token per request), and only it speculates
        decode_options = {
            **engine_options,
            "resident_prefix_bytes": 0,
            "compile_decode": compile_decode,
            **(speculation or {}),
        }
        decode_engine = LLMEngine.from_pretrained(model_path, **decode_options)
        prefill_options = {"grammars": decode_engine.grammars, **engine_options, "compile_prefill": compile_prefill}
        prefill_engine = LLMEngine(decode_engine.model, weights=decode_engine.weights, **prefill_options)
        codec = Codec.for_model(model_path, served_model, default_thinking, image_policy)
        self.store = store
        self.maintenance_seconds = maintenance_seconds
        self.stopping = threading.Event()
        # the load reports every router here (and the gateway's admission control) reads
        self.replicas = ReplicaTable()
        self.listener = ReportListener(bus, topic_prefix, self.replicas, self.stopping)
        self._threads: list[threading.Thread] = []
        self.tokenizer = TokenizerWorker(bus, topic_prefix, codec, self.replicas)
        self.prefill = PrefillWorker(
            bus,
            topic_prefix,
            prefill_engine,
            store,
            retention=retention,
            anchor_interval=anchor_interval,
            replicas=self.replicas,
        )
        self.decode = DecodeWorker(bus, topic_prefix, decode_engine, store, retention=retention, replicas=self.replicas)
        self.workers: list[Worker] = [self.tokenizer, self.prefill, self.decode]
        # a model that reads images (V4.1 with a vision tower): its encoder, the stage before prefill
        self.encoder: EncoderWorker | None = None
        vision = load_vision_encoder(model_path, dtype=prefill_engine.model.lm_head.weight.dtype)
        if vision is not None:
            weights = prefill_engine.weights
            self.encoder = EncoderWorker(bus, topic_prefix, vision, store, weights, retention, self.replicas)
            self.workers.append(self.encoder)

    @property
    def engine_workers(self) -> list[Worker]:
        """The workers that run PyTorch: they take turns on one thread."""
        return [w for w in (self.encoder, self.prefill, self.decode) if w is not None]

    def start(self, workers: list[Worker] | None = None) -> Mesh:
        """Run the workers (by default all of them) on background threads, engine workers on one
        thread, the cache's maintenance tasks on another, and the reader of the replicas' load
        reports (which the routers go by) on a third."""
        workers = workers if workers is not None else self.workers
        if self.listener.ident is None:  # started once, by the first start()
            self.listener.start()
            self._threads.append(self.listener)
        maintenance = MaintenanceThread(self.store, self.maintenance_seconds, self.stopping)
        maintenance.start()
        self._threads.append(maintenance)
        engines = [w for w in workers if w in self.engine_workers]
        groups = [[w] for w in workers if w not in engines] + ([engines] if engines else [])
        for group in groups:
            name = "+".join(w.group for w in group)
            args = (group, self.stopping, [self.tokenizer] if group is engines else None)
            thread = threading.Thread(target=run_workers, args=args, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def run_engines(self, until: threading.Event | None = None) -> None:
        """Run prefill and decode on the calling thread until stop() (or `until` is set): `deepmesh
        serve` gives them its main thread, which loaded the model, so no second thread runs PyTorch."""
        run_workers(self.engine_workers, until or self.stopping, also_urgent=[self.tokenizer])

    def stop(self) -> None:
        """Stop every worker, then write what only memory holds down to the cache's disk tiers:
        a restart finds every entry the catalog lists."""
        self.stopping.set()
        for thread in self._threads:
            thread.join(timeout=30)
        self._threads.clear()
        self.store.flush()
