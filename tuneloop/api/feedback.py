"""POST /v1/feedback (tuneloop's own): a rating, a corrected completion and/or a preference (a
chosen and a rejected completion) for a logged request, stored with the request log (the
loop's retrain reads it: tuneloop/requestlog/feedback.py turns corrections into training rows
and preferences, corrections and ratings into DPO pairs)."""

from __future__ import annotations

import time
import uuid

from fastapi import Request

from tuneloop.api.handlers import call_of
from tuneloop.api.protocol import FeedbackRequest
from tuneloop.requestlog.record import utc_iso
from tuneloop.serving.errors import RouteNotFound


def create_feedback(request_log, body: FeedbackRequest, request: Request) -> dict:
    if request_log is None:
        raise RouteNotFound("feedback needs the request log, which is off on this server (request_log.enabled)")
    call = call_of(request)  # the feedback request's own record: its key, as the gateway found it
    fid, created = f"fb_{uuid.uuid4().hex}", int(time.time())
    request_log.submit(
        {
            "kind": "feedback",
            "feedback_id": fid,
            "time": utc_iso(time.time()),
            "request_id": body.request_id,
            "key_id": call.key_id,
            "tenant": call.tenant,
            "rating": body.rating,
            "correction": body.correction,
            "comment": body.comment,
            "chosen": body.preference.chosen if body.preference else None,
            "rejected": body.preference.rejected if body.preference else None,
            "via": call.request_id,
        },
        stream="feedback",
    )
    return {"id": fid, "object": "feedback", "created": created, "request_id": body.request_id}
