"""Built-in hal backends: ``cpu`` (reference), ``npu`` (Ascend, torch_npu), ``cuda`` (Triton)."""
