"""Elastic membership over the global store (placeholder docs filled below)."""

from zb.elastic.mesh import ElasticDeviceMesh, EventSink
from zb.elastic.view import WorldView

__all__ = ["ElasticDeviceMesh", "EventSink", "WorldView"]
