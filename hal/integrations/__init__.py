"""Adapters that let inference engines use hal through their own plugin seams.

Each adapter imports its engine; nothing in hal's core, backends or ``speculative`` imports an
adapter, so hal never needs an engine installed.
"""
