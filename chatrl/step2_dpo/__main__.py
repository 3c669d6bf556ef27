from chatrl.dist import shutdown
from chatrl.resilience import report_failure
from chatrl.step2_dpo.main import run

# the engines stay referenced until the process group is shut down: a ZeRO-3 engine freed while its
# gloo collectives are in flight can abort the process at the end of a finished run
with report_failure():
    result = run()
    shutdown()
