"""Route ownership: the node's task queue is polled by the identity it reported."""

from __future__ import annotations

from temporalio import activity
from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.exceptions import ApplicationError

from mvp_core import names
from mvp_core.models import CheckRouteInput


@activity.defn(name=names.ACT_CHECK_ROUTE)
async def check_route(inp: CheckRouteInput) -> bool:
    """True when a poller of ``task_queue`` has exactly the reported identity.

    Raises (and so is retried by the workflow's policy) while no such poller is seen:
    a new worker's poller appears within ~0.1 s.
    """
    client = activity.client()
    resp = await client.workflow_service.describe_task_queue(
        DescribeTaskQueueRequest(
            namespace=client.namespace,
            task_queue=TaskQueue(name=inp.task_queue),
            task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY,
        )
    )
    identities = sorted({p.identity for p in resp.pollers})
    if inp.identity in identities:
        return True
    raise ApplicationError(
        f"route owner mismatch on {inp.task_queue}: expected poller {inp.identity!r}, "
        f"saw {identities or 'no pollers'}",
        type="RouteNotOwned",
    )
