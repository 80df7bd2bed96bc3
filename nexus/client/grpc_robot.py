"""A robot's client of the gateway's gRPC API (``joynexus.v1.RobotPolicy``, :mod:`nexus.gateway.grpc_api`).

``RobotClient(target, token)`` opens a channel to the gateway's gRPC address (``grpc`` in the service's
``gateway/gateway.json``, :func:`grpc_target`); ``client.info(tenant)`` describes the tenant's policy;
``client.session(tenant)`` opens one ``Act`` stream on which ``act(obs)`` sends an observation and returns its
action chunk (one round trip on the open stream); ``client.upload(job, buffer)`` sends whole episodes (an
:class:`~nexus.client.rollouts.EpisodeBuffer` or its columns) into the tenant's RL job with
``rollouts="external"``. A refusal raises :class:`grpc.RpcError` with the status and the service's message.
"""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from nexus.gateway.grpc_api import SERVICE, to_array, to_tensor
from nexus.gateway.proto import nexus_robot_pb2 as pb

_END = object()


def grpc_target(gateway_dir: str | Path) -> str | None:
    """The running gateway's gRPC address (``host:port``), None when it serves no gRPC (or is not up)."""
    try:
        return json.loads((Path(gateway_dir) / "gateway.json").read_text()).get("grpc")
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def observation(tenant: str, obs: Mapping[str, Any], **fields: Any) -> pb.Observation:
    """An :class:`Observation` message from ``{"state", "images", "instruction"}`` (numpy arrays) and the
    message's other fields (``version``, ``sample``, ``seed``, ``deadline_ms``, ``executed_prefix``, ``request_id``)."""
    msg = pb.Observation(tenant=tenant, instruction=str(obs.get("instruction") or ""), **{
        k: v for k, v in fields.items() if v is not None and k != "executed_prefix"})
    if obs.get("state") is not None:
        msg.state.CopyFrom(to_tensor(np.asarray(obs["state"], np.float32)))
    for cam, img in (obs.get("images") or {}).items():
        msg.images[cam].CopyFrom(to_tensor(np.asarray(img, np.uint8)))
    if fields.get("executed_prefix") is not None:
        msg.executed_prefix.CopyFrom(to_tensor(np.asarray(fields["executed_prefix"], np.float32)))
    return msg


def chunk_dict(reply: pb.ActionChunk) -> dict[str, Any]:
    """An :class:`ActionChunk` as a dict: ``actions`` [chunk, action_dim], ``version``, ``logprob``, ``value``,
    ``timing`` (ms), ``deadline_missed``, ``request_id``; a refusal for now: ``actions`` None and ``retry_after_s``."""
    if reply.retry_after_s > 0:  # refused for now: nothing was done
        return {"actions": None, "retry_after_s": reply.retry_after_s, "request_id": reply.request_id}
    return {"actions": np.array(to_array(reply.actions, "actions")), "version": reply.policy_version,
            "logprob": reply.logprob, "value": reply.value, "deadline_missed": reply.deadline_missed,
            "request_id": reply.request_id,
            "timing": {"queue_ms": reply.timing.queue_ms, "forward_ms": reply.timing.forward_ms,
                       "total_ms": reply.timing.total_ms, "deadline_ms": reply.timing.deadline_ms}}


class ActSession:
    """One open ``Act`` stream of a tenant: observations in, action chunks out, in order."""

    def __init__(self, client: RobotClient, tenant: str, timeout: float | None = None) -> None:
        self.tenant = tenant
        self._out: queue.Queue = queue.Queue()
        self._replies: Iterator[pb.ActionChunk] = client._act(iter(self._out.get, _END), metadata=client.metadata,
                                                              timeout=timeout)
        self._next_id = 0

    def send(self, obs: Mapping[str, Any] | pb.Observation, **fields: Any) -> None:
        """Send an observation without waiting for its chunk (:meth:`receive` gets the chunks in order)."""
        self._next_id += 1
        msg = obs if isinstance(obs, pb.Observation) else observation(self.tenant, obs, request_id=self._next_id,
                                                                         **fields)
        self._out.put(msg)

    def receive(self) -> dict[str, Any]:
        return chunk_dict(next(self._replies))

    def act(self, obs: Mapping[str, Any] | pb.Observation, max_retries: int = 100, **fields: Any) -> dict[str, Any]:
        """The action chunk of one observation (``sample=True``: a sample with its ``logprob``, for RL); sent again
        after ``retry_after_s`` while the gateway refuses it for now (at most ``max_retries`` times)."""
        for _ in range(max_retries):
            self.send(obs, **fields)
            out = self.receive()
            if out["actions"] is not None:
                return out
            time.sleep(out["retry_after_s"])
        raise RuntimeError(f"the gateway refused the observation {max_retries} times (busy): retry later")

    def close(self) -> None:
        self._out.put(_END)
        self._replies.cancel()  # type: ignore[attr-defined]

    def __enter__(self) -> ActSession:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class RobotClient:
    """A channel to the gateway's gRPC robot API with a token (``ca``: the service CA's PEM for a TLS gateway)."""

    def __init__(self, target: str, token: str, ca: str | Path | bytes | None = None,
                 max_message_bytes: int = 64 << 20) -> None:
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        if ca is None:
            self.channel = grpc.insecure_channel(target, options=options)
        else:
            root = ca if isinstance(ca, bytes) else Path(ca).read_bytes()
            self.channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root), options=options)
        self.metadata = (("authorization", f"Bearer {token}"),)
        self._act = self.channel.stream_stream(f"/{SERVICE}/Act", request_serializer=pb.Observation.SerializeToString,
                                               response_deserializer=pb.ActionChunk.FromString)
        self._upload = self.channel.unary_unary(f"/{SERVICE}/UploadEpisodes",
                                                request_serializer=pb.EpisodeUpload.SerializeToString,
                                                response_deserializer=pb.UploadReply.FromString)
        self._info = self.channel.unary_unary(f"/{SERVICE}/Info", request_serializer=pb.InfoRequest.SerializeToString,
                                              response_deserializer=pb.PolicyInfo.FromString)

    def info(self, tenant: str, timeout: float = 60) -> dict[str, Any]:
        r = self._info(pb.InfoRequest(tenant=tenant), metadata=self.metadata, timeout=timeout)
        return {"tenant": r.tenant, "version": r.version, "action_dim": r.action_dim, "chunk": r.chunk,
                "proprio_dim": r.proprio_dim, "instruction": r.instruction,
                "cameras": [{"name": c.name, "height": c.height, "width": c.width} for c in r.cameras]}

    def session(self, tenant: str, timeout: float | None = None) -> ActSession:
        """An ``Act`` stream of ``tenant``; ``timeout`` (s): the stream's gRPC deadline, which every observation's
        reply is also due by (the inference queue starts its group in time; see ``deadline_ms`` per observation)."""
        return ActSession(self, tenant, timeout)

    def upload(self, job: str, episodes: Any, timeout: float = 600) -> dict[str, Any]:
        """Whole episodes (an ``EpisodeBuffer`` or its ``columns()``) into the RL job ``job``."""
        cols = episodes.columns() if hasattr(episodes, "columns") else episodes
        msg = pb.EpisodeUpload(job=job)
        for k, v in cols.items():
            if k == "images":
                for cam, img in v.items():
                    msg.images[cam].CopyFrom(to_tensor(np.asarray(img, np.uint8)))
            else:
                getattr(msg, k).CopyFrom(to_tensor(np.asarray(v)))
        r = self._upload(msg, metadata=self.metadata, timeout=timeout)
        return {"job": r.job, "accepted": r.accepted, "rows": r.rows, "episodes": r.episodes,
                "policy_version": r.policy_version, "pending": r.pending}

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RobotClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["ActSession", "RobotClient", "chunk_dict", "grpc_target", "observation"]
