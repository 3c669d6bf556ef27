from chatrl import cli
from chatrl.dist import exit_now, shutdown
from chatrl.resilience import report_failure
from chatrl.step3_ppo.main import build, build_parser, train

# the engines stay referenced until the process group is shut down: a ZeRO-3 engine freed while its
# gloo collectives are in flight can abort the process at the end of a finished run
with report_failure():
    run = build(cli.parse(build_parser()))
    train(run)
    shutdown()
exit_now()
