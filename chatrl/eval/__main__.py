"""``python -m chatrl.eval``: see :mod:`chatrl.eval.main`."""

from chatrl.eval.main import main

main()
