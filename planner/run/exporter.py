"""The reference trainer's Prometheus endpoint (``--metrics-port``), and how it measures communication.

Every rank serves its own metrics on ``--metrics-port`` + its local rank, so one node's ranks
never share a port and each rank's numbers sit beside its GPU's dcgm-exporter series. The
names below are the ones prometheus-rules.yaml and grafana-dashboard.json query
(planner/emit/monitoring.py imports them).

Communication time is measured, not predicted: DeepSpeed's comms logger (deepspeed.comm)
times every collective and point-to-point op that goes through ``deepspeed.comm`` (ZeRO's
reduce-scatters and all-gathers, gradient all-reduces, pipeline sends and receives, MoE
all-to-alls, the trainer's loss all-reduce). The logger makes each op blocking (it synchronises
the device after it), so the time counts the whole op, overlap removed: on a GPU the share is an
upper bound of exposed communication and the step is a little slower with the port on.
Asynchronous ops are timed to their launch only.
"""

from __future__ import annotations

from typing import Any

from planner.errors import UserError

STEP_TIME = "dsplan_step_time_seconds"
TOKENS_PER_S = "dsplan_tokens_per_second"
COMM_TIME = "dsplan_comm_time_seconds"
COMM_SHARE = "dsplan_comm_share"
STEPS = "dsplan_steps"  # a counter: prometheus_client exposes it as dsplan_steps_total
LAST_STEP = "dsplan_last_step"


def check_port(port: int, source: str = "--metrics-port") -> int:
    """0 (off) or a port a user process may bind."""
    if port != 0 and not 1024 <= port <= 65535:
        raise UserError(f"{source} {port}: give 0 (no metrics endpoint) or a port in 1024..65535")
    return port


class CommTimer:
    """Seconds of communication since the last ``take()``, from DeepSpeed's comms logger.

    The logger keeps one cumulative wall-clock timer per op name (deepspeed/comm/comm.py
    ``timers``, milliseconds); each ``take()`` reads and resets them, so they never grow with
    the run, and clears the logger's own per-op lists for the same reason."""

    def __init__(self) -> None:
        import deepspeed.comm as dist

        dist.configure(enabled=True, prof_all=True, verbose=False)

    def take(self) -> float:
        from deepspeed.comm import comm

        names = list(comm.comms_logger.comms_dict)
        timers = comm.timers.get_timers()
        total_ms = sum(timers[name].elapsed(reset=True) for name in names if name in timers)
        comm.comms_logger.reset_data()
        return total_ms / 1000.0


class TrainerMetrics:
    """The gauges one rank serves; ``observe`` sets them after each step."""

    def __init__(self, port: int, rank: int, local_rank: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = CollectorRegistry()
        labels = ["rank"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labels, registry=self.registry).labels(rank=str(rank))

        self.step_time = gauge(STEP_TIME, "Wall time of the last optimizer step (s)")
        self.tokens = gauge(TOKENS_PER_S, "Tokens per second of the last step, whole job")
        self.comm_time = gauge(COMM_TIME, "Communication time in the last step (s), DeepSpeed comms logger")
        self.comm_share = gauge(COMM_SHARE, "Communication time / step time of the last step (0..1)")
        self.last_step = gauge(LAST_STEP, "The last optimizer step finished")
        self.steps = Counter(STEPS, "Optimizer steps finished by this process", labels,
                             registry=self.registry).labels(rank=str(rank))
        self.port = port + local_rank
        try:
            self.server, _thread = start_http_server(self.port, registry=self.registry)
        except OSError as err:
            raise UserError(f"--metrics-port {port}: rank {rank} cannot serve metrics on port {self.port} "
                            f"({err.strerror or err}); pick a free base port (local rank R uses port + R)") from None

    def observe(self, step: int, step_time_s: float, tokens_per_s: float, comm_s: float) -> None:
        self.step_time.set(step_time_s)
        self.tokens.set(tokens_per_s)
        self.comm_time.set(comm_s)
        self.comm_share.set(min(1.0, comm_s / step_time_s) if step_time_s > 0 else 0.0)
        self.last_step.set(step)
        self.steps.inc()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
