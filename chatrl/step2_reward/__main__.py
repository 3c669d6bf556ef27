from chatrl.distributed.dist import run_program
from chatrl.step2_reward.main import run

run_program(run)
