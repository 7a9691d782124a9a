"""The savings study: the savings arithmetic (``savings``), the benchmark's report from its kept
runs (``report``), the compared methods' configs (``variants``) at the benchmark's sizes
(``sizes``), the bookkeeping of the kept runs (``runs``) and the plots (``plotting``).

Report-only code: training does not run it (a run with a baseline calls ``savings.run_savings``
and the plots after training, to report), and it is left out of a run's code version
(:func:`megatron_multilevel.study.runs.source_version`).
"""
