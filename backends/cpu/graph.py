"""The CPU backend's graph: hal's ``EagerGraph`` (there is no graph runtime to capture with)."""

from __future__ import annotations

from hal.sdk import EagerGraph

CpuGraph = EagerGraph
