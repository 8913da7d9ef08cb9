"""The device check's parts by role (imported by ``bench/device_check.py``, its driver and step processes).

``driver``: the steps in order, each in a process of its own, budgets, the JSON report.
One module per step, holding what its step process runs and how the driver starts it and
reads its result: ``encoder_step``, ``pulls``, ``throughput``, ``towers``, ``merge``.
``shapes``: what each mode runs; ``report``: results, errors and logs, as every process writes them.
"""
