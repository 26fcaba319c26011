"""Trainer rank 0's side of a weight update: ``WeightSender(servers, settings).push(buckets, version)``.

One push = gather buckets ahead (within a memory budget, while the servers still generate) ->
pause (keep in-flight requests) -> start -> update (bucketed broadcast on the target's dedicated
group while every server receives) -> finish with the version -> prefix-cache reset -> resume,
then the canary: every worker's checksum of the bytes it received must equal the trainer's, and
every engine parameter must have been written. Targets: ``UpdateTarget``.

Nothing here blocks forever: group creation is bounded by ``settings.init_timeout_s``, every
collective and HTTP call by ``settings.timeout_s``. When an update fails, each server is probed
and the ones that are dead or hung are named in the error.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from refractor.records import TimelineEvent
from refractor.weight_sync.control_plane import ServerControl, ServerRef, WeightSyncError
from refractor.weight_sync.data_plane import BucketSender, SendStats, WorkerReport
from refractor.weight_sync.process_group import CollectiveTimeout, TransferGroup, host_store
from refractor.weight_sync.records import PushResult, UpdateTarget
from refractor.weight_sync.settings import WeightSyncSettings


class CanaryError(WeightSyncError):
    """A server's received weights differ from what the trainer sent (or were not all loaded)."""


@dataclass
class _Group:
    target: UpdateTarget
    servers: list[ServerControl]
    rank_offsets: list[int]
    world_sizes: list[int]
    transfer: TransferGroup
    sender: BucketSender


class WeightSender:
    def __init__(
        self,
        servers: Sequence[ServerRef],
        settings: WeightSyncSettings = WeightSyncSettings(),
        *,
        eval_servers: Collection[str] = (),
        master_address: str = "127.0.0.1",
        device: torch.device | str | None = None,
    ):
        names = [s.name for s in servers]
        if len(set(names)) != len(names):
            raise ValueError(f"server names must be unique, got {names}")
        unknown = set(eval_servers) - set(names)
        if unknown:
            raise ValueError(f"eval servers {sorted(unknown)} are not among the servers {names}")
        self.servers = list(servers)
        self.settings = settings
        self.eval_servers = frozenset(eval_servers)
        self.master_address = master_address
        device = torch.device(device) if device is not None else torch.device("cpu")
        # CPU staging: buckets are assembled in host memory and travel over gloo, even from a GPU;
        # CUDA IPC: they stay in this GPU's memory and only their handles travel over gloo
        self.ipc_device = device if settings.cuda_ipc and device.type == "cuda" else None
        use_gloo = settings.cpu_staging or self.ipc_device is not None
        self.backend = "nccl" if device.type == "cuda" and not use_gloo else "gloo"
        self.device = device if self.backend == "nccl" else torch.device("cpu")
        self.timeout_s = settings.timeout_s
        self._groups: dict[UpdateTarget, _Group] = {}
        self._pool = ThreadPoolExecutor(
            max_workers=2 * len(self.servers) + 2, thread_name_prefix="weight-sync"
        )

    def target_servers(self, target: UpdateTarget) -> list[ServerRef]:
        if target == UpdateTarget.TRAINING_ONLY:
            return [s for s in self.servers if s.name not in self.eval_servers]
        if target == UpdateTarget.RESTARTED:
            raise ValueError("a push to a restarted server names it: use push_to_restarted")
        return list(self.servers)

    def replace_server(self, name: str, url: str) -> None:
        """Server ``name`` was restarted and answers at ``url``. Every group it belonged to is
        released on the trainer's side (the next push creates it again; the live servers replace
        their end of it then)."""
        index = next((i for i, s in enumerate(self.servers) if s.name == name), None)
        if index is None:
            raise ValueError(f"unknown server {name!r}; known: {[s.name for s in self.servers]}")
        self.servers[index] = ServerRef(name, url)
        for target, group in list(self._groups.items()):
            if any(c.server.name == name for c in group.servers):
                del self._groups[target]
                self._release(group, servers_too=False)

    def push_to_restarted(
        self, name: str, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int
    ) -> PushResult:
        """Give the restarted server ``name`` the current weights as ``version``, through the normal
        protocol (pause, stream, finish, canary) on a group of its own, released afterwards."""
        refs = [s for s in self.servers if s.name == name]
        if not refs:
            raise ValueError(f"unknown server {name!r}; known: {[s.name for s in self.servers]}")
        buckets = iter(buckets)
        try:
            group = self._create_group(UpdateTarget.RESTARTED, refs)
            try:
                return self._push(buckets, version, group, False)
            finally:
                self._release(group, servers_too=True)
        except BaseException:
            with contextlib.suppress(Exception):
                for _ in buckets:  # the other ranks gather in lockstep (see push)
                    pass
            raise

    # --- set-up ------------------------------------------------------------------------------
    def init(self) -> None:
        """Create the dedicated group of every target (a push also does this lazily)."""
        self._group(UpdateTarget.FULL)
        if self.eval_servers:
            self._group(UpdateTarget.TRAINING_ONLY)

    def _group(self, target: UpdateTarget) -> _Group:
        existing = self._groups.pop(target, None)
        if existing is not None and not existing.transfer.broken:
            self._groups[target] = existing
            return existing
        if existing is not None:
            existing.transfer.shutdown()
        refs = self.target_servers(target)
        if not refs:
            raise WeightSyncError(
                f"weight-update target {target.value!r} has no servers (all are eval servers)"
            )
        group = self._create_group(target, refs)
        self._groups[target] = group
        return group

    def _create_group(self, target: UpdateTarget, refs: list[ServerRef]) -> _Group:
        controls = [ServerControl(ref, self.timeout_s, self.settings.control_token) for ref in refs]
        world_sizes = self._on_all(
            controls, ServerControl.world_size, f"querying the world size for {target.value!r}"
        )
        offsets, world = rank_layout(world_sizes)
        init_timeout_s = self.settings.init_timeout_s
        store = host_store(self.master_address, world, init_timeout_s)
        futures = {
            c: self._pool.submit(
                c.init_weight_transfer_engine,
                {
                    "master_address": self.master_address,
                    "master_port": store.port,
                    "world_size": world,
                    "rank_offset": offset,
                    "group": target.value,
                    "backend": self.backend,
                    "payload": "group" if self.ipc_device is None else "cuda_ipc",
                    "init_timeout_s": init_timeout_s,
                    "timeout_s": self.timeout_s,
                },
                init_timeout_s + 30,
            )
            for c, offset in zip(controls, offsets, strict=True)
        }
        try:
            transfer = TransferGroup.create(
                master_address=self.master_address,
                master_port=store.port,
                rank=0,
                world_size=world,
                backend=self.backend,
                group_name=target.value,
                device=self.device,
                init_timeout_s=init_timeout_s,
                timeout_s=self.timeout_s,
                store=store,
            )
        except Exception as err:  # noqa: BLE001 - rendezvous failures come in many types
            raise self._failure(
                f"creating the {target.value!r} weight-transfer group", controls, futures, err
            ) from err
        self._wait_all(futures, f"creating the {target.value!r} weight-transfer group", controls)
        return _Group(
            target,
            controls,
            offsets,
            world_sizes,
            transfer,
            BucketSender(transfer, self.settings.broadcast_mode, ipc_device=self.ipc_device),
        )

    # --- one update --------------------------------------------------------------------------
    def push(
        self,
        buckets: Iterable[list[tuple[str, torch.Tensor]]],
        version: int,
        target: UpdateTarget = UpdateTarget.FULL,
        *,
        _corrupt_for_test: bool = False,
    ) -> PushResult:
        """Send every bucket to the target's servers and make them serve it as ``version``.

        Buckets are gathered BEFORE the servers pause, up to ``settings.gather_before_pause_bytes``
        (about: the bucket that crosses the budget is kept too), so generation goes on while the
        trainer gathers; the rest is gathered while streaming, during the pause (0 = stream
        everything while paused). ``buckets`` is always consumed to its end, also when the update fails:
        trainer ranks that gather the buckets in lockstep with rank 0 (FSDP) never wait for a
        rank that gave up.
        """
        buckets = iter(buckets)
        try:
            return self._push(buckets, version, self._group(UpdateTarget(target)), _corrupt_for_test)
        except BaseException:
            with contextlib.suppress(Exception):
                for _ in buckets:
                    pass
            raise

    def _push(
        self,
        buckets: Iterator[list[tuple[str, torch.Tensor]]],
        version: int,
        group: _Group,
        corrupt: bool,
    ) -> PushResult:
        start = time.perf_counter()
        spans = _Spans()
        target = group.target
        controls = group.servers
        with spans.span("gather_ahead") as attrs:
            ahead, ahead_bytes = gather_ahead(buckets, self.settings.gather_before_pause_bytes)
            attrs.update(buckets=len(ahead), bytes=ahead_bytes)
        what = f"weight update to version {version} ({target.value!r})"
        unresponsive: frozenset[str] = frozenset()
        paused_at = time.perf_counter()
        failed = True
        try:  # resumed in every case: a server that paused must not stay paused because another failed
            with spans.span("pause"):
                self._on_all(controls, ServerControl.pause, what)
                self._on_all(controls, ServerControl.start_weight_update, what)
            receiving = {
                c: self._pool.submit(c.update_weights, target.value, str(version), self.timeout_s)
                for c in controls
            }
            receive_spans = {c: spans.open("server", server=c.server.name) for c in controls}
            for control, future in receiving.items():
                future.add_done_callback(lambda _, span=receive_spans[control]: span.close())
            try:
                stream = _release_as_sent(ahead, buckets)
                stats = group.sender.send(self._checked(stream, receiving, controls, what), corrupt=corrupt)
                reports = group.sender.gather_reports()
            except (CollectiveTimeout, WeightSyncError) as err:
                group.transfer.broken = True  # workers hold a partial stream: the next push re-creates it
                failure = self._failure(what, controls, receiving, err)
                unresponsive = failure.unresponsive
                raise failure from err
            spans.add_buckets(stats)
            with spans.span("finish"):
                self._wait_all(receiving, what, controls)
                self._on_all(controls, lambda c: c.finish_weight_update(str(version)), what)
                recompute = self.settings.inflight_kv == "recompute"
                self._on_all(controls, lambda c: c.reset_prefix_cache(reset_running_requests=recompute), what)
            failed = False
        finally:
            with spans.span("resume"):
                self._resume([c for c in controls if c.server.name not in unresponsive], quietly=failed)
            paused = time.perf_counter() - paused_at
        by_server = self._reports_by_server(group, reports)
        spans.add_server_reports(receive_spans, by_server)
        check_canary(stats, by_server, version)
        return PushResult(
            version,
            target,
            trainer_seconds=time.perf_counter() - start,
            paused_seconds=paused,
            transfer_seconds=stats.seconds,
            stats=stats,
            reports=by_server,
            gathered_ahead_bytes=ahead_bytes,
            spans=spans.events(),
        )

    def _checked(self, buckets, receiving: dict[ServerControl, Future], controls, what):
        """Pass buckets through, stopping early when a server already failed its receive call."""
        for bucket in buckets:
            for control, future in receiving.items():
                if future.done() and future.exception() is not None:
                    raise WeightSyncError(f"{what}: server {control.server} failed: {future.exception()}")
            yield bucket

    def _reports_by_server(self, group: _Group, reports: list[WorkerReport]) -> dict[str, list[WorkerReport]]:
        by_rank = {r.rank: r for r in reports}
        out = {}
        for control, offset, size in zip(group.servers, group.rank_offsets, group.world_sizes, strict=True):
            out[control.server.name] = [
                by_rank[rank] for rank in range(offset, offset + size) if rank in by_rank
            ]
        return out

    # --- helpers -----------------------------------------------------------------------------
    def _on_all(self, controls: list[ServerControl], call: Callable[[ServerControl], Any], what: str) -> list:
        futures = {c: self._pool.submit(call, c) for c in controls}
        return self._wait_all(futures, what, controls)

    def _wait_all(
        self, futures: dict[ServerControl, Future], what: str, controls: list[ServerControl]
    ) -> list:
        deadline = time.monotonic() + self.timeout_s + 30
        results = []
        errors = []
        for control, future in futures.items():
            try:
                results.append(future.result(timeout=max(0.0, deadline - time.monotonic())))
            except FutureTimeout:
                errors.append(f"server {control.server}: no answer within {self.timeout_s:.0f} s")
            except Exception as err:  # noqa: BLE001 - reported with the server's name
                errors.append(str(err))
        if errors:
            raise WeightSyncError(f"{what} failed:\n  " + "\n  ".join(errors))
        return results

    def _failure(
        self,
        what: str,
        controls: list[ServerControl],
        futures: dict[ServerControl, Future],
        cause: BaseException,
    ) -> WeightSyncError:
        probes = [self._pool.submit(c.probe, min(5.0, self.timeout_s)) for c in controls]
        problems = []
        unresponsive = set()
        for control, probe in zip(controls, probes, strict=True):
            future = futures.get(control)
            call_error = future.exception() if future is not None and future.done() else None
            reason = probe.result()
            if reason is not None:
                unresponsive.add(control.server.name)
                problems.append(
                    f"server {control.server}: {reason}" + (f" [{call_error}]" if call_error else "")
                )
            elif call_error is not None:
                problems.append(str(call_error))
        if not problems:
            problems.append("every server still answers /health; see the servers' logs")
        detail = f" ({cause})" if isinstance(cause, CollectiveTimeout) else ""
        return WeightSyncError(f"{what} failed{detail}:\n  " + "\n  ".join(problems), frozenset(unresponsive))

    def _resume(self, controls: list[ServerControl], quietly: bool) -> None:
        """Resume every server. ``quietly`` (the update already failed): a server that cannot be
        resumed must not turn that clear error into a second one. Otherwise a server left paused
        fails the update, naming it: it would serve nothing for the rest of the run."""
        futures = {c: self._pool.submit(_resume_until_running, c) for c in controls}
        if quietly:
            for future in futures.values():
                with contextlib.suppress(Exception):
                    future.result(timeout=self.timeout_s)
            return
        self._wait_all(futures, "resuming the servers after the update", controls)

    def close(self) -> None:
        """Release every group: the servers' side first (best effort), then the trainer's."""
        for group in self._groups.values():
            self._release(group, servers_too=True)
        self._groups.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _release(self, group: _Group, servers_too: bool) -> None:
        if servers_too:
            futures = [self._pool.submit(c.shutdown_weight_transfer_engine) for c in group.servers]
            for future in futures:
                with contextlib.suppress(Exception):
                    future.result(timeout=10)
        group.transfer.shutdown()
        for control in group.servers:
            control.close()


RESUME_ATTEMPTS = 5


def _resume_until_running(control: ServerControl) -> None:
    """Resume, then check that the server says it runs; a failed or unconfirmed resume is tried
    again (a resume is harmless on a running server), so a server is never left paused by one lost
    call after a failed update."""
    problem = "it still says it is paused"
    for attempt in range(RESUME_ATTEMPTS):
        try:
            control.resume()
            if not control.is_paused():
                return
        except WeightSyncError as err:
            problem = str(err)
        time.sleep(0.05 * (attempt + 1))
    raise WeightSyncError(f"server {control.server} stays paused after {RESUME_ATTEMPTS} resumes: {problem}")


def gather_ahead(
    buckets: Iterator[list[tuple[str, torch.Tensor]]], budget_bytes: int
) -> tuple[list[list[tuple[str, torch.Tensor]]], int]:
    """Materialize buckets from ``buckets`` until ``budget_bytes`` are held (the last one may cross it).

    Waits for the device, so the gather is really over before the caller pauses the servers.
    """
    ahead: list[list[tuple[str, torch.Tensor]]] = []
    held = 0
    while held < budget_bytes:
        bucket = next(buckets, None)
        if bucket is None:
            break
        ahead.append(bucket)
        held += sum(t.numel() * t.element_size() for _, t in bucket)
    devices = {t.device for bucket in ahead for _, t in bucket if t.is_cuda}
    for device in devices:
        torch.cuda.synchronize(device)
    return ahead, held


def _release_as_sent(ahead: list, rest: Iterator) -> Iterator:
    """The gathered buckets, each dropped once handed over, then the rest of the stream."""
    while ahead:
        yield ahead.pop(0)
    yield from rest


def rank_layout(world_sizes: Sequence[int]) -> tuple[list[int], int]:
    """Ranks of a group: the trainer is 0, then each server's workers in order (a server with
    TP x PP x DP workers takes that many consecutive ranks). Returns (first rank per server, world)."""
    offsets = [1 + sum(world_sizes[:i]) for i in range(len(world_sizes))]
    return offsets, 1 + sum(world_sizes)


def check_canary(stats: SendStats, reports: dict[str, list[WorkerReport]], version: int) -> None:
    """Raise ``CanaryError`` naming every server whose workers did not get exactly what was sent."""
    problems = []
    for server, workers in reports.items():
        if not workers:
            problems.append(f"server {server!r}: no worker reported back")
        for r in workers:
            if (r.checksum, r.tensors, r.bytes) != (stats.checksum, stats.tensors, stats.bytes):
                problems.append(
                    f"server {server!r} (rank {r.rank}): received checksum {r.checksum} "
                    f"over {r.tensors} tensors / {r.bytes} bytes, "
                    f"the trainer sent checksum {stats.checksum} over {stats.tensors} tensors / "
                    f"{stats.bytes} bytes"
                )
            elif r.params_loaded != r.params_total:
                problems.append(
                    f"server {server!r} (rank {r.rank}): only {r.params_loaded} "
                    f"of its {r.params_total} parameters "
                    "were written (an update missing some of the model's tensors, or one the server "
                    "rejected whole; see the server log)"
                )
    if problems:
        raise CanaryError(
            f"weight update to version {version} is not what the trainer sent:\n  " + "\n  ".join(problems)
        )


class _OpenSpan:
    def __init__(self, name: str, attrs: dict[str, Any]):
        self.name = name
        self.attrs = attrs
        self.start = time.time()
        self.end: float | None = None

    def close(self) -> None:
        if self.end is None:
            self.end = time.time()


class _Spans:
    """The phases of one push as ``weight_sync/<phase>`` timeline spans (wall clock; rank 0's
    view: a server's span runs from the trainer's call of its receive route to the call's answer,
    with the receive and load durations that server's workers reported)."""

    def __init__(self) -> None:
        self._spans: list[_OpenSpan] = []

    def open(self, name: str, **attrs: Any) -> _OpenSpan:
        span = _OpenSpan(name, attrs)
        self._spans.append(span)
        return span

    def add(self, name: str, start: float, end: float, **attrs: Any) -> None:
        span = self.open(name, **attrs)
        span.start, span.end = start, end

    @contextlib.contextmanager
    def span(self, name: str, **attrs: Any) -> Iterator[dict[str, Any]]:
        span = self.open(name, **attrs)
        try:
            yield span.attrs
        finally:
            span.close()

    def add_buckets(self, stats: SendStats) -> None:
        for t in stats.bucket_timings:
            self.add("gather", t.waited_from, t.started, bucket=t.index, bytes=t.bytes)
            self.add("send", t.started, t.ended, bucket=t.index, bytes=t.bytes)
        if stats.bucket_timings:  # the last broadcasts finish
            self.add("drain", stats.drained_from, stats.finished)

    def add_server_reports(self, spans: dict[ServerControl, _OpenSpan], reports: dict[str, list]) -> None:
        for control, span in spans.items():
            workers = reports.get(control.server.name, [])
            span.attrs["receive_seconds"] = max((w.receive_us for w in workers), default=0) / 1e6
            span.attrs["load_seconds"] = max((w.load_us for w in workers), default=0) / 1e6

    def events(self) -> tuple[TimelineEvent, ...]:
        return tuple(
            TimelineEvent(f"weight_sync/{s.name}", s.start, s.end, "trainer", s.attrs)
            for s in sorted(self._spans, key=lambda s: s.start)
            if s.end is not None
        )
