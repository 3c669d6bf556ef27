from chatrl.distributed.dist import run_program
from chatrl.step1_sft.main import run

run_program(run)
