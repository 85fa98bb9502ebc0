"""DeepSpeed's TrainSchedule runs each rank's forwards and backwards in Megatron's 1F1B order,
so the cost model's 1F1B pipeline formula prices it (planner/cost/step_time.py ``pipeline``);
what differs is how it communicates (frameworks.Traits.pipe_engine), not the order."""

from __future__ import annotations

import pytest

from planner.cost.schedule_replay import rank_ops


def _deepspeed_order(schedule_cls, pp: int, m: int, rank: int) -> list[tuple[str, int]]:
    """Rank ``rank``'s compute instructions, (F|B, micro-batch), as TrainSchedule yields them."""
    sched = schedule_cls(micro_batches=m, stages=pp, stage_id=rank)
    out = []
    for step_id, cmds in enumerate(sched.steps()):
        mb, _ = sched._step_to_micro_batch(step_id)
        for c in cmds:
            name = type(c).__name__
            if name in ("ForwardPass", "BackwardPass"):
                out.append((name[0], mb))
    return out


@pytest.mark.parametrize(("pp", "m"), [(2, 1), (4, 3), (4, 8), (5, 12), (8, 8)])
def test_train_schedule_is_1f1b(pp: int, m: int) -> None:
    schedule = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    for rank in range(pp):
        megatron = [(kind, mb) for kind, _, mb in rank_ops(rank, pp, 1, m, pp)]
        assert _deepspeed_order(schedule.TrainSchedule, pp, m, rank) == megatron
