"""Errors shared across chatrl (no imports: any module may use them)."""


class UsageError(ValueError):
    """Bad input the user can fix, with a message that says everything (the flag, file or row).

    The entry points print the message alone, as argparse does for a bad flag, and exit with code 2:
    a traceback would only hide it (:func:`chatrl.distributed.resilience.report_failure`, ``score.py``).
    """
