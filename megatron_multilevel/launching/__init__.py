"""DeepSpeed's launcher as ``launch/pretrain_vcycle.sh`` runs it: its runner (``runner.py``) and
per-node launch (``node.py``), with what a run under a scheduler needs and they lack: a signal to
the launcher reaches every rank and no process outlives its launcher (``training/stop.py`` has the
ranks' side), and overrides reach pdsh's remote shell quoted."""
