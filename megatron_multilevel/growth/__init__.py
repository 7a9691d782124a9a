"""Growth methods' own pieces, beside the coalescing operators that every growth starts from:
MSG's layer mask (``mask``), LiGO's learned depth operator (``ligo``) and the fresh layers of a
random expansion (``fresh``). The compared methods themselves are declared once, in
``megatron_multilevel/methods.py``."""
