from chatrl.distributed.dist import run_program
from chatrl.step3_ppo.main import run

run_program(run)
