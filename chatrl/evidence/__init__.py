"""A run's evidence about itself: the correctness certificate (``certificate``), the version and checksum
of the weights behind every rollout (``weight_version``), step 3's rollout records (``rollout_records``)
and the run-health alerts read from the logged metrics (``alerts``). The commands that read it back are
leaf tools (:mod:`chatrl.tools`: the report, the inspector, the replay)."""
