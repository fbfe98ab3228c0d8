"""``lowmem_offload``: one technique in one folder, the strategy and its precision plugin.

``strategy`` (``OffloadStrategy``) keeps the fp32 masters (``masters``, ``masters_view``, ``manual_grads``), moves
gradients and weights (``transfer``), steps on the host (``host_optimizer``) and streams blocks' weights
(``param_stream``); ``precision`` (``MasterHalfPrecision``, with ``loss_scaler``) casts, scales and clips. The
strategy hands itself to the plugin through :meth:`MasterHalfPrecision.attach`.
"""

from lightning_lowmem.strategies.offload.host_step import NonFiniteGradientError
from lightning_lowmem.strategies.offload.precision import MasterHalfPrecision
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

__all__ = ["MasterHalfPrecision", "NonFiniteGradientError", "OffloadStrategy"]
