from chatrl import cli
from chatrl.dist import run_program
from chatrl.step3_ppo.main import build, build_parser, train


def _main():
    run = build(cli.parse(build_parser()))
    train(run)
    return run  # holds the engines (see run_program)


run_program(_main)
