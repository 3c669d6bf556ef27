from chatrl.dist import exit_now, shutdown
from chatrl.resilience import report_failure
from chatrl.step3_ppo.main import main

with report_failure():
    main()
    shutdown()
exit_now()
