"""The ZeRO++ switches a configuration chooses (``QuantizationOptions``).

A leaf module: the collectives registry reads these options and
``zeropp.deepspeed_api.initialize`` builds them from a config, so both import them from here
(``zeropp.deepspeed_api.initialize`` and ``zeropp`` re-export the class).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QuantizationOptions:
    """ZeRO++ switches and their precision (defaults are the paper's)."""

    quantized_weights: bool = False  # qwZ
    hpz_size: int = 1  # hpZ (1 = off)
    quantized_gradients: bool = False  # qgZ
    weight_bits: int = 8
    gradient_bits: int = 4
    # qgZ's inter-node hop at its own width (2: ternary, with error feedback); None = gradient_bits
    gradient_inter_node_bits: int | None = None
    block_size: int = 256
    # hpZ with qwZ: secondary shards kept as the forward's int8 payload, not 16-bit values
    # ([Note: int8 secondary]); the same weights either way.
    quantized_secondary: bool = True
    # qgZ error feedback as (err_beta, reset_T); None = off (ZeroConfig.error_feedback).
    error_feedback: tuple[float, int] | None = None
    # The forward gather sends quantized weight deltas across nodes ([Note: weight deltas]).
    weight_deltas: bool = False
    delta_bits: int = 4
    delta_block_size: int = 2048
