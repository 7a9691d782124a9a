"""Distribution around the pure operators: tensor-parallel layouts, ZeRO, transitions."""
