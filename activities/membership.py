"""Route ownership: the node's task queue is polled by the identity it reported."""

from __future__ import annotations

from temporalio import activity
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.exceptions import ApplicationError

from mvp_core import names
from mvp_core.errors import ErrorType
from mvp_core.models import CheckRouteInput, RouteCheck


def judge_route(identity: str, pollers: set[str]) -> RouteCheck | None:
    """Route ownership from the pollers seen on a node's queue (None: none yet, ask again).

    Owned: the reported identity is the queue's only poller. Not owned: someone else
    polls it, or two workers do (a node started twice, or a stale one): either could take
    the node's commands, so the route is not the reporting node's.
    """
    seen = sorted(pollers)
    if not seen:
        return None
    if seen == [identity]:
        return RouteCheck(owned=True, pollers=seen)
    if identity in pollers:
        reason = f"{len(seen)} workers poll the node's queue: {seen}"
    else:
        reason = f"expected poller {identity!r}, saw {seen}"
    return RouteCheck(owned=False, pollers=seen, reason=reason)


@activity.defn(name=names.ACT_CHECK_ROUTE)
async def check_route(inp: CheckRouteInput) -> RouteCheck:
    """Whether the node's queue is polled by exactly the identity it reported.

    Raises (and so is retried by the workflow's policy) while no poller is seen yet: a new
    worker's poller appears within ~0.1 s.
    """
    client = activity.client()
    resp = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=inp.task_queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
        )
    )
    verdict = judge_route(inp.identity, {p.identity for p in resp.pollers})
    if verdict is None:
        raise ApplicationError(
            f"no poller on {inp.task_queue} yet", type=ErrorType.ROUTE_NOT_POLLED
        )
    return verdict
