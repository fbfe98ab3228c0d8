"""``lowmem_offload``: one technique in one folder.

``strategy`` (``OffloadStrategy``) owns its parts: the fp32 host masters (``masters``, shown through ``masters_view``,
in manual optimization by ``manual_grads``), the transfer of gradients and weights (``transfer``), the step schedule
(``step_schedule``: after backward, or in it), the host kernel (``host_optimizer``), the non-finite guard
(``nonfinite``) and parameter streaming (``param_stream``, ``stream_plan``). ``precision`` (``MasterHalfPrecision``,
with ``loss_scaler``) casts, scales and clips, as Lightning's precision plugins do.
"""

from lightning_lowmem.strategies.offload.nonfinite import NonFiniteGradientError
from lightning_lowmem.strategies.offload.precision import MasterHalfPrecision
from lightning_lowmem.strategies.offload.strategy import OffloadStrategy

__all__ = ["MasterHalfPrecision", "NonFiniteGradientError", "OffloadStrategy"]
