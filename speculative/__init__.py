"""Multi-layer EAGLE (MTP) speculative decoding on hal, with a tiny MiMo-V2-style model.

    from speculative import MultiLayerEagleWorker, GreedyDecoder, TinyConfig, TinyMiMo, distill
    model = TinyMiMo(TinyConfig()); distill(model)
    spec = MultiLayerEagleWorker(model, "cpu", num_steps=3)     # any hal device string
    print(spec.generate([[1, 2, 3]], 32).tokens)

Nothing here branches on the device: pools, kernels and graphs come from ``hal.get_backend``.
"""

from speculative.distill import DistillConfig, distill
from speculative.model import TinyConfig, TinyMiMo
from speculative.worker import GenerationResult, GreedyDecoder, MultiLayerEagleWorker

__all__ = [
    "DistillConfig",
    "GenerationResult",
    "GreedyDecoder",
    "MultiLayerEagleWorker",
    "TinyConfig",
    "TinyMiMo",
    "distill",
]
