"""How an engine core runs: a spawned local process (_ProcessHandle) or a Ray actor (_RayHandle, _EngineCoreActor),
behind one interface the client uses: exited(), status(), wait_exit() (blocks until the core ends; the client's
watcher thread), stop(timeout_s). Either runs the same loop, engine/core.py's run_engine_core.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import zmq

from lmserve.core.outputs import BlockMap
from lmserve.engine.admission import Admission
from lmserve.engine.core import CoreLaunch, run_engine_core
from lmserve.engine.snapshot import EngineSnapshot

logger = logging.getLogger(__name__)


_ENV_LOCK = threading.Lock()


def start_with_env(process: multiprocessing.process.BaseProcess, env: dict[str, str]) -> None:
    """Start a spawned `process` with `env` in its environment: a spawned child's OpenMP reads its environment
    before anything of ours runs, so the variables are in os.environ for the moment of the start (and restored)."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            process.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


class _ProcessHandle:
    """An engine core in a spawned process (daemonic: multiprocessing also ends it at interpreter exit)."""

    def __init__(self, launch: CoreLaunch, env: dict[str, str]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(
            target=run_engine_core, args=(launch,), name=f"lmserve-core-{launch.engine_index}", daemon=True
        )
        start_with_env(self.process, env)

    def exited(self) -> bool:
        return not self.process.is_alive()

    def status(self) -> str:
        code = self.process.exitcode
        if code is None:
            return "running"
        return f"killed by signal {-code}" if code < 0 else f"exit status {code}"

    def wait_exit(self) -> str:
        multiprocessing.connection.wait([self.process.sentinel])  # does not reap: stop() joins
        self.process.join(1.0)
        return self.status()

    def stop(self, timeout_s: float) -> None:
        self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("engine core %s did not stop in time; terminating", self.process.pid)
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)


class _RayHandle:
    """An engine core as a Ray actor (num_cpus = its threads) whose run() is the same core loop."""

    def __init__(self, launch: CoreLaunch, env: dict[str, str]) -> None:
        import ray

        env = {**env, **({"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {})}
        tp = launch.config.tensor_parallel_size
        options: dict = {}
        self.placement_group = None
        if tp > 1:  # one placement group per TP group: the core (rank 0) in bundle 0, its workers in the others
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            per_rank = max(1, launch.num_threads // tp)
            self.placement_group = placement_group([{"CPU": per_rank}] * tp, strategy="PACK")
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self.placement_group, 0)
            num_cpus = per_rank
        else:
            num_cpus = launch.num_threads
        actor_cls = ray.remote(num_cpus=num_cpus, max_restarts=0)(_EngineCoreActor)
        self.actor = actor_cls.options(name=None, runtime_env={"env_vars": env}, lifetime=None, **options).remote()
        self.ref = self.actor.run.remote(launch)
        self._status: str | None = None

    def exited(self) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def status(self) -> str:
        return self._status or "running"

    def wait_exit(self) -> str:
        import ray

        try:
            ray.get(self.ref)
            self._status = "the actor's loop returned"
        except Exception as e:  # RayActorError when the actor process died
            self._status = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return self._status

    def stop(self, timeout_s: float) -> None:
        import ray

        ready, _ = ray.wait([self.ref], timeout=timeout_s)
        if not ready:
            ray.kill(self.actor)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)


class _EngineCoreActor:
    """Ray actor body (wrapped with ray.remote at launch, so Ray stays an optional import)."""

    def run(self, launch: CoreLaunch) -> None:
        run_engine_core(launch)


@dataclass
class CoreView:
    """The client's view of one engine core."""

    index: int
    handle: Any  # _ProcessHandle | _RayHandle
    socket: zmq.Socket  # PUSH: requests to the core
    admission: Admission
    num_threads: int
    snapshot: EngineSnapshot | None = None
    block_map: BlockMap | None = None  # the latest the core sent while watched
    pid: int | None = None
    alive: bool = True
    error: str | None = None  # why it died (CoreFailed message or exit status)
    pending: dict[str, tuple[int, int]] = field(default_factory=dict)  # unacknowledged adds: seqs, blocks
    streams: set[str] = field(default_factory=set)

    def load(self) -> tuple[int, float]:
        m = self.snapshot.metrics if self.snapshot is not None else {}
        queued = m.get("num_requests_running", 0) + m.get("num_requests_waiting", 0)
        return queued + sum(s for s, _ in self.pending.values()), m.get("kv_cache_usage", 0.0)


def ray_init(client: Any) -> str:
    """Connect to RAY_ADDRESS's cluster, or start a local Ray (shut down with the client); returns the IP
    the cores reach this process at."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("--distributed-executor-backend ray needs Ray: pip install 'lmserve[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=True)
        client._ray_started = True
    return ray.util.get_node_ip_address()


def bind_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
