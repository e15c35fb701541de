"""Cost maths (no torch import): cluster files, TCO (CAPEX/OPEX, owning vs renting)
and the cost of a training run."""
