"""Test-wide settings: float64 enabled so references can be compared tightly."""

import jax

jax.config.update("jax_enable_x64", True)
