"""Multi-layer EAGLE (MTP) speculative decoding on hal, with a tiny MiMo-V2-style model.

    import hal
    from hal.speculative import MultiLayerEagleWorker, GreedyDecoder, TinyConfig, TinyMiMo, distill
    model = TinyMiMo(TinyConfig()); distill(model, hal.get_backend("cpu"))
    spec = MultiLayerEagleWorker(model, hal.get_backend("cpu"), num_steps=3)   # the backend, resolved once
    print(spec.generate([[1, 2, 3]], 32).tokens)

A model the engines run implements ``EngineModel`` and describes itself with a ``ModelSpec``.
Nothing here branches on the device: pools, kernels and graphs come from the engine's backend.
"""

from hal.speculative.distill import DistillConfig, distill
from hal.speculative.contract import EngineModel, ModelSpec
from hal.speculative.model import TinyConfig, TinyMiMo
from hal.speculative.engine import GenerationResult, GreedyDecoder
from hal.speculative.mtp import MultiLayerEagleWorker

__all__ = [
    "DistillConfig",
    "EngineModel",
    "GenerationResult",
    "GreedyDecoder",
    "ModelSpec",
    "MultiLayerEagleWorker",
    "TinyConfig",
    "TinyMiMo",
    "distill",
]
