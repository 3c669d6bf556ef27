from chatrl.dist import shutdown
from chatrl.resilience import report_failure
from chatrl.step2_dpo.main import main

with report_failure():
    main()
    shutdown()
